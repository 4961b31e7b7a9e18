"""Statistical checks shared by the distribution tests and the compatibility matrix."""

from __future__ import annotations

import torch


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """observed, expected: [G, C] counts in G groups with fixed totals. Cells with
    expected < 5 are pooled per group; an observation where expected is 0 gives p = 0."""
    if observed[expected == 0].sum() > 0:
        return 0.0
    stat, dof = torch.zeros((), dtype=torch.float64), 0
    for obs, exp in zip(observed.double(), expected, strict=True):
        obs, exp = obs[exp > 0], exp[exp > 0]
        order = exp.argsort()
        obs, exp = obs[order], exp[order]
        n_sparse = int((exp < 5).sum())
        while n_sparse and n_sparse < len(exp) and exp[:n_sparse].sum() < 5:
            n_sparse += 1
        if n_sparse:
            obs = torch.cat([obs[:n_sparse].sum()[None], obs[n_sparse:]])
            exp = torch.cat([exp[:n_sparse].sum()[None], exp[n_sparse:]])
        stat += ((obs - exp) ** 2 / exp).sum()
        dof += len(exp) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))

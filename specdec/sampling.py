"""Sampling, as the verifier and the sampling drafters both apply it.

One request's parameters (`SamplingParams`, also read from the wire), a batch's as
tensors (`SamplingMetadata`), and the filters that turn logits into the distribution
p a request samples from (`apply_sampling`: temperature, min-p, top-k, top-p, in
vLLM's order). The verifier's rejection sampler scores drafts against this p; a
sampling drafter shapes its q with the same function, so q and p agree on what a
filter removes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.pb import common_pb2

# Temperatures below this are treated as greedy, as vLLM does: dividing logits by a
# near-zero temperature only approaches argmax, at the risk of overflow.
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How one request samples. Filters apply in vLLM's order: temperature, min-p, top-k, top-p."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None = the engine's shared generator

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int, 0 or -1 (off) or >= 1, got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**64
        ):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplingParams) -> SamplingParams:
        """The wire's SamplingParams (unset temperature and top_p mean 1, as in OpenAI's
        API); ValueError naming the field for values out of range."""
        return cls(
            temperature=msg.temperature if msg.HasField("temperature") else 1.0,
            top_k=msg.top_k,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            min_p=msg.min_p,
            seed=msg.seed if msg.HasField("seed") else None,
        )

    def to_proto(self) -> common_pb2.SamplingParams:
        """The filters and seed on the wire (the fields `from_proto` reads; top_k -1 as 0)."""
        msg = common_pb2.SamplingParams(temperature=self.temperature, top_k=max(self.top_k, 0),
                                        top_p=self.top_p, min_p=self.min_p)
        if self.seed is not None:
            msg.seed = self.seed
        return msg

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The request's own generator, or None when it is unseeded.

        A drafter makes it once per request and keeps it across steps: re-seeding every
        step would replay the same random numbers at every step. (The verifier keys
        seeded noise by position instead: verifier/sampling/sampler.py.)
        """
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


@dataclass(slots=True)
class SamplingMetadata:
    """Sampling parameters of a batch of B requests, as tensors on the logits' device.

    The optional filters are None when no request in the batch uses them, so the
    sampler skips their sort without a device sync.
    """

    temperature: torch.Tensor  # [B] float32; meaningless where is_greedy
    is_greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor | None  # [B] int64, 0 = off
    top_p: torch.Tensor | None  # [B] float32, 1 = off
    min_p: torch.Tensor | None  # [B] float32, 0 = off
    # [B]: a seeded request's own generator; unseeded requests share one object.
    generators: list[torch.Generator]
    all_greedy: bool

    def __post_init__(self) -> None:
        batch_size = self.temperature.shape[0]
        for name in ("is_greedy", "top_k", "top_p", "min_p"):
            value = getattr(self, name)
            if value is not None and value.shape != (batch_size,):
                raise ValueError(f"{name} must have shape ({batch_size},), "
                                 f"got {tuple(value.shape)}")
        if len(self.generators) != batch_size:
            raise ValueError(f"generators must have {batch_size} entries, "
                             f"got {len(self.generators)}")

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        shared_generator: torch.Generator,
        device: torch.device | str = "cpu",
        position_keyed: bool = False,
    ) -> SamplingMetadata:
        """Batch per-request params.

        `generators[i]` is request i's own generator (kept by a drafter, made by
        `SamplingParams.make_generator`) or None for an unseeded request, which then
        draws from `shared_generator`. position_keyed: seeded requests draw noise
        keyed by their positions instead (the verifier's sampler) and need none.
        """
        if len(generators) != len(params):
            raise ValueError(f"generators must have {len(params)} entries, got {len(generators)}")
        for i, (p, g) in enumerate(zip(params, generators, strict=True)):
            if p.seed is not None and g is None and not position_keyed:
                raise ValueError(f"generators[{i}] is None but request {i} has a seed")

        greedy = [p.is_greedy for p in params]

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        def optional_column(values: list, dtype: torch.dtype, off: float) -> torch.Tensor | None:
            # Greedy requests' filters never matter: their argmax is taken on raw logits.
            used = any(v != off and not g for v, g in zip(values, greedy, strict=True))
            return column(values, dtype) if used else None

        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            is_greedy=column(greedy, torch.bool),
            top_k=optional_column([max(p.top_k, 0) for p in params], torch.int64, 0),  # -1 -> 0
            top_p=optional_column([p.top_p for p in params], torch.float32, 1.0),
            min_p=optional_column([p.min_p for p in params], torch.float32, 0.0),
            generators=[g if g is not None else shared_generator for g in generators],
            all_greedy=all(greedy),
        )

    @classmethod
    def make_dummy(
        cls,
        batch_size: int,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """B identical unseeded requests sharing one generator seeded with `seed` (for tests)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        shared = torch.Generator(device=device).manual_seed(seed)
        return cls.from_params([params] * batch_size, [None] * batch_size, shared, device)


# On CUDA, the filters by the sort-free Triton kernel (specdec/sampling_filters_triton.py)
# rather than torch's sort. Off until bench/gpu_check.py has run it on a GPU: it is tested
# under Triton's interpreter only, which has no bfloat16.
SORT_FREE_FILTERS = False


def apply_sampling(
    logits: torch.Tensor,  # [N, V]
    metadata: SamplingMetadata,
    num_rows: torch.Tensor,  # [B] int64, rows per request; sums to N
) -> torch.Tensor:  # [N, V] float32
    """Target probabilities after temperature, min-p, top-k and top-p, in vLLM's order.

    Rows of greedy requests come out as softmax(logits); the sampler never reads them,
    since greedy requests use the argmax of the raw logits.
    """
    n = logits.shape[0]

    def per_row(x: torch.Tensor) -> torch.Tensor:  # [B] -> [N]
        return x.repeat_interleave(num_rows, output_size=n)

    # Greedy temperatures are 0; divide those rows by 1 instead of by zero.
    temperature = torch.where(metadata.is_greedy, 1.0, metadata.temperature)
    if logits.is_cuda and SORT_FREE_FILTERS:
        # The same filters without sorting rows (specdec/sampling_filters_triton.py has the
        # semantics); imported on first CUDA use: CPU runs never import triton.
        from specdec.sampling_filters_triton import apply_filters_triton

        return apply_filters_triton(
            logits, per_row(temperature),
            per_row(metadata.min_p) if metadata.min_p is not None else None,
            per_row(metadata.top_k) if metadata.top_k is not None else None,
            per_row(metadata.top_p) if metadata.top_p is not None else None,
        )
    logits = logits.float() / per_row(temperature)[:, None]  # a new tensor: masked in place below
    if metadata.min_p is not None:
        logits = _apply_min_p(logits, per_row(metadata.min_p))
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = _apply_top_k_top_p(
            logits,
            per_row(metadata.top_k) if metadata.top_k is not None else None,
            per_row(metadata.top_p) if metadata.top_p is not None else None,
        )
    return logits.softmax(dim=-1)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # logits: [N, V], min_p: [N]. Drop tokens less likely than min_p times the top token.
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [N, 1]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [N, V]
    top_k: torch.Tensor | None,  # [N] int64, 0 = off
    top_p: torch.Tensor | None,  # [N] float32, 1 = off
) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending: [N, V]
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)  # [N]
        kth_largest = sorted_logits.gather(-1, (vocab_size - k)[:, None])  # [N, 1]
        # Ties with the k-th largest logit stay, as in vLLM.
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        # Drop the least likely tokens while their total mass stays <= 1 - top_p: what
        # remains is the smallest top set with mass >= top_p. The top token always stays.
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
        drop = cumulative <= 1 - top_p[:, None]
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(-1, order, sorted_logits)


# Tokens per block of `inverse_cdf`'s first search: only the chosen block's weights are
# accumulated one by one.
CDF_BLOCK = 256


def inverse_cdf(
    weights: torch.Tensor,  # [B, V] float32 >= 0, each row with a positive sum
    u: torch.Tensor,  # [B] float64 in [0, 1)
) -> torch.Tensor:  # [B] int64
    """Row b's token by the inverse CDF at u[b]: token v with probability
    weights[b, v] / sum(weights[b]), and a zero weight never.

    In two levels, since a float32 running sum over 49152 tokens drifts by about 1e-7
    a token, the size of many tokens' probabilities, and a float64 copy of the whole
    row costs more than the rest: a block of CDF_BLOCK tokens is chosen by its float32
    sum (within about 1e-6 of its weight, relatively), then a token within it by the
    float64 running sum of its weights, scaled to the block's float32 sum. So every
    token's probability is within a factor 1 +- 1e-6 of its weight's share."""
    batch, vocab = weights.shape
    num_blocks = -(-vocab // CDF_BLOCK)
    if num_blocks * CDF_BLOCK != vocab:
        weights = torch.nn.functional.pad(weights, (0, num_blocks * CDF_BLOCK - vocab))
    blocks = weights.view(batch, num_blocks, CDF_BLOCK)
    mass = blocks.sum(-1).double()  # [B, blocks]
    ends = mass.cumsum(-1)  # [B, blocks]: the weight up to each block's end
    target = (u * ends[:, -1])[:, None]  # [B, 1]
    # Rounding (u * sum rounding up to the sum) can put the target a hair past the
    # last block of positive weight: that block then.
    block = torch.minimum(torch.searchsorted(ends, target, right=True), _last_positive(mass))
    inside = blocks.gather(1, block[:, :, None].expand(batch, 1, CDF_BLOCK)).squeeze(1)
    running = inside.double().cumsum_(-1)  # [B, CDF_BLOCK]
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp_(min=0)), 0.0)  # [B, 1]
    # The target's place in the block, from the block's float32 sum to its exact one.
    at = (target - before) / mass.gather(1, block) * running[:, -1:]
    within = torch.searchsorted(running, at, right=True)
    return (block * CDF_BLOCK + torch.minimum(within, _last_positive(inside))).squeeze(1)


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the index of the last positive entry of each row of x [B, N]."""
    return x.shape[1] - 1 - (x > 0).flip(-1).long().argmax(-1, keepdim=True)

"""Reading a DraftTable (drafter.proto): the drafts it gives for one outcome.

Both ends read tables the same way: the verifier to take a step's drafts without
waiting for the drafter, the drafter to answer the Advance by the table it sent, so
the next table is on the drafts the verifier verifies.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from specdec.pb import drafter_pb2


def table_drafts(table: drafter_pb2.DraftTable, new: list[int],
                 copy_after: Callable[[int, int], list[int]] | None = None) -> list[int] | None:
    """The drafts a DraftTable gives for the Advance appending `new` ([] for none), or
    None for an outcome it cannot answer (not its proposal's prefix and a token).
    copy_after(b, k): the k tokens after b's latest earlier occurrence in the context,
    for the tokens a table with copy_unlisted does not list."""
    a = len(new) - 1
    if not 0 <= a < len(table.group_sizes) or list(table.proposal[:a]) != new[:a]:
        return None
    lo = sum(table.group_sizes[:a])
    hi = lo + table.group_sizes[a]
    i = bisect.bisect_left(table.bonus, new[-1], lo, hi)
    if i == hi or table.bonus[i] != new[-1]:
        if not table.copy_unlisted:
            return []
        return None if copy_after is None else copy_after(new[-1], table.k)
    start = sum(table.lengths[:i])
    return list(table.token_ids[start:start + table.lengths[i]])

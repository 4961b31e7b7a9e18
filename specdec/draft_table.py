"""Reading a DraftTable (drafter.proto): the drafts it gives for one outcome.

Both ends read tables the same way: the verifier to take a step's drafts without
waiting for the drafter, the drafter to answer the Advance by the table it sent, so
the next table is on the drafts the verifier verifies.

The verifier reads a table as an index of Python objects built when the table arrives,
on the stream's own thread, in the shadow of the step's forward: the lookup is then one
dict probe on the step's critical path. Walking the message's repeated fields at lookup
time (slicing, summing offsets, bisecting) took 10 us a sequence inside the engine's
step against 3.7 us in a warm loop: the step's forward leaves the caches cold, and at
16 sequences the lookups were half of the step's wait on the drafters.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.pb import drafter_pb2


class TableIndex:
    """One DraftTable as a dict from each listed outcome (the new tokens an Advance
    appends: the proposal's first a tokens and the target's token b) to its drafts."""

    __slots__ = ("proposal", "drafts", "groups", "k", "copy_unlisted")

    def __init__(self, table: drafter_pb2.DraftTable):
        self.proposal = tuple(table.proposal)
        self.k = table.k
        self.copy_unlisted = table.copy_unlisted
        bonus, lengths, tokens = list(table.bonus), list(table.lengths), list(table.token_ids)
        self.drafts: dict[tuple[int, ...], list[int]] = {}
        entry = start = 0
        for a, size in enumerate(table.group_sizes):
            if a > len(self.proposal):
                break  # groups past the proposal name no outcome
            prefix = self.proposal[:a]
            for i in range(entry, entry + size):
                self.drafts[(*prefix, bonus[i])] = tokens[start:start + lengths[i]]
                start += lengths[i]
            entry += size
        self.groups = min(len(table.group_sizes), len(self.proposal) + 1)

    def lookup(self, new: list[int],
               copy_after: Callable[[int, int], list[int]] | None = None) -> list[int] | None:
        """The drafts for the Advance appending `new` ([] for none; the index's own
        list, not to be changed), or None for an outcome the table cannot answer (not
        its proposal's prefix and a token). copy_after(b, k): the k tokens after b's
        latest earlier occurrence in the context, for the tokens a table with
        copy_unlisted does not list."""
        drafts = self.drafts.get(tuple(new))
        if drafts is not None:
            return drafts
        a = len(new) - 1
        if not 0 <= a < self.groups or tuple(new[:a]) != self.proposal[:a]:
            return None
        if not self.copy_unlisted:
            return []
        return None if copy_after is None else copy_after(new[-1], self.k)


def table_drafts(table: drafter_pb2.DraftTable, new: list[int],
                 copy_after: Callable[[int, int], list[int]] | None = None) -> list[int] | None:
    """TableIndex(table).lookup(new, copy_after), for a table read once."""
    return TableIndex(table).lookup(new, copy_after)

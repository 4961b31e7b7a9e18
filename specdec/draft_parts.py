"""A drafter stream's step in messages of bounded size (docs/design.md section 3,
"Message sizes").

A step's request (the batch's entries) or answer (its proposals; a followup's bets
and tables) can be any size: Starts carry whole contexts, Advances hidden states,
proposals dense q. Each end packs it into consecutive messages of at most a budget
of bytes, flagged `continued` but the last; the receiver takes the step as the
items of them all, in order. An item larger than the budget travels alone.
"""

from __future__ import annotations

from specdec.pb import drafter_pb2

# What an item adds to its message besides its own bytes, at most: its field's tag
# and its length's varint (a length under 2**35).
_FRAMING = 6


def runs(sizes: list[int], budget: int) -> list[slice]:
    """Consecutive runs of the items, in order, each at most `budget` bytes of items
    with their framing; an item larger than that is a run of its own."""
    out: list[slice] = []
    begin, total = 0, 0
    for i, size in enumerate(sizes):
        size += _FRAMING
        if i > begin and total + size > budget:
            out.append(slice(begin, i))
            begin, total = i, 0
        total += size
    if begin < len(sizes):
        out.append(slice(begin, len(sizes)))
    return out


def request_parts(request: drafter_pb2.DraftRequest,
                  budget: int) -> list[drafter_pb2.DraftRequest]:
    """The request as messages of at most `budget` bytes (but an entry larger alone)."""
    if request.ByteSize() <= budget:
        return [request]
    entries = request.entries
    parts = [drafter_pb2.DraftRequest(step=request.step, entries=entries[run], continued=True)
             for run in runs([e.ByteSize() for e in entries], budget - 16)]
    parts[-1].continued = False
    return parts


def response_parts(response: drafter_pb2.DraftResponse,
                   budget: int) -> list[drafter_pb2.DraftResponse]:
    """The answer or followup as messages of at most `budget` bytes (but a proposal
    larger alone): its proposals, bets and tables in runs, the last message with the
    rest of its fields."""
    if response.ByteSize() <= budget:
        return [response]
    items = ([("proposals", p) for p in response.proposals]
             + [("bets", b) for b in response.bets] + [("tables", t) for t in response.tables])
    tail = drafter_pb2.DraftResponse()
    tail.CopyFrom(response)
    for name in ("proposals", "bets", "tables"):
        tail.ClearField(name)
    parts = []
    for run in runs([item.ByteSize() for _, item in items],
                    budget - tail.ByteSize() - 16) or [slice(0, 0)]:
        part = drafter_pb2.DraftResponse(step=response.step, followup=response.followup,
                                         continued=True)
        for name, item in items[run]:
            getattr(part, name).append(item)
        parts.append(part)
    parts[-1].MergeFrom(tail)
    parts[-1].continued = False
    return parts

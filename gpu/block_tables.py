"""A step's block tables as one flat int32 buffer, from per-request copies that only grow.

A request's table gains a block every `block_size` tokens, but a step needs every scheduled
request's whole table, padded to the longest: 256 sequences at 4k tokens are 64k ids. Made from
Python lists into a tensor each step that cost 5-6 ms of host time (on a GPU, a third of a decode
step). Here each request keeps its ids in an `array('i')` that takes only its new blocks, and a
step concatenates those arrays with memory copies.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple


class StepTables(NamedTuple):
    """`num_rows` tables of `width` block ids each, row-major, padded with block 0. `flat` is
    made for one step: AttentionMetadata.build appends the step's other ints to it."""

    flat: array
    num_rows: int
    width: int

    @classmethod
    def from_lists(cls, tables: list[list[int]]) -> StepTables:
        width = max((len(t) for t in tables), default=0)
        flat = array("i")
        for t in tables:
            flat.extend(t)
            flat.extend([0] * (width - len(t)))
        return cls(flat, len(tables), width)


class _Row:
    __slots__ = ("source", "ids")

    def __init__(self, source: list[int]) -> None:
        self.source = source  # the block manager's list: a new list means new blocks
        self.ids = array("i")


class BlockTables:
    """The runner's per-request copies, kept for the requests of the last step."""

    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}
        self._zeros = array("i")

    def gather(self, seqs) -> StepTables:
        """The scheduled sequences' tables (`seq.block_table`, append-only while the request
        holds its blocks; replaced by a new list when it is preempted and re-admitted)."""
        width = max(len(s.block_table) for s in seqs)
        if len(self._zeros) < width:
            self._zeros = array("i", bytes(4 * width))
        zeros = self._zeros
        old, rows = self._rows, {}
        flat = array("i")
        for s in seqs:
            table = s.block_table
            rid = s.request.request_id
            row = old.get(rid)
            if row is None or row.source is not table or len(row.ids) > len(table):
                row = _Row(table)
            ids = row.ids
            have, n = len(ids), len(table)
            if n > have:
                ids.extend(table[have:])
            flat += ids
            if n < width:
                flat += zeros[: width - n]
            rows[rid] = row
        self._rows = rows  # requests not scheduled this step start over when they return
        return StepTables(flat, len(seqs), width)

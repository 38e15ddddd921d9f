"""A step's block tables as one flat int32 buffer (gpu/runner_state.py builds it from each
request's own table; AttentionMetadata.build appends the step's other ints to it)."""

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

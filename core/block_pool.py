"""BlockPool: the fixed set of KV cache blocks and the free list they are handed out from."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids 0..num_blocks-1. The free list is FIFO so freed blocks are reused last."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return len(self._in_use)

    def take(self, n: int) -> list[int]:
        """Take n free blocks. The caller has checked `num_free >= n` first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._in_use.update(blocks)
        return blocks

    def give_back(self, blocks: list[int]) -> None:
        for b in blocks:
            self._in_use.remove(b)  # KeyError on a double free: a bug worth crashing on
            self._free.append(b)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if free & self._in_use:
            raise AssertionError("a block is both free and in use")
        if len(free) + len(self._in_use) != self.num_blocks:
            raise AssertionError(
                f"free {len(free)} + in use {len(self._in_use)} != total {self.num_blocks}"
            )

"""KVCacheManager: per-request block tables over the block pool, with check-then-act allocation."""

from __future__ import annotations

from core.block_pool import BlockPool
from core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_in_use / self.pool.num_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so that computed + new tokens all have a slot."""
        total = request.num_computed_tokens + num_new_tokens
        have = len(self.block_tables.get(request.request_id, ()))
        return max(0, -(-total // self.block_size) - have)

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int) -> list[int]:
        """Grow the request's block table to hold its new tokens; returns the whole table."""
        table = self.block_tables.setdefault(request.request_id, [])
        n = self.blocks_needed(request, num_new_tokens)
        if n:
            table.extend(self.pool.take(n))
        return table

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, None)
        if table:
            # Reverse order: the tail of a sequence goes back first (matters once blocks are cached).
            self.pool.give_back(table[::-1])

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        owned = [b for t in self.block_tables.values() for b in t]
        if len(owned) != len(set(owned)):
            raise AssertionError("a block is owned by two requests")
        if len(owned) != self.pool.num_in_use:
            raise AssertionError(
                f"{len(owned)} blocks in tables but {self.pool.num_in_use} marked in use"
            )

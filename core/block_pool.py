"""BlockPool: the fixed set of KV cache blocks, their reference counts, the prefix-cache index and
the LRU free list that blocks are handed out from.

A block with no owner sits on the free list. If it still holds a cached prefix (it has a hash) it
stays findable until the pool needs it: blocks are taken from the head of the list (least recently
freed first), and a taken block loses its hash. Requests free their blocks tail first, so the
ends of chains are evicted before their beginnings.
"""

from __future__ import annotations


class Block:
    __slots__ = ("block_id", "ref_cnt", "hash", "parent_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.hash is not None})"


class FreeList:
    """Doubly linked list of blocks: O(1) append, pop from the head, and removal from the middle."""

    def __init__(self) -> None:
        self._head = Block(-1)  # sentinels
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, block: Block) -> None:
        last = self._tail.prev
        last.next, block.prev, block.next, self._tail.prev = block, last, self._tail, block
        self._len += 1

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> Block:
        block = self._head.next
        if block is self._tail:
            raise IndexError("the free list is empty")
        self.remove(block)
        return block

    def __iter__(self):
        b = self._head.next
        while b is not self._tail:
            yield b
            b = b.next


class BlockPool:
    """The KV cache's blocks: reference counts, the LRU free list and the prefix-cache index.

    Blocks come into being on first use: those never handed out are the range of ids from
    `len(self.blocks)` up, which sits at the head of the free order (a fresh block is always
    taken before a recycled one, as a list that started with every block in id order would
    give). A small model on a large GPU has millions of blocks; making them all up front cost
    seconds at start-up and every full garbage collection after it."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks: list[Block] = []  # every block handed out at least once, by id
        self.free = FreeList()  # recycled blocks, least recently freed first
        self.cached: dict[int, Block] = {}
        self.num_evictions = 0

    @property
    def num_fresh(self) -> int:
        """Blocks never handed out yet."""
        return self.num_blocks - len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached ones included: they get evicted)."""
        return self.num_fresh + len(self.free)

    @property
    def num_in_use(self) -> int:
        return len(self.blocks) - len(self.free)

    def take(self, n: int) -> list[Block]:
        """Take n blocks from the head of the free order. The caller checked `num_free >= n`."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks with only {self.num_free} free")
        out = []
        for _ in range(n):
            if len(self.blocks) < self.num_blocks:
                block = Block(len(self.blocks))
                self.blocks.append(block)
            else:
                block = self.free.popleft()
                if block.hash is not None:
                    del self.cached[block.hash]
                    block.hash, block.parent_hash, block.token_ids = None, None, ()
                    self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Share cached blocks with one more request (taking them off the free list if idle)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free.remove(block)
            block.ref_cnt += 1

    def give_back(self, blocks: list[Block]) -> None:
        """Drop one reference to each block; unowned ones go to the tail of the free list."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free.append(block)

    def lookup(
        self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> Block | None:
        """The cached block for this hash, if its parent and its own tokens really match."""
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def register(
        self, block: Block, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> bool:
        """Make a full block whose KV is written findable. False if that prefix is cached already
        (another request computed it at the same time): the block then simply stays private."""
        if block.hash is not None or block_hash in self.cached:
            return False
        block.hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self.cached[block_hash] = block
        return True

    def check_integrity(self) -> None:
        """fresh + free + cached-and-free + in use == total, and every structure agrees with the
        others."""
        seen: set[int] = set()
        free_cached = 0
        for block in self.free:
            if block.block_id in seen:
                raise AssertionError(f"block {block.block_id} is on the free list twice")
            seen.add(block.block_id)
            if block.ref_cnt != 0:
                raise AssertionError(f"block {block.block_id} is free with ref_cnt {block.ref_cnt}")
            free_cached += block.hash is not None
        if len(seen) != len(self.free):
            raise AssertionError("free list length is wrong")
        in_use = [b for b in self.blocks if b.block_id not in seen]
        if any(b.ref_cnt <= 0 for b in in_use):
            raise AssertionError("a block is neither free nor owned")
        for h, block in self.cached.items():
            if block.hash != h:
                raise AssertionError(
                    f"cache index points at block {block.block_id} with another hash"
                )
        if sum(b.hash is not None for b in self.blocks) != len(self.cached):
            raise AssertionError("a block has a hash the cache index does not know")
        if any(b.block_id != i for i, b in enumerate(self.blocks)):
            raise AssertionError("the blocks handed out are not ids 0.. in order")
        free_uncached = len(seen) - free_cached
        total = self.num_fresh + free_uncached + free_cached + len(in_use)
        if total != self.num_blocks:
            raise AssertionError(
                f"fresh {self.num_fresh} + free {free_uncached} + cached-and-free {free_cached} "
                f"+ in use {len(in_use)} != total {self.num_blocks}"
            )

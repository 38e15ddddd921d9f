"""KVCacheManager: per-request block tables over the block pool, check-then-act allocation, and
automatic prefix caching (a full block's hash chains its parent's hash with its own token ids)."""

from __future__ import annotations

from core.block_pool import Block, BlockPool
from core.request import Request


def block_hash(parent: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
    # The salt goes into the first block only; every later hash inherits it through the chain.
    return hash((parent, token_ids) if parent is not None else (salt, token_ids))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[Block]] = {}
        self.block_tables: dict[str, list[int]] = {}  # the same tables as ids, for the runner
        self._num_registered: dict[str, int] = {}  # leading blocks of a table already cached
        # Block copies (src, dst) the runner makes before the next forward, per request: a
        # sequence about to write into a partial block it shares with another (beams forked
        # from one beam) writes into a copy of it instead (copy on write). A request freed
        # before the step is sent (preempted) drops its copy: its dst may be handed out again.
        self.copies: dict[str, tuple[int, int]] = {}
        # Counted per prompt lookup, for metrics and tests.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_in_use / self.pool.num_blocks

    # ---- prefix cache ----
    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The request's chained block hashes up to `num_blocks` full blocks, computed once."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        # A request's adapter keys its blocks as a salt does: by the adapter's content, so two
        # adapters never share KV, nor an adapter reloaded under its old name with other weights.
        lora = request.lora
        salt = request.cache_salt if lora is None else (request.cache_salt, lora.key)
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash(parent, tuple(tokens[i * bs : (i + 1) * bs]), salt))
        return hashes

    def find_cached(self, request: Request) -> list[Block]:
        """The longest run of cached full blocks from the request's start, never covering its
        last token (that one must be computed so there are logits to sample)."""
        if (
            not self.enable_caching
            or request.prompt_logprobs is not None
            or (request.pooling is not None and request.pooling.needs_every_position)
        ):
            return []  # prompt logprobs, mean and CLS pooling need every position computed
        n = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, n)
        bs = self.block_size
        tokens = request.all_token_ids
        hits: list[Block] = []
        parent = None
        for i in range(n):
            block = self.pool.lookup(hashes[i], parent, tuple(tokens[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
            parent = hashes[i]
        return hits

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Record one admitted request's prefix-cache query (retries are not counted)."""
        if self.enable_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def cache_computed(self, request: Request) -> None:
        """Register the request's full blocks whose KV has now been written."""
        if not self.enable_caching:
            return
        rid = request.request_id
        table = self.tables.get(rid)
        if not table:
            return
        # Only blocks whose every token is known (a pending sample's block waits for it).
        known = min(request.num_computed_tokens, request.num_tokens)
        full = min(known // self.block_size, len(table))
        start = self._num_registered.get(rid, 0)
        if full <= start:
            return
        hashes = self._hashes(request, full)
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(start, full):
            self.pool.register(
                table[i],
                hashes[i],
                hashes[i - 1] if i else None,
                tuple(tokens[i * bs : (i + 1) * bs]),
            )
        self._num_registered[rid] = full

    # ---- allocation ----
    def blocks_needed(self, request: Request, num_new_tokens: int, cached: int = 0) -> int:
        """New blocks to take so that computed (or `cached` hit blocks) + new tokens all fit,
        and a copy of the block the new tokens start in if it is shared."""
        table = self.tables.get(request.request_id, ())
        have = len(table) + cached
        total = max(request.num_computed_tokens, cached * self.block_size) + num_new_tokens
        return max(0, -(-total // self.block_size) - have) + self._shared_at(request, table)

    def _shared_at(self, request: Request, table) -> int:
        """1 if the block the request writes next is one it shares (only ever a forked beam's
        partial last block: full blocks are never written again, cache hits are full)."""
        i = request.num_computed_tokens // self.block_size
        return int(i < len(table) and table[i].ref_cnt > 1)

    def can_allocate(
        self, request: Request, num_new_tokens: int, hits: list[Block] | None = None
    ) -> bool:
        hits = hits or []
        # Hit blocks nobody owns are on the free list: sharing them takes them off it.
        idle_hits = sum(1 for b in hits if b.ref_cnt == 0)
        need = self.blocks_needed(request, num_new_tokens, len(hits))
        return need <= self.pool.num_free - idle_hits

    def allocate(
        self, request: Request, num_new_tokens: int, hits: list[Block] | None = None
    ) -> list[int]:
        """Grow the request's table (shared hit blocks first) to hold its new tokens; returns the
        table as block ids."""
        rid = request.request_id
        table = self.tables.setdefault(rid, [])
        ids = self.block_tables.setdefault(rid, [])
        if hits:
            need = self.blocks_needed(request, num_new_tokens, len(hits))
            self.pool.touch(hits)
            table.extend(hits)
            ids.extend(b.block_id for b in hits)
            self._num_registered[rid] = len(hits)
        else:
            need = self.blocks_needed(request, num_new_tokens)
        if not hits and self._shared_at(request, table):
            i = request.num_computed_tokens // self.block_size
            (copy,) = self.pool.take(1)
            self.copies[rid] = (table[i].block_id, copy.block_id)
            self.pool.give_back([table[i]])
            table[i], ids[i] = copy, copy.block_id
            need -= 1
        if need:
            new = self.pool.take(need)
            table.extend(new)
            ids.extend(b.block_id for b in new)
        return ids

    def fork(self, dst: Request, src: Request) -> None:
        """dst's blocks become src's (a beam continuing another): every block shared, each
        copied later only where dst writes into it (`allocate`). dst's own are dropped."""
        self.free(dst)
        sid, did = src.request_id, dst.request_id
        table = self.tables.get(sid)
        if not table:
            return
        self.pool.touch(table)
        self.tables[did] = list(table)
        self.block_tables[did] = list(self.block_tables[sid])
        self._num_registered[did] = self._num_registered.get(sid, 0)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies the next step must make first (and forget them here)."""
        copies = list(self.copies.values())
        self.copies.clear()
        return copies

    def free(self, request: Request) -> None:
        rid = request.request_id
        if self.copies:
            self.copies.pop(rid, None)
        table = self.tables.pop(rid, None)
        self.block_tables.pop(rid, None)
        self._num_registered.pop(rid, None)
        if table:
            self.pool.give_back(table[::-1])  # tail first: the end of a chain is evicted first

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for table in self.tables.values():
            if len(table) != len({b.block_id for b in table}):
                raise AssertionError("a block appears twice in one table")
            for b in table:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            if refs.get(b.block_id, 0) != b.ref_cnt:
                raise AssertionError(
                    f"block {b.block_id} has ref_cnt {b.ref_cnt} but "
                    f"{refs.get(b.block_id, 0)} owners"
                )
        for rid, table in self.tables.items():
            if [b.block_id for b in table] != self.block_tables[rid]:
                raise AssertionError(f"block ids of {rid} drifted from its table")

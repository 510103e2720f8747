"""Paged KV-cache bookkeeping: a block pool with reference counts and a prefix cache.

Invariants:
- Block 0 is the *null block*: never handed out, its KV stays zero, and padded slots point at it.
- A block is in the free queue iff its ref_cnt is 0. Free blocks keep their hash (and so stay
  reusable as prefix hits) until they are popped for a new allocation: that is the LRU eviction.
- A full block's hash chains its parent's hash with its token ids, so equal hashes mean equal
  prefixes. The pool also stores each cached block's token ids and parent hash and compares them on
  lookup, so a hash collision can never hand a request someone else's KV.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

BlockHashFn = Callable[[int | None, tuple[int, ...]], int]


def builtin_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    # Fast, and deterministic across processes for ints (no string salting), but not collision-proof.
    return hash((parent_hash, token_ids))


def sha256_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A 128-bit prefix of SHA-256: nobody can craft two prefixes that share KV."""
    data = (parent_hash or 0).to_bytes(16, "little", signed=False) + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")


HASH_ALGOS: dict[str, BlockHashFn] = {"sha256": sha256_block_hash, "builtin": builtin_block_hash}


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None   # kept to verify hash hits
    parent_hash: int | None = None              # ... with the parent's hash (the block's place in the chain)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1   # pinned forever
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[int, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)   # least recently freed first
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (prefix hits), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each block. Pass them tail-first so a prefix's leading blocks,
        the most shareable ones, are evicted last."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None

    def lookup(self, block_hash: int, token_ids: tuple[int, ...],
               parent_hash: int | None = None) -> KVCacheBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: int, token_ids: tuple[int, ...],
                    parent_hash: int | None = None) -> None:
        if block.block_hash is not None:
            return
        if block_hash in self.cached:   # an identical block (or a collision) is already cached
            return
        block.block_hash, block.token_ids, block.parent_hash = block_hash, token_ids, parent_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = block.token_ids = block.parent_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks[1:]:
            if block.ref_cnt == 0:
                self._evict(block)


class KVCacheManager:
    """Per-request block lists on top of a BlockPool, plus prefix-cache hit accounting."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: BlockHashFn = sha256_block_hash) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[int]] = {}
        self.req_num_cached: dict[str, int] = {}   # leading blocks already offered to the cache
        self.prefix_cache_queries = 0   # tokens looked up
        self.prefix_cache_hits = 0      # tokens found

    # ---- hashing ---------------------------------------------------------------------------
    def _block_hashes(self, req_id: str, token_ids: Sequence[int], upto_tokens: int) -> list[int]:
        """Hashes of the request's full blocks among its first `upto_tokens` tokens (memoised)."""
        hashes = self.req_hashes.setdefault(req_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= upto_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(self.hash_fn(parent, tuple(token_ids[i * bs:(i + 1) * bs])))
        return hashes

    # ---- scheduling API --------------------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: Sequence[int]) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of whole blocks. The last token is always left to compute, since
        the model must run on at least one token to produce logits."""
        if not self.enable_prefix_caching:
            return [], 0
        num_tokens = len(token_ids)
        hashes = self._block_hashes(req_id, token_ids, num_tokens - 1)
        hits: list[KVCacheBlock] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            block = self.pool.lookup(h, tuple(token_ids[i * bs:(i + 1) * bs]), hashes[i - 1] if i else None)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def num_blocks_needed(self, req_id: str, num_total_tokens: int, num_hit_blocks: int = 0) -> int:
        have = len(self.req_blocks.get(req_id, ())) + num_hit_blocks
        return max(0, -(-num_total_tokens // self.block_size) - have)

    def allocate_slots(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                       num_new_tokens: int, computed_blocks: Sequence[KVCacheBlock] = ()) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` after `num_computed_tokens`. Returns the newly allocated
        blocks, or None (and changes nothing) if the pool cannot supply them."""
        total = num_computed_tokens + num_new_tokens
        need = self.num_blocks_needed(req_id, total, len(computed_blocks))
        # Hits sitting in the free queue are not available for new allocations.
        reusable_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reusable_free:
            return None
        blocks = self.req_blocks.setdefault(req_id, [])
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        new_blocks = self.pool.allocate(need)
        blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req_id, token_ids, total)
        return new_blocks

    def _cache_full_blocks(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        blocks = self.req_blocks[req_id]
        hashes = self._block_hashes(req_id, token_ids, num_tokens)
        bs = self.block_size
        # The memo may reach further (a lookup hashes the whole prompt); cache only what is filled,
        # and start after the blocks already handled on earlier steps.
        start = self.req_num_cached.get(req_id, 0)
        for i in range(start, num_tokens // bs):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]),
                                      hashes[i - 1] if i else None)
        self.req_num_cached[req_id] = max(start, num_tokens // bs)

    def free(self, req_id: str) -> None:
        blocks = self.req_blocks.pop(req_id, [])
        self.pool.free(list(reversed(blocks)))
        self.req_hashes.pop(req_id, None)
        self.req_num_cached.pop(req_id, None)

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

"""Paged KV-cache bookkeeping: a block pool with reference counts and a prefix cache.

Invariants:
- Block 0 is the *null block*: never handed out, its KV stays zero, and padded slots point at it.
- A block is in the free queue iff its ref_cnt is 0. Free blocks keep their hash (and so stay
  reusable as prefix hits) until they are popped for a new allocation: that is the LRU eviction.
- A full block's hash chains its parent's hash with its token ids, so equal hashes mean equal
  prefixes. The pool also stores each cached block's token ids and parent hash and compares them
  on lookup, so a hash collision can never hand a request someone else's KV.
- A request with a `cache_salt` (vLLM's, one per tenant) starts its chain from the salt's hash
  instead of none, so it shares blocks only with requests of the same salt.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from shardserve.utils import cdiv

BlockHashFn = Callable[[int | None, tuple[int, ...]], int]


def builtin_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    # Fast, and deterministic across processes for ints (no string salting), but not collision-proof.
    return hash((parent_hash, token_ids))


def sha256_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A 128-bit prefix of SHA-256: nobody can craft two prefixes that share KV."""
    data = (parent_hash or 0).to_bytes(16, "little", signed=False) + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")


HASH_ALGOS: dict[str, BlockHashFn] = {"sha256": sha256_block_hash, "builtin": builtin_block_hash}


def salt_root(cache_salt: str | None) -> int | None:
    """The parent hash of a salted request's first block (None: unsalted). Domain-separated from
    block hashes, so no chain of token blocks can reach it."""
    if cache_salt is None:
        return None
    digest = hashlib.sha256(b"shardserve cache_salt\0" + cache_salt.encode("utf-8")).digest()
    return int.from_bytes(digest[:16], "little")


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


@dataclass
class ReqKV:
    """One request's KV state, created on its first lookup or allocation and dropped whole by `free`.

    Invariants: `blocks[i]` holds the request's tokens [i * block_size, (i + 1) * block_size).
    `block_hashes[i]` is the chained hash of the i-th full block of its tokens; it is a memo and may
    run ahead of `blocks` (a lookup hashes the whole prompt before anything is allocated).
    `num_cached_blocks <= len(blocks)`: the leading blocks already offered to the prefix cache.
    """

    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    root: int | None = None   # the first block's parent hash: salt_root(the request's cache_salt)

    def parent(self, index: int) -> int | None:
        return self.block_hashes[index - 1] if index else self.root


class KVCacheManager:
    """Per-request block lists (`requests: dict[req_id, ReqKV]`) on top of a BlockPool, plus
    prefix-cache hit accounting.

    Verbs come in pairs: `can_allocate` says whether the pool can hold a request's first N tokens,
    `allocate` takes the blocks (call it only after a yes); `allocate_slots` (vLLM's name) does both
    and returns None, changing nothing, when the pool is short. `free` gives everything back.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: BlockHashFn = sha256_block_hash) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.pool = BlockPool(num_blocks)
        self.requests: dict[str, ReqKV] = {}
        self.prefix_cache_queries = 0   # tokens looked up
        self.prefix_cache_hits = 0      # tokens found

    # ---- hashing ---------------------------------------------------------------------------
    def _block_tokens(self, token_ids: Sequence[int], index: int) -> tuple[int, ...]:
        return tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])

    def _record(self, req_id: str, cache_salt: str | None = None) -> ReqKV:
        """The request's record, made on first use (with the chain's root from its salt)."""
        record = self.requests.get(req_id)
        if record is None:
            record = self.requests[req_id] = ReqKV(root=salt_root(cache_salt))
        return record

    def _block_hashes(self, req_id: str, token_ids: Sequence[int], upto_tokens: int) -> list[int]:
        """Hashes of the request's full blocks among its first `upto_tokens` tokens (memoised)."""
        record = self.requests[req_id]
        hashes = record.block_hashes
        while (len(hashes) + 1) * self.block_size <= upto_tokens:
            hashes.append(self.hash_fn(record.parent(len(hashes)), self._block_tokens(token_ids, len(hashes))))
        return hashes

    # ---- scheduling API --------------------------------------------------------------------
    def get_computed_blocks(self, req_id: str, token_ids: Sequence[int],
                            cache_salt: str | None = None) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of whole blocks (of the same salt). The last token is always left
        to compute, since the model must run on at least one token to produce logits."""
        if not self.enable_prefix_caching:
            return [], 0
        record = self._record(req_id, cache_salt)
        hashes = self._block_hashes(req_id, token_ids, len(token_ids) - 1)
        hits: list[KVCacheBlock] = []
        for index, block_hash in enumerate(hashes):
            block = self.pool.lookup(block_hash, self._block_tokens(token_ids, index), record.parent(index))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def num_blocks(self, req_id: str) -> int:
        record = self.requests.get(req_id)
        return len(record.blocks) if record else 0

    def num_blocks_needed(self, req_id: str, num_total_tokens: int, num_hit_blocks: int = 0) -> int:
        """New blocks the request needs to hold `num_total_tokens`, beyond what it has and its hits."""
        have = self.num_blocks(req_id) + num_hit_blocks
        return max(0, cdiv(num_total_tokens, self.block_size) - have)

    def can_allocate(self, req_id: str, num_total_tokens: int,
                     computed_blocks: Sequence[KVCacheBlock] = ()) -> bool:
        """Whether the pool can grow the request to `num_total_tokens`, taking `computed_blocks`
        (prefix hits from `get_computed_blocks`) first."""
        num_needed = self.num_blocks_needed(req_id, num_total_tokens, len(computed_blocks))
        if not computed_blocks:   # a running request's next step: the common case, kept cheap
            return num_needed <= self.pool.num_free_blocks
        # Hits sitting in the free queue are not available for new allocations.
        num_free_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        return num_needed <= self.pool.num_free_blocks - num_free_hits

    def allocate(self, req_id: str, token_ids: Sequence[int], num_total_tokens: int,
                 computed_blocks: Sequence[KVCacheBlock] = (), cache_salt: str | None = None) -> list[KVCacheBlock]:
        """Grow the request to `num_total_tokens`: take `computed_blocks`, then new blocks. Only after
        `can_allocate` said yes. Returns the new blocks. `cache_salt` counts where this makes the
        request's record (its first allocation without a lookup before)."""
        num_needed = self.num_blocks_needed(req_id, num_total_tokens, len(computed_blocks))
        record = self._record(req_id, cache_salt)
        blocks = record.blocks
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        new_blocks = self.pool.allocate(num_needed) if num_needed else []
        blocks.extend(new_blocks)
        # Offer the blocks of known tokens (not a step's draft tokens) that filled since last time.
        num_known = min(num_total_tokens, len(token_ids))
        if self.enable_prefix_caching and num_known // self.block_size > record.num_cached_blocks:
            self._cache_full_blocks(req_id, token_ids, num_known)
        return new_blocks

    def allocate_slots(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                       num_new_tokens: int, computed_blocks: Sequence[KVCacheBlock] = ()) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` after `num_computed_tokens`. Returns the newly allocated
        blocks, or None (and changes nothing) if the pool cannot supply them."""
        num_total_tokens = num_computed_tokens + num_new_tokens
        if not self.can_allocate(req_id, num_total_tokens, computed_blocks):
            return None
        return self.allocate(req_id, token_ids, num_total_tokens, computed_blocks)

    def _cache_full_blocks(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        record = self.requests[req_id]
        hashes = self._block_hashes(req_id, token_ids, num_tokens)
        num_full_blocks = num_tokens // self.block_size
        # The memo may reach further (a lookup hashes the whole prompt); cache only what is filled,
        # and start after the blocks already handled on earlier steps.
        for index in range(record.num_cached_blocks, num_full_blocks):
            block = record.blocks[index]
            if block.block_hash is None:
                self.pool.cache_block(block, hashes[index], self._block_tokens(token_ids, index),
                                      record.parent(index))
        record.num_cached_blocks = max(record.num_cached_blocks, num_full_blocks)

    def free(self, req_id: str) -> None:
        """Drop the request's record and its references (tail first; unknown ids are a no-op)."""
        record = self.requests.pop(req_id, None)
        if record is not None:
            self.pool.free(list(reversed(record.blocks)))

    def block_ids(self, req_id: str, start: int = 0) -> list[int]:
        """The request's block ids from its `start`-th block on."""
        record = self.requests.get(req_id)
        return [block.block_id for block in record.blocks[start:]] if record else []

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

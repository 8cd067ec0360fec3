"""Paged KV-cache blocks with prefix caching.

A full block is named by a chained xxhash64 of its tokens and its predecessor's hash, so
equal hashes mean equal prefixes. Blocks are reference counted; a block nobody holds but
whose hash is known stays cached in an LRU list until a new allocation evicts it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque

import xxhash

from atom_runtime.sequence import PLACEHOLDER, Sequence


def block_hash(parent: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh64()
    h.update((parent if parent is not None else 0).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV-cache blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.block_of_hash: dict[int, int] = {}
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, LRU first
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def blocks_to_take(self, prefix: list[int], num_new_tokens: int) -> int:
        """Free-pool blocks that admitting a sequence takes: its new blocks, and those of its cached `prefix` that no
        one holds (they leave the evictable set); prefix blocks a running sibling holds cost nothing."""
        new = self.blocks_needed(len(prefix) * self.block_size + num_new_tokens) - len(prefix)
        return new + sum(1 for b in prefix if self.ref_counts[b] == 0)

    def _take_free_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.block_of_hash[self.hash_of[block]]
            self.hash_of[block] = None
        self.ref_counts[block] = 1
        return block

    def _hold(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.evictable.pop(block, None)
        self.ref_counts[block] += 1

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold a prefix of `seq`; the last token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        blocks, parent = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = block_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.block_of_hash.get(h)
            if block is None:
                break
            blocks.append(block)
            parent = h
        return blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq` (after taking `prefix` from the cache)."""
        total = seq.num_computed_tokens + num_new_tokens
        if total <= len(seq.block_table) * self.block_size and (
            not self.enable_prefix_caching or total // self.block_size <= len(seq.block_hashes)
        ):
            return True  # the common decode step: room in the last block, no block filled
        if not seq.block_table and prefix:
            if self.blocks_to_take(prefix, num_new_tokens) > self.num_free_blocks:
                return False
            for block in prefix:
                self._hold(block)
            seq.block_table = list(prefix)
            seq.block_hashes = [self.hash_of[b] for b in prefix]
            seq.num_computed_tokens = len(prefix) * self.block_size
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(needed))
        self._register_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Hash the blocks this step fills, so later requests (and later sequences of this step) reuse them."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), num_tokens // self.block_size):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            if PLACEHOLDER in tokens:  # not sampled yet: hashed in a later step
                return
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.block_of_hash and self.hash_of[block] is None:
                self.block_of_hash[h] = block
                self.hash_of[block] = h

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so the LRU list evicts the end of a prefix before its start.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.hash_of[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

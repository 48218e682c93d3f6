"""Paged KV-cache accounting with prefix caching.

The KV cache lives on the worker; this class decides which block ids hold which tokens.
A block that is full and whose KV has been computed is registered under a chained hash
(xxh64 over the parent block's hash and the block's token ids), so a later sequence with the
same prefix reuses it by reference count instead of recomputing it. Freed blocks keep their
hash and stay findable until they are handed out again (the free list is the LRU cache).
"""
from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from scheduler_svc.engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    """The prefix-cache key of a full block: it depends on every token before it too."""
    data = array("I", token_ids).tobytes()
    if parent_hash is not None:
        data = parent_hash.to_bytes(8, "little") + data
    return xxhash.xxh64_intdigest(data)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None             # set once the block is full and computed
        self.token_ids: list[int] | None = None  # its tokens, to verify a hit (collisions)

    def forget(self) -> None:
        self.hash = None
        self.token_ids = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Free blocks in the order they are reused, first one first. An OrderedDict so a
        # prefix hit can take a block out of the middle in O(1).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0

    # -- capacity ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / len(self.blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup -------------------------------------------------------------------
    def _block_hash(self, token_ids: list[int], hashes: list[int], index: int) -> int:
        """hashes[index], extending the lazily built chain of full-block hashes as needed."""
        bs = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            hashes.append(hash_block(hashes[i - 1] if i else None, token_ids[i * bs:(i + 1) * bs]))
        return hashes[index]

    def _match(self, token_ids: list[int], hashes: list[int]) -> list[int]:
        """Block ids holding the longest computed prefix of token_ids. The block holding the
        last token is never a hit: that token must run through the model to give logits."""
        bs = self.block_size
        hits: list[int] = []
        for i in range((len(token_ids) - 1) // bs):
            block_id = self.hash_to_block_id.get(self._block_hash(token_ids, hashes, i))
            if block_id is None or self.blocks[block_id].token_ids != token_ids[i * bs:(i + 1) * bs]:
                break
            hits.append(block_id)
        return hits

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks an admission of seq would reuse (pass them to allocate)."""
        return self._match(seq.token_ids, seq.block_hashes)

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """How many tokens of a prompt this cache holds (for routing between worker groups)."""
        return len(self._match(token_ids, [])) * self.block_size

    # -- allocation ----------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        # Its old content is about to be overwritten: drop the hash entry, but only if it is
        # still this block's (a later block with the same content may own it now).
        if block.hash is not None:
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.forget()
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, cached_block_ids: list[int], num_tokens: int) -> bool:
        """Admits seq: reuses cached_block_ids (from match_prefix) and adds fresh blocks so
        that num_tokens slots exist. All or nothing; False when the blocks are not there.
        The hit counters count every admission, re-admissions after preemption included."""
        if seq.block_table:
            raise RuntimeError(f"{seq} already holds blocks")
        num_fresh = self.blocks_for(num_tokens) - len(cached_block_ids)
        # Cached blocks nobody uses sit in the free list: reviving them costs free blocks too.
        num_revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if num_fresh + num_revived > len(self.free_block_ids):
            return False
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(num_fresh):
            seq.block_table.append(self._take_free_block())
        seq.num_computed_tokens = len(cached_block_ids) * self.block_size
        self.prefix_cache_queried_tokens += seq.num_tokens
        self.prefix_cache_hit_tokens += seq.num_computed_tokens
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grows seq's table to hold num_new_tokens more tokens past the computed ones and the
        drafts steps in flight verify (a chunk may need several blocks). All or nothing; False
        when blocks run out."""
        num_needed = (self.blocks_for(seq.num_computed_tokens + seq.num_unresolved_drafts + num_new_tokens)
                      - len(seq.block_table))
        if num_needed > len(self.free_block_ids):
            return False
        for _ in range(num_needed):
            seq.block_table.append(self._take_free_block())
        return True

    def cache_computed_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Registers the blocks of seq that a step computing its positions start..end-1 made
        full, once that step's result is back (prefill chunks and decode tokens alike). Not at
        schedule time: a block's last tokens may still be placeholders then, and a hit in the
        very step that computes the block would rely on the worker writing before reading."""
        bs = self.block_size
        if end > min(seq.num_tokens, len(seq.block_table) * bs):
            raise RuntimeError(f"{seq} has no computed tokens up to position {end}")
        for i in range(start // bs, end // bs):
            block = self.blocks[seq.block_table[i]]
            block.hash = self._block_hash(seq.token_ids, seq.block_hashes, i)
            block.token_ids = seq.token_ids[i * bs:(i + 1) * bs]
            # A block computed twice (two equal prompts admitted together) moves the entry
            # to the newer block; the older one keeps its hash but is no longer found.
            self.hash_to_block_id[block.hash] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Gives back seq's blocks. Cached ones stay findable until reused, the tail going
        first (reversed); blocks nobody can find are reused before any cached one."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.hash is None or self.hash_to_block_id.get(block.hash) != block_id:
                    block.forget()
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (the worker lost its KV). Every sequence must be freed."""
        if self.num_used_blocks:
            raise RuntimeError(f"{self.num_used_blocks} blocks are still in use")
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.forget()

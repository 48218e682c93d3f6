"""BlockManager: ref counts, prefix sharing, and each of nano-vllm's known prefix-cache bugs."""
from __future__ import annotations

import itertools
import random

import pytest

from scheduler_svc.engine import block_manager as block_manager_module
from scheduler_svc.engine.block_manager import BlockManager, hash_block
from common.sampling import SamplingParams
from scheduler_svc.engine.sequence import Sequence

_ids = itertools.count()


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(next(_ids), "req", tokens, SamplingParams())


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the scheduler does for a step that computes num_tokens more of seq: counts them
    when scheduling, registers the blocks they fill when the result is back."""
    start = seq.num_computed_tokens
    seq.num_computed_tokens += num_tokens
    bm.cache_computed_blocks(seq, start, seq.num_computed_tokens)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Admits seq with its prefix hits and computes the rest; returns the hit tokens."""
    assert bm.allocate(seq, bm.match_prefix(seq), seq.num_tokens)
    hit = seq.num_computed_tokens
    compute(bm, seq, seq.num_uncomputed_tokens)
    return hit


def decode(bm: BlockManager, seq: Sequence, token: int) -> None:
    """Appends a sampled token and computes it, as one decode step does."""
    seq.token_ids.append(token)
    assert bm.append_slots(seq, 1)
    compute(bm, seq, 1)


def chain_hashes(tokens: list[int], block_size: int) -> list[int]:
    hashes: list[int] = []
    for i in range(len(tokens) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None,
                                 tokens[i * block_size:(i + 1) * block_size]))
    return hashes


def test_hash_chains_over_parent():
    a, b = hash_block(None, [1, 2]), hash_block(None, [3, 4])
    assert hash_block(a, [5, 6]) != hash_block(b, [5, 6])
    assert hash_block(a, [5, 6]) == hash_block(a, [5, 6])


def test_only_full_computed_blocks_are_hashed_including_decode_completed():
    bm = BlockManager(8, 4)
    tokens = [random.randrange(1000) for _ in range(10)]
    seq = make_seq(tokens)
    assert bm.allocate(seq, [], 10) and len(seq.block_table) == 3
    assert not bm.hash_to_block_id                       # allocated is not computed
    compute(bm, seq, 6)                             # a chunk ending inside block 1
    assert [bm.blocks[b].hash is not None for b in seq.block_table] == [True, False, False]
    compute(bm, seq, 4)
    assert [bm.blocks[b].hash is not None for b in seq.block_table] == [True, True, False]
    decode(bm, seq, 7)                                   # position 10: block 2 not full yet
    assert bm.blocks[seq.block_table[2]].hash is None
    decode(bm, seq, 8)                                   # position 11 fills block 2
    assert len(seq.block_table) == 3
    expected = chain_hashes(seq.token_ids, 4)
    assert [bm.blocks[b].hash for b in seq.block_table] == expected
    assert {bm.hash_to_block_id[h] for h in expected} == set(seq.block_table)
    # Another sequence with those 12 tokens and one more reuses all three blocks.
    other = make_seq(seq.token_ids + [9])
    assert bm.match_prefix(other) == seq.block_table


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(8, 4)
    prompt = list(range(8))                              # exactly two full blocks
    first = make_seq(prompt)
    admit(bm, first)
    assert len(bm.hash_to_block_id) == 2
    again = make_seq(prompt)
    hits = bm.match_prefix(again)
    assert hits == first.block_table[:1]                 # the last token's block is no hit
    assert bm.allocate(again, hits, again.num_tokens)
    assert again.num_computed_tokens == 4 and again.num_uncomputed_tokens == 4
    assert again.block_table[1] != first.block_table[1]  # recomputed into its own block
    longer = make_seq(prompt + [8])
    assert bm.match_prefix(longer) == first.block_table
    assert bm.cached_prefix_len(prompt[:4]) == 0         # a one-block prompt: never a hit


def test_reused_block_loses_its_stale_hash_entry():
    bm = BlockManager(2, 4)
    first = make_seq([1, 2, 3, 4, 5])
    admit(bm, first)
    (stale_hash,) = bm.hash_to_block_id
    bm.free(first)
    assert bm.cached_prefix_len([1, 2, 3, 4, 5]) == 4    # freed, still a hit until reused
    other = make_seq([9] * 8)
    assert bm.allocate(other, bm.match_prefix(other), 8)  # takes both blocks, KV not written
    assert stale_hash not in bm.hash_to_block_id
    assert bm.cached_prefix_len([1, 2, 3, 4, 5]) == 0


def test_reuse_keeps_the_entry_of_a_newer_block_with_the_same_content():
    bm = BlockManager(6, 4)
    a, b = make_seq([1, 2, 3, 4, 5]), make_seq([1, 2, 3, 4, 5])
    for seq in (a, b):                                   # admitted together: both miss
        assert bm.allocate(seq, bm.match_prefix(seq), 5)
    for seq in (a, b):
        compute(bm, seq, 5)
    (h,) = bm.hash_to_block_id
    assert bm.hash_to_block_id[h] == b.block_table[0]
    old_block = a.block_table[0]
    bm.free(a)
    assert bm.blocks[old_block].hash is None             # nobody could find it: reused first
    filler = make_seq([7] * 4)
    assert bm.allocate(filler, [], 4) and filler.block_table == [old_block]
    assert bm.hash_to_block_id[h] == b.block_table[0]
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == b.block_table[:1]


def test_hash_collision_is_not_served(monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(4, 4)
    admit(bm, make_seq([1, 2, 3, 4, 5]))
    assert bm.hash_to_block_id == {42: bm.hash_to_block_id[42]}
    assert bm.match_prefix(make_seq([5, 6, 7, 8, 9])) == []
    assert bm.cached_prefix_len([1, 2, 3, 4, 0]) == 4


def test_preempted_sequence_hits_its_own_computed_blocks():
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(10)))
    admit(bm, seq)
    for token in (100, 101):
        seq.token_ids.append(token)                      # sampled ...
        assert bm.append_slots(seq, 1)
        compute(bm, seq, 1)                         # ... and computed next step
    seq.token_ids.append(102)                            # sampled, not computed
    table = list(seq.block_table)
    bm.free(seq)                                         # preempted
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    hits = bm.match_prefix(seq)
    assert hits == table[:3]                             # 12 computed tokens, 3 full blocks
    assert bm.allocate(seq, hits, seq.num_tokens)
    assert seq.num_computed_tokens == 12 and seq.num_uncomputed_tokens == 1


def test_shared_prefix_ref_counts_and_revival_from_the_free_list():
    bm = BlockManager(6, 4)
    prefix = list(range(8))
    a, b = make_seq(prefix + [50, 51]), make_seq(prefix + [60])
    admit(bm, a)
    assert admit(bm, b) == 8
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    assert bm.num_used_blocks == 4
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1] and bm.num_used_blocks == 3
    bm.free(b)
    assert bm.num_free_blocks == 6 and all(blk.ref_count == 0 for blk in bm.blocks)
    # The shared blocks are free but cached; reviving them costs free blocks.
    hog = make_seq([9] * 12)
    assert bm.allocate(hog, [], 12)                      # 3 free left: the cached two and one
    c = make_seq(prefix + [70] * 8)                      # 2 hits + 2 fresh = 4 > 3
    hits = bm.match_prefix(c)
    assert hits == shared
    assert not bm.allocate(c, hits, c.num_tokens) and c.block_table == []
    assert bm.allocate(c, hits, 9)                       # 2 hits + 1 fresh fits
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1] and bm.num_free_blocks == 0


def test_blocks_without_hash_are_reused_before_cached_ones():
    bm = BlockManager(4, 4)
    seq = make_seq(list(range(6)))
    admit(bm, seq)                                       # block 0 cached, block 1 partial
    cached, partial = seq.block_table
    bm.free(seq)
    taker = make_seq([9] * 4)
    assert bm.allocate(taker, [], 4)
    assert taker.block_table == [partial]
    assert bm.cached_prefix_len(list(range(6))) == 4


def test_append_slots_is_all_or_nothing():
    bm = BlockManager(3, 4)
    seq = make_seq(list(range(3)))
    assert bm.allocate(seq, [], 3)
    assert not bm.append_slots(seq, 13)                  # 13 slots: 4 blocks, 3 exist
    assert len(seq.block_table) == 1 and bm.num_free_blocks == 2
    assert bm.append_slots(seq, 12) and len(seq.block_table) == 3
    with pytest.raises(RuntimeError):
        bm.cache_computed_blocks(seq, 0, 4)              # more than the 3 tokens it has


def test_counters_usage_and_reset():
    bm = BlockManager(4, 2)
    first, second = make_seq([1, 2, 3]), make_seq([1, 2, 3, 4, 5])
    admit(bm, first)
    assert admit(bm, second) == 2
    assert (bm.prefix_cache_queried_tokens, bm.prefix_cache_hit_tokens) == (8, 2)
    assert bm.num_used_blocks == 4 and bm.usage == 1.0   # 2 + 3 blocks, one shared
    with pytest.raises(RuntimeError):
        bm.reset_prefix_cache()                          # blocks still in use
    bm.free(first)
    bm.free(second)
    assert bm.cached_prefix_len([1, 2, 3, 4, 5]) == 4
    bm.reset_prefix_cache()
    assert bm.cached_prefix_len([1, 2, 3, 4, 5]) == 0 and not bm.hash_to_block_id

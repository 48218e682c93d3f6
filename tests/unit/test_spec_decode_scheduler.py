"""The scheduler's side of speculative decoding: which decodes verify drafts and how many, the
KV slots reserved for them, the accepted run applied (and cut at a stop), the next step scheduled
while a verification is in flight, replies checked, and the engine's settings taken from its workers."""
from __future__ import annotations

import asyncio
import itertools

import pytest

from common.pb.llm.worker.v1 import worker_pb2
from common.sampling import SamplingParams
from scheduler_svc.engine.api import CoreRequest, make_seq_id
from scheduler_svc.engine.block_manager import BlockManager
from scheduler_svc.engine.core import EngineConfig, EngineCore
from scheduler_svc.engine.group_runner import GroupRunner, StepLimitError
from scheduler_svc.engine.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.sequence import FinishReason, Sequence
from scheduler_svc.engine.speculation import SpeculationConfig
from scheduler_svc.engine.worker_client import WorkerGroupClient
from tests.support.fake_worker import FakeWorkerClient, prefix_token
from tests.unit.test_group_runner import _run_to_completion

EOS = 0
_ids = itertools.count(1)


def make_scheduler(num_blocks: int = 32, block_size: int = 4, k: int = 3, max_batch_size: int = 4,
                   budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=num_blocks * block_size,
                             block_size=block_size, speculation=SpeculationConfig(k, max_batch_size, "ngram"))
    return Scheduler(config, BlockManager(num_blocks, block_size), eos_token_ids=[EOS])


def add(sched: Scheduler, prompt: list[int], **params) -> Sequence:
    params.setdefault("max_tokens", 100)
    seq = Sequence(next(_ids), "r", prompt, SamplingParams(**params))
    sched.add(seq)
    return seq


def prefill_with_drafts(sched: Scheduler, seq: Sequence, num_drafts: int = 3) -> None:
    """Runs seq's prompt; the worker answers that it holds num_drafts drafts for it."""
    out = sched.schedule()
    assert out.propose_drafts
    sched.update(out, [7] * len(out.sampling_seqs), (), [num_drafts] * len(out.sampling_seqs))
    assert seq.num_drafts == num_drafts


def test_a_decode_verifies_the_drafts_its_worker_holds_with_a_slot_for_each():
    sched = make_scheduler()
    seq = add(sched, [1, 2, 3, 4, 5, 6])               # 6 prompt tokens + 1 sampled: 7
    prefill_with_drafts(sched, seq)
    out = sched.schedule()
    assert out.num_drafts == {0: 3} and out.num_scheduled_tokens == 4
    # Positions 6 (the newest token) and 7..9 (the drafts) need blocks up to position 9.
    assert len(seq.block_table) == 3 and out.cached_requests[0].new_block_ids == seq.block_table[2:]


def test_an_accepted_run_is_appended_and_the_rejected_drafts_slots_kept_for_the_next_tokens():
    sched = make_scheduler()
    seq = add(sched, [1, 2, 3, 4, 5, 6])
    prefill_with_drafts(sched, seq)
    out = sched.schedule()
    free_before = sched.block_manager.num_free_blocks
    received = sched.update(out, [8, 9], [2], [1])     # one draft accepted, then one more token
    assert received == [seq] and out.received_counts == [2]
    assert seq.output_token_ids == [7, 8, 9] and seq.num_computed_tokens == 8 and seq.num_drafts == 1
    # 9 tokens: the next decode writes position 8, in block 2, where the rejected drafts were.
    assert len(seq.block_table) == 3 and sched.block_manager.num_free_blocks == free_before
    assert (out.num_verifications, out.num_draft_tokens, out.num_accepted_tokens) == (1, 3, 1)
    out = sched.schedule()                              # one draft held: one verified
    assert out.num_drafts == {0: 1} and out.num_scheduled_tokens == 2


def test_all_rejected_drafts_leave_a_plain_decode_behind():
    sched = make_scheduler(block_size=2)
    seq = add(sched, [1, 2, 3])
    prefill_with_drafts(sched, seq)
    out = sched.schedule()
    assert len(seq.block_table) == 4                    # positions 3..6
    sched.update(out, [5])                              # no token_counts: one token each
    assert seq.output_token_ids == [7, 5] and seq.num_computed_tokens == 4
    assert seq.num_drafts == 0 and seq.num_unresolved_drafts == 0
    # The drafts' slots stay for the tokens that follow: no block comes and goes for them.
    assert len(seq.block_table) == 4 and sched.block_manager.num_used_blocks == 4
    for _ in range(2):
        out = sched.schedule()
        assert out.num_scheduled_tokens == 1 and not out.cached_requests[0].new_block_ids
        sched.update(out, [5])


def test_a_stop_token_inside_an_accepted_run_cuts_it_there():
    sched = make_scheduler()
    seq = add(sched, [1, 2, 3])
    prefill_with_drafts(sched, seq)
    out = sched.schedule()
    received = sched.update(out, [8, EOS, 9, 10], [4])
    assert received == [seq] and out.received_counts == [2]
    assert seq.output_token_ids == [7, 8, EOS] and seq.finish_reason is FinishReason.STOP
    assert sched.block_manager.num_used_blocks == 0


def test_a_step_is_scheduled_while_a_verification_is_in_flight():
    """The next step goes before the last one's answer: it asks for the most drafts the step in
    flight may propose, with slots for them past every draft in flight; the answer then moves its
    entry by the drafts accepted."""
    sched = make_scheduler()
    seq = add(sched, [1, 2, 3, 4, 5, 6])                # 7 tokens once the prompt ran
    prefill_with_drafts(sched, seq)
    first = sched.schedule()                            # position 6, drafts at 7..9
    assert first.num_drafts == {0: 3} and seq.num_unresolved_drafts == 3 and len(seq.block_table) == 3
    second = sched.schedule()                           # at worst position 10, drafts at 11..13
    assert second.num_drafts == {0: 3} and second.scheduled[0].num_computed_tokens == 7
    assert len(seq.block_table) == 4 and second.cached_requests[0].new_block_ids == seq.block_table[3:]
    received = sched.update(first, [8, 9], [2], [3], [3])       # one of three accepted
    assert received == [seq] and seq.num_unresolved_drafts == 3 and seq.num_drafts == 3
    assert second.scheduled[0].num_computed_tokens == 8 and seq.num_computed_tokens == 9
    assert (first.num_verifications, first.num_draft_tokens, first.num_accepted_tokens) == (1, 3, 1)
    # The worker held two drafts when the second step ran: it verified them both.
    sched.update(second, [10, 11, 12], [3], [3], [2])
    assert seq.output_token_ids == [7, 8, 9, 10, 11, 12] and seq.num_computed_tokens == 11
    assert seq.num_unresolved_drafts == 0 and seq.num_drafts == 3
    assert (second.num_verifications, second.num_draft_tokens, second.num_accepted_tokens) == (1, 2, 2)
    # Blocks 0 and 1 hold computed tokens 0..7: registered; block 2 (8..11) is not full of computed ones.
    assert [sched.block_manager.blocks[b].hash is not None for b in seq.block_table[:3]] == [True, True, False]


def test_drafts_in_flight_count_against_max_tokens():
    sched = make_scheduler()
    seq = add(sched, [1, 2, 3], max_tokens=7)           # 1 sampled, 6 to go
    prefill_with_drafts(sched, seq)
    first = sched.schedule()
    assert first.num_drafts == {0: 3}                   # brings up to 4: 5 of 7
    second = sched.schedule()                           # 1 + at most 1 more draft
    assert second.num_drafts == {0: 1}
    sched.update(first, [8, 9, 10, 11], [4], [3], [3])
    assert not sched.schedule().seqs                    # its last tokens are in flight
    sched.update(second, [12, 13], [2], [3], [1])
    assert seq.num_output_tokens == 7 and seq.finish_reason is FinishReason.LENGTH


def test_a_reply_verifying_more_drafts_than_asked_is_refused():
    sched = make_scheduler()
    seq = add(sched, [1, 2, 3])
    prefill_with_drafts(sched, seq, 2)
    out = sched.schedule()
    with pytest.raises(ValueError, match="verified 3 drafts for sampling request 0, which asked for 2"):
        sched.update(out, [8], [1], [0], [3])
    assert seq.num_unresolved_drafts == 2


def test_max_tokens_bounds_the_drafts_verified():
    sched = make_scheduler()
    seq = add(sched, [1, 2, 3], max_tokens=3)           # 1 sampled, 2 to go: one draft at most
    prefill_with_drafts(sched, seq)
    out = sched.schedule()
    assert out.num_drafts == {0: 1}
    sched.update(out, [8, 9], [2])
    assert seq.output_token_ids == [7, 8, 9] and seq.finish_reason is FinishReason.LENGTH


def test_no_drafts_over_the_batch_threshold_for_opted_out_requests_or_without_room():
    sched = make_scheduler(max_batch_size=2)
    a = add(sched, [1, 2, 3])
    add(sched, [4, 5, 6], speculative=False)
    out = sched.schedule()
    sched.update(out, [7, 7], (), [3, 3])
    out = sched.schedule()
    assert out.num_drafts == {0: 3}                     # b opted out
    sched.update(out, [8, 8], (), [3, 3])
    add(sched, [9, 9, 9])                               # a third request: over the threshold
    out = sched.schedule()
    assert not out.cached.draft_indices and not out.propose_drafts
    assert a.num_drafts == 0                            # held, not verified in a large batch, then dropped


def test_drafts_never_preempt_anyone():
    sched = make_scheduler(num_blocks=3, block_size=4)
    a = add(sched, [1, 2, 3, 4, 5, 6])
    b = add(sched, [1, 1])
    out = sched.schedule()
    sched.update(out, [7, 7], (), [3, 3])
    assert sched.block_manager.num_free_blocks == 0
    out = sched.schedule()              # no block is free: each verifies what its last block holds
    assert out.num_drafts == {0: 1, 1: 1} and not out.preempted_seq_ids
    assert len(a.block_table) == 2 and len(b.block_table) == 1 and sched.num_running == 2


def test_a_reply_with_a_run_longer_than_the_drafts_is_refused_and_changes_nothing():
    sched = make_scheduler()
    seq = add(sched, [1, 2, 3])
    prefill_with_drafts(sched, seq, 2)
    out = sched.schedule()
    tokens = list(seq.token_ids)
    with pytest.raises(ValueError, match="returned 4 tokens for sampling request 0, which may have 1..3"):
        sched.update(out, [8, 9, 10, 11], [4])
    with pytest.raises(ValueError, match="holds 5 drafts"):
        sched.update(out, [8], (), [5])
    assert seq.token_ids == tokens and seq.num_placeholder_tokens == 1


def _engine_tokens(num_speculative_tokens: int, die_at: set[int] = frozenset()) -> tuple[dict, object, FakeWorkerClient]:
    """Runs three requests through an engine core over a fake worker that proposes the true
    continuation (every other time with its second draft wrong)."""
    def propose(tokens: list[int]) -> list[int]:
        drafts = []
        for j in range(4):
            true = prefix_token(tokens + drafts, 50)
            drafts.append(true + 1 if j == 1 and len(tokens) % 2 else true)
        return drafts

    async def scenario():
        client = FakeWorkerClient(die_at, num_blocks=64, block_size=4, vocab_size=50,
                                  num_speculative_tokens=num_speculative_tokens, propose=propose)
        core = EngineCore([WorkerGroupClient([client])], eos_token_ids=[0],
                          config=EngineConfig(reconnect_interval_s=0.001))
        await core.start()
        assert await core.wait_ready(timeout_s=10)
        requests = [CoreRequest(make_seq_id(0, i + 1), f"r{i}", [i + 1, 2, 3],
                                SamplingParams(max_tokens=15, ignore_eos=True)) for i in range(3)]
        try:
            return await _run_to_completion(core, requests), core.metrics, client
        finally:
            await core.shutdown(grace_s=0)

    return asyncio.run(scenario())


def test_the_engine_gives_the_same_tokens_with_drafts_and_counts_them():
    plain, *_ = _engine_tokens(0)
    speculative, metrics, client = _engine_tokens(4)
    assert speculative == plain
    # Steps go out while one that verifies drafts runs: nothing waits for its answer.
    assert client.max_in_flight == 2 and client.sent_behind_verification >= 3
    value = metrics.registry.get_sample_value
    drafts, accepted = value("llm_spec_decode_draft_tokens_total"), value("llm_spec_decode_accepted_tokens_total")
    verifications = value("llm_spec_decode_verifications_total")
    assert 0 < accepted < drafts and verifications > 0
    # Every output token is the one each verification brings or an accepted draft, or a plain sample.
    assert value("llm_sampled_tokens_total") == 45 >= verifications + accepted


def test_a_worker_restart_mid_speculation_loses_and_repeats_no_token():
    plain, *_ = _engine_tokens(0)
    assert _engine_tokens(4, die_at={5, 9})[0] == plain


def _speculation(config: EngineConfig, method: str, k: int) -> SpeculationConfig:
    runner = GroupRunner(0, WorkerGroupClient([FakeWorkerClient()]), config, [0], metrics=None, hooks=None)
    info = worker_pb2.WorkerInfo(max_model_len=64, block_size=4, num_kv_blocks=16, max_num_seqs=8,
                                 max_num_batched_tokens=64, speculative_method=method, num_speculative_tokens=k)
    return runner.scheduler_config([info]).speculation


def test_the_engine_follows_its_workers_speculation_unless_told_otherwise():
    assert _speculation(EngineConfig(), "eagle3", 4) == SpeculationConfig(4, 16, "eagle3")
    assert _speculation(EngineConfig(num_speculative_tokens=2), "ngram", 4).num_speculative_tokens == 2
    assert _speculation(EngineConfig(speculative_method="off"), "ngram", 4).num_speculative_tokens == 0
    assert _speculation(EngineConfig(), "", 0).num_speculative_tokens == 0
    with pytest.raises(StepLimitError, match="--speculative-method draft, but the workers of group 0 .* propose "
                                             "with ngram"):
        _speculation(EngineConfig(speculative_method="draft"), "ngram", 4)
    with pytest.raises(StepLimitError, match="--num-speculative-tokens 6 is more than the 4 drafts"):
        _speculation(EngineConfig(num_speculative_tokens=6), "ngram", 4)

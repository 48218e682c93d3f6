"""Continuous batching: decides each step's work and applies the sampled tokens.

One unified step in the style of vLLM V1: every request simply has some tokens left to
compute. Running requests go first (a decode takes one token, an unfinished prefill the
next chunk), preempting the lowest-priority, most recently admitted ones when KV blocks run out;
then waiting requests are admitted by priority (aged by their wait, see waiting_queue.py), then
first come, first served, with the remaining token budget, chunked when their prompt does not fit.
So one step can mix a long prompt's chunk with many decodes. With one priority (the default) this is plain FCFS.

Steps may be scheduled ahead (vLLM's async scheduling): schedule() for step N+1 may run before
update() of step N, since the worker runs steps in order and appends the tokens it samples. A
request that samples in a step in flight counts one placeholder token, so the next step names its
decode; update() turns placeholders into real tokens. A request that stops at step N although
step N+1 computes it gets that step's token discarded; preempted or aborted ones likewise.

A request whose client reads slower than it is generated is paused (backpressure): it leaves the
batch but keeps its blocks and its worker mirror, so it resumes where it stopped; the tokens of
steps in flight still reach it. Its blocks are the first taken back when a running or waiting
request needs blocks (before any running request is preempted); it is then recomputed when it
resumes, like a preempted one. Paused requests take no slot of max_num_seqs.

After a failed step (the worker reset), the requests it held are suspects: they come back one at a
time (a suspect is admitted only while no other runs), so that a request that makes the worker
fail is alone among the suspects of the next failure and can be blamed for it (GroupRunner).

Speculative decoding (speculation.py has the rules): a decode whose worker holds draft tokens for
it may verify some of them in its step, with KV slots reserved for each; the step then brings
it the accepted drafts and one more token, cut at a stop. Such steps are scheduled ahead too: the
worker computes the next step's positions from its own count of the accepted drafts (on the device,
or on the host once the verification is settled), so the scheduler need not know how many there were. Until it does,
it reserves their slots (num_unresolved_drafts), asks the next step to verify the most drafts the
one in flight may propose (the worker verifies those it holds), and, once the answer comes, moves
the entries of the later step in flight by the drafts accepted. Rejected drafts' slots stay in the
block table for the tokens that follow.
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence as Sequence_

from scheduler_svc.engine.block_manager import BlockManager
from scheduler_svc.engine.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_svc.engine.scheduler_output import NewRequestData, SchedulerOutput
from scheduler_svc.engine.speculation import SpeculationConfig, check_reply, num_drafts_to_verify
from scheduler_svc.engine.waiting_queue import WaitingQueue


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int                   # running requests at most
    max_num_batched_tokens: int         # token budget of one step
    max_model_len: int                  # prompt plus output at most (else finish "length")
    block_size: int
    long_prefill_token_threshold: int = 0   # >0: a prefill takes at most this many per step
    priority_aging_s: float = 0.0       # seconds of waiting one priority level is worth (waiting_queue.py)
    speculation: SpeculationConfig = SpeculationConfig()   # off unless given
    # Requests the worker holds at once, running and paused (WorkerInfo.max_held_requests): the
    # longest-paused lose their mirrors past it. 0: no bound.
    max_held_requests: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.max_held_requests and self.max_held_requests < self.max_num_seqs:
            raise ValueError(f"max_held_requests {self.max_held_requests} is below max_num_seqs {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must not be negative")
        if not self.priority_aging_s >= 0:
            raise ValueError("priority_aging_s must not be negative")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: Iterable[int] = ()) -> None:
        if config.block_size != block_manager.block_size:
            raise ValueError("config.block_size differs from the block manager's")
        # So that any one request can always run to max_model_len alone (else it could
        # wait, or preempt itself, forever).
        capacity = block_manager.num_blocks * block_manager.block_size
        if config.max_model_len > capacity:
            raise ValueError(f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                             f"{config.max_model_len}: lower max_model_len or add KV blocks")
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = WaitingQueue(config.priority_aging_s)
        # By priority (highest first), then admission order: the end is preempted first, and
        # _schedule_running, going front to back, never preempts a sequence it already scheduled.
        self.running: list[Sequence] = []
        self.paused: dict[int, Sequence] = {}   # out of the batch, oldest pause first
        self._unfinished: dict[int, Sequence] = {}
        # Worker mirrors to drop, collected until the next step that is sent.
        self._finished_ids: list[int] = []
        self._preempted_ids: list[int] = []
        # Scheduled steps whose results have not been applied, oldest first.
        self._in_flight: deque[SchedulerOutput] = deque()
        self.num_preemptions = 0                # since start, for ModelInfo and metrics

    # -- queue -----------------------------------------------------------------------------
    def check_new(self, seq: Sequence) -> None:
        """Raises ValueError when add(seq) would."""
        if seq.seq_id in self._unfinished:
            raise ValueError(f"seq_id {seq.seq_id} is already queued")
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"{seq} is not new")
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(f"the prompt has {seq.num_tokens} tokens; max_model_len is "
                             f"{self.config.max_model_len}")
        if seq.sampling.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence."""
        self.check_new(seq)
        self.waiting.push(seq)
        self._unfinished[seq.seq_id] = seq

    def hand_over(self) -> list[Sequence]:
        """Gives up every unfinished request, in queue order (paused ones last), for other groups
        to adopt (this group's workers are gone): they hold no blocks and keep all their tokens."""
        self.reset_all_worker_state()
        seqs = list(self.waiting) + list(self.paused.values())
        self.waiting.clear()
        self.paused.clear()
        self._unfinished.clear()
        return seqs

    def adopt(self, seq: Sequence) -> None:
        """Queues a request another group's scheduler handed over; like a preempted one, it
        is re-sent in full and recomputed (hitting this group's prefix cache where it can)."""
        if seq.seq_id in self._unfinished:
            raise ValueError(f"seq_id {seq.seq_id} is already queued")
        if seq.status is SequenceStatus.FINISHED or seq.block_table or seq.on_worker:
            raise ValueError(f"{seq} was not handed over")
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(f"{seq} is longer than this group's max_model_len {self.config.max_model_len}")
        if seq.paused:
            self.paused[seq.seq_id] = seq
        else:
            self.waiting.push(seq)
        self._unfinished[seq.seq_id] = seq

    def abort(self, seq_id: int) -> Sequence | None:
        """Drops a request in whatever state, freeing its blocks at once."""
        return self.finish(seq_id, FinishReason.ABORT)

    def finish(self, seq_id: int, reason: FinishReason = FinishReason.STOP) -> Sequence | None:
        """Ends a request early (a stop string found by the detokenizer, or an abort)."""
        seq = self._unfinished.get(seq_id)
        if seq is None:
            return None
        if seq.paused:
            pass                              # _release takes it out of self.paused
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq, reason)
        return seq

    # -- backpressure ----------------------------------------------------------------------
    def pause(self, seq_id: int) -> bool:
        """Takes a request out of the batch until resume(): it keeps its blocks and worker
        mirror, unless another request needs the blocks first or the worker would hold more
        requests than it can (the longest-paused then lose theirs). False when there is no such
        unfinished request or it is paused already."""
        seq = self._unfinished.get(seq_id)
        if seq is None or seq.paused:
            return False
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.paused = True
        self.paused[seq_id] = seq
        if seq.status is SequenceStatus.RUNNING and self.config.max_held_requests:
            # Running requests never pass max_num_seqs, so the paused that keep their mirrors are
            # held to the rest; each reclaimed one drops its mirror with its blocks.
            spare = self.config.max_held_requests - self.config.max_num_seqs
            while sum(held.status is SequenceStatus.RUNNING for held in self.paused.values()) > spare:
                self._reclaim_paused()
        return True

    def resume(self, seq_id: int) -> bool:
        """Puts a paused request back: into the batch when it still holds its blocks and a slot
        is free, else into the queue where a preempted one goes (recomputed, mostly from the
        prefix cache)."""
        seq = self.paused.pop(seq_id, None)
        if seq is None:
            return False
        seq.paused = False
        if seq.status is SequenceStatus.RUNNING:
            if len(self.running) < self.config.max_num_seqs:
                self._add_running(seq)
                return True
            self._preempt(seq)                # its slot went to another request meanwhile
            return True
        self.waiting.push(seq)                # by its priority and arrival, as a preempted one
        return True

    @property
    def num_paused(self) -> int:
        return len(self.paused)

    def _reclaim_paused(self) -> bool:
        """Frees the blocks of the longest-paused request that holds any; False if none does."""
        for seq in self.paused.values():
            if seq.status is SequenceStatus.RUNNING:
                self._free(seq)
                seq.status = SequenceStatus.PREEMPTED
                self.num_preemptions += 1
                if seq.on_worker:
                    self._preempted_ids.append(seq.seq_id)
                    seq.on_worker = False
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        # Preempted requests head the queue. One comes back in this same step only when
        # others still hold its prefix blocks; the worker drops the old mirror first.
        self._schedule_waiting(output, budget)
        output.propose_drafts = self.speculating
        if self.config.speculation.num_speculative_tokens:
            # What the worker will hold for each once this step ran: the most it may propose.
            most = self.config.speculation.num_speculative_tokens if output.propose_drafts else 0
            for seq in output.sampling_seqs:
                seq.num_drafts = most if seq.sampling.speculative else 0
        if output.seqs:
            # Sent with this step; when nothing is scheduled no step is sent, so they wait.
            output.finished_seq_ids, self._finished_ids = self._finished_ids, []
            output.preempted_seq_ids, self._preempted_ids = self._preempted_ids, []
            self._in_flight.append(output)
        return output

    def _num_to_schedule(self, num_uncomputed: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            num_uncomputed = min(num_uncomputed, threshold)
        return min(num_uncomputed, budget)

    @property
    def speculating(self) -> bool:
        """Whether decodes may verify drafts now: speculation is on and the batch, with the requests
        waiting to join it, is small enough."""
        spec = self.config.speculation
        batch = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return spec.num_speculative_tokens > 0 and batch <= spec.max_batch_size

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        """Every running sequence gets its next tokens while the budget lasts. The common case,
        a decode that stays inside its last block, touches nothing but the output's columns."""
        bs = self.block_manager.block_size
        running = self.running
        speculating = self.speculating
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            placeholders = seq.num_placeholder_tokens
            if placeholders and self._finishes_by_length(seq, placeholders + seq.num_unresolved_drafts):
                i += 1                        # its last token may be in flight: wait for the answer
                continue
            num_computed = seq.num_computed_tokens
            num_tokens = len(seq.token_ids) + placeholders - num_computed
            if speculating and seq.num_drafts and num_tokens == 1:
                budget -= self._schedule_decode_with_drafts(output, seq, budget)
                i += 1
                continue
            if num_tokens == 1 and num_computed + seq.num_unresolved_drafts < len(seq.block_table) * bs:
                self._add_cached(output, seq, 1, num_computed, False)   # the decode fast path
                budget -= 1
                i += 1
                continue
            num_tokens = self._num_to_schedule(num_tokens, budget)
            if self._reserve_slots(seq, num_tokens):
                self._add_cached(output, seq, num_tokens, num_computed, True)
                budget -= num_tokens
                i += 1
        return budget

    def _schedule_decode_with_drafts(self, output: SchedulerOutput, seq: Sequence, budget: int) -> int:
        """Schedules seq's decode with as many of its drafts as may be verified and have KV slots
        without preempting anyone (else as a plain decode); returns the tokens it takes."""
        bm = self.block_manager
        k = num_drafts_to_verify(seq, self.config.speculation, budget - 1, self.config.max_model_len)
        # As many as the free blocks hold: drafts never take a block from another request.
        k = min(k, (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - seq.num_computed_tokens
                - seq.num_unresolved_drafts - 1)
        if k > 0 and bm.append_slots(seq, 1 + k):
            self._add_cached(output, seq, 1, seq.num_computed_tokens, True, k)
            return 1 + k
        if self._reserve_slots(seq, 1):
            self._add_cached(output, seq, 1, seq.num_computed_tokens, True)
            return 1
        return 0

    def _reserve_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempts from the end of the running list (the lowest priority, most recently admitted)
        until seq's new tokens have slots; False when seq itself (then the last one) had to go."""
        while not self.block_manager.append_slots(seq, num_tokens):
            if self._reclaim_paused():
                continue
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.head()
            if seq.suspect and any(s.suspect for s in self.running):
                break                         # suspects of a failed step come back one at a time
            # A prompt whose logprobs are asked is computed in full the first time: the cache
            # holds KV, not the logits that score each token.
            cached = [] if seq.sampling.prompt_logprobs and not seq.num_output_tokens else bm.match_prefix(seq)
            num_cached = len(cached) * bm.block_size
            num_tokens = self._num_to_schedule(seq.num_tokens - num_cached, budget)
            # FCFS: when the head does not fit, nobody behind it jumps the queue.
            if not bm.allocate(seq, cached, num_cached + num_tokens):
                if self._reclaim_paused():
                    continue
                break
            self.waiting.pop_head()
            if seq.status is SequenceStatus.WAITING:
                seq.num_cached_prompt_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            seq.num_admissions += 1
            self._add_running(seq)
            self._add_new(output, seq, num_tokens)
            budget -= num_tokens

    def _add_running(self, seq: Sequence) -> None:
        running = self.running
        if not running or running[-1].priority <= seq.priority:
            running.append(seq)          # the common case: one priority
        else:
            bisect.insort_right(running, seq, key=_priority)

    def _add_cached(self, output: SchedulerOutput, seq: Sequence, num_tokens: int, num_computed: int,
                    may_have_new_blocks: bool, num_drafts: int = 0) -> None:
        """Appends a sequence the worker holds: its columns, and the blocks it gained since the
        worker last heard of it (none on the decode fast path, which stays inside its block)."""
        cached = output.cached
        index = len(cached.seq_ids)
        cached.seq_ids.append(seq.seq_id)
        if num_tokens != 1:
            cached.multi_token_indices.append(index)
            cached.multi_token_counts.append(num_tokens)
        if num_drafts:
            cached.draft_indices.append(index)
            cached.draft_counts.append(num_drafts)
            output.sampling_draft_indices.append(len(output.sampling_seqs))   # a decode: it samples
            output.num_scheduled_tokens += num_drafts
            seq.num_unresolved_drafts += num_drafts
        if may_have_new_blocks and len(seq.block_table) > seq.num_blocks_on_worker:
            new_blocks = seq.block_table[seq.num_blocks_on_worker:]
            cached.new_block_indices.append(index)
            cached.new_block_counts.append(len(new_blocks))
            cached.new_block_ids += new_blocks
            seq.num_blocks_on_worker = len(seq.block_table)
        self._add_scheduled(output, seq, num_tokens, num_computed)

    def _add_new(self, output: SchedulerOutput, seq: Sequence, num_tokens: int) -> None:
        output.new_requests.append(NewRequestData(
            seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, seq.num_computed_tokens,
            num_tokens, list(seq.block_table), seq.sampling))
        seq.on_worker = True
        seq.num_drafts = 0                    # a fresh mirror holds none
        seq.num_blocks_on_worker = len(seq.block_table)
        self._add_scheduled(output, seq, num_tokens, seq.num_computed_tokens)

    @staticmethod
    def _add_scheduled(output: SchedulerOutput, seq: Sequence, num_tokens: int, num_computed: int) -> None:
        output.seqs.append(seq)
        output.num_scheduled.append(num_tokens)
        output.num_computed.append(num_computed)
        output.admissions.append(seq.num_admissions)
        output.num_scheduled_tokens += num_tokens
        seq.num_computed_tokens = num_computed + num_tokens
        if num_computed + num_tokens == len(seq.token_ids) + seq.num_placeholder_tokens:
            output.sampling_seqs.append(seq)
            output.sampling_admissions.append(seq.num_admissions)
            seq.num_placeholder_tokens += 1

    def _free(self, seq: Sequence) -> None:
        """Gives back seq's blocks; what steps in flight compute or sample for it is dropped."""
        self.block_manager.free(seq)
        seq.num_placeholder_tokens = 0
        seq.num_drafts = seq.num_unresolved_drafts = 0

    def _requeue(self, seq: Sequence) -> None:
        """Recompute-style preemption: free everything, wait at the front of the queue."""
        self._free(seq)
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.push(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.num_preemptions += 1
        if seq.on_worker:
            self._preempted_ids.append(seq.seq_id)
            seq.on_worker = False

    def _release(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.paused:
            del self.paused[seq.seq_id]
            seq.paused = False
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._unfinished[seq.seq_id]
        if seq.on_worker:
            self._finished_ids.append(seq.seq_id)
            seq.on_worker = False

    # -- results -----------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, token_ids: Sequence_[int], token_counts: Sequence_[int] = (),
               num_drafts: Sequence_[int] = (), verified_drafts: Sequence_[int] = ()) -> list[Sequence]:
        """Applies the result of the oldest step in flight: `token_ids` holds one token per
        entry of output.sampling_seqs, in that order, or `token_counts[i]` for entry i when the
        step verified drafts (1 + its accepted drafts); `num_drafts[i]`, when given, is how many
        drafts the worker now holds for entry i, and `verified_drafts[i]` how many it verified
        (default: the count asked). Registers the blocks the step filled, appends
        each sampled token and checks the stop conditions (a stop inside a run cuts it there),
        freeing finished sequences at once. Returns the sequences that received tokens (finished
        ones included, with finish_reason set), in batch order; output.received_counts says how
        many each got when the step verified drafts. An output no longer in flight (applied
        already, or dropped by a reset) is ignored."""
        if not any(o is output for o in self._in_flight):
            return []
        if output is not self._in_flight[0]:
            raise RuntimeError("step results must be applied in the order the steps were scheduled")
        # Check before changing anything, so a bad reply leaves every sequence as it was.
        check_reply(output.sampling_seqs, output.sampling_draft_indices, output.cached.draft_counts, len(token_ids),
                    token_counts, num_drafts, self.config.speculation.num_speculative_tokens, verified_drafts)
        self._in_flight.popleft()
        bs = self.block_manager.block_size
        running = SequenceStatus.RUNNING
        drafted = set(output.cached.draft_indices) if output.cached.draft_indices else None
        # Blocks first: a block the step filled is registered once its KV exists. Most entries
        # stay inside their block and cost one comparison. Entries that verified drafts register
        # theirs once their accepted run is known.
        for index, (seq, n, start, admission) in enumerate(zip(output.seqs, output.num_scheduled, output.num_computed,
                                                               output.admissions)):
            if ((start + n) // bs != start // bs and seq.status is running and seq.num_admissions == admission
                    and not (drafted and index in drafted)):
                self.block_manager.cache_computed_blocks(seq, start, start + n)
        if drafted:
            return self._apply_runs(output, token_ids, token_counts or [1] * len(output.sampling_seqs), num_drafts,
                                    verified_drafts)
        received: list[Sequence] = []
        finished = False
        eos, max_model_len = self.eos_token_ids, self.config.max_model_len
        drafts = iter(num_drafts) if num_drafts else itertools.repeat(0)
        speculation = self.config.speculation.num_speculative_tokens > 0
        for seq, admission, token, held in zip(output.sampling_seqs, output.sampling_admissions, token_ids, drafts):
            if seq.status is not running or seq.num_admissions != admission:
                continue                      # finished, preempted or reset meanwhile: stale
            tokens = seq.token_ids
            tokens.append(token)
            seq.num_placeholder_tokens -= 1
            if speculation and not seq.num_placeholder_tokens:
                seq.num_drafts = held         # (else a later step in flight proposes its next ones)
            received.append(seq)
            params = seq.sampling
            num_output = len(tokens) - seq.num_prompt_tokens
            if num_output >= params.min_tokens and (
                    (token in eos and not params.ignore_eos) or token in params.stop_token_ids):
                self._release(seq, FinishReason.STOP)      # the model stopped: wins over length
                finished = True
            elif num_output >= params.max_tokens or len(tokens) >= max_model_len:
                self._release(seq, FinishReason.LENGTH)
                finished = True
        if finished:
            self.running = [seq for seq in self.running if seq.status is running]
        return received

    def _apply_runs(self, output: SchedulerOutput, token_ids: Sequence_[int], counts: Sequence_[int],
                    num_drafts: Sequence_[int], verified: Sequence_[int]) -> list[Sequence]:
        """update() for a step that verified drafts: each sampling sequence gets a run of tokens."""
        running = SequenceStatus.RUNNING
        drafts_of = dict(zip(output.sampling_draft_indices, output.cached.draft_counts))
        entry_of = dict(zip(output.sampling_draft_indices, output.cached.draft_indices))
        for j, k in drafts_of.items():        # resolved, whatever becomes of the sequence
            seq = output.sampling_seqs[j]
            if seq.num_admissions == output.sampling_admissions[j] and seq.status is running:
                seq.num_unresolved_drafts -= k
        received: list[Sequence] = []
        received_counts: list[int] = []
        offset = 0
        for j, (seq, admission, n) in enumerate(zip(output.sampling_seqs, output.sampling_admissions, counts)):
            run = token_ids[offset:offset + n]
            offset += n
            if seq.status is not running or seq.num_admissions != admission:
                continue                      # finished, preempted or reset meanwhile: stale
            seq.num_placeholder_tokens -= 1
            appended = self._append_run(seq, run)
            received.append(seq)
            received_counts.append(appended)
            k = (verified[j] if verified else drafts_of[j]) if j in drafts_of else 0
            if k:
                output.num_verifications += 1
                output.num_draft_tokens += k
                output.num_accepted_tokens += appended - 1
            if seq.status is running:
                if not seq.num_placeholder_tokens:   # (else a later step in flight proposes its next ones)
                    seq.num_drafts = num_drafts[j] if num_drafts else 0
                if j in drafts_of:
                    self._keep_accepted(seq, output.num_computed[entry_of[j]], n)
        self.running = [seq for seq in self.running if seq.status is running]
        output.received_counts = received_counts
        return received

    def _append_run(self, seq: Sequence, run: Sequence_[int]) -> int:
        """Appends tokens to seq up to the first that finishes it (then releasing it); returns
        how many it appended."""
        params, tokens = seq.sampling, seq.token_ids
        for i, token in enumerate(run):
            tokens.append(token)
            num_output = len(tokens) - seq.num_prompt_tokens
            if num_output >= params.min_tokens and (
                    (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids):
                self._release(seq, FinishReason.STOP)
                return i + 1
            if num_output >= params.max_tokens or len(tokens) >= self.config.max_model_len:
                self._release(seq, FinishReason.LENGTH)
                return i + 1
        return len(run)

    def _keep_accepted(self, seq: Sequence, start: int, num_tokens: int) -> None:
        """After a verification from position `start` that brought num_tokens tokens: the accepted
        drafts' KV counts as computed (past whatever later steps in flight compute for seq, whose
        entries move by as many positions) and the blocks it filled are registered."""
        accepted = num_tokens - 1
        seq.num_computed_tokens += accepted
        if accepted:
            for later in self._in_flight:
                later.shift_positions(seq, accepted)
        end = start + num_tokens
        if end // self.block_manager.block_size != start // self.block_manager.block_size:
            self.block_manager.cache_computed_blocks(seq, start, end)

    def _finishes_by_length(self, seq: Sequence, num_more_tokens: int) -> bool:
        """Whether seq reaches max_tokens or max_model_len once num_more_tokens are appended."""
        return (seq.num_output_tokens + num_more_tokens >= seq.sampling.max_tokens
                or seq.num_tokens + num_more_tokens >= self.config.max_model_len)

    # -- worker restart ----------------------------------------------------------------------
    def reset_all_worker_state(self) -> None:
        """The worker lost its KV cache and mirrors (and the results of steps in flight): every
        running request goes back to the queue (by priority and arrival, so ahead of those that
        arrived after it), to be re-sent in full, and the prefix cache is emptied."""
        for seq in reversed(self.running):
            self._requeue(seq)
            seq.on_worker = False
        self.running = []
        for seq in self.paused.values():      # they stay paused, now without blocks
            if seq.status is SequenceStatus.RUNNING:
                self._free(seq)
                seq.status = SequenceStatus.PREEMPTED
            seq.on_worker = False
        self._in_flight.clear()
        self._finished_ids.clear()
        self._preempted_ids.clear()
        self.block_manager.reset_prefix_cache()


def _priority(seq: Sequence) -> int:
    return seq.priority

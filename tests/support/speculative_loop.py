"""A speculating ModelRunner driven as the scheduler would drive it, for whole requests: Loop's
first step computes every prompt, then each step decodes every request, verifying all the drafts
the worker holds for it (tests/unit/test_spec_decode_runner.py, tests/e2e/test_runner_grammar_e2e.py);
AheadLoop launches each step before the reply of the step before is read, as a scheduler that
schedules ahead does (tests/unit/test_spec_decode_ahead.py)."""
from __future__ import annotations

from common.pb.llm.worker.v1 import worker_pb2 as pb
from tests.support.runner_driver import add_new_blocks, grow_blocks, make_runner, prompt
from worker_svc.model_runner import ModelRunner
from worker_svc.step_message import parse_step_request


class Loop:
    """A scheduler in miniature for whole requests: the first step computes every prompt, then
    each step decodes every request, verifying all the drafts the worker holds for it."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free_blocks = list(range(runner.num_kv_blocks))[::-1]
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.held: dict[int, int] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.tops: dict[int, list[int]] = {}
        self.step_id = 0
        self.num_verified = self.num_accepted = 0
        self.propose = True                  # what each step's propose_drafts says (the batch threshold)
        # Drafts each decode asks to verify; None: those the worker said it holds. A scheduler
        # that schedules ahead asks for the most the step before may propose.
        self.ask: int | None = None
        self.num_fitted = 0                  # verifications the worker fitted to fewer drafts than asked

    def _grow(self, seq_id: int, num_tokens: int) -> list[int]:
        return grow_blocks(self.blocks[seq_id], self.free_blocks, num_tokens)

    def start(self, requests: dict[int, tuple[list[int], pb.SamplingOptions]]) -> None:
        new = []
        for seq_id, (token_ids, sampling) in requests.items():
            self.tokens[seq_id], self.blocks[seq_id], self.computed[seq_id] = list(token_ids), [], 0
            self.logprobs[seq_id], self.tops[seq_id] = [], []
            self._grow(seq_id, len(token_ids))
            new.append(pb.NewRequest(seq_id=seq_id, token_ids=token_ids, num_prompt_tokens=len(token_ids),
                                     num_scheduled_tokens=len(token_ids), block_ids=self.blocks[seq_id],
                                     sampling=sampling))
            self.computed[seq_id] = len(token_ids)
        self._apply(list(requests), {}, pb.StepRequest(new_requests=new, propose_drafts=self.propose))

    def decode(self) -> None:
        order = list(self.tokens)
        columns = pb.CachedRequests(seq_ids=order)
        drafts = {}
        for i, seq_id in enumerate(order):
            k = drafts[seq_id] = self.held.get(seq_id, 0) if self.ask is None else self.ask
            fresh = self._grow(seq_id, self.computed[seq_id] + 1 + k)
            if k:
                columns.draft_indices.append(i)
                columns.draft_counts.append(k)
            add_new_blocks(columns, i, fresh)
        self._apply(order, drafts, pb.StepRequest(cached=columns, propose_drafts=self.propose))

    def _apply(self, order: list[int], drafts: dict[int, int], request: pb.StepRequest) -> None:
        self.step_id += 1
        request.step_id = self.step_id
        output = self.runner.step(parse_step_request(request))
        counts = output.token_counts or [1] * len(order)
        held_drafts = output.num_drafts or [0] * len(order)     # a plain runner proposes none
        verified = output.verified_drafts or [0] * len(order)
        assert len(output.token_ids) == sum(counts) and len(held_drafts) == len(order) == len(verified)
        offset = 0
        for seq_id, n, held, k in zip(order, counts, held_drafts, verified):
            run = output.token_ids[offset:offset + n]
            if output.logprobs is not None:
                self.logprobs[seq_id] += output.logprobs[offset:offset + n]
            if output.top_logprobs is not None:
                self.tops[seq_id] += output.top_logprobs.token_ids[offset * 3:(offset + n) * 3]
            offset += n
            assert k == min(drafts.get(seq_id, 0), self.held.get(seq_id, 0)) and 1 <= n <= k + 1
            self.num_fitted += k < drafts.get(seq_id, 0)
            if k:
                self.num_verified += 1
                self.num_accepted += n - 1
                self.computed[seq_id] += n       # the decode and the accepted drafts (rejected ones' slots stay)
            elif self.computed[seq_id] < len(self.tokens[seq_id]):
                self.computed[seq_id] += 1
            self.tokens[seq_id] += run
            self.held[seq_id] = held
            row = self.runner.batch.row_of[seq_id]
            assert self.runner.batch.num_blocks[row] == len(self.blocks[seq_id])
            assert self.runner.batch.num_computed[row] == self.computed[seq_id]

    def run(self, requests: dict[int, tuple[list[int], pb.SamplingOptions]], num_new: int) -> dict[int, list[int]]:
        self.start(requests)
        while min(len(self.tokens[s]) - len(p) for s, (p, _) in requests.items()) < num_new:
            self.decode()
        return {s: self.tokens[s][len(p):len(p) + num_new] for s, (p, _) in requests.items()}


def ngram_runner(model_dir, **overrides) -> ModelRunner:
    return make_runner(model_dir, speculative_method="ngram", num_speculative_tokens=4, **overrides)


def repeating(seed: int, period: int, repeats: int) -> list[int]:
    return prompt(seed, period) * repeats


class AheadLoop:
    """A scheduler that schedules ahead, as the engine's does: up to `depth` steps are launched whose
    replies are not read (2: step n + 1 is launched before step n's reply is read), every request
    asking for the most drafts the step before may have proposed (K). By default every step decodes
    every request in admission order, each got all its blocks with its prompt, and every step asks
    for drafts; `orders` (cycled) names the requests each step decodes, in its order, `on_demand`
    hands each request only the blocks its largest acceptance can need by then (new blocks arrive
    with the steps, at block boundaries), and `proposes` (cycled) which steps ask for drafts."""

    def __init__(self, runner: ModelRunner, num_drafts: int, depth: int = 2, orders: list[list[int]] | None = None,
                 on_demand: bool = False, proposes: list[bool] = (True,)) -> None:
        self.runner, self.num_drafts, self.depth = runner, num_drafts, depth
        self.orders, self.on_demand, self.proposes = orders, on_demand, proposes
        self.tokens: dict[int, list[int]] = {}
        self.step_id = 0
        self.in_flight: list = []   # (pending step, the requests it decodes in order)
        self.num_accepted = 0

    def run(self, requests: dict[int, tuple[list[int], pb.SamplingOptions]], num_new: int,
            steps: int | None = None) -> dict[int, list[int]]:
        """Steps until every request has num_new tokens (or `steps` steps); their first num_new."""
        free = list(range(self.runner.num_kv_blocks))[::-1]
        limit = self.runner.max_model_len
        blocks, scheduled, new = {}, dict.fromkeys(requests, 0), []
        for seq_id, (token_ids, sampling) in requests.items():
            self.tokens[seq_id] = list(token_ids)
            wanted = len(token_ids) if self.on_demand else len(token_ids) + num_new + 2 * (self.num_drafts + 1)
            blocks[seq_id] = grow_blocks([], free, min(wanted, limit))
            new.append(pb.NewRequest(seq_id=seq_id, token_ids=token_ids, num_prompt_tokens=len(token_ids),
                                     num_scheduled_tokens=len(token_ids), block_ids=list(blocks[seq_id]),
                                     sampling=sampling))
        self._launch(pb.StepRequest(new_requests=new, propose_drafts=True), list(requests))
        decodes = 0
        while (self.step_id < steps if steps is not None
               else min(len(self.tokens[s]) - len(p) for s, (p, _) in requests.items()) < num_new):
            order = self.orders[decodes % len(self.orders)] if self.orders else list(requests)
            columns = pb.CachedRequests(seq_ids=order, draft_indices=range(len(order)),
                                        draft_counts=[self.num_drafts] * len(order))
            for i, seq_id in enumerate(order):
                scheduled[seq_id] += 1
                if self.on_demand:   # a decode step computes up to 1 + K tokens
                    reach = len(requests[seq_id][0]) + scheduled[seq_id] * (1 + self.num_drafts)
                    add_new_blocks(columns, i, grow_blocks(blocks[seq_id], free, min(reach, limit)))
            self._launch(pb.StepRequest(cached=columns, propose_drafts=self.proposes[decodes % len(self.proposes)]),
                         order)
            decodes += 1
        while self.in_flight:
            self._read()
        return {s: self.tokens[s][len(p):len(p) + num_new] for s, (p, _) in requests.items()}

    def _launch(self, request: pb.StepRequest, order: list[int]) -> None:
        self.step_id += 1
        request.step_id = self.step_id
        self.in_flight.append((self.runner.launch(parse_step_request(request)), order))
        if len(self.in_flight) == self.depth:
            self._read()

    def _read(self) -> None:
        pending, order = self.in_flight.pop(0)
        output = pending.result()
        counts = output.token_counts or [1] * len(order)
        offset = 0
        for seq_id, n in zip(order, counts, strict=True):
            self.tokens[seq_id] += output.token_ids[offset:offset + n]
            self.num_accepted += n - 1
            offset += n

"""The plain-decode fast path of the step's preparation (batch_prep._stage_plain_decode) stages what the general
path stages: random batches of rows at their next token (the newest sampled one on the device, or a known one),
some constrained, some asking for top logprobs, at random contexts; the same columns copied, the same StepBatch,
the same counts advanced. Steps it must leave to the general path (a row mid-prompt, drafts, prompt scoring) do."""
from __future__ import annotations

import dataclasses
import random
import types

import numpy as np
import pytest
import torch

from worker_svc import batch_prep
from worker_svc.graph_inputs import DecodeLayout
from worker_svc.input_batch import InputBatch
from worker_svc.layers.sampler import SamplingOptions
from worker_svc.runner_io import NewRequest
from worker_svc.staging import Staging

MAX_MODEL_LEN, BLOCK_SIZE, MAX_BATCH = 512, 16, 8


class RecordingStaging(Staging):
    """The CPU staging buffer, keeping each fill's parts and offsets."""

    def __init__(self) -> None:
        super().__init__(100_000, torch.device("cpu"))
        self.fills = []

    def fill(self, parts, offsets=(), first_view=0):
        self.fills.append(([np.array(p).copy() for p in parts], list(offsets), first_view))
        return super().fill(parts, offsets, first_view)


def random_runner(rng: random.Random, num_rows: int, *, scoring: bool = False):
    batch = InputBatch(MAX_MODEL_LEN, MAX_MODEL_LEN // BLOCK_SIZE, initial_rows=MAX_BATCH)
    free_blocks = list(range(1000))
    rng.shuffle(free_blocks)
    for seq_id in range(num_rows):
        context = rng.randint(1, MAX_MODEL_LEN - 2)
        blocks = [free_blocks.pop() for _ in range(-(-(context + 1) // BLOCK_SIZE))]
        options = SamplingOptions(temperature=0.0, top_logprobs=rng.choice([0, 0, 3]))
        if scoring and seq_id == 0:
            options = dataclasses.replace(options, prompt_logprobs=True)
        row = batch.add(NewRequest(seq_id, [rng.randrange(3, 500) for _ in range(context)], context, 0, context,
                                   blocks, options), None, matcher=f"matcher {seq_id}" if rng.random() < 0.3 else None)
        if rng.random() < 0.5:   # its newest token sampled, known only on the device
            batch.num_tokens[row] += 1
            batch.num_computed[row] = context
        else:                    # its newest token known here (a re-sent request, a prefix hit)
            batch.num_computed[row] = context - 1
    graphs = types.SimpleNamespace(staged=True, batch_sizes=[1, 2, 4, MAX_BATCH],
                                   rows=torch.arange(MAX_BATCH))
    return types.SimpleNamespace(batch=batch, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                                 decode_graphs=graphs, bookkeeping=None, drafter=None, sampler=None,
                                 device_sampler=object(), _decode_layout=DecodeLayout(MAX_BATCH),
                                 _staging=RecordingStaging(), last_sampled=torch.zeros(MAX_BATCH, dtype=torch.int64))


def prepared(runner, rows, fast: bool, monkeypatch):
    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(batch_prep, "_stage_plain_decode", lambda runner, rows: None)
        step = batch_prep.prepare_batch(runner, rows, np.ones(len(rows), np.int64))
    b = runner.batch
    return step, runner._staging.fills, (b.num_computed.copy(), b.num_tokens.copy())


def assert_same(fast, general) -> None:
    (step_f, fills_f, counts_f), (step_g, fills_g, counts_g) = fast, general
    assert len(fills_f) == len(fills_g) == 1
    (parts_f, offsets_f, first_f), (parts_g, offsets_g, first_g) = fills_f[0], fills_g[0]
    assert offsets_f == offsets_g and first_f == first_g and len(parts_f) == len(parts_g)
    for part_f, part_g in zip(parts_f, parts_g):
        assert part_f.dtype == part_g.dtype or (part_f.astype(np.int64) == part_g).all()
        np.testing.assert_array_equal(part_f, part_g)
    for field in dataclasses.fields(step_f):
        value_f, value_g = getattr(step_f, field.name), getattr(step_g, field.name)
        if isinstance(value_f, torch.Tensor):
            assert torch.equal(value_f, value_g), field.name
        elif isinstance(value_f, np.ndarray):
            np.testing.assert_array_equal(value_f, value_g, err_msg=field.name)
        elif field.name == "constrained" and value_f is not None:
            assert value_f[0] == value_g[0] and value_f[1] == value_g[1] and torch.equal(value_f[2], value_g[2])
        else:
            assert value_f == value_g, field.name
    for f, g in zip(counts_f, counts_g):
        np.testing.assert_array_equal(f, g)


@pytest.mark.parametrize("trial", range(60))
def test_a_plain_decode_step_stages_what_the_general_path_stages(trial, monkeypatch):
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    num_rows = rng.randint(1, MAX_BATCH)
    rows = np.array(rng.sample(range(num_rows), rng.randint(1, num_rows)), np.int64)   # a subset, in any order
    fast = prepared(random_runner(random.Random(seed), num_rows), rows, True, monkeypatch)
    general = prepared(random_runner(random.Random(seed), num_rows), rows, False, monkeypatch)
    assert fast[0].graph, f"seed {seed}"
    assert_same(fast, general)


def test_steps_the_fast_path_leaves_to_the_general_one(monkeypatch):
    taken = []
    original = batch_prep._stage_plain_decode
    monkeypatch.setattr(batch_prep, "_stage_plain_decode", lambda *args: taken.append(1) or original(*args))
    rng = random.Random(0)
    runner = random_runner(rng, 3)
    runner.batch.num_tokens[0] += 5   # a row whose next token is not its last known one: mid-prompt
    step = batch_prep.prepare_batch(runner, np.arange(3), np.ones(3, np.int64))
    assert taken == [1] and not step.graph, "tried, declined: the general path's (no graph for a chunk)"
    taken.clear()
    scoring = random_runner(random.Random(1), 2, scoring=True)
    assert scoring.batch.num_scoring
    batch_prep.prepare_batch(scoring, np.arange(2), np.ones(2, np.int64))
    taken_counts = random_runner(random.Random(2), 2)
    batch_prep.prepare_batch(taken_counts, np.arange(2), np.array([1, 2], np.int64))
    assert taken == [], "prompt scoring and a row of two tokens never try it"

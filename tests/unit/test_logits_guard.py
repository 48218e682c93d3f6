"""The sampler under extreme inputs: a row its own processing makes non-finite never falls to
token 0 (argmax of NaN, or of an all -inf row); it takes the raw logits' choice, with a finite
logprob, and the other rows of the batch are untouched."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from worker_svc.layers.logits_guard import drawable_rows, usable_rows, with_unusable_rows_raw
from worker_svc.layers.sampler import Sampler, SamplingOptions

VOCAB = 16
INF, NAN = math.inf, math.nan


@dataclass
class Row:
    sampling: SamplingOptions
    num_output_tokens: int = 0
    penalty_row: int | None = None


def _logits(rows: int, favourite: int = 7) -> torch.Tensor:
    """Positive logits everywhere (a repetition penalty divides them), highest at `favourite`."""
    logits = torch.rand(rows, VOCAB, generator=torch.Generator().manual_seed(3)) + 1.0
    logits[:, favourite] = 5.0
    return logits


def test_usable_rows():
    scores = torch.tensor([[0.0, 1.0], [-INF, 2.0], [NAN, 1.0], [INF, 1.0], [-INF, -INF], [3e38, 3e38]])
    assert usable_rows(scores).tolist() == [True, True, False, False, False, True]
    assert drawable_rows(scores.softmax(-1)).tolist() == [True, True, False, False, False, True]
    raw = torch.arange(12.0).reshape(6, 2)
    fixed = with_unusable_rows_raw(scores, raw)
    assert torch.equal(fixed[[0, 1, 5]], scores[[0, 1, 5]])
    assert torch.equal(fixed[[2, 3, 4]], raw[[2, 3, 4]])


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "drawing"])
@pytest.mark.parametrize("penalty", [
    dict(repetition_penalty=1e-45),          # positive logits / 1e-45 = +inf
    dict(presence_penalty=NAN),
    dict(frequency_penalty=-INF),            # +inf for every token seen in the output
    dict(repetition_penalty=INF, presence_penalty=INF),
], ids=["repetition-1e-45", "presence-nan", "frequency-minus-inf", "inf-inf"])
def test_a_penalty_that_breaks_a_row_is_skipped_for_that_row(penalty, temperature):
    sampler = Sampler(VOCAB, torch.device("cpu"), seed=0)
    broken = SamplingOptions(temperature=temperature, top_k=1, logprobs=True, **penalty)   # top_k 1: one choice
    seen = [0, 1, 2, 3]                       # prompt and output hold token 0 (EOS in many vocabularies)
    rows = [Row(broken, num_output_tokens=2, penalty_row=sampler.add_request(seen, 2, broken)),
            Row(SamplingOptions(temperature=0.0, logprobs=True))]
    logits = _logits(2)
    tokens, logprobs = sampler.sample_rows(logits, rows)
    assert tokens == [7, 7]
    assert all(math.isfinite(lp) for lp in logprobs)


@pytest.mark.parametrize("mixed", [False, True], ids=["drawing-only", "with-a-greedy-row"])
def test_temperature_overflow_takes_the_raw_argmax(mixed):
    # 1e35 / 1.1e-5 overflows float32: the processed row is +inf at the favourite, NaN after softmax.
    logits = torch.zeros(2, VOCAB)
    logits[0, 9] = 1e35
    logits[1, 4] = 1.0
    rows = [Row(SamplingOptions(temperature=1.1e-5, logprobs=True)),
            Row(SamplingOptions(temperature=0.0 if mixed else 1.0, top_k=1, logprobs=True))]
    tokens, logprobs = Sampler(VOCAB, torch.device("cpu")).sample_rows(logits, rows)
    assert tokens == [9, 4]
    assert all(math.isfinite(lp) for lp in logprobs)


def test_healthy_rows_sample_exactly_as_without_the_guard(monkeypatch):
    def run() -> tuple[list[int], list[float]]:
        sampler = Sampler(VOCAB, torch.device("cpu"), seed=0)
        options = [SamplingOptions(temperature=0.8, top_p=0.9, seed=i, logprobs=True) for i in range(20)]
        options += [SamplingOptions(temperature=t, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=True)
                    for t in (0.0, 1.0)]
        options += [SamplingOptions(temperature=0.0, logprobs=True), SamplingOptions(min_p=0.1)]
        rows = [Row(o, penalty_row=sampler.add_request([1, 2, 3], 2, o)) for o in options]
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(11)) * 4
        return sampler.sample_rows(logits, rows)

    guarded = run()
    monkeypatch.setattr("worker_svc.layers.sampler.drawable_rows", lambda probs: torch.ones(len(probs), dtype=torch.bool))
    monkeypatch.setattr("worker_svc.layers.sampler.with_unusable_rows_raw", lambda scores, raw: scores)
    assert guarded == run()
    assert len(set(guarded[0])) > 3

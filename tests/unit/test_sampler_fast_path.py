"""The sampler's shortcuts: greedy rows take only an argmax, only drawing rows are processed,
and nothing sorts the vocabulary unless a row asks for top-k or top-p. The results must be those
of the full computation (tests/test_sampler.py covers the semantics themselves)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from worker_svc.layers.sampler import Sampler, SamplingOptions

VOCAB = 32


@dataclass
class Row:
    sampling: SamplingOptions
    num_output_tokens: int = 0
    penalty_row: int | None = None


def test_mixed_batch_gets_each_rows_token_and_logprob():
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(6, VOCAB, generator=g) * 2
    original = logits.clone()
    options = [
        SamplingOptions(temperature=0.0, logprobs=True),
        SamplingOptions(temperature=0.7, top_k=1, logprobs=True),   # a draw that can only pick the top token
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=1.3, seed=4),
        SamplingOptions(temperature=0.0, top_p=0.5, logprobs=True),  # greedy: truncation is ignored
        SamplingOptions(temperature=0.5, top_k=1, logprobs=True),
    ]
    tokens, logprobs = Sampler(VOCAB, torch.device("cpu")).sample_rows(logits, [Row(o) for o in options])
    top = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 1, 2, 4, 5)] == [top[i] for i in (0, 1, 2, 4, 5)]
    raw = logits.log_softmax(-1)
    for i in (0, 1, 4, 5):   # the raw distribution's, however the token was drawn
        assert logprobs[i] == pytest.approx(raw[i, top[i]].item(), abs=1e-6)
    assert (logprobs[2], logprobs[3]) == (0.0, 0.0)   # not asked
    assert torch.equal(logits, original)   # the caller's logits are never written


def test_greedy_rows_take_the_argmax_of_half_precision_logits():
    g = torch.Generator().manual_seed(22)
    logits = (torch.randn(8, VOCAB, generator=g) * 4).to(torch.bfloat16)
    rows = [Row(SamplingOptions(temperature=0.0, logprobs=i % 2 == 0)) for i in range(8)]
    tokens, logprobs = Sampler(VOCAB, torch.device("cpu")).sample_rows(logits, rows)
    assert tokens == logits.float().argmax(-1).tolist()
    expected = logits.float().log_softmax(-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    assert logprobs[::2] == pytest.approx(expected[::2].tolist(), abs=1e-6)
    assert logprobs[1::2] == [0.0] * 4


def test_nothing_sorts_the_vocabulary_without_top_k_or_top_p(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("sorted the vocabulary")

    monkeypatch.setattr(torch.Tensor, "sort", refuse)
    monkeypatch.setattr(torch.Tensor, "topk", refuse)
    logits = torch.randn(300, VOCAB, generator=torch.Generator().manual_seed(23))
    options = [SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.9, logprobs=True),
               SamplingOptions(temperature=1.0, min_p=0.1), SamplingOptions(temperature=0.0, top_k=5)]
    rows = [Row(options[i % len(options)]) for i in range(300)]
    tokens, logprobs = Sampler(VOCAB, torch.device("cpu")).sample_rows(logits, rows)
    top = logits.argmax(-1).tolist()
    assert all(tokens[i] == top[i] for i in range(0, 300, 4)) and all(tokens[i] == top[i] for i in range(3, 300, 4))
    assert all(-math.inf < logprobs[i] <= 0.0 for i in range(1, 300, 4))
    assert len({tokens[i] for i in range(1, 300, 4)}) > 1   # the tempered rows really drew


def test_half_precision_logits_draw_exactly_as_their_float32_copy():
    """Skipping the float32 copy (and temperature 1's division) changes no draw and no logprob."""
    g = torch.Generator().manual_seed(24)
    logits = (torch.randn(10, VOCAB, generator=g) * 3).to(torch.bfloat16)
    kinds = [SamplingOptions(temperature=1.0), SamplingOptions(temperature=0.7), SamplingOptions(top_k=4),
             SamplingOptions(top_p=0.8, temperature=1.2), SamplingOptions(min_p=0.2), SamplingOptions(temperature=0.0)]
    rows = [Row(dataclasses.replace(kinds[i % len(kinds)], seed=i, logprobs=True), i) for i in range(10)]
    as_given = Sampler(VOCAB, torch.device("cpu")).sample_rows(logits, rows)
    upcast = Sampler(VOCAB, torch.device("cpu")).sample_rows(logits.float(), rows)
    assert as_given == upcast

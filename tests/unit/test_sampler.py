"""The sampler: greedy, truncation (top-k, top-p, min-p) on crafted logits, seeded
reproducibility across batch compositions, penalties against their formulas, and the empirical
distribution of temperature sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from common.pb.llm.worker.v1 import worker_pb2
from worker_svc.layers.sampler import Sampler, SamplingOptions
from worker_svc.step_message import sampling_options_from_proto

VOCAB = 16


@dataclass
class Row:
    sampling: SamplingOptions
    num_output_tokens: int = 0
    penalty_row: int | None = None


def sampler(seed: int = 0) -> Sampler:
    return Sampler(VOCAB, torch.device("cpu"), seed)


def crafted_logits(probs: list[float], rows: int) -> torch.Tensor:
    """Logits whose softmax is `probs` on the first tokens and 0 elsewhere."""
    row = torch.full((VOCAB,), -math.inf)
    row[:len(probs)] = torch.tensor(probs).log()
    return row.repeat(rows, 1)


def test_greedy_is_argmax_with_raw_logprob():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    rows = [Row(SamplingOptions(temperature=0.0, top_k=2, top_p=0.5, logprobs=True)) for _ in range(6)]
    tokens, logprobs = sampler().sample_rows(logits, rows)
    assert tokens == logits.argmax(-1).tolist()
    expected = logits.log_softmax(-1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    assert logprobs == pytest.approx(expected.tolist(), abs=1e-6)


@pytest.mark.parametrize("options,allowed", [
    (SamplingOptions(top_k=3), {0, 1, 2}),
    (SamplingOptions(top_p=0.75), {0, 1}),            # 0.5 + 0.3 reaches 0.75; 0.15 is not needed
    (SamplingOptions(min_p=0.2), {0, 1, 2}),          # 0.05 < 0.2 * 0.5
    (SamplingOptions(top_k=3, top_p=0.6), {0, 1}),    # top-p over the top-3 renormalised
    (SamplingOptions(top_k=1, temperature=5.0), {0}),
])
def test_truncation_never_picks_excluded_tokens(options, allowed):
    probs = [0.5, 0.3, 0.15, 0.05]
    rows = [Row(options) for _ in range(400)]
    tokens, _ = sampler().sample_rows(crafted_logits(probs, len(rows)), rows)
    assert set(tokens) == allowed   # every allowed token turns up in 400 draws, nothing else


@pytest.mark.parametrize("with_plain_row", [False, True])   # True: a row without top-k forces the full sort
def test_truncation_is_per_row_within_a_batch(with_plain_row):
    probs = [0.5, 0.3, 0.15, 0.05]
    kinds = [(SamplingOptions(top_k=2), {0, 1}), (SamplingOptions(top_k=3, top_p=0.75), {0, 1}),
             (SamplingOptions(temperature=0.0), {0})]
    if with_plain_row:
        kinds.append((SamplingOptions(top_p=0.9), {0, 1, 2}))
    rows = [Row(options) for options, _ in kinds for _ in range(300)]
    tokens, _ = sampler().sample_rows(crafted_logits(probs, len(rows)), rows)
    for i, (_, allowed) in enumerate(kinds):
        assert set(tokens[300 * i:300 * (i + 1)]) == allowed


def test_sampled_logprob_is_of_the_raw_distribution_before_temperature_and_truncation():
    rows = [Row(SamplingOptions(temperature=0.5, top_k=2, logprobs=True)) for _ in range(50)]
    probs = [0.5, 0.3, 0.15, 0.05]
    tokens, logprobs = sampler().sample_rows(crafted_logits(probs, len(rows)), rows)
    assert set(tokens) == {0, 1}
    for token, logprob in zip(tokens, logprobs):
        assert logprob == pytest.approx(math.log(probs[token]), abs=1e-5)


def test_seeded_tokens_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    logits_a, logits_c = torch.randn(VOCAB, generator=g), torch.randn(VOCAB, generator=g)
    a = Row(SamplingOptions(temperature=1.0, seed=42), num_output_tokens=5)
    c = Row(SamplingOptions(temperature=0.8, top_p=0.9, seed=7), num_output_tokens=0)
    unseeded = Row(SamplingOptions(temperature=1.0))
    first, _ = sampler(seed=1).sample_rows(torch.stack([logits_a, torch.randn(VOCAB, generator=g), logits_c]),
                                      [a, unseeded, c])
    second, _ = sampler(seed=2).sample_rows(
        torch.stack([torch.randn(VOCAB, generator=g), logits_c, torch.randn(VOCAB, generator=g), logits_a]),
        [unseeded, c, Row(SamplingOptions(temperature=0.0)), a],
    )
    assert (first[0], first[2]) == (second[3], second[1])


def test_seeded_draws_vary_with_the_output_index():
    logits = torch.zeros(1, VOCAB)   # uniform: a repeated token would show the noise repeats
    tokens = [sampler().sample_rows(logits, [Row(SamplingOptions(seed=9), num_output_tokens=i)])[0][0] for i in range(64)]
    assert len(set(tokens)) > VOCAB // 2


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9% quantile of chi-square with 7 degrees of freedom.
CHI2_7DF_999 = 24.32


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])
    probs = (logits / 0.7).softmax(-1)
    n = 4000
    padded = torch.full((n, VOCAB), -math.inf)
    padded[:, :8] = logits
    unseeded, _ = sampler(seed=123).sample_rows(padded, [Row(SamplingOptions(temperature=0.7))] * n)
    assert chi_square(unseeded, probs) < CHI2_7DF_999
    # A seeded request's draws over its output indices follow the same distribution.
    s = sampler()
    seeded = [s.sample_rows(padded[:1], [Row(SamplingOptions(temperature=0.7, seed=5), i)])[0][0] for i in range(1500)]
    assert chi_square(seeded, probs) < CHI2_7DF_999


def expected_penalized(logits: torch.Tensor, prompt: list[int], output: list[int], rep: float,
                       presence: float, frequency: float) -> torch.Tensor:
    """The formulas token by token: HF repetition penalty over prompt + output, OpenAI presence
    and frequency penalties over the output."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token in set(output):
        out[token] -= presence + frequency * output.count(token)
    return out


def test_penalties_match_their_formulas_and_follow_sampled_tokens():
    g = torch.Generator().manual_seed(5)
    s = sampler()
    options = SamplingOptions(temperature=0.0, repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3)
    prompt, output = [1, 2, 2, 9], [3, 3, 9, 4]
    row = Row(options, num_output_tokens=len(output),
              penalty_row=s.add_request(prompt + output, len(prompt), options))
    plain = Row(SamplingOptions(temperature=0.0))   # shares the batch, gets no penalty
    for _ in range(4):
        logits = torch.randn(2, VOCAB, generator=g) * 3
        expected = expected_penalized(logits[0], prompt, output, 1.7, 0.4, 0.3)
        tokens, _ = s.sample_rows(logits, [row, plain])
        assert tokens == [int(expected.argmax()), int(logits[1].argmax())]
        output.append(tokens[0])   # the sampler counted it; the next step must penalise it
        row.num_output_tokens += 1

    table_logits = torch.randn(1, VOCAB, generator=g)
    direct = expected_penalized(table_logits[0], prompt, output, 1.7, 0.4, 0.3)
    column = lambda x: torch.tensor([[x]])  # noqa: E731
    s.penalties.apply(table_logits, torch.tensor([0]), torch.tensor([row.penalty_row]),
                      column(1.7), column(0.4), column(0.3))
    torch.testing.assert_close(table_logits[0], direct)


def test_released_penalty_rows_are_reused_clean():
    s = sampler()
    options = SamplingOptions(frequency_penalty=1.0)
    first = s.add_request([1, 2, 3, 3], 2, options)
    s.remove_request(first)
    second = s.add_request([5, 6], 2, options)
    assert second == first
    assert s.penalties.output_counts[second].sum() == 0
    assert s.penalties.prompt_mask[second].nonzero().flatten().tolist() == [5, 6]
    rows = [s.add_request([1], 1, options) for _ in range(20)]   # grows past the initial rows
    assert len(set(rows + [second])) == 21


def test_options_from_proto_read_unset_as_the_default_and_refuse_values_out_of_bounds():
    options = sampling_options_from_proto(worker_pb2.SamplingOptions(temperature=0.5, seed=0))
    assert (options.top_p, options.repetition_penalty, options.seed) == (1.0, 1.0, 0)
    assert sampling_options_from_proto(worker_pb2.SamplingOptions()) == SamplingOptions()
    for bad, field in ((dict(top_p=1.5), "top_p"), (dict(top_p=0.0), "top_p"), (dict(temperature=-1), "temperature"),
                       (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(top_logprobs=21), "top_logprobs"),
                       (dict(min_p=math.inf), "min_p")):
        with pytest.raises(ValueError, match=field):
            sampling_options_from_proto(worker_pb2.SamplingOptions(**bad))
    with pytest.raises(ValueError, match="unknown kind 'xml'"):
        sampling_options_from_proto(worker_pb2.SamplingOptions(constraint=worker_pb2.Constraint(kind="xml")))


def test_logit_bias_is_added_before_penalties_and_truncation_and_logprobs_stay_raw():
    """A biased row samples as the same row would from logits with the bias added by hand (greedy,
    seeded draws under top-k/top-p, penalties after the bias); its logprob is of the raw logits;
    rows without a bias in the same batch are untouched."""
    g = torch.Generator().manual_seed(11)
    bias = ((1, 4.0), (5, -100.0), (7, 2.5))
    dense = torch.zeros(VOCAB)
    for token_id, value in bias:
        dense[token_id] = value
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=6, top_p=0.9, seed=3),
             dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5)]
    for kind in kinds:
        s_biased, s_by_hand = sampler(), sampler()
        biased = SamplingOptions(logit_bias=bias, logprobs=True, **kind)
        by_hand = SamplingOptions(logprobs=True, **kind)
        rows = []
        for s, options in ((s_biased, biased), (s_by_hand, by_hand)):
            penalty = s.add_request([2, 5, 9, 9], 2, options)
            rows.append([Row(options, 2, penalty), Row(SamplingOptions(temperature=0.0))])
        for _ in range(5):
            logits = torch.randn(2, VOCAB, generator=g) * 3
            tokens, logprobs = s_biased.sample_rows(logits, rows[0])
            expected, _ = s_by_hand.sample_rows(logits + torch.stack([dense, torch.zeros(VOCAB)]), rows[1])
            assert tokens == expected, kind
            assert tokens[0] != 5   # -100 bans it against these logits
            assert logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1)[tokens[0]]), abs=1e-5)
            assert tokens[1] == int(logits[1].argmax())
            for r in (rows[0][0], rows[1][0]):
                r.num_output_tokens += 1


def test_logit_bias_from_proto_is_sorted_by_id_and_bounded():
    pb = worker_pb2.SamplingOptions(logit_bias={9: -3.0, 2: 1.5})
    assert sampling_options_from_proto(pb).logit_bias == ((2, 1.5), (9, -3.0))
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        sampling_options_from_proto(worker_pb2.SamplingOptions(logit_bias={2: 101}))
    with pytest.raises(ValueError, match="1025 entries"):
        sampling_options_from_proto(worker_pb2.SamplingOptions(logit_bias={i: 1.0 for i in range(1025)}))
    with pytest.raises(ValueError, match="token id 9 >= vocab_size 9"):
        sampling_options_from_proto(pb).check_token_ids(9)

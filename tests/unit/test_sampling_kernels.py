"""The device sampler (worker_svc/layers/device_sampler.py and its kernels) against the torch
sampler, which is the reference (layers/sampler.py).

The distribution: the kernels' draw, replayed in numpy (tests/support/gumbel_replica.py), is
drawn 20,000 times on a small vocabulary per truncation mode and compared with the reference's
probabilities by a chi-square test (fixed keys, so the statistic is the same every run; alpha
1e-4). The kernels are held to that replay token for token, on random rows that take every path
(several chunks, the first draw outside the kept set, a search of several rounds, ties).
Without CUDA the kernels run under Triton's interpreter, whose float32 arithmetic is numpy's.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tests.support import gumbel_replica as replica
from tests.support.triton_interpreter import DEVICE, gpu_faithful
from worker_svc.layers.sampler import Sampler, SamplingOptions

ALPHA = 1e-4
DRAWS = 20_000
MODES = {
    "temperature": dict(temperature=0.7),
    "top-k": dict(top_k=4),
    "top-p": dict(top_p=0.75),
    "min-p": dict(min_p=0.15),
    "all": dict(temperature=1.3, top_k=6, top_p=0.8, min_p=0.05),
}


@pytest.fixture(scope="module", autouse=True)
def interpreted_like_a_gpu():
    with gpu_faithful():
        yield


def device_sampler(vocab: int, **settings):
    from worker_svc.layers.device_sampler import DeviceSampler

    # the passes most rows skip run on fewer programs than chunks: a program takes several
    return DeviceSampler(vocab, DEVICE, **({"capacity": 32, "max_rows": 32, "chunk": 16, "gather_cap": 8,
                                            "split_programs": 5} | settings))


def sample(sampler, logits: torch.Tensor, rows: list[int]) -> tuple[list[int], list[float], torch.Tensor]:
    """Flushes and samples logits [len(rows), vocab] of those table rows; (tokens, logprobs, last_sampled)."""
    n = len(rows)
    tokens = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    logprobs = torch.zeros(n, dtype=torch.float32, device=DEVICE)
    last_sampled = torch.full((sampler.capacity + 1,), -1, dtype=torch.int64, device=DEVICE)
    sampler.flush()
    sampler.sample(logits.to(DEVICE), torch.tensor(rows, device=DEVICE), tokens, logprobs, last_sampled)
    return tokens.tolist(), logprobs.tolist(), last_sampled.cpu()


def reference_probabilities(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    s = Sampler(logits.shape[-1], torch.device("cpu"))
    return s.probabilities(logits[None], s.metadata([options], [None]))[0]


def chi_square_p_value(tokens: np.ndarray, probs: torch.Tensor) -> float:
    support = probs > 0
    counts = torch.bincount(torch.from_numpy(tokens), minlength=len(probs)).double()
    assert counts[~support].sum() == 0, "drew a token the reference never draws"
    expected = probs.double()[support] * len(tokens)
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), statistic / 2)) if df else 1.0


@pytest.mark.parametrize("mode", list(MODES))
def test_drawn_tokens_follow_the_reference_distribution(mode):
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.007, 0.003])
    order = torch.randperm(len(probs), generator=torch.Generator().manual_seed(7))   # kept tokens anywhere
    logits = probs[order].log()
    options = SamplingOptions(**MODES[mode])
    keys = np.random.default_rng(0).integers(0, 2 ** 63, DRAWS)
    truncation = {k: v for k, v in MODES[mode].items() if k != "temperature"}
    tokens = replica.draw(logits.numpy(), options.temperature, keys, np.zeros(DRAWS, np.int64), **truncation)
    expected = reference_probabilities(logits, options)
    assert chi_square_p_value(tokens, expected) > ALPHA
    # A draw per output index of one seeded request follows it too.
    seeded = replica.draw(logits.numpy(), options.temperature, np.full(DRAWS, replica.row_key(5)), np.arange(DRAWS),
                          **truncation)
    assert chi_square_p_value(seeded, expected) > ALPHA


def test_the_noise_is_finite_for_every_random_pattern():
    extremes = np.array([0, 1, 511, 512, 2 ** 31, 2 ** 32 - 513, 2 ** 32 - 1], np.uint32)
    u = replica.uniform(extremes)
    assert np.all((u > 0) & (u < 1))
    assert np.all(np.isfinite(-np.log(-np.log(u))))


def random_rows(modes: list[dict], vocab: int, scales: tuple[float, ...], seed: int, dtype=torch.float32):
    """A row per mode and scale: logits of standard deviation `scale` (a small one gives flat rows,
    whose bfloat16 values tie)."""
    g = torch.Generator().manual_seed(seed)
    options = [SamplingOptions(seed=100 + i, **m) for i, m in enumerate(m for m in modes for _ in scales)]
    row_scales = torch.tensor([scale for _ in modes for scale in scales])
    logits = (torch.randn(len(options), vocab, generator=g) * row_scales[:, None]).to(dtype)
    return options, logits


def replica_token(logits_row: torch.Tensor, options: SamplingOptions, counter: int) -> int:
    truncation = dict(top_k=options.top_k, top_p=options.top_p, min_p=options.min_p)
    return int(replica.draw(logits_row.float().numpy(), options.temperature, [replica.row_key(options.seed)],
                            [counter], **truncation)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_kernels_draw_the_replicas_token(dtype):
    """Rows of 40 tokens in chunks of 16 (the last one short), a buffer of 8 gathered tokens:
    truncating rows gather their kept set, bracket their cut, or search it alone, and (in flat
    bfloat16 rows) ties at the cut occur."""
    modes = [*MODES.values(), dict(top_k=1, temperature=2.0), dict(top_p=0.3, min_p=0.2)]
    options, logits = random_rows(modes, 40, (2.0, 0.3), seed=11, dtype=dtype)
    sampler = device_sampler(40)
    for row, o in enumerate(options):
        sampler.add(row, [1] * (3 + row), 3, o)   # output index `row`: the counters differ
    tokens, _, _ = sample(sampler, logits, list(range(len(options))))
    assert tokens == [replica_token(logits[r], o, r) for r, o in enumerate(options)]


def adversarial_rows(vocab: int) -> tuple[list[SamplingOptions], torch.Tensor]:
    """Rows made to break a cut: three values (ties everywhere), all equal, half -inf, a few tokens
    beyond SEARCH_DEPTH, nearly flat, the largest tokens in pairs of neighbours (one group's maximum
    stands for two: more than k tokens pass the bound), steep rows whose top-p cut a bracket of a
    small buffer holds with other candidates; with k = 1, k >= the finite tokens, k = vocab
    (off), top_p tiny and 1.0 (off), min_p over flat rows, and the modes together."""
    g = torch.Generator().manual_seed(21)
    ties = torch.randint(0, 3, (vocab,), generator=g).float()
    flat = torch.zeros(vocab)
    masked = torch.randn(vocab, generator=g) * 2
    masked[::2] = float("-inf")
    deep = torch.randn(vocab, generator=g)
    deep[:5] = -45.0
    near_flat = torch.randn(vocab, generator=g) * 1e-3
    spread = torch.randn(vocab, generator=g) * 3
    pairs = torch.randn(vocab, generator=g)
    pairs[[8, 9, 20, 21, 32, 33]] = torch.tensor([5.0, 4.9, 4.5, 4.4, 4.0, 3.9])
    steep = [torch.randn(vocab, generator=g) * 1.5 for _ in range(3)]   # top-p brackets with candidates
    shelf = torch.randn(vocab, generator=g) * 0.5 - 6   # top-k 8 weighs tokens that min-p 0.3 drops: top-p 0.7
    shelf[[3, 11, 17, 22, 26, 30, 35, 38]] = torch.tensor([3.0, 2.9, 2.0, 1.0, 0.9, 0.8, 0.7, 0.6])   # keeps 3
    cases = [(pairs, dict(top_k=3)), (pairs, dict(top_k=4, top_p=0.9)), (pairs, dict(top_p=0.6)),
             (ties, dict(top_k=4)), (ties, dict(top_p=0.5)), (ties, dict(top_k=7, top_p=0.8)), (ties, dict(min_p=0.5)),
             (ties, dict(top_k=9, min_p=0.4)),
             (flat, dict(top_k=3)), (flat, dict(top_p=0.3)), (flat, dict(min_p=0.9)),
             (flat, dict(top_k=2, top_p=0.5, min_p=0.5)),
             (masked, dict(top_k=30)), (masked, dict(top_p=0.9, temperature=0.5)), (masked, dict(min_p=0.1)),
             (deep, dict(top_k=39)), (deep, dict(top_p=0.999)),
             (spread, dict(top_k=1)), (spread, dict(top_k=vocab)), (spread, dict(top_p=1e-6)),
             (spread, dict(top_p=1.0, temperature=2.0)), (spread, dict(top_p=0.8, min_p=0.05)),
             (spread, dict(top_k=12)), (pairs, dict(top_k=10)), (spread, dict(min_p=0.9)),
             (steep[0], dict(top_p=0.7)), (steep[1], dict(top_p=0.6)), (steep[2], dict(top_p=0.75, min_p=0.02)),
             (spread, dict(top_k=8, top_p=0.6, min_p=0.3)), (shelf, dict(top_k=8, top_p=0.7, min_p=0.3)),
             (spread, dict(top_k=30, top_p=0.99, min_p=0.5, temperature=3.0)),
             (masked, dict(top_k=15, top_p=0.95, min_p=0.4, temperature=2.0)),
             (near_flat, dict(min_p=0.999)), (near_flat, dict(top_p=0.95, min_p=0.999))]
    options = [SamplingOptions(seed=200 + i, **c) for i, (_, c) in enumerate(cases)]
    return options, torch.stack([row for row, _ in cases])


def kept_by_cut(logits_row: torch.Tensor, options: SamplingOptions, cut: float) -> np.ndarray:
    """The kept set a kernel's cut stands for: z >= cut and, with min-p, z - max z >= log(min_p)."""
    z = logits_row.float().numpy() * np.float32(1.0 / options.temperature)
    keep = z >= np.float32(cut)
    if options.min_p > 0:
        keep &= z - z.max() >= np.float32(math.log(options.min_p))
    return keep


@pytest.mark.parametrize("gather_cap", [8, 64], ids=["overflowing", "gathered"])
def test_kept_sets_and_tokens_equal_the_replicas_on_adversarial_rows(gather_cap):
    """The kept set of each row (its cut, ties at it kept) is the replica's, whichever way the row
    found it, and so is its token. A buffer of 8 sends rows down every path."""
    options, logits = adversarial_rows(40)
    sampler = device_sampler(40, gather_cap=gather_cap)
    for row, o in enumerate(options):
        sampler.add(row, [1] * (3 + row), 3, o)
    tokens, _, _ = sample(sampler, logits, list(range(len(options))))
    assert tokens == [replica_token(logits[r], o, r) for r, o in enumerate(options)]
    taken = sampler.cut_paths(len(options))
    for row, (o, path) in enumerate(zip(options, taken)):
        z = logits[row].numpy() * np.float32(1.0 / o.temperature)
        expected = replica.kept(z, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p)
        if path != "alone":   # the single-program search keeps no cut when its first draw is kept
            assert np.array_equal(kept_by_cut(logits[row], o, float(sampler.cuts[row])), expected), (row, o, path)
    expected_paths = {"gathered", "bracketed", "alone", "min-p", "none"} if gather_cap == 8 else {
        "gathered", "min-p", "none"}
    assert set(taken) == expected_paths


def test_a_row_draws_the_same_token_whichever_way_it_finds_its_cut():
    """Fresh random rows sampled with buffers of 8 and 64 tokens (the rows overflowing it or not):
    the same tokens, the replica's."""
    modes = [dict(top_k=5), dict(top_p=0.7), dict(top_k=6, top_p=0.9, min_p=0.02), dict(min_p=0.2),
             dict(top_p=0.9, min_p=0.1, temperature=1.5)]
    options, logits = random_rows(modes, 40, (3.0, 1.0, 0.2), seed=22, dtype=torch.bfloat16)
    expected = [replica_token(logits[r], o, r) for r, o in enumerate(options)]
    taken = set()
    for gather_cap in (8, 64):
        sampler = device_sampler(40, gather_cap=gather_cap)
        for row, o in enumerate(options):
            sampler.add(row, [1] * (3 + row), 3, o)
        tokens, _, _ = sample(sampler, logits, list(range(len(options))))
        assert tokens == expected, f"gather_cap {gather_cap}"
        taken |= set(sampler.cut_paths(len(options)))
    assert {"gathered", "bracketed", "min-p"} <= taken


def test_greedy_rows_take_the_first_argmax_among_drawing_rows():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    logits[1, 5] = logits[1, 37] = 9.0        # a tie across chunks: the first wins, as torch.argmax
    options = [SamplingOptions(temperature=0.0, top_k=3, top_p=0.1), SamplingOptions(temperature=0.0),
               SamplingOptions(temperature=0.9, seed=1), SamplingOptions(temperature=0.0, min_p=0.9),
               SamplingOptions(top_k=2, seed=2), SamplingOptions(temperature=1e-6)]
    sampler = device_sampler(40)
    for row, o in enumerate(options):
        sampler.add(row, [1, 2], 2, o)
    tokens, _, _ = sample(sampler, logits, list(range(6)))
    argmax = logits.float().argmax(-1).tolist()
    assert [tokens[i] for i in (0, 1, 3, 5)] == [argmax[i] for i in (0, 1, 3, 5)]
    assert tokens[1] == 5


def test_a_seeded_rows_tokens_depend_only_on_its_seed_and_output_index():
    g = torch.Generator().manual_seed(13)
    row = torch.randn(40, generator=g)
    seeded = SamplingOptions(temperature=0.8, top_p=0.9, seed=42)
    alone = device_sampler(40, seed=1)
    alone.add(0, [1, 2, 3, 4, 5], 2, seeded)   # output index 3
    first, _, _ = sample(alone, row[None], [0])
    # Other neighbours, another row of the table, another worker seed, other chunks: the same token.
    crowded = device_sampler(40, seed=2, chunk=8)
    for r in range(5):
        crowded.add(r, [1, 2, 3, 4, 5], 2, SamplingOptions(temperature=1.0) if r != 3 else seeded)
    logits = torch.randn(5, 40, generator=g)
    logits[3] = row
    tokens, _, _ = sample(crowded, logits, [0, 1, 2, 3, 4])
    assert tokens[3] == first[0]
    # Each step advances the output index, and the draws change with it.
    draws = [sample(alone, torch.zeros(1, 40), [0])[0][0] for _ in range(6)]
    assert len(set(draws)) > 3


def test_logprobs_are_of_the_raw_logits_and_zero_where_not_asked():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(14)) * 3
    options = [SamplingOptions(temperature=0.5, top_k=3, logprobs=True, seed=1), SamplingOptions(temperature=0.0),
               SamplingOptions(temperature=0.0, logprobs=True), SamplingOptions(min_p=0.3, top_logprobs=2, seed=2)]
    sampler = device_sampler(40)
    for row, o in enumerate(options):
        sampler.add(row, [1, 2], 2, o)
    tokens, logprobs, _ = sample(sampler, logits, [0, 1, 2, 3])
    raw = logits.log_softmax(-1)
    for i in (0, 2, 3):
        assert logprobs[i] == pytest.approx(float(raw[i, tokens[i]]), abs=1e-5)
    assert logprobs[1] == 0.0
    assert sampler.wants_logprobs(np.array([1, 2])) and not sampler.wants_logprobs(np.array([1]))


def test_penalties_and_bias_sample_as_the_torch_path_step_after_step():
    """Greedy rows pick the torch path's tokens while the kernels count what they sampled into the
    penalty state; a drawing row draws the replica's token from the torch path's adjusted logits."""
    from worker_svc.layers.sampler import adjusted_logits

    g = torch.Generator().manual_seed(15)
    prompt, output = [1, 2, 2, 9, 30], [3, 3, 33]
    options = [SamplingOptions(temperature=0.0, repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3),
               SamplingOptions(temperature=0.0, logit_bias=((4, 3.0), (20, -100.0), (35, 2.5))),
               SamplingOptions(temperature=0.0, repetition_penalty=1.3, logit_bias=((3, 1.5), (17, 4.0))),
               SamplingOptions(temperature=0.8, top_k=5, frequency_penalty=0.7, logit_bias=((8, 2.0),), seed=9),
               SamplingOptions(temperature=0.0)]
    kernels, torch_path = device_sampler(40), Sampler(40, torch.device("cpu"))
    penalty_rows = []
    for row, o in enumerate(options):
        kernels.add(row, prompt + output, len(prompt), o)
        penalty_rows.append(torch_path.add_request(prompt + output, len(prompt), o))
    for step in range(3):
        logits = torch.randn(len(options), 40, generator=g) * 3
        meta = torch_path.metadata(options, penalty_rows)
        adjusted = adjusted_logits(logits, meta, torch_path.penalties)
        tokens, _, _ = sample(kernels, logits, list(range(len(options))))
        assert [tokens[i] for i in (0, 1, 2, 4)] == adjusted[[0, 1, 2, 4]].argmax(-1).tolist(), f"step {step}"
        assert tokens[3] == replica_token(adjusted[3], options[3], len(output) + step)
        torch_path.penalties.record(meta.penalty_rows, torch.tensor([tokens[i] for i in (0, 2, 3)]))
    assert torch.equal(kernels.penalties.output_counts[:3].cpu(), torch_path.penalties.output_counts[:3])


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "drawing"])
def test_rows_whose_processing_broke_take_the_raw_logits(temperature):
    logits = torch.rand(3, 40, generator=torch.Generator().manual_seed(16)) + 1.0
    logits[:, 7] = 5.0
    logits[2, 9] = 1e35   # / 1.1e-5 overflows float32
    options = [SamplingOptions(temperature=temperature, top_k=1, repetition_penalty=1e-45),   # +inf scores
               SamplingOptions(temperature=temperature, top_k=1, presence_penalty=math.nan),
               SamplingOptions(temperature=1.1e-5, logprobs=True)]
    sampler = device_sampler(40)
    for row, o in enumerate(options):
        sampler.add(row, [0, 1, 2, 3, 7], 2, o)
    tokens, logprobs, _ = sample(sampler, logits, [0, 1, 2])
    assert tokens == [7, 7, 9]
    assert math.isfinite(logprobs[2])


def test_sampling_counts_each_draw_and_stores_each_rows_newest_token():
    sampler = device_sampler(40)
    sampler.add(3, [1, 2, 3], 1, SamplingOptions(temperature=0.0))
    sampler.add(5, [1, 2], 2, SamplingOptions(temperature=1.0, seed=3))
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(17))
    rows = [3, 5, sampler.dummy_row, sampler.dummy_row]   # a captured batch's padding
    tokens, _, last_sampled = sample(sampler, logits, rows)
    assert last_sampled[3] == tokens[0] and last_sampled[5] == tokens[1]
    assert sampler.counters[[3, 5]].tolist() == [3, 1]
    assert tokens[2] == int(logits[2].argmax())   # the dummy row is greedy, and harmless
    sampler.remove(5)
    sampler.add(5, [1, 2, 3, 4], 2, SamplingOptions(temperature=1.0, seed=3))   # re-admitted: index 2 again
    sample(sampler, logits[1:2], [5])
    assert sampler.counters[5] == 3


def test_the_distribution_for_speculative_decoding_is_the_torch_paths():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(18))
    options = [SamplingOptions(temperature=0.0), SamplingOptions(top_k=4, frequency_penalty=0.5),
               SamplingOptions(top_p=0.8, logit_bias=((2, 1.0),))]
    kernels, torch_path = device_sampler(40), Sampler(40, torch.device("cpu"))
    penalty_rows = []
    for row, o in enumerate(options):
        kernels.add(row, [1, 2, 5, 5], 2, o)
        penalty_rows.append(torch_path.add_request([1, 2, 5, 5], 2, o))
    expected = torch_path.probabilities(logits, torch_path.metadata(options, penalty_rows))
    actual = kernels.probabilities(logits.to(DEVICE), np.arange(3)).cpu()
    torch.testing.assert_close(actual, expected)
    assert torch.equal(actual[0], torch.nn.functional.one_hot(logits[0].argmax(), 40).float())
    assert (actual[1] > 0).sum() == 4 and actual.sum(-1).allclose(torch.ones(3))


def test_options_that_keep_everything_do_not_truncate():
    sampler = device_sampler(40)
    sampler.add(0, [1], 1, SamplingOptions(top_k=40, top_p=1.0, min_p=0.0, seed=1))
    assert sampler._table[0, 0] == 0   # no flag: a plain draw
    plain = dataclasses.replace(SamplingOptions(seed=1))
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(19))
    assert sample(sampler, logits, [0])[0][0] == replica_token(logits[0], plain, 0)


def test_drawing_ahead_takes_each_positions_token_at_its_output_index_and_changes_nothing():
    """sample_ahead (a verifying step's positions, several a row) draws position (row, j) as the row
    draws j outputs later, with the same logprob; no counter, newest token or count moves."""
    vocab = 40
    options = [SamplingOptions(temperature=0.9, top_k=6, seed=11, logprobs=True),
               SamplingOptions(top_p=0.8, min_p=0.05, logprobs=True),   # unseeded: the worker's generator keys it
               SamplingOptions(temperature=0.0)]
    ahead, plain = device_sampler(vocab), device_sampler(vocab)
    for row, o in enumerate(options):
        ahead.add(row, [1, 2, 3, 4, 5], 3, o)
        plain.add(row, [1, 2, 3, 4, 5], 3, o)
    assert not ahead.processes(np.arange(3)) and not ahead.greedy(np.arange(3)) and ahead.greedy(np.array([2]))
    rows, offsets = [0, 0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 2, 3, 0, 1, 0, 1, 2]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(20))
    ahead.flush()
    plain.flush()
    counters = ahead.counters.clone()
    tokens = torch.zeros(len(rows), dtype=torch.int64, device=DEVICE)
    logprobs = torch.zeros(len(rows), dtype=torch.float32, device=DEVICE)
    ahead.sample_ahead(logits.to(DEVICE), torch.tensor(rows, device=DEVICE), torch.tensor(offsets, device=DEVICE),
                       tokens, logprobs)
    assert torch.equal(ahead.counters, counters)
    for i, (row, offset) in enumerate(zip(rows, offsets)):
        plain.counters[row] = counters[row] + offset
        token, logprob, _ = sample(plain, logits[i:i + 1], [row])
        assert int(tokens[i]) == token[0], f"position {i}"
        assert float(logprobs[i]) == pytest.approx(logprob[0], abs=1e-6)
    at_zero = torch.zeros_like(tokens)
    ahead.sample_ahead(logits.to(DEVICE), torch.tensor(rows, device=DEVICE), torch.zeros_like(tokens), at_zero,
                       logprobs)
    assert not torch.equal(at_zero, tokens), "the offsets did not reach the noise"


@pytest.mark.parametrize("chunk", [64, 3], ids=["one-pass", "in-passes-of-3"])
def test_drawing_ahead_with_penalties_and_bias_counts_the_drafts_before_each_position(monkeypatch, chunk):
    """Rows with penalties or a logit bias: position (row, j) draws as the row does j outputs later
    once the j drafts before it are counted (a sampler holding the drafts as output draws the
    position); count_emitted then counts only the emitted tokens of penalized rows. The drafts are
    each row's first token, so the penalties move the later positions off it."""
    from worker_svc.layers import device_sampler as module

    monkeypatch.setattr(module, "AHEAD_CHUNK", chunk)   # positions per pass of the per-position scratch
    vocab = 40
    options = [SamplingOptions(temperature=0.0, repetition_penalty=1.4, frequency_penalty=5.0, logprobs=True),
               SamplingOptions(temperature=0.5, seed=5, presence_penalty=6.0, logit_bias=((3, 2.0), (7, -1.5))),
               SamplingOptions(temperature=0.9, logit_bias=((1, 3.0),))]
    ahead = device_sampler(vocab)
    for row, o in enumerate(options):
        ahead.add(row, [1, 2, 3, 4, 5], 3, o)
    assert ahead.processes(np.array([0])) and ahead.processes(np.array([2])) and not ahead.greedy(np.array([0]))
    rows, offsets = [0, 0, 0, 1, 1, 1, 2, 2], [0, 1, 2, 0, 1, 2, 0, 1]
    base = torch.randn(3, vocab, generator=torch.Generator().manual_seed(21)) * 2
    logits = base[rows]                         # a row's positions see the same logits: only the counts differ
    ahead.flush()
    keys, start = ahead.keys.clone(), ahead.counters.clone()

    def alone(row: int, drafted: list[int], offset: int) -> tuple[int, float]:
        """The row's draw at output index start + offset with `drafted` as output before it."""
        reference = device_sampler(vocab)
        reference.add(row, [1, 2, 3, 4, 5, *drafted], 3, options[row])
        reference.flush()
        reference.keys[row], reference.counters[row] = keys[row], start[row] + offset
        token, logprob, _ = sample(reference, base[row:row + 1], [row])
        return token[0], logprob[0]

    firsts = {row: alone(row, [], 0)[0] for row in range(3)}
    drafts = {row: [firsts[row]] * 2 for row in range(3)}
    preceding = torch.full((len(rows), 2), -1, dtype=torch.int64)
    for i, (row, offset) in enumerate(zip(rows, offsets)):
        preceding[i, :offset] = torch.tensor(drafts[row][:offset])
    counts = ahead.penalties.output_counts.clone()
    tokens = torch.zeros(len(rows), dtype=torch.int64, device=DEVICE)
    logprobs = torch.zeros(len(rows), dtype=torch.float32, device=DEVICE)
    rows_d = torch.tensor(rows, device=DEVICE)
    ahead.sample_ahead(logits.to(DEVICE), rows_d, torch.tensor(offsets, device=DEVICE), tokens, logprobs,
                       preceding.to(DEVICE))
    assert torch.equal(ahead.penalties.output_counts, counts) and torch.equal(ahead.counters, start)
    for i, (row, offset) in enumerate(zip(rows, offsets)):
        token, logprob = alone(row, drafts[row][:offset], offset)
        assert int(tokens[i]) == token, f"position {i}"
        assert float(logprobs[i]) == pytest.approx(logprob, abs=1e-6)
    assert int(tokens[1]) != firsts[0] and int(tokens[4]) != firsts[1], "the drafts before them were not counted"
    emitted = torch.tensor([True, True, False, True, False, False, True, True], device=DEVICE)
    ahead.count_emitted(rows_d, tokens, emitted)
    added = ahead.penalties.output_counts - counts
    assert int(added.sum()) == 3   # rows 0 (two emitted) and 1 (one); row 2 has no penalties
    assert ahead._ahead_processed.shape[0] == min(chunk, len(rows))

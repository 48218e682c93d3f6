"""Verification of drafts (worker_svc/spec_decode/verification.py) with the real sampler: the
tokens it emits follow the target's distribution exactly (a chi-square test over a small Markov
chain, with temperature, top-k and a presence penalty that depends on the tokens before each
position), a seeded request emits the very tokens plain sampling draws, and the layout and
acceptance rules on crafted tokens. Also the n-gram proposer."""
from __future__ import annotations

import numpy as np
import torch

from worker_svc.layers.sampler import Sampler, SamplingOptions
from worker_svc.spec_decode.ngram import propose_ngram
from worker_svc.spec_decode.verification import DeviceLayout, VerifyLayout, accept, preceding_drafts

VOCAB = 5
START = 0
OPTIONS = SamplingOptions(temperature=0.8, top_k=4, presence_penalty=0.7)
# 99.9% quantile of chi-square with 15 degrees of freedom (16 pairs of tokens top-k leaves).
CHI2_15DF_999 = 37.70


def markov_logits() -> torch.Tensor:
    """Row t: the model's logits for the token after t; repeating a token is likely, so that the
    presence penalty matters."""
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)) + 2 * torch.eye(VOCAB)


def processed(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
    """The target distribution after `output`: presence penalty, temperature, top-k (the
    sampler's order), written out by hand."""
    logits = logits.clone()
    for token in set(output):
        logits[token] -= OPTIONS.presence_penalty
    logits = logits / OPTIONS.temperature
    kth = logits.topk(OPTIONS.top_k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


def exact_pairs(m: torch.Tensor) -> torch.Tensor:
    """P(first two tokens after START = (a, b))."""
    first = processed(m[START], [])
    return torch.stack([first[a] * processed(m[a], [a]) for a in range(VOCAB)])


def device_layout(layout: VerifyLayout) -> DeviceLayout:
    parts = (layout.first, layout.num_drafts, layout.owner, layout.offset, layout.next_drafts)
    return DeviceLayout(*(torch.from_numpy(p) for p in parts), layout.max_drafts)


def speculative_pairs(sampler: Sampler, m: torch.Tensor, drafts: list[int], trials: int,
                      seeds: list[int] | None = None) -> list[tuple[int, int]]:
    """The first two tokens of `trials` requests after START, each verifying `drafts` in one step
    (then sampling plainly when fewer than two were emitted)."""
    options = [OPTIONS] * trials if seeds is None else [
        SamplingOptions(temperature=OPTIONS.temperature, top_k=OPTIONS.top_k,
                        presence_penalty=OPTIONS.presence_penalty, seed=s) for s in seeds]
    rows = [sampler.add_request([START], 1, o) for o in options]
    k = len(drafts)
    layout = VerifyLayout.build(np.full(trials, k), np.tile(drafts, (trials, 1)))
    positions = [START] + drafts
    logits = m[positions].repeat(trials, 1)
    expanded = [o for o in options for _ in range(k + 1)]
    meta = sampler.metadata(expanded, [r for r in rows for _ in range(k + 1)])
    seeded = [j % (k + 1) for j, _ in meta.seeded]           # output index = offset in the run
    dev = device_layout(layout)
    tokens, _ = sampler.sample(logits, meta, seeded, preceding_drafts(dev), record=False)
    accepted, emitted, _ = accept(tokens, dev)
    sampler.record(meta, tokens, emitted)
    first = tokens[dev.first]
    second = tokens[(dev.first + 1).clamp_max(len(tokens) - 1)]
    again = torch.nonzero(accepted == 0).flatten().tolist()   # only the first token was emitted
    if again:
        meta = sampler.metadata([options[i] for i in again], [rows[i] for i in again])
        seeded = [1] * len(meta.seeded)
        plain, _ = sampler.sample(m[first[again]], meta, seeded)
        second[again] = plain
    for r in rows:
        sampler.remove_request(r)
    return list(zip(first.tolist(), second.tolist()))


def plain_pairs(sampler: Sampler, m: torch.Tensor, seeds: list[int]) -> list[tuple[int, int]]:
    """The same requests sampled one token per step."""
    out = []
    for seed in seeds:
        o = SamplingOptions(temperature=OPTIONS.temperature, top_k=OPTIONS.top_k,
                            presence_penalty=OPTIONS.presence_penalty, seed=seed)
        row = sampler.add_request([START], 1, o)
        meta = sampler.metadata([o], [row])
        a = int(sampler.sample(m[[START]], meta, [0])[0])
        b = int(sampler.sample(m[[a]], meta, [1])[0])
        sampler.remove_request(row)
        out.append((a, b))
    return out


def chi_square(pairs: list[tuple[int, int]], probs: torch.Tensor) -> float:
    firsts, seconds = torch.tensor(pairs).T
    counts = torch.bincount(firsts * VOCAB + seconds, minlength=VOCAB * VOCAB).view(VOCAB, VOCAB).double()
    expected = probs.double() * len(pairs)
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, "a token that top-k excludes was emitted"
    return float(((counts - expected)[allowed] ** 2 / expected[allowed]).sum())


def test_verified_tokens_follow_the_target_distribution_whatever_the_drafts():
    m = markov_logits()
    probs = exact_pairs(m)
    likely = int(probs.sum(1).argmax())
    good = [likely, int(processed(m[likely], [likely]).argmax())]
    excluded = int(m[START].argmin())                         # never allowed by top-k
    for drafts in (good, [excluded, good[1]], [good[0]]):
        pairs = speculative_pairs(Sampler(VOCAB, torch.device("cpu"), seed=11), m, drafts, 10_000)
        assert chi_square(pairs, probs) < CHI2_15DF_999, drafts


def test_a_seeded_request_emits_the_tokens_plain_sampling_draws():
    m = markov_logits()
    seeds = list(range(300))
    probs = exact_pairs(m)
    likely = int(probs.sum(1).argmax())
    drafts = [likely, int(processed(m[likely], [likely]).argmax())]
    speculative = speculative_pairs(Sampler(VOCAB, torch.device("cpu")), m, drafts, len(seeds), seeds)
    assert speculative == plain_pairs(Sampler(VOCAB, torch.device("cpu")), m, seeds)


def test_a_run_is_accepted_up_to_the_first_sample_that_differs_from_the_next_draft():
    layout = VerifyLayout.build(np.array([2, 0, 3]), np.array([[5, 6, 0], [0, 0, 0], [7, 8, 9]]))
    assert layout.next_drafts.tolist() == [5, 6, -1, -1, 7, 8, 9, -1]
    dev = device_layout(layout)
    accepted, emitted, last = accept(torch.tensor([5, 6, 1, 4, 7, 3, 9, 9]), dev)
    assert accepted.tolist() == [2, 0, 1] and last.tolist() == [2, 3, 5]
    assert emitted.tolist() == [True, True, True, True, True, True, False, False]
    assert preceding_drafts(dev)[5:].tolist() == [[7, -1, -1], [7, 8, -1], [7, 8, 9]]


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    assert propose_ngram(tokens, 3).tolist() == [4, 9, 2]        # "1 2 3" beats the later "2 3"
    assert propose_ngram(np.array([4, 5, 6, 5, 6]), 2).tolist() == [5, 6]
    assert propose_ngram(np.array([1, 2, 3]), 3).tolist() == []
    # Only the window is searched: an occurrence before it is not found.
    assert propose_ngram(np.array([7, 8] + [1] * 10 + [7]), 2, window=5).tolist() == []

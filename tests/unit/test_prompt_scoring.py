"""Which prompt tokens a step scores (worker_svc/prompt_scoring.py): the logits at position p
score the token at p + 1, chunk by chunk, up to the last prompt token, whose logits sample
instead; a request scored to its end stops being scored."""
from __future__ import annotations

import numpy as np
import torch

from worker_svc.input_batch import InputBatch
from worker_svc.layers.sampler import SamplingOptions
from worker_svc.prompt_scoring import plan_prompt_scoring, score_prompt
from worker_svc.runner_io import NewRequest

PROMPT = list(range(20, 30))     # 10 tokens


def batch_with(*requests: NewRequest) -> InputBatch:
    batch = InputBatch(max_model_len=32, max_blocks_per_seq=8, initial_rows=4)
    for request in requests:
        batch.add(request, None)
    return batch


def plan(batch: InputBatch, rows: list[int], start: list[int], counts: list[int]):
    start, counts = np.array(start, np.int64), np.array(counts, np.int64)
    query_start = np.concatenate([[0], np.cumsum(counts)])
    return plan_prompt_scoring(batch, np.array(rows, np.int64), start, start + counts, query_start)


def test_a_prompt_is_scored_chunk_by_chunk_up_to_its_last_token():
    scoring = NewRequest(7, PROMPT, 10, 0, 4, [0, 1], SamplingOptions(prompt_logprobs=True, top_logprobs=3))
    plain = NewRequest(8, [1, 2, 3], 3, 0, 3, [2], SamplingOptions())
    batch = batch_with(plain, scoring)
    # Step 1: the plain request's prompt, then positions 0..3 of the scored one.
    indices, targets, scored = plan(batch, [0, 1], [0, 0], [3, 4])
    assert indices.tolist() == [3, 4, 5, 6] and targets.tolist() == PROMPT[1:5]
    assert scored == [(7, 1, 4, 3)] and batch.num_scoring == 1
    # Step 2: positions 4..9, the rest of the prompt: its last token's logits sample, not score.
    indices, targets, scored = plan(batch, [1], [4], [6])
    assert indices.tolist() == [0, 1, 2, 3, 4] and targets.tolist() == PROMPT[5:10]
    assert scored == [(7, 5, 5, 3)] and batch.num_scoring == 0


def test_a_prompt_cached_to_its_last_token_scores_nothing_and_stops_scoring():
    batch = batch_with(NewRequest(7, PROMPT, 10, 0, 9, [0, 1], SamplingOptions(prompt_logprobs=True)))
    plan(batch, [0], [0], [9])
    indices, targets, scored = plan(batch, [0], [9], [1])
    assert (len(indices), len(targets), scored) == (0, 0, [])


def test_scores_are_the_logprobs_of_the_targets_with_the_most_likely_tokens():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    hidden = torch.arange(6).unsqueeze(1)

    def compute_logits(hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return logits[hidden[indices, 0]]

    indices, targets = torch.tensor([0, 2, 3, 5]), torch.tensor([4, 1, 9, 0])
    result = score_prompt(compute_logits, hidden, indices, targets, [(7, 1, 4, 2)], max_rows=3)
    expected = logits[indices].log_softmax(-1)
    assert torch.allclose(result.scores, expected.gather(1, targets.unsqueeze(1)).squeeze(1))
    assert result.score_top_ids.tolist() == expected.topk(2, dim=-1).indices.tolist()
    assert score_prompt(lambda h, i: None, hidden, indices, targets, [(7, 1, 4, 0)], max_rows=3) is None

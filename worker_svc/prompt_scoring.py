"""Prompt scoring: the logprobs of a request's prompt tokens, chunk by chunk as its prefill runs.

The logits at position p score the token at p + 1, so a chunk computing positions start..end-1
scores the prompt tokens start+1..end, up to the last prompt token (whose logits sample the
first output token instead). `plan_prompt_scoring` finds a step's tokens to score on the host,
while the step is prepared; `score_prompt` computes their logprobs on the device
(layers/logprobs.py) and starts their copy to the host.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from worker_svc.input_batch import InputBatch
from worker_svc.layers.logprobs import score_tokens
from worker_svc.staging import EMPTY_PART, Logprobs, to_host

# Per scored request of a step: (seq_id, first position scored, count, top_logprobs).
Scored = list[tuple[int, int, int, int]]


def plan_prompt_scoring(batch: InputBatch, rows: np.ndarray, start: np.ndarray, seq_lens: np.ndarray,
                        query_start: np.ndarray) -> tuple[np.ndarray, np.ndarray, Scored]:
    """The step's prompt tokens to score: the flat indices of the positions whose logits score
    them, the tokens they score, and per request what was scored. A row whose prompt is scored
    to its end stops being a scoring row."""
    b = batch
    indices, targets, scored = [], [], []
    for i in np.flatnonzero(b.scores_prompt[rows]).tolist():
        row = int(rows[i])
        first, last = int(start[i]), int(b.num_prompt[row]) - 1
        end = min(int(seq_lens[i]), last)
        if end > first:
            indices.append(query_start[i] + np.arange(end - first))
            targets.append(b.token_ids[row, first + 1:end + 1])
            scored.append((int(b.seq_id_of[row]), first + 1, end - first, int(b.top_logprobs[row])))
        if end == last:
            b.prompt_scored(row)
    if not scored:
        return EMPTY_PART, EMPTY_PART, []
    return np.concatenate(indices), np.concatenate(targets), scored


def score_prompt(compute_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None], hidden: torch.Tensor,
                 indices: torch.Tensor, targets: torch.Tensor, scored: Scored, max_rows: int) -> Logprobs | None:
    """Scores the planned tokens (on every rank: the LM head is a collective; rank 0 gets the
    values, the others None). Slices of max_rows positions: the sampling of as many rows is
    what the start-up memory profile measured."""
    k = max(k for _, _, _, k in scored)
    result = score_tokens(compute_logits, hidden, indices, targets, k, max_rows)
    if result is None:       # not rank 0
        return None
    scores, top_ids, top_values = result
    return Logprobs(scored=scored, scores=to_host(scores), score_top_ids=to_host(top_ids),
                    score_top_values=to_host(top_values))

"""Log-probabilities beyond the sampled token's: the most likely tokens of each sampled position,
and the scores of prompt tokens given the tokens before them.

Like the sampled token's logprob (layers/sampler.py), these are of the logits as the model gives
them (after a constraint's mask, which only removes tokens), before penalties, temperature and
truncation: vLLM's default. Computed in float32 on the logits' device; the most likely come first
(torch.topk, sorted). Nothing here waits for the device.

Prompt scoring may cover every token of a prefill chunk (up to max_num_batched_tokens); its logits
are made and reduced `max_rows` positions at a time, so its memory stays that of sampling as many
rows, which the worker's start-up memory profile covers.
"""
from __future__ import annotations

from typing import Callable

import torch


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 [n, k], logprobs float32 [n, k]) of the k most likely tokens of each row."""
    values, ids = logits.float().log_softmax(-1).topk(k, dim=-1)
    return ids, values


def score_tokens(compute_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None],
                 hidden: torch.Tensor, indices: torch.Tensor, targets: torch.Tensor, k: int, max_rows: int,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """The logprob of targets[i] under the logits of hidden[indices[i]] ([n] float32) and, when
    k > 0, the k most likely tokens there (ids [n, k], logprobs [n, k]). `compute_logits` is the
    model's (a collective under tensor parallelism: every rank calls it alike, and ranks that get
    no logits get None here)."""
    scores, top_ids, top_values = [], [], []
    for start in range(0, len(indices), max_rows):
        logits = compute_logits(hidden, indices[start:start + max_rows])
        if logits is None:
            continue
        logprobs = logits.float().log_softmax(-1)
        scores.append(logprobs.gather(1, targets[start:start + max_rows].unsqueeze(1)).squeeze(1))
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            top_ids.append(ids)
            top_values.append(values)
    if not scores:
        return None
    if not k:
        return torch.cat(scores), None, None
    return torch.cat(scores), torch.cat(top_ids), torch.cat(top_values)

"""The sampler's last line of defence against scores its own processing made non-finite.

Validation bounds every sampling parameter so that finite model logits stay finite through
penalties, temperature and truncation; this guard holds when something slips through anyway
(a worker called with unvalidated options, logits near the float range). A row is *usable* when
its scores have no NaN, no +inf, and at least one finite value: exactly when their softmax has no
NaN. An unusable row would otherwise pick token 0 (argmax treats NaN as the largest value, and an
all -inf row has argmax 0), which for many tokenizers is EOS: the request would end at once, as
if the model had finished. Instead, a row whose penalties broke it falls back to the model's raw
logits, and a drawing row whose processed distribution broke takes the raw logits' argmax.

The checks are tensor ops with no host synchronisation. The raw logits are trusted: NaN there is a
failure of the model itself, which no choice of token repairs.
"""
from __future__ import annotations

import torch


def usable_rows(scores: torch.Tensor) -> torch.Tensor:
    """[n] bool: rows with no NaN, no +inf and a finite value (their log-sum-exp is finite)."""
    return torch.logsumexp(scores.float(), dim=-1).isfinite()


def with_unusable_rows_raw(scores: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """`scores` ([n, vocab], float32) where usable, the same rows of `raw` elsewhere."""
    return torch.where(usable_rows(scores).unsqueeze(1), scores, raw.to(scores.dtype))


def drawable_rows(probs: torch.Tensor) -> torch.Tensor:
    """[n] bool: rows of softmax(scores) that came from usable scores (no NaN: their sum is a number)."""
    return ~probs.sum(dim=-1).isnan()


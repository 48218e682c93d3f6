"""The scheduler's rules for speculative decoding: how many of the drafts a worker holds for a
decode it verifies in one step, and the checks on a reply that carries runs of tokens.

A decode verifies k drafts (0..num_speculative_tokens) when the batch is small enough (above
max_batch_size a step is cheaper without), the request has not opted out, the worker holds (or, with
a step in flight that proposes, may hold) k drafts for it, and the step budget and its limits leave
room: the verification brings up to k + 1 tokens after every token steps in flight may bring, and
none may pass max_tokens or max_model_len.
"""
from __future__ import annotations

from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

from common.speculation import DEFAULT_MAX_BATCH_SIZE
from scheduler_svc.engine.sequence import Sequence


@dataclass(frozen=True)
class SpeculationConfig:
    num_speculative_tokens: int = 0          # the most drafts a decode verifies; 0: off
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE   # running requests at most for a step to speculate
    method: str = ""                         # the workers' proposer (ngram, eagle3, draft), for ModelInfo

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must not be negative")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be positive")


def num_drafts_to_verify(seq: Sequence, config: SpeculationConfig, budget: int, max_model_len: int) -> int:
    """How many of the drafts the worker holds for seq its decode verifies (0: a plain decode).
    `budget`: the step's tokens left beyond the decode's own."""
    if not seq.sampling.speculative:
        return 0
    pending = seq.num_placeholder_tokens + seq.num_unresolved_drafts   # tokens steps in flight may bring
    room = min(seq.sampling.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens) - pending - 1
    return max(0, min(seq.num_drafts, config.num_speculative_tokens, budget, room))


def check_reply(sampling_seqs: Sequence_[Sequence], draft_positions: Sequence_[int], draft_counts: Sequence_[int],
                num_tokens: int, token_counts: Sequence_[int], num_drafts: Sequence_[int],
                max_drafts: int, verified: Sequence_[int] = ()) -> None:
    """ValueError unless the reply gives each sampling sequence 1 token, or 1 + at most the drafts
    it verified (draft_positions index sampling_seqs; verified, when given, says how many of the
    drafts asked each did), and at most max_drafts drafts for the next."""
    n = len(sampling_seqs)
    if verified:
        if len(verified) != n:
            raise ValueError(f"the step returned {len(verified)} verified-draft counts for {n} sampling requests")
        asked = [0] * n
        for position, count in zip(draft_positions, draft_counts):
            asked[position] = count
        bad = next((i for i, (v, most) in enumerate(zip(verified, asked)) if v > most), None)
        if bad is not None:
            raise ValueError(f"the step verified {verified[bad]} drafts for sampling request {bad}, which asked "
                             f"for {asked[bad]}")
        draft_counts = [verified[position] for position in draft_positions]
    if token_counts:
        if len(token_counts) != n:
            raise ValueError(f"the step returned {len(token_counts)} token counts for {n} sampling requests")
        if sum(token_counts) != num_tokens:
            raise ValueError(f"the step's token counts add up to {sum(token_counts)}, not its {num_tokens} tokens")
        limits = [1] * n
        for position, count in zip(draft_positions, draft_counts):
            limits[position] += count
        bad = next((i for i, (c, most) in enumerate(zip(token_counts, limits)) if not 1 <= c <= most), None)
        if bad is not None:
            raise ValueError(f"the step returned {token_counts[bad]} tokens for sampling request {bad}, which "
                             f"may have 1..{limits[bad]}")
    elif num_tokens != n:
        raise ValueError(f"the step returned {num_tokens} tokens for {n} sampling requests")
    if num_drafts:
        if len(num_drafts) != n:
            raise ValueError(f"the step returned {len(num_drafts)} draft counts for {n} sampling requests")
        if max(num_drafts) > max_drafts:
            raise ValueError(f"the worker holds {max(num_drafts)} drafts for a request; at most {max_drafts} "
                             "are verified")

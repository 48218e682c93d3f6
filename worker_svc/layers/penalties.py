"""Repetition, presence and frequency penalties, with incremental per-request token counts.

Each request with a penalty owns one row of two device tables: which tokens its prompt holds,
and how often each token occurs in its output so far. A step gathers the rows of its batch
and adds the sampled tokens back in one scatter, so per-step work is O(batch), not O(context).
"""
from __future__ import annotations

import torch

from worker_svc.row_pool import RowPool, grown_capacity


class PenaltyTable:
    def __init__(self, vocab_size: int, device: torch.device, initial_rows: int = 8) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.rows = RowPool()
        self.prompt_mask = torch.zeros(initial_rows, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(initial_rows, vocab_size, dtype=torch.int32, device=device)

    def add(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        """A row for a new (or re-admitted) request, filled from the tokens it already has."""
        row = self.rows.acquire()
        self._ensure_capacity(self.rows.high_water)
        mask, counts = self.prompt_mask[row], self.output_counts[row]     # views: filled in place
        mask.zero_()
        mask.index_fill_(0, torch.tensor(prompt_ids, dtype=torch.long, device=self.device), True)
        if output_ids:     # a re-admitted request; a new one has none (no bincount to make)
            outputs = torch.tensor(output_ids, dtype=torch.long, device=self.device)
            counts.copy_(torch.bincount(outputs, minlength=self.vocab_size))
        else:
            counts.zero_()
        return row

    def release(self, row: int) -> None:
        self.rows.release(row)

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Counts one newly sampled token per entry (a row may repeat); `keep` (bool, per entry)
        leaves out the entries it is False for."""
        ones = torch.ones_like(token_ids, dtype=torch.int32) if keep is None else keep.to(torch.int32)
        self.output_counts.index_put_((rows, token_ids), ones, accumulate=True)

    def apply(self, logits: torch.Tensor, batch_rows: torch.Tensor, table_rows: torch.Tensor,
              repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
              preceding: torch.Tensor | None = None) -> None:
        """Penalises logits[batch_rows] in place; the penalty tensors are per batch row [n, 1].

        Repetition (transformers' semantics, over prompt and output): a seen token's logit is
        divided by the penalty when positive, multiplied when negative. Presence and frequency
        (OpenAI's, over output only): subtract presence once and frequency per occurrence.
        `preceding` [n, m] (-1 padded): output tokens not recorded yet that come before each row's
        position (the drafts before a verified position), counted as output too."""
        counts = self.output_counts[table_rows]
        if preceding is not None:
            counts.scatter_add_(1, preceding.clamp_min(0), (preceding >= 0).to(torch.int32))
        in_output = counts > 0
        seen = self.prompt_mask[table_rows] | in_output
        selected = logits[batch_rows]
        repeated = torch.where(selected > 0, selected / repetition, selected * repetition)
        selected = torch.where(seen, repeated, selected)
        logits[batch_rows] = selected - frequency * counts - presence * in_output

    def _ensure_capacity(self, needed: int) -> None:
        capacity = self.prompt_mask.shape[0]
        if needed <= capacity:
            return
        extra = grown_capacity(capacity, needed) - capacity
        self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(extra, self.vocab_size)])
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(extra, self.vocab_size)])

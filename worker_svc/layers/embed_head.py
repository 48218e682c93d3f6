"""Token embedding and LM head split by vocabulary rows across tensor-parallel ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker_svc.parallel_state import divide, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.rows_per_rank = divide(num_embeddings, self.tp_size)
        self.vocab_start = self.rows_per_rank * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.rows_per_rank))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        # Each rank embeds the ids it owns and contributes zeros for the rest.
        local = token_ids - self.vocab_start
        owned = (local >= 0) & (local < self.rows_per_rank)
        y = F.embedding(local * owned, self.weight) * owned.unsqueeze(-1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    plan = None   # linear_methods.LinearPlan, once linear_selection has chosen
    fp8 = None    # (FP8 values, float32 block scales, block) once quantize_fp8 kept them

    def operands(self):
        """What linear_methods computes the logits from."""
        from worker_svc.layers.linear_methods import LinearOperands   # imports Triton

        return LinearOperands(*self.fp8) if self.fp8 is not None else LinearOperands(self.weight)

    @torch.no_grad()
    def quantize_fp8(self, block: tuple[int, int], kernel: bool, shared: bool) -> None:
        """The head's weight in block FP8 (--lm-head-dtype fp8: the official -FP8 checkpoints keep it in
        bf16; at one row of Qwen3-8B its 1.24 GB are ~9% of an FP8 step). With `kernel` the FP8 values and
        scales are what the logits are computed from (the bf16 weight freed unless `shared` with the
        embedding); without, the head's weight becomes their dequantized values (a CPU computes what a
        GPU would). Lossy: the logits move by about FP8's rounding (docs/PERF_NOTES.md v43)."""
        from worker_svc.layers.fp8 import FP8_DTYPE, dequantize_blocks, quantize_rows_

        weight = self.weight
        rows, width = weight.shape
        values = torch.empty(rows, width, dtype=FP8_DTYPE, device=weight.device)
        scales = torch.empty(-(-rows // block[0]), -(-width // block[1]), dtype=torch.float32, device=weight.device)
        quantize_rows_(values, scales, block, lambda start, count: weight[start:start + count])
        if not kernel:   # (a copy of its own where the embedding shares the weight: the embedding stays)
            self.weight = nn.Parameter(dequantize_blocks(values, scales, block, weight.dtype), requires_grad=False)
            return
        self.fp8 = (values, scales, block)
        if not shared:
            self.weight = nn.Parameter(weight.new_empty(0, width), requires_grad=False)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the logits (its vocabulary rows)."""
        if self.plan is not None:
            return self.plan(hidden, None)
        if self.fp8 is not None:
            from worker_svc.layers.fp8 import dequantize_blocks

            return F.linear(hidden, dequantize_blocks(*self.fp8, hidden.dtype))
        return F.linear(hidden, self.weight)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's most likely token id, on every rank (a proposer's drafts): the first of equal
        maxima, as argmax over the full logits. Ranks gather each other's best value and id, not
        their logits."""
        logits = self.local_logits(hidden)
        if self.tp_size == 1:
            return logits.argmax(dim=-1)
        best, index = logits.float().max(dim=-1)
        local = torch.stack([best, (index + self.vocab_start).float()], dim=1)   # ids < 2**24: exact
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local)
        gathered = torch.stack(parts)                       # [ranks, rows, (value, id)]
        rank = gathered[:, :, 0].argmax(dim=0)              # the first rank holding the row's maximum
        return gathered[rank, torch.arange(len(rank), device=rank.device), 1].long()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full logits on rank 0, which alone samples; None on the other ranks."""
        logits = self.local_logits(hidden)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None

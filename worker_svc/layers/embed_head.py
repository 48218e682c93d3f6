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

    def operands(self):
        """What linear_methods computes the logits from."""
        from worker_svc.layers.linear_methods import LinearOperands   # imports Triton

        return LinearOperands(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full logits on rank 0, which alone samples; None on the other ranks."""
        logits = self.plan(hidden, None) if self.plan is not None else F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None

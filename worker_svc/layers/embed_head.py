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

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the logits (its vocabulary rows)."""
        return self.plan(hidden, None) if self.plan is not None else F.linear(hidden, self.weight)

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

"""Linear layers split across tensor-parallel ranks (Megatron style).

Column-parallel layers split the output features, row-parallel layers the input features
(their partial outputs are summed across ranks). Packed layers (QKV, gate+up) hold several
checkpoint tensors side by side; `shard_ids` names them so the loader can check every part
of every parameter was filled.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker_svc.parallel_state import divide, get_tp_rank, get_tp_size


class _ParallelLinear(nn.Module):
    shard_ids: tuple = (None,)   # a plain layer is filled by one checkpoint tensor

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = get_tp_rank(), get_tp_size(), tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _rank_slice(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        return loaded.chunk(self.tp_size, dim)[self.tp_rank]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(self._rank_slice(loaded, self.tp_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_ParallelLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, get_tp_size()), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(self._rank_slice(loaded, 0))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its own heads of all three."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        self.q_size = divide(num_heads, tp_size) * head_dim
        self.kv_size = divide(num_kv_heads, tp_size) * head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset, size = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }[shard_id]
        param.data.narrow(0, offset, size).copy_(self._rank_slice(loaded, 0))


class RowParallelLinear(_ParallelLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, get_tp_size()), output_size, bias, tp_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.ndim == 1:   # the bias is not split: rank 0 alone adds it
            param.data.copy_(loaded)
        else:
            super().weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y

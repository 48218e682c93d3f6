"""Linear layers split across tensor-parallel ranks (Megatron style), optionally in block FP8.

Column-parallel layers split the output features, row-parallel layers the input features
(their partial outputs are summed across ranks). Packed layers (QKV, gate+up) hold several
checkpoint tensors side by side; `shard_ids` names them so the loader can check every part
of every parameter was filled.

With an Fp8Config (worker_svc/layers/fp8.py) a layer's weight is FP8 with a `weight_scale_inv`
per block, filled together from the checkpoint's FP8 tensor (or quantized at load from a
full-precision one), and its matmul is the block-scaled FP8 GEMM; with `kernel=False` it keeps
the dequantized weight and computes like an unquantized layer. Every shard boundary (tensor
parallelism, packing) of an FP8 weight must fall on a block boundary: the layer checks that
when it is built.

A row-parallel layer built with `input_activation="silu_and_mul"` takes the packed [gate | up]
projection and multiplies silu(gate) * up itself (the MLP's down projection), so that a kernel
can apply the activation as it loads its input. On a GPU, linear_selection gives each layer a
`plan` (linear_methods.LinearPlan) that picks the fastest measured kernel for the step's row
count; without one (the CPU, or before the choice) a layer computes as described above. Where
the plan's runner for a row count takes its input quantized to FP8 (`quant_group`), the RMSNorm
before the layer quantizes its output for it (layernorm.py) and the layer gets that instead.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker_svc.layers.activation import SiluAndMul
from worker_svc.layers.fp8 import FP8_DTYPE, BlockFp8Tensor, Fp8Config, as_dense, as_fp8, fill_random_fp8_
from worker_svc.parallel_state import divide, get_tp_rank, get_tp_size

INPUT_ACTIVATIONS = ("silu_and_mul",)


class _ParallelLinear(nn.Module):
    shard_ids: tuple = (None,)   # a plain layer is filled by one checkpoint tensor
    plan = None                  # linear_methods.LinearPlan, once linear_selection has chosen
    norm_fed = False             # the model feeds it an RMSNorm's output (RMSNorm.forward's `into`)

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int,
                 quant: Fp8Config | None = None, input_activation: str | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = get_tp_rank(), get_tp_size(), tp_dim
        self.quant = quant
        if input_activation is not None and input_activation not in INPUT_ACTIVATIONS:
            raise ValueError(f"input_activation {input_activation!r} is not one of {', '.join(INPUT_ACTIVATIONS)}")
        self.act_fn = SiluAndMul() if input_activation is not None else None
        fp8 = quant is not None and quant.kernel
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8_DTYPE if fp8 else None),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if fp8:
            bn, bk = quant.block
            self._check_fp8_shape(output_size, input_size)
            self.weight_scale_inv = nn.Parameter(
                torch.empty(-(-output_size // bn), input_size // bk, dtype=torch.float32), requires_grad=False)
            self.weight_scale_inv.shard_ids = ()   # filled with the weight, never on its own
            self.weight.init_dummy = self._init_dummy_fp8
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _init_dummy_fp8(self, generator: torch.Generator, std: float) -> None:
        fill_random_fp8_(self.weight.data, self.weight_scale_inv.data, self.quant.block, generator, std)

    def _check_fp8_shape(self, output_size: int, input_size: int) -> None:
        """The FP8 GEMM quantizes activations in groups of whole blocks, and a shard must start
        on a block boundary."""
        bn, bk = self.quant.block
        if input_size % bk:
            raise ValueError(f"an FP8 layer's input width per rank ({input_size}) must be a multiple of its "
                             f"{bk}-column blocks")
        if self.tp_size > 1 and self.tp_dim == 0 and output_size % bn:
            raise ValueError(f"an FP8 layer's output rows per rank ({output_size}) must be a multiple of its "
                             f"{bn}-row blocks to be split over {self.tp_size} ranks")

    def _rank_slice(self, loaded, dim: int):
        return loaded.chunk(self.tp_size, dim)[self.tp_rank]

    def _row_offset(self, shard_id) -> int:
        """Where this checkpoint part's rows start in the (packed) weight."""
        return 0

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | BlockFp8Tensor, shard_id=None) -> None:
        offset = self._row_offset(shard_id)
        if param is self.bias:   # the bias is not split by row-parallel layers: rank 0 alone adds it
            part = loaded if self.tp_dim == 1 else self._rank_slice(loaded, 0)
            param.data.narrow(0, offset, part.shape[0]).copy_(part)
        elif param.dtype == FP8_DTYPE:
            if isinstance(loaded, torch.Tensor):   # quantized where the layer lives (fast on a GPU)
                loaded = loaded.to(param.device)
            part = self._rank_slice(as_fp8(loaded, self.quant.block), self.tp_dim)
            param.data.narrow(0, offset, part.shape[0]).copy_(part.values)
            bn = self.quant.block[0]
            if offset % bn:
                raise ValueError(f"a packed part starting at row {offset} splits the FP8 weight's {bn}-row blocks")
            self.weight_scale_inv.data.narrow(0, offset // bn, part.scale_inv.shape[0]).copy_(part.scale_inv)
        else:
            # Dequantized (or quantized and back) before the split: no block alignment needed.
            part = self._rank_slice(as_dense(loaded, param.dtype, self.quant), self.tp_dim)
            param.data.narrow(0, offset, part.shape[0]).copy_(part)

    def operands(self):
        """What linear_methods computes this layer's product from."""
        from worker_svc.layers.linear_methods import LinearOperands   # imports Triton

        fp8 = self.weight.dtype == FP8_DTYPE
        return LinearOperands(self.weight, self.weight_scale_inv if fp8 else None, self.quant.block if fp8 else None,
                              silu_mul=self.act_fn is not None, norm_fed=self.norm_fed)

    def quant_group(self, num_rows: int) -> int | None:
        """The column group of the FP8 quantization this layer takes its input in at num_rows
        rows (then an fp8_kernels.Fp8Activation), or None: the model dtype."""
        return self.plan.quant_group(num_rows) if self.plan is not None else None

    def takes_norm(self, num_rows: int) -> bool:
        """Whether at num_rows rows this layer computes the RMSNorm before it itself (its input
        then a linear_methods.NormedInput: the norm's weight, the residual and x)."""
        return self.plan is not None and self.plan.takes_norm(num_rows)

    def _matmul(self, x, bias: torch.Tensor | None) -> torch.Tensor:
        if self.plan is not None:
            return self.plan(x, bias)
        if self.act_fn is not None:
            x = self.act_fn(x)
        if self.weight.dtype == FP8_DTYPE:
            from worker_svc.layers import fp8_kernels   # imports Triton

            return fp8_kernels.fp8_linear(x, self.weight, self.weight_scale_inv, self.quant.block, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(_ParallelLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant: Fp8Config | None = None) -> None:
        super().__init__(input_size, divide(output_size, get_tp_size()), bias, tp_dim=0, quant=quant)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant: Fp8Config | None = None) -> None:
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))
        if quant is not None and quant.kernel:
            _check_parts_whole_blocks([divide(s, get_tp_size()) for s in output_sizes], quant)
        super().__init__(input_size, sum(output_sizes), bias, quant)

    def _row_offset(self, shard_id) -> int:
        return sum(self.output_sizes[:shard_id]) // self.tp_size


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its own heads of all three."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 quant: Fp8Config | None = None) -> None:
        tp_size = get_tp_size()
        self.q_size = divide(num_heads, tp_size) * head_dim
        self.kv_size = divide(num_kv_heads, tp_size) * head_dim
        if quant is not None and quant.kernel:
            _check_parts_whole_blocks([self.q_size, self.kv_size], quant)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, quant)

    def _row_offset(self, shard_id) -> int:
        return {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard_id]


class RowParallelLinear(_ParallelLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant: Fp8Config | None = None,
                 input_activation: str | None = None) -> None:
        """input_activation "silu_and_mul": the input is [gate | up], each input_size wide."""
        super().__init__(divide(input_size, get_tp_size()), output_size, bias, tp_dim=1, quant=quant,
                         input_activation=input_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


def _check_parts_whole_blocks(part_rows: list[int], quant: Fp8Config) -> None:
    bn = quant.block[0]
    if any(rows % bn for rows in part_rows):
        raise ValueError(f"packed FP8 projections of {part_rows} rows per rank do not fall on the {bn}-row "
                         "blocks of their scales")

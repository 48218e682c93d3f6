"""The fused MoE path (Triton): routing, tokens sorted by expert, and grouped GEMMs over the
stacked expert weights, all on the device.

For T tokens with top-k experts each there are n = T * k (token, expert) assignments,
numbered token * k + slot. One MoE block is:
1. `route_topk`: softmax over the router logits, top-k, optional renormalisation (one program
   per token), as worker_svc.layers.moe.route computes it.
2. `sort_by_expert`: a counting sort of the assignments by expert into `sorted_ids`, each
   expert's run padded to a multiple of BLOCK_M with the sentinel n, and `block_expert` naming
   the expert of every BLOCK_M-row block. At most cdiv(n, BLOCK_M) + min(E, n) blocks can be
   non-empty, so every buffer and grid is sized by n alone; the blocks actually used
   (`num_padded`) stay on the device and surplus programs return at once. No host sync
   anywhere: a decode step is capturable in a CUDA graph.
3. `grouped_gemm` twice: each program multiplies one block of rows (gathered through
   sorted_ids) by one column tile of its expert's weight. First [gate | up] = x @ w13[e]^T
   into one row per assignment, then SwiGLU (fused_kernels.silu_and_mul), then
   (act @ w2[e]^T) * routing weight, and the k rows of each token are summed.
Roundings follow the reference loop (moe.moe_reference) where it rounds to the model dtype,
except that a token's k expert outputs are summed in float32 and rounded once.
With FP8 experts (block scales, fp8.py) the products are scaled per weight block, and the
activations either stay in the model dtype against the dequantized expert tile (`weight_only`:
decode, where few rows reach each expert and the weight read is all that counts) or are
quantized per token group as the GEMM loads them (FP8 x FP8 on the tensor cores, no separate
quantization kernel); `fp8_activations` picks, by rows per expert unless told. Weight-only with
bfloat16 activations takes each FP8 weight as a bfloat16 by moving its bits (gemv_kernels.
fp8_bits_as_bf16: no conversion instruction, the same product bit for bit; WORKER_MOE_FP8_BITS=0
converts instead, for comparisons).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from worker_svc.layers import fused_kernels
from worker_svc.layers.fp8 import FP8_MAX, MIN_AMAX
from worker_svc.layers.fp8_kernels import _quantize_tile, per_token_group_quant
from worker_svc.layers.gemv_kernels import BITS_SUM_SCALE, BITS_X_SCALE, fp8_bits_as_bf16

FP8_ACTIVATIONS = ("weight_only", "on_load", "given")
# FP8 x FP8 on tiles Hopper's wgmma takes e4m3 from: Triton runs the 16- and 32-row blocks of a
# decode step on mma.sync in f16, converting every weight and activation element first (PERF_NOTES
# v41), where wgmma multiplies e4m3 from 64-row operands. Modes of their own (the activations as the
# mode without the suffix takes them), which moe_selection times beside the others at start-up:
# "_m64" pads each expert's rows to 64-row blocks; "_swap" keeps 16-row blocks and swaps the dot (the
# weight tile as the 64-row operand, the block's rows as the narrow one). Quantizing on load is left
# out on 64-row blocks: a 64 x 128 activation tile quantized every K step (the census: 14
# instructions per weight element, against 2.1 for the swapped dot of activations quantized first).
MODE_TILES = {"_m64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),
              "_swap": dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, SWAP_AB=True)}
WIDE_MODES = ("given_m64", "on_load_swap", "given_swap")
_FP8_MAX, _MIN_AMAX = tl.constexpr(FP8_MAX), tl.constexpr(MIN_AMAX)   # globals a kernel may read
# Rows per expert up to which FP8 experts multiply bf16 activations (weight-only) by default; past
# it the activations are quantized as loaded. WORKER_MOE_FP8_WEIGHT_ONLY_ROWS sets it (0: always
# FP8 x FP8, which converts no weights: the A/B of PERF_NOTES v37).
WEIGHT_ONLY_MAX_ROWS_PER_EXPERT = float(os.environ.get("WORKER_MOE_FP8_WEIGHT_ONLY_ROWS", "16"))
# Weight-only FP8 experts with bfloat16 activations: weights by their bits (0: converted, the A/B of v38).
WEIGHT_BITS = os.environ.get("WORKER_MOE_FP8_BITS", "1") != "0"


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, num_experts,
                       TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, E_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + token * stride_l + experts, mask=experts < num_experts,
                     other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    slots = tl.arange(0, K_PAD)
    chosen_probs = tl.zeros((K_PAD,), dtype=tl.float32)
    chosen_ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for slot in tl.static_range(TOP_K):   # k rounds of arg-max, each taking its winner out
        best = tl.max(probs, axis=0)
        best_id = tl.min(tl.where(probs == best, experts, E_PAD), axis=0)
        chosen_probs = tl.where(slots == slot, best, chosen_probs)
        chosen_ids = tl.where(slots == slot, best_id, chosen_ids)
        probs = tl.where(experts == best_id, -1.0, probs)
    if RENORMALIZE:
        chosen_probs = chosen_probs / tl.sum(chosen_probs, axis=0)
    mask = slots < TOP_K
    tl.store(weights_ptr + token * TOP_K + slots, chosen_probs.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids, mask=mask)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in the logits' dtype, expert ids [T, top_k] int32)."""
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(-1) == 1
    weights = torch.empty(num_tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _route_topk_kernel[(num_tokens,)](
            router_logits, weights, ids, router_logits.stride(0), num_experts, TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, E_PAD=triton.next_power_of_2(num_experts),
            num_warps=4 if num_experts > 256 else 1,
        )
    return weights, ids


_SORT_BLOCK = 1024   # assignments per program of the counting and scattering kernels


@triton.jit(do_not_specialize=["num_assignments"])
def _count_kernel(ids_ptr, counts_ptr, num_assignments, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_assignments
    experts = tl.load(ids_ptr + offs, mask=mask, other=0)
    tl.atomic_add(counts_ptr + experts, 1, mask=mask)


@triton.jit(do_not_specialize=["num_assignments", "max_blocks"])
def _offsets_kernel(counts_ptr, cursor_ptr, block_expert_ptr, sorted_ids_ptr, num_padded_ptr,
                    num_experts, num_assignments, max_blocks,
                    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    expert_mask = experts < num_experts
    counts = tl.load(counts_ptr + experts, mask=expert_mask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + experts, ends - padded, mask=expert_mask)   # where each expert's rows start
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # Block b holds expert e's rows when e experts end at or before its first row. Blocks past
    # the last expert name the last one: their rows are all sentinels.
    for first in range(0, max_blocks, CHUNK):
        blocks = first + tl.arange(0, CHUNK)
        ended = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & expert_mask[None, :]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts - 1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < max_blocks)
    for first in range(0, max_blocks * BLOCK_M, CHUNK * BLOCK_M):
        rows = first + tl.arange(0, CHUNK * BLOCK_M)
        tl.store(sorted_ids_ptr + rows, num_assignments, mask=rows < max_blocks * BLOCK_M)


@triton.jit(do_not_specialize=["num_assignments"])
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, num_assignments, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_assignments
    experts = tl.load(ids_ptr + offs, mask=mask, other=0)
    # Rows of one expert land in any order: each output row depends on its own input row only.
    rows = tl.atomic_add(cursor_ptr + experts, 1, mask=mask)
    tl.store(sorted_ids_ptr + rows, offs, mask=mask)


def max_blocks(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Blocks that can hold rows: each used expert wastes less than one block to padding."""
    return triton.cdiv(num_assignments, block_m) + min(num_experts, num_assignments)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [max_blocks * block_m], block_expert int32 [max_blocks], num_padded
    int32 [1]): assignment ids grouped by expert, each group padded with the sentinel
    topk_ids.numel() to whole blocks; the expert of each block; how many rows are in use."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    blocks = max_blocks(n, num_experts, block_m)
    device = topk_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    grid = (triton.cdiv(n, _SORT_BLOCK),)
    _count_kernel[grid](flat, counts, n, BLOCK=_SORT_BLOCK)
    _offsets_kernel[(1,)](counts, cursor, block_expert, sorted_ids, num_padded, num_experts, n, blocks,
                          E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=64)
    _scatter_kernel[grid](flat, cursor, sorted_ids, n, BLOCK=_SORT_BLOCK)
    return sorted_ids, block_expert, num_padded


@triton.jit(do_not_specialize=["num_assignments"])
def _grouped_gemm_kernel(
    a_ptr, a_s_ptr, b_ptr, b_s_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_assignments,
    stride_am, stride_as, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm,
    A_ROW_DIVISOR: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, FP8: tl.constexpr, FP8_ACTIVATIONS: tl.constexpr,
    GROUP_N: tl.constexpr, DOT_PRECISION: tl.constexpr, WEIGHT_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr = False,
):
    # SWAP_AB (FP8 x FP8): the dot takes the weight tile as its 64-row operand and the block's rows as
    # the narrow one, so Hopper's wgmma multiplies e4m3 without padding the rows to 64 (PERF_NOTES v41).
    tl.static_assert(not SWAP_AB or (FP8 and FP8_ACTIVATIONS != "weight_only"), "the swapped dot is FP8 x FP8")
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return   # a block past the last expert's rows
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))   # assignment ids
    row_mask = rows < num_assignments
    a_rows = (rows // A_ROW_DIVISOR).to(tl.int64)   # x has a row per token, later inputs one per assignment
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:   # K is whole groups of BLOCK_K; one scale per row and group, per column and group
            b_s = tl.load(b_s_ptr + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn + k // BLOCK_K,
                          mask=n_mask, other=0.0)
            if FP8_ACTIVATIONS == "weight_only" and WEIGHT_BITS:   # bfloat16 a: b 2^-120 of itself, a x 2^64
                scaled = (a.to(tl.float32) * BITS_X_SCALE).to(tl.bfloat16)
                acc += tl.dot(scaled, fp8_bits_as_bf16(b)) * (b_s * BITS_SUM_SCALE)[None, :]
            elif FP8_ACTIVATIONS == "weight_only":
                acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION) * b_s[None, :]
            else:
                if FP8_ACTIVATIONS == "on_load":
                    a, a_s = _quantize_tile(a.to(tl.float32), _FP8_MAX, _MIN_AMAX)
                else:
                    a_s = tl.load(a_s_ptr + a_rows * stride_as + k // BLOCK_K, mask=row_mask, other=0.0)
                if SWAP_AB:
                    acc += tl.dot(tl.trans(b), tl.trans(a)) * b_s[:, None] * a_s[None, :]
                else:
                    acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    out_dtype = c_ptr.dtype.element_ty
    if MUL_ROUTED_WEIGHT:   # as the reference: the projection rounded, then times the weight
        weight = tl.load(topk_weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc.to(out_dtype).to(tl.float32) * weight[:, None]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(out_dtype), mask=row_mask[:, None] & n_mask[None, :])


def moe_config(num_assignments: int, num_experts: int, fp8_block_k: int | None = None) -> dict:
    """Tile sizes by the rows an expert gets on average: decode gives each expert a few rows
    (thin blocks, the weights' read dominates); prefill gives it hundreds (square tiles)."""
    per_expert = num_assignments / max(num_experts, 1)
    if per_expert <= 16:
        config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif per_expert <= 64:
        config = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif per_expert <= 256:
        config = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)
    else:
        config = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    if fp8_block_k is not None:
        config["BLOCK_K"] = fp8_block_k   # one activation and weight scale per K step
    return config


def grouped_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, top_k: int, config: dict, *,
                 a_per_token: bool, topk_weights: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                 fp8_activations: str = "given") -> None:
    """out[r] = a[r // top_k if a_per_token else r] @ weight[expert of r]^T (times the routing
    weight of r when topk_weights is given), for every assignment r listed in sorted_ids. FP8
    weights (weight_scale): a is FP8 with a_scale ("given"), or in the model dtype and used as
    it is ("weight_only") or quantized as loaded ("on_load")."""
    num_assignments = out.shape[0]
    num_experts, num_cols, width = weight.shape
    fp8 = weight_scale is not None
    assert fp8_activations in FP8_ACTIVATIONS and (a_scale is not None) == (fp8 and fp8_activations == "given")
    block_k = config["BLOCK_K"] if fp8 else max(16, min(config["BLOCK_K"], triton.next_power_of_2(width)))
    assert weight.stride(-1) == 1 and a.stride(-1) == 1 and out.stride(-1) == 1
    grid = (block_expert.shape[0] * triton.cdiv(num_cols, config["BLOCK_N"]),)
    _grouped_gemm_kernel[grid](
        a, a_scale if a_scale is not None else a, weight, weight_scale if fp8 else weight, out,
        topk_weights if topk_weights is not None else out, sorted_ids, block_expert, num_padded,
        num_cols, width, num_assignments,
        a.stride(0), a_scale.stride(0) if a_scale is not None else 0, weight.stride(0), weight.stride(1),
        weight_scale.stride(0) if fp8 else 0, weight_scale.stride(1) if fp8 else 0, out.stride(0),
        A_ROW_DIVISOR=top_k if a_per_token else 1, MUL_ROUTED_WEIGHT=topk_weights is not None, FP8=fp8,
        FP8_ACTIVATIONS=fp8_activations,
        GROUP_N=block[0] if fp8 else 1, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        WEIGHT_BITS=WEIGHT_BITS and fp8 and fp8_activations == "weight_only" and a.dtype == torch.bfloat16,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=block_k, SWAP_AB=config.get("SWAP_AB", False),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def default_fp8_activations(num_assignments: int, num_experts: int) -> str:
    """Weight-only while few rows reach each expert (decode), else FP8 x FP8 quantized on load."""
    per_expert = num_assignments / max(num_experts, 1)
    return "weight_only" if per_expert <= WEIGHT_ONLY_MAX_ROWS_PER_EXPERT else "on_load"


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                  config: dict | None = None, fp8_activations: str | None = None) -> torch.Tensor:
    """moe.moe_reference's result for x [T, H] routed to topk_ids [T, k] with topk_weights.
    FP8 experts take the activations as `fp8_activations` says (FP8_ACTIVATIONS; "given":
    quantized by per_token_group_quant first; or one of WIDE_MODES: the same on wgmma's tiles),
    by default_fp8_activations unless told."""
    num_tokens, top_k = topk_ids.shape
    num_experts, width13, _ = w13.shape
    hidden = w2.shape[1]
    n = num_tokens * top_k
    if n == 0:
        return torch.zeros_like(x)
    fp8 = w13_scale is not None
    mode = (fp8_activations or default_fp8_activations(n, num_experts)) if fp8 else "given"
    if mode in WIDE_MODES:   # the activations as the plain mode takes them, on the suffix's tiles
        suffix = next(suffix for suffix in MODE_TILES if mode.endswith(suffix))
        mode = mode.removesuffix(suffix)
        config = config or {**MODE_TILES[suffix], "BLOCK_K": block[1]}
    config = config or moe_config(n, num_experts, block[1] if fp8 else None)
    sorted_ids, block_expert, num_padded = sort_by_expert(topk_ids, num_experts, config["BLOCK_M"])
    x = x if x.stride(-1) == 1 else x.contiguous()
    routing = (sorted_ids, block_expert, num_padded, top_k, config)
    fp8_args = dict(block=block, fp8_activations=mode)

    gate_up = torch.empty(n, width13, dtype=x.dtype, device=x.device)
    x_q, x_scale = per_token_group_quant(x, block[1]) if fp8 and mode == "given" else (x, None)
    grouped_gemm(x_q, w13, gate_up, *routing, a_per_token=True, a_scale=x_scale, weight_scale=w13_scale, **fp8_args)
    act = fused_kernels.silu_and_mul(gate_up)
    act_q, act_scale = per_token_group_quant(act, block[1]) if fp8 and mode == "given" else (act, None)
    down = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    grouped_gemm(act_q, w2, down, *routing, a_per_token=False, topk_weights=topk_weights.reshape(-1),
                 a_scale=act_scale, weight_scale=w2_scale, **fp8_args)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, *, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None, fp8_activations: str | None = None) -> torch.Tensor:
    """The sparse MoE block's experts for x [T, H] given its router logits [T, E]."""
    topk_weights, topk_ids = route_topk(router_logits, top_k, renormalize)
    return fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale, block=block,
                         fp8_activations=fp8_activations)

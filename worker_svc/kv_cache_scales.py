"""The FP8 KV cache's scales (one per layer and kv head, see layers/attention/kv_quant.py): the
checkpoint's where it carries them, otherwise a bound that no K or V value can exceed, derived
from the weights.

Checkpoint: vLLM's names for per-layer K/V scales, each a scalar (per tensor) or one value per kv
head: `model.layers.N.self_attn.{k_proj.k_scale, v_proj.v_scale}` (ModelOpt),
`model.layers.N.self_attn.{k_scale, v_scale}` (compressed-tensors), `...self_attn.attn.{k,v}_scale`,
and the older `...self_attn.kv_scale` (both). As in vLLM, a stored value times the scale is the
K/V value. A layer the checkpoint gives no scale gets the bound.

The bound, instead of vLLM's 1.0 or a calibration pass: Qwen3 normalises every K head, so with
x̂ the RMS-normalised head (|x̂| <= sqrt(head_dim)) and w the k_norm weight, each rotated element
is at most max|w| * sqrt(head_dim) * the RoPE table's largest |cos|, |sin|. V = W_v (g * ĥ) with
ĥ the RMS-normalised hidden state (|ĥ| <= sqrt(hidden)) and g the input norm's weight, so by
Cauchy-Schwarz |v_j| <= sqrt(hidden) * |W_v[j] * g| + |bias_j|. The scale maps that bound (plus a
2% margin for the model dtype's rounding) to e4m3's 448: nothing saturates, whatever the input,
and no calibration data is needed. The cost is range: typical values sit 10-100x below the bound,
still far inside e4m3's normal range (2^-6..448, relative step 1/16 throughout), so the precision
is that of a calibrated scale. The bound is per kv head, computed from this rank's own weights, so
it is the same on every tensor-parallel rank and on every restart.
"""
from __future__ import annotations

import logging
import math
import pathlib
import re

import torch
from safetensors import safe_open
from torch import nn

from worker_svc.layers.attention.kv_quant import FP8_KV_MAX, KVScales, is_fp8
from worker_svc.parallel_state import get_tp_rank, get_tp_size

logger = logging.getLogger(__name__)

# model.layers.N.self_attn.<...>_scale: group 1 the layer, group 2 which (k, v, kv)
KV_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:k_proj\.(k)|v_proj\.(v)|(?:attn\.)?(kv|k|v))_scale$")
# Activation scales some FP8 exports carry beside them, which this worker does not use.
_UNUSED_ATTENTION_SCALE = re.compile(r"^model\.layers\.\d+\.self_attn\.(?:q_proj\.|attn\.)?(?:q|prob)_scale$")
BOUND_MARGIN = 1.02
_ROWS_PER_PASS = 256   # one-hot rows pushed through a projection at once


def is_attention_scale(name: str) -> bool:
    """A checkpoint tensor that scales the KV cache or the attention's activations, rather than
    a weight of the model: the weight loader passes over these."""
    return bool(KV_SCALE_NAME.match(name) or _UNUSED_ATTENTION_SCALE.match(name))


def checkpoint_kv_scales(files: list[pathlib.Path], num_layers: int) -> dict[int, dict[str, torch.Tensor]]:
    """layer -> {"k": scale, "v": scale} (float32, scalar or one per kv head of the whole model)
    for every layer the checkpoint's files give scales to."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                match = KV_SCALE_NAME.match(name)
                if match is None or int(match[1]) >= num_layers:
                    continue
                which = next(g for g in match.groups()[1:] if g)
                value = handle.get_tensor(name).float().reshape(-1)
                for part in ("k", "v") if which == "kv" else (which,):
                    found.setdefault(int(match[1]), {})[part] = value
    return found


def _rank_heads(scale: torch.Tensor, total_kv_heads: int, name: str) -> torch.Tensor:
    """A checkpoint scale as this rank's per-head vector."""
    local = total_kv_heads // get_tp_size()
    if scale.numel() == 1:
        return scale.expand(local).clone()
    if scale.numel() != total_kv_heads:
        raise ValueError(f"{name} has {scale.numel()} values: a KV-cache scale is one number or one per kv head "
                         f"({total_kv_heads})")
    return scale[get_tp_rank() * local:(get_tp_rank() + 1) * local].clone()


@torch.inference_mode()
def bound_kv_scales(layer: nn.Module, rope_amplitude: float) -> KVScales:
    """The bound's scales (module docstring) for one Qwen3 decoder layer on this rank: it holds
    input_layernorm and self_attn (qkv_proj, k_norm, num_heads, num_kv_heads, head_dim)."""
    attn = layer.self_attn
    head_dim, num_heads, num_kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads
    k_bound = attn.k_norm.weight.float().abs().max() * math.sqrt(head_dim) * rope_amplitude
    v_start, v_size = (num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim   # [q | k | v]
    v_norms = _value_row_norms(attn.qkv_proj, layer.input_layernorm.weight, v_start, v_size)
    hidden = layer.input_layernorm.weight.shape[0]
    v_rows = v_norms * math.sqrt(hidden)
    bias = attn.qkv_proj.bias
    if bias is not None:
        v_rows = v_rows + bias.float()[v_start:v_start + v_size].abs()
    v_bound = v_rows.view(num_kv_heads, head_dim).amax(dim=1)
    to_scale = BOUND_MARGIN / FP8_KV_MAX
    k = (k_bound * to_scale).expand(num_kv_heads).clamp_min(torch.finfo(torch.float32).tiny)
    v = (v_bound * to_scale).clamp_min(torch.finfo(torch.float32).tiny)
    return KVScales.of(k, v)


def _value_row_norms(qkv_proj: nn.Module, norm_weight: torch.Tensor, v_start: int, v_size: int) -> torch.Tensor:
    """|W_v[j] * g| for each of this rank's value rows j: the projection, as a black box (any
    weight format), applied to the rows of diag(g), less its bias."""
    hidden = norm_weight.shape[0]
    bias = qkv_proj.bias
    squares = torch.zeros(v_size, dtype=torch.float32, device=norm_weight.device)
    for start in range(0, hidden, _ROWS_PER_PASS):
        rows = min(_ROWS_PER_PASS, hidden - start)
        x = torch.zeros(rows, hidden, dtype=norm_weight.dtype, device=norm_weight.device)
        x[torch.arange(rows), torch.arange(start, start + rows)] = norm_weight[start:start + rows]
        columns = qkv_proj(x)[:, v_start:v_start + v_size].float()
        if bias is not None:
            columns = columns - bias.float()[v_start:v_start + v_size]
        squares += columns.square().sum(dim=0)
    return squares.sqrt()


def bind_kv_scales(model: nn.Module, cache_dtype: torch.dtype, checkpoint_files: list[pathlib.Path]) -> None:
    """Gives every attention layer its KVScales for an FP8 cache (None otherwise): from the
    checkpoint where it has them, else the weights' bound. Call after the weights are loaded."""
    layers = model.model.layers
    if not is_fp8(cache_dtype):
        for layer in layers:
            layer.self_attn.attn.kv_scales = None
        return
    stored = checkpoint_kv_scales(checkpoint_files, len(layers))
    rope_amplitude = float(model.model.rotary_emb.cos_sin.abs().max())
    total_kv_heads = model.config.num_key_value_heads
    for i, layer in enumerate(layers):
        bound = bound_kv_scales(layer, rope_amplitude)
        given = stored.get(i, {})
        device = bound.k.device
        k = _rank_heads(given["k"], total_kv_heads, f"layer {i}'s k_scale").to(device) if "k" in given else bound.k
        v = _rank_heads(given["v"], total_kv_heads, f"layer {i}'s v_scale").to(device) if "v" in given else bound.v
        layer.self_attn.attn.kv_scales = KVScales.of(k, v)
    logger.info("fp8 KV cache: scales of %d of %d layers from the checkpoint, the rest bounded by the weights",
                len(stored), len(layers))

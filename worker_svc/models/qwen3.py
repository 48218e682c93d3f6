"""Qwen3ForCausalLM (dense) over a flat batch of tokens from many requests.

Tokens of all requests in a step are concatenated ([num_tokens, hidden]); which request each
token belongs to, and where its K/V live, is in the AttentionMetadata. Projections are
tensor-parallel (heads split across ranks) with q/k/v and gate/up packed into one matmul each,
and block FP8 when the model is built with an Fp8Config (each layer is told its checkpoint
names, so that `modules_to_not_convert` can exempt it). Qwen3-MoE (models/qwen3_moe.py) is this
model with a sparse MLP in some layers: `_mlp` is where the two differ.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from worker_svc.layers.attention import AttentionBackend, AttentionMetadata
from worker_svc.layers.attention.layer import PagedAttention
from worker_svc.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from worker_svc.layers.fp8 import Fp8Config
from worker_svc.layers.layernorm import RMSNorm
from worker_svc.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker_svc.layers.rotary import RotaryEmbedding, attend_qkv, inverse_frequencies
from worker_svc.parallel_state import divide, get_tp_size


def head_dim_of(config) -> int:
    """Qwen3 may set head_dim explicitly (Qwen3-0.6B: 128 with hidden 1024 and 16 heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen3Attention(nn.Module):
    def __init__(self, config, backend: AttentionBackend, prefix: str = "", quant: Fp8Config | None = None) -> None:
        super().__init__()
        tp_size = get_tp_size()
        self.head_dim = head_dim_of(config)
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_kv_heads = divide(config.num_key_value_heads, tp_size)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=bias,
            quant=_layer_quant(quant, prefix, "q_proj", "k_proj", "v_proj"),
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        quant=_layer_quant(quant, prefix, "o_proj"))
        # Qwen3 normalises each head's q and k before RoPE.
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = PagedAttention(backend, scale=self.head_dim ** -0.5)

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = attend_qkv(self.qkv_proj(hidden), self.q_norm, self.k_norm, cos_sin, self.attn, meta,
                         self.num_heads, self.num_kv_heads)
        return self.o_proj(out.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, config, prefix: str = "", quant: Fp8Config | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen3 uses silu, this checkpoint asks for {config.hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       quant=_layer_quant(quant, prefix, "gate_proj", "up_proj"))
        # SwiGLU is the down projection's input activation: a kernel can apply it as it loads.
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           quant=_layer_quant(quant, prefix, "down_proj"),
                                           input_activation="silu_and_mul")
    @property
    def input_linear(self) -> MergedColumnParallelLinear:
        """The projection that takes the MLP's input (the norm before it feeds it: layernorm.py's `into`)."""
        return self.gate_up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config, backend: AttentionBackend, mlp: nn.Module, prefix: str = "",
                 quant: Fp8Config | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, backend, f"{prefix}.self_attn", quant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = mlp
        for linear in (self.self_attn.qkv_proj, getattr(mlp, "input_linear", None)):   # what the norms feed
            if linear is not None:
                linear.norm_fed = True

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it). Each residual add is done
        by the norm that follows it (one kernel on CUDA), in the model dtype as the reference adds;
        each norm is told the projection it feeds, which may take its output quantized to FP8."""
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:
            hidden, residual = self.input_layernorm(hidden, into=qkv_proj), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, into=qkv_proj)
        hidden = self.self_attn(hidden, cos_sin, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, into=getattr(self.mlp, "input_linear", None))
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    def __init__(self, config, backend: AttentionBackend, max_position: int, quant: Fp8Config | None,
                 make_mlp: Callable[[int, str], nn.Module]) -> None:
        """make_mlp(layer index, module prefix): that layer's MLP."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, backend, make_mlp(i, f"model.layers.{i}.mlp"), f"model.layers.{i}", quant)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(*inverse_frequencies(config, head_dim_of(config)), max_position)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                aux_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Final hidden states; with aux_layers, also the residual stream entering each of those
        layers (what an EAGLE-3 head reads), in their order."""
        cos_sin = self.rotary_emb(positions)   # looked up once, shared by every layer
        hidden, residual = self.embed_tokens(input_ids), None
        entering = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                entering[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, cos_sin, meta)
        hidden = self.norm(hidden, residual)[0]
        return (hidden, [entering[i] for i in aux_layers]) if aux_layers else hidden


class Qwen3ForCausalLM(nn.Module):
    # checkpoint projection -> (packed parameter, its part); the loader maps names through this.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, backend: AttentionBackend, max_position: int | None = None,
                 quant: Fp8Config | None = None) -> None:
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported (no released Qwen3 model uses it)")
        self.config = config
        self.quant_config = quant   # the loader reads FP8 checkpoints' block size from here
        self.model = Qwen3Model(config, backend, max_position or config.max_position_embeddings, quant,
                                lambda i, prefix: self._mlp(config, i, prefix, quant))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                aux_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Final hidden states of every token: [num_tokens, hidden] (and, with aux_layers, the
        hidden states entering those layers: Qwen3Model.forward)."""
        return self.model(input_ids, positions, meta, aux_layers)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor | None:
        """Logits of the rows that sample only: [len(logits_indices), vocab], on tensor-parallel
        rank 0 (which samples); None on the other ranks."""
        return self.lm_head(hidden[logits_indices])

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @staticmethod
    def _mlp(config, layer_idx: int, prefix: str, quant: Fp8Config | None) -> nn.Module:
        return Qwen3MLP(config, prefix, quant)


def _layer_quant(quant: Fp8Config | None, prefix: str, *projections: str) -> Fp8Config | None:
    """The quantization of the layer that packs these checkpoint projections under `prefix`."""
    return quant.for_modules(*(f"{prefix}.{p}" for p in projections)) if quant is not None else None

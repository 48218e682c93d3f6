"""An EAGLE-3 draft head in the published layout (LlamaForCausalLMEagle3, as the Qwen3 heads of
AngelSlim, SpecForge and NVIDIA ship it): `fc` maps the target's low, middle and high hidden
states (concatenated) to one hidden state; one Llama decoder layer (`midlayer`, no q/k norm)
attends over [input_layernorm(embed(token)), hidden_norm(hidden)], so its q/k/v take twice the
hidden width; its own `norm` and `lm_head` over a reduced draft vocabulary whose id i is target
id i + d2t[i]. The token embedding is the checkpoint's `embed_tokens`, else the target's.

At position p the head reads the target's hidden state of p and the token at p + 1, and predicts
the token at p + 2; its pre-norm output is the hidden state it reads at p + 1 when it drafts on.
"""
from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace

import torch
from torch import nn

from worker_svc.layers.attention import AttentionBackend, AttentionMetadata
from worker_svc.layers.attention.layer import PagedAttention
from worker_svc.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from worker_svc.layers.layernorm import RMSNorm
from worker_svc.layers.linear import QKVParallelLinear, RowParallelLinear
from worker_svc.loader import expected_parts
from worker_svc.layers.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies
from worker_svc.models.qwen3 import Qwen3MLP
from worker_svc.parallel_state import divide, get_tp_size

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "num_hidden_layers": 1,
             "rope_theta": 10000.0, "rope_scaling": None}
# checkpoint projection -> (packed parameter, its part)
_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_eagle3_config(head_dir: str | pathlib.Path, target_config) -> SimpleNamespace:
    """The head's config.json as attributes, checked against the target's config: `aux_layers`
    (eagle_config.eagle_aux_hidden_state_layer_ids, else vLLM's default (2, n // 2, n - 3) of
    the target's n layers), `draft_vocab_size` and `target_hidden_size` filled in."""
    path = pathlib.Path(head_dir) / "config.json"
    raw = json.loads(path.read_text())
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    if not set(raw.get("architectures") or ()) & set(ARCHITECTURES):
        raise ValueError(f"{path}: architectures {raw.get('architectures')} is not an EAGLE-3 head ({ARCHITECTURES})")
    config = SimpleNamespace(**(_DEFAULTS | raw))
    if config.num_hidden_layers != 1:
        raise ValueError(f"{path}: num_hidden_layers {config.num_hidden_layers}; EAGLE-3 heads have one layer")
    config.num_key_value_heads = raw.get("num_key_value_heads") or config.num_attention_heads
    config.head_dim = raw.get("head_dim") or config.hidden_size // config.num_attention_heads
    config.draft_vocab_size = raw.get("draft_vocab_size") or config.vocab_size
    config.target_hidden_size = raw.get("target_hidden_size") or config.hidden_size
    n = target_config.num_hidden_layers
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3)
    config.aux_layers = tuple(int(i) for i in ids)
    if len(config.aux_layers) != 3 or not all(0 <= i < n for i in config.aux_layers):
        raise ValueError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids must be 3 layers of the target's "
                         f"0..{n - 1}, got {list(config.aux_layers)}")
    for key, want in (("vocab_size", target_config.vocab_size), ("target_hidden_size", target_config.hidden_size)):
        if getattr(config, key) != want:
            raise ValueError(f"{path}: {key} {getattr(config, key)} differs from the target's {want}")
    return config


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read [embeds | hidden], 2 * hidden_size wide."""

    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        tp_size = get_tp_size()
        self.head_dim = config.head_dim
        self.num_heads = divide(config.num_attention_heads, tp_size)      # this rank's
        self.num_kv_heads = divide(config.num_key_value_heads, tp_size)
        self.qkv_proj = QKVParallelLinear(2 * config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias)
        self.attn = PagedAttention(backend, scale=self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        sizes = [n * self.head_dim for n in (self.num_heads, self.num_kv_heads, self.num_kv_heads)]
        q, k, v = self.qkv_proj(x).split(sizes, dim=-1)
        q = apply_rotary(q.reshape(-1, self.num_heads, self.head_dim), cos_sin)
        k = apply_rotary(k.reshape(-1, self.num_kv_heads, self.head_dim), cos_sin)
        out = self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim).contiguous(), meta)
        return self.o_proj(out.flatten(1))


class Eagle3Layer(nn.Module):
    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, the residual before it); the residual stream starts at `hidden`."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(x, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    def __init__(self, config, backend: AttentionBackend, max_position: int, own_embeddings: bool) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config, backend)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.draft_vocab_size, config.hidden_size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if own_embeddings else None
        self.rotary_emb = RotaryEmbedding(*inverse_frequencies(config, config.head_dim), max_position)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self._shared_embed: list[nn.Module] = []   # the target's, when the checkpoint has none (not a submodule)

    def share_embeddings(self, embed: nn.Module) -> None:
        self._shared_embed = [embed]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._shared_embed[0])(token_ids)

    def combine(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """The target's low/mid/high hidden states [tokens, target hidden] as one hidden state."""
        return self.fc(torch.cat(aux, dim=-1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed hidden states for the LM head, pre-norm hidden states to draft on from)."""
        x, residual = self.midlayer(self.embed(input_ids), hidden, self.rotary_emb(positions), meta)
        return self.norm(x, residual)

    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The most likely target token ids of each row: the draft vocabulary's argmax, mapped."""
        draft_ids = self.lm_head.greedy(normed)
        return draft_ids + self.d2t[draft_ids]

    def attention_layers(self) -> list[PagedAttention]:
        return [self.midlayer.self_attn.attn]


def eagle3_checkpoint(head_dir: str | pathlib.Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's checkpoint (*.safetensors, else pytorch_model.bin), under the
    published names (a "model." prefix and SpecForge's "layers.0." read as "midlayer.")."""
    head_dir = pathlib.Path(head_dir)
    files = sorted(head_dir.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors.update(load_file(file))
    elif (head_dir / "pytorch_model.bin").is_file():
        tensors = torch.load(head_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin in {head_dir}")
    return {name.removeprefix("model.").replace("layers.0.", "midlayer."): t for name, t in tensors.items()}


def load_eagle3_weights(head: Eagle3Head, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Fills the head from its checkpoint's tensors; ValueError names what does not fit or lacks."""
    params = dict(head.named_parameters())
    filled = set()
    for name, tensor in tensors.items():
        if name == "t2d":
            continue   # the inverse map; drafting needs d2t only
        if name == "d2t":
            head.d2t.copy_(tensor.to(torch.int64))
            continue
        target, shard = name, None
        for part, (packed, shard_id) in _PACKED.items():
            if f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{packed}."), shard_id
        if target not in params:
            raise ValueError(f"{source}: weight {name!r} has no place in an EAGLE-3 head")
        param = params[target]
        loader = getattr(param, "weight_loader", None)
        loader(param, tensor, shard) if loader is not None else param.data.copy_(tensor)
        filled.add((target, shard))
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected_parts(head) - filled)
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} weights, e.g. {', '.join(missing[:6])}")
    if "d2t" not in tensors and head.config.draft_vocab_size != head.config.vocab_size:
        raise ValueError(f"{source}: a draft vocabulary of {head.config.draft_vocab_size} ids needs its d2t map")

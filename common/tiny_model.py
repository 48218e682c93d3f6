"""Writes a small Qwen3 checkpoint with seeded random weights, in Hugging Face format.

It is the embedded default model of the demo and the tests, so neither needs a download:
config.json, generation_config.json, model.safetensors and a byte-level BPE tokenizer
(tokenizer.json, tokenizer_config.json, chat_template.jinja) that transformers' AutoTokenizer
loads. The tokenizer is shaped like Qwen3's: the same special and added tokens (chat turns,
<think> reasoning, <tool_call> blocks), Qwen3's own chat template (tools and the enable_thinking
switch), and fewer ids than the model's vocab_size, so the padded embedding rows that real Qwen3
checkpoints have (151669 tokens, 151936 rows) exist here too.
Same arguments => byte-identical weights and tokenizer.

    python -m common.tiny_model --out models/tiny-qwen3 [--kind moe|fp8|moe-fp8|draft|eagle3]
"""
from __future__ import annotations

import json
import pathlib
import sys

from common.cli import ArgumentParser

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added after the BPE vocabulary, as in Qwen3, and like Qwen3 not special: they mark structure
# in the model's text (reasoning, tool calls, tool results) and survive skip_special_tokens, so
# the chat output parser sees them whatever the request asks.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# Embedding rows past the tokenizer's last id (Qwen3 pads its vocabulary to a multiple of 128).
PADDED_ROWS = 8
CHAT_TEMPLATE_PATH = pathlib.Path(__file__).with_name("qwen3_chat_template.jinja")
# A fixed English corpus, so the BPE merges (and so the token ids) never change.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A scheduler batches requests, allocates blocks
of the key-value cache and streams tokens back to every client as soon as they are sampled.
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Special cases aren't special enough to break the rules. Although
practicality beats purity. Errors should never pass silently. Unless explicitly silenced.
In the face of ambiguity, refuse the temptation to guess. There should be one obvious way to
do it. Now is better than never. If the implementation is hard to explain, it's a bad idea.
Hello world! Once upon a time there was a model that answered questions about the weather,
numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000, and code such as def main(): return 42.
"""


def build_tokenizer(vocab_size: int):
    """A byte-level BPE trained on the fixed corpus: every string encodes, every id decodes.
    Its `vocab_size` ids are the special tokens, the bytes and the merges (the first ids of a
    larger vocab_size's training, so a token's id does not depend on the size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer


def save_tiny_tokenizer(out: pathlib.Path, vocab_size: int = 512):
    """Writes the embedded tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja)
    into `out`, so any model directory, a config-only one too, gets a tokenizer that transformers
    loads. It has PADDED_ROWS fewer ids than the model's `vocab_size`. Returns the trained
    `tokenizers.Tokenizer`, added tokens included."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    num_bpe = vocab_size - len(ADDED_TOKENS) - PADDED_ROWS
    tokenizer = build_tokenizer(num_bpe)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in ADDED_TOKENS])
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size={vocab_size}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE_PATH.read_text().rstrip("\n"),   # as Qwen3 ships it
    )
    fast.save_pretrained(out)
    return tokenizer


def _qwen3_fields(*, vocab_size: int = 512, hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                  num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32, max_position_embeddings: int = 4096,
                  tie_word_embeddings: bool = True, init_std: float = 0.25) -> dict:
    """The config fields of every tiny model, by transformers' names. The defaults exercise GQA
    (4:2) and a head_dim that is not hidden_size / num_heads, as Qwen3 allows."""
    return dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                tie_word_embeddings=tie_word_embeddings, initializer_range=init_std)


def write_tiny_qwen3(out: pathlib.Path, *, seed: int = 0, **shape) -> pathlib.Path:
    """Writes the checkpoint into `out` and returns it; `shape` takes _qwen3_fields' arguments."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _write_checkpoint(out, Qwen3Config, Qwen3ForCausalLM, seed=seed, **_qwen3_fields(**shape))


def _write_checkpoint(out: pathlib.Path, config_class, model_class, *, seed: int, vocab_size: int,
                      **config_fields) -> pathlib.Path:
    """The tiny tokenizer, a seeded float32 model of config_class(**config_fields) and a greedy
    generation config, written into `out`."""
    import torch

    tokenizer = save_tiny_tokenizer(out, vocab_size)
    eos_ids = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    config = config_class(vocab_size=vocab_size, rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=None,
                          eos_token_id=eos_ids[0], pad_token_id=eos_ids[1], **config_fields)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_ids, "pad_token_id": eos_ids[1], "do_sample": False}, indent=2) + "\n"
    )
    return out


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m common.tiny_model", description=__doc__,
                            env_prefix="QWEN3_SERVE_TINY_MODEL_")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("models/tiny-qwen3"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--untied", action="store_true", help="separate lm_head weights")
    parser.add_argument("--kind", choices=["dense", "moe", "fp8", "moe-fp8", "draft", "eagle3"], default="dense",
                        help="dense Qwen3, Qwen3-MoE, or either in the block-FP8 checkpoint format; draft: a dense model "
                             "with the same tokenizer, to draft for another (pick --seed and --num-layers); eagle3: "
                             "an EAGLE-3 head for the default dense model")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shape = {name: getattr(args, name) for name in ("seed", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                                    "hidden_size")}
    TINY_KINDS[args.kind](args.out, tie_word_embeddings=not args.untied, **shape)
    print(f"wrote tiny Qwen3 checkpoint ({args.kind}) to {args.out}")
    return 0


# --- Qwen3-MoE and block-FP8 variants (for the MoE and FP8 paths' tests and the demo) ---------

def write_tiny_qwen3_moe(
    out: pathlib.Path,
    *,
    seed: int = 0,
    num_layers: int = 4,
    moe_intermediate_size: int = 32,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple[int, ...] = (0,),
    norm_topk_prob: bool = True,
    **shape,
) -> pathlib.Path:
    """A tiny Qwen3MoeForCausalLM checkpoint in `out` (transformers writes the per-expert
    layout, mlp.experts.{i}.gate_proj/up_proj/down_proj and mlp.gate, as the released models
    have it); `shape` takes _qwen3_fields' other arguments. The defaults mix a dense layer
    (mlp_only_layers) with sparse ones; same arguments => identical weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _write_checkpoint(
        out, Qwen3MoeConfig, Qwen3MoeForCausalLM, seed=seed, moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=list(mlp_only_layers), norm_topk_prob=norm_topk_prob,
        **_qwen3_fields(num_layers=num_layers, **shape))


# The linear layers the official -FP8 checkpoints quantize: attention, dense MLP and expert
# projections. Embeddings, the LM head, norms and the MoE router stay in full precision.
_FP8_WEIGHT = r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight"
FP8_MAX = 448.0   # largest float8_e4m3fn


def quantize_fp8_blocks(weight, block: tuple[int, int]):
    """(float8_e4m3fn values, float32 weight_scale_inv) of a 2-D weight: each block of
    block[0] rows x block[1] columns is divided by its largest magnitude / 448. Written block by
    block, plainly, as the format's reference (the worker has its own vectorised quantizer)."""
    import torch

    rows, cols = weight.shape
    bn, bk = block
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // bn), -(-cols // bk), dtype=torch.float32)
    for i in range(0, rows, bn):
        for j in range(0, cols, bk):
            piece = weight[i:i + bn, j:j + bk].float()
            scale = piece.abs().max().clamp_min(1e-12) / FP8_MAX
            values[i:i + bn, j:j + bk] = (piece / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            scales[i // bn, j // bk] = scale
    return values, scales


def write_tiny_qwen3_fp8(out: pathlib.Path, *, moe: bool = False, weight_block_size: tuple[int, int] = (32, 32),
                         **model_args) -> pathlib.Path:
    """A tiny checkpoint in the official -FP8 layout: the dense (or, with `moe`, the MoE) tiny
    model's linear layers as float8_e4m3fn `weight` + float32 `weight_scale_inv` per block, and
    config.json's quantization_config. The blocks are smaller than the released [128, 128] so
    that a tiny model's weights hold several of them (and its shards stay whole blocks)."""
    import re

    from safetensors.torch import load_file, save_file

    (write_tiny_qwen3_moe if moe else write_tiny_qwen3)(out, **model_args)
    tensors = load_file(out / "model.safetensors")
    quantized = {}
    for name, tensor in tensors.items():
        if re.fullmatch(_FP8_WEIGHT, name):
            quantized[name], quantized[name + "_scale_inv"] = quantize_fp8_blocks(tensor, weight_block_size)
        else:
            quantized[name] = tensor
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(weight_block_size)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# --- speculative decoding's proposers: a draft model and an EAGLE-3 head for the tiny model ------

def write_tiny_draft(out: pathlib.Path, *, seed: int = 1, num_layers: int = 1, **model_args) -> pathlib.Path:
    """A second tiny Qwen3 with the tiny model's tokenizer and vocabulary (other weights, one
    layer): the draft model of the tiny model."""
    return write_tiny_qwen3(out, seed=seed, num_layers=num_layers, **model_args)


def write_tiny_eagle3(out: pathlib.Path, *, seed: int = 0, vocab_size: int = 512, hidden_size: int = 64,
                      intermediate_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
                      draft_vocab_size: int = 256, aux_layer_ids: tuple[int, int, int] = (0, 1, 1),
                      embed_tokens: bool = False, init_std: float = 0.25, **_) -> pathlib.Path:
    """A random EAGLE-3 head for the tiny model in the published layout (LlamaForCausalLMEagle3's
    config.json keys; midlayer.*, fc, norm, lm_head, d2t and t2d tensors; embed_tokens only with
    `embed_tokens`): its draft vocabulary is a seeded sorted subset of the target's ids, and its
    aux layers (the tiny model has two) are named in eagle_config. Same arguments => same bytes."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * init_std

    tensors = {f"midlayer.self_attn.{p}_proj.weight": rand(n * head_dim, 2 * hidden_size) for p, n in heads.items()}
    tensors["midlayer.self_attn.o_proj.weight"] = rand(hidden_size, num_heads * head_dim)
    tensors |= {f"midlayer.mlp.{p}_proj.weight": rand(intermediate_size, hidden_size) for p in ("gate", "up")}
    tensors["midlayer.mlp.down_proj.weight"] = rand(hidden_size, intermediate_size)
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden_size, generator=generator)
    tensors["fc.weight"] = rand(hidden_size, 3 * hidden_size)
    tensors["lm_head.weight"] = rand(draft_vocab_size, hidden_size)
    if embed_tokens:
        tensors["embed_tokens.weight"] = rand(vocab_size, hidden_size)
    kept = torch.randperm(vocab_size, generator=generator)[:draft_vocab_size].sort().values
    tensors["d2t"] = kept - torch.arange(draft_vocab_size)
    tensors["t2d"] = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, kept, True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "attention_bias": False,
              "hidden_act": "silu", "hidden_size": hidden_size, "intermediate_size": intermediate_size,
              "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
              "num_hidden_layers": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
              "rope_theta": 1_000_000.0, "rope_scaling": None, "tie_word_embeddings": False,
              "torch_dtype": "float32", "vocab_size": vocab_size, "draft_vocab_size": draft_vocab_size,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


TINY_KINDS = {"dense": write_tiny_qwen3, "moe": write_tiny_qwen3_moe,
              "fp8": write_tiny_qwen3_fp8, "moe-fp8": lambda out, **kw: write_tiny_qwen3_fp8(out, moe=True, **kw),
              "draft": write_tiny_draft, "eagle3": write_tiny_eagle3}


if __name__ == "__main__":
    sys.exit(main())

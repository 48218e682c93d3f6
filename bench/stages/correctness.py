"""Stage correctness: the service's greedy tokens (from the service stage) against transformers
bf16 over the first CORRECTNESS_TOKENS tokens, and the engine's logits against transformers fp32
and bf16 on the same prompts. The engine's logits come from one varlen prefill by the worker's own
ModelRunner (its model, weights loader and attention backend). The FP8 KV cache's row: the same
engine over an FP8 cache, its logits against the bf16 cache's and transformers fp32, and its
greedy tokens (the in-process engine) against transformers bf16. The FP8 LM head's row likewise
(--lm-head-dtype fp8: the head's weight quantized at load, lossy)."""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

from bench.options import max_token_id, model_dir

REQUIRES = ("checkpoint",)
CORRECTNESS_PROMPTS = 4
CORRECTNESS_TOKENS = 32


def correctness_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randint(0, max_token_id(args)) for _ in range(rng.randint(16, 64))]
            for _ in range(CORRECTNESS_PROMPTS)]


def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    prompts = correctness_prompts(args)
    service_file = args.out / "service.json"
    service = json.loads(service_file.read_text()).get("result", {}) if service_file.exists() else {}
    result: dict = {}
    references, hf_greedy = {}, []
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(model_dir(args), dtype=dtype).to(args.device).eval()
        with torch.inference_mode():
            references[dtype] = [model(torch.tensor([p], device=args.device)).logits[0].float() for p in prompts]
            if dtype is torch.bfloat16:
                hf_greedy = _hf_greedy(model, prompts, args.device)
                if service.get("greedy"):
                    result.update(greedy_match(service["greedy"], hf_greedy))
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    ours = engine_logits(model_dir(args), prompts, device=args.device, attention_backend=args.attention_backend)
    fp32, bf16 = references[torch.float32], references[torch.bfloat16]
    result["engine_vs_hf_fp32"] = logits_agreement(ours, fp32)
    result["hf_bf16_vs_hf_fp32"] = logits_agreement(bf16, fp32)
    result["engine_vs_hf_bf16"] = logits_agreement(ours, bf16)
    for name, option in (("fp8_kv", {"kv_cache_dtype": "fp8"}), ("fp8_head", {"lm_head_dtype": "fp8"})):
        variant = engine_logits(model_dir(args), prompts, device=args.device, attention_backend=args.attention_backend,
                                **option)
        result[f"engine_{name}_vs_engine"] = logits_agreement(variant, ours)
        result[f"engine_{name}_vs_hf_fp32"] = logits_agreement(variant, fp32)
        greedy = engine_greedy(model_dir(args), prompts, device=args.device, attention_backend=args.attention_backend,
                               **option)
        result[f"{name}_greedy"] = greedy_match(greedy, hf_greedy)
    return result


def engine_greedy(path: pathlib.Path, prompts: list[list[int]], *, device: str, attention_backend: str,
                  kv_cache_dtype: str = "auto", lm_head_dtype: str = "auto") -> list[list[int]]:
    """The in-process engine's greedy first CORRECTNESS_TOKENS tokens of each prompt."""
    from common.sampling import SamplingParams
    from tools.offline import LLM

    llm = LLM(str(path), device=device, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype,
              lm_head_dtype=lm_head_dtype, max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + CORRECTNESS_TOKENS + 16,
              num_kv_blocks=sum(-(-(len(p) + CORRECTNESS_TOKENS) // 16) + 1 for p in prompts) + 8)
    return llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=CORRECTNESS_TOKENS))


def _hf_greedy(model, prompts: list[list[int]], device: str) -> list[list[int]]:
    import torch

    greedy = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=CORRECTNESS_TOKENS, min_new_tokens=CORRECTNESS_TOKENS, pad_token_id=0)
        greedy.append(out[0, len(p):].tolist())
    return greedy


def greedy_match(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """Positional match rate, and how many leading tokens agree before the first difference."""
    positions = sum(len(r) for r in reference)
    same = sum(a == b for o, r in zip(ours, reference) for a, b in zip(o, r))
    leading = []
    for o, r in zip(ours, reference):
        n = 0
        while n < min(len(o), len(r)) and o[n] == r[n]:
            n += 1
        leading.append(n)
    return {"greedy_match_rate": same / positions, "greedy_leading_matches": leading}


def logits_agreement(ours: list, reference: list) -> dict:
    import torch

    a, b = torch.cat(ours).double(), torch.cat(reference).double()
    return {"relative_error": ((a - b).norm() / b.norm()).item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).double().mean().item()}


def prefill_metadata(prompt_lens: list[int], block_size: int, device):
    """A batch of fresh prompts, each in its own run of consecutive blocks."""
    import torch

    from worker_svc.layers.attention.base import AttentionMetadata

    blocks = [-(-n // block_size) for n in prompt_lens]
    tables = torch.zeros(len(prompt_lens), max(blocks), dtype=torch.int32)
    slots, first = [], 0
    for i, (n, b) in enumerate(zip(prompt_lens, blocks)):
        tables[i, :b] = torch.arange(first, first + b, dtype=torch.int32)
        slots.append(torch.arange(n) + first * block_size)
        first += b
    starts = torch.tensor([0, *prompt_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device), query_start_loc=starts.to(device),
        seq_lens=torch.tensor(prompt_lens, dtype=torch.int32, device=device), block_tables=tables.to(device),
        max_query_len=max(prompt_lens), max_seq_len=max(prompt_lens),
        query_lens_cpu=list(prompt_lens), seq_lens_cpu=list(prompt_lens))


def engine_logits(path: pathlib.Path, prompts: list[list[int]], *, device: str = "cuda",
                  attention_backend: str = "auto", dtype: str = "bfloat16", kv_cache_dtype: str = "auto",
                  lm_head_dtype: str = "auto") -> list:
    """float32 logits [len(prompt), vocab] per prompt (every attention reads its K/V back from a
    cache of kv_cache_dtype; the LM head in lm_head_dtype)."""
    import torch

    from worker_svc.config import WorkerConfig
    from worker_svc.model_runner import ModelRunner

    lens = [len(p) for p in prompts]
    # Enough blocks for any block size of 16 tokens or more (the runner picks it per backend).
    runner = ModelRunner(WorkerConfig(model=str(path), device=device, dtype=dtype,
                                      attention_backend=attention_backend, enforce_eager=True,
                                      kv_cache_dtype=kv_cache_dtype, lm_head_dtype=lm_head_dtype, num_kv_blocks=sum(-(-n // 16) for n in lens) + 1))
    meta = prefill_metadata(lens, runner.block_size, runner.device)
    with torch.inference_mode():
        input_ids = torch.tensor([t for p in prompts for t in p], device=runner.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(runner.device)
        hidden = runner.model(input_ids, positions, meta)
        logits = runner.model.compute_logits(hidden, torch.arange(len(input_ids), device=runner.device)).float()
    return list(logits.split(lens))


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    c = results["correctness"]["result"]
    print("\ncorrectness (bf16 engine vs transformers on the same random weights)")
    if "greedy_match_rate" in c:
        print(f"  greedy, first {CORRECTNESS_TOKENS} tokens vs transformers bf16: match rate "
              f"{c['greedy_match_rate']:.1%}, leading matches {c['greedy_leading_matches']}")
    for key in ("engine_vs_hf_fp32", "hf_bf16_vs_hf_fp32", "engine_vs_hf_bf16", "engine_fp8_kv_vs_engine",
                "engine_fp8_kv_vs_hf_fp32", "engine_fp8_head_vs_engine", "engine_fp8_head_vs_hf_fp32"):
        if key in c:
            print(f"  logits {key:26s} relative error {c[key]['relative_error']:.2e}, "
                  f"top-1 agreement {c[key]['top1_agreement']:.1%}")
    for key, what in (("fp8_kv_greedy", "fp8 KV cache"), ("fp8_head_greedy", "fp8 LM head")):
        if key in c:
            g = c[key]
            print(f"  {what}: greedy, first {CORRECTNESS_TOKENS} tokens vs transformers bf16: match rate "
                  f"{g['greedy_match_rate']:.1%}, leading matches {g['greedy_leading_matches']}")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))

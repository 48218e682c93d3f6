"""GPU benchmark of the Qwen3-MoE and block-FP8 paths, one command, each number against its floor.

Stages (each in its own subprocess, so each gets the whole GPU and a failure costs only its row;
each writes OUT/<stage>.json, and the tables are printed from whatever JSON OUT holds):
  bandwidth    device copy bandwidth (read + write), bf16 and FP8 matmul rates, for the floors
  moe_kernel   one Qwen3-30B-A3B MoE layer (128 experts, top-8, hidden 2048, width 768, bf16):
               the fused Triton path vs the reference expert loop at batch 1, 64, 256 (median
               time, largest difference), and the floor of reading the experts the batch touches
  fp8_gemm     Qwen3-8B's four projections at the decode batch: bf16 F.linear vs the FP8 path
               (token-group quantization + block-scaled GEMM), and a few tile shapes for the GEMM
  moe_e2e      Qwen3-30B-A3B's config with random bf16 weights (load_format dummy) through the
               in-process engine (scheduler_svc.offline.LLM) on nano-vllm's bench.py workload:
               output tok/s against its floor
  decode_*     Qwen3-0.6B and Qwen3-8B configs, bf16 and --quantization fp8 (dummy weights):
               decode tok/s at batch 256 (two runs of the same shape, one with a single output
               token: their difference is the decode time) against the floor of each

Floors (analytic, with the rates measured here): a decode step reads the attention and dense
weights, the experts its batch touches (per MoE layer E * (1 - (1 - k/E)^B) of them for B
tokens routed uniformly at random, as random weights route), the LM head, and the KV of every
running sequence, or computes 2 FLOPs per active weight and token, whichever takes longer;
prefill computes 2 FLOPs per active weight per prompt token plus causal attention. FP8 weights
are 1 byte (plus a float32 scale per 128 x 128 block) and multiply at the FP8 rate.

    PYTHONUNBUFFERED=1 python -m bench.moe_fp8_bench --out /tmp/moe-fp8       # H200: < 6 minutes
    python -m bench.moe_fp8_bench --out /tmp/moe-fp8-cpu --device cpu --tiny   # smoke test, tiny configs
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = {"moe": "qwen3-30b-a3b.json", "0.6b": "qwen3-0.6b.json", "8b": "qwen3-8b.json"}
DECODE_STAGES = {f"decode_{size}_{q}": (size, q) for size in ("0.6b", "8b") for q in ("bf16", "fp8")}
STAGES = ("bandwidth", "moe_kernel", "fp8_gemm", "moe_e2e", *DECODE_STAGES)
FP8_BLOCK = (128, 128)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True, help="results (one JSON per stage and all.json), logs")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {','.join(STAGES)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny configs and workload (a CPU smoke test)")
    p.add_argument("--num-requests", type=int, default=256, help="moe_e2e: requests of the bench.py workload")
    p.add_argument("--kernel-batches", default="1,64,256")
    p.add_argument("--decode-batch", type=int, default=256)
    p.add_argument("--decode-prompt", type=int, default=32,
                   help="prompt tokens of each decode-stage request (short: the step is then about the weights)")
    p.add_argument("--decode-steps", type=int, default=128, help="decode steps timed in the decode stages")
    p.add_argument("--stage-timeout", type=float, default=300.0)
    p.add_argument("--run-stage", choices=STAGES, help=argparse.SUPPRESS)   # the subprocess side
    return p.parse_args(argv)


# --- model directories and shapes ---------------------------------------------------------------

def model_dir(args: argparse.Namespace, name: str) -> pathlib.Path:
    """Config + tokenizer (no weights: the stages load dummy weights), written once per OUT."""
    out = args.out / "models" / name
    if (out / "config.json").exists():
        return out
    if args.tiny:
        from common.tiny_model import write_tiny_qwen3, write_tiny_qwen3_moe

        if name == "moe":
            write_tiny_qwen3_moe(out, num_experts=16, num_experts_per_tok=4, mlp_only_layers=())
        else:
            write_tiny_qwen3(out, hidden_size=64 if name == "0.6b" else 128, num_layers=2)
    else:
        from bench.model_dirs import write_config_dir

        write_config_dir(out, REPO / "configs" / CONFIGS[name])
    return out


def load_config(args: argparse.Namespace, name: str) -> dict:
    return json.loads((model_dir(args, name) / "config.json").read_text())


def num_experts(config: dict) -> int:
    return config.get("num_experts", config.get("num_local_experts", 0))


def sparse_layers(config: dict) -> list[bool]:
    step, mlp_only = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
    return [config.get("model_type") == "qwen3_moe" and num_experts(config) > 0 and i not in mlp_only
            and (i + 1) % step == 0 for i in range(config["num_hidden_layers"])]


def expected_touched(num_tokens: int, experts: int, top_k: int) -> float:
    """Distinct experts that num_tokens uniformly routed tokens select, in expectation."""
    return experts * (1 - (1 - top_k / experts) ** num_tokens) if experts else 0.0


class Shape:
    """Weight counts of a Qwen3 / Qwen3-MoE config, split into what every token reads and what
    only the experts it is routed to read."""

    def __init__(self, config: dict, fp8: bool = False) -> None:
        self.config, self.fp8 = config, fp8
        h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or h // heads
        q, kv_width = heads * self.head_dim, kv * self.head_dim
        self.layers = config["num_hidden_layers"]
        self.sparse = sparse_layers(config)
        self.attention_linear = h * (q + 2 * kv_width) + q * h          # per layer, quantizable
        self.dense_mlp_linear = 3 * h * config["intermediate_size"]
        self.expert_linear = 3 * h * config.get("moe_intermediate_size", 0)
        self.experts, self.top_k = num_experts(config), config.get("num_experts_per_tok", 0)
        self.router = self.experts * h
        self.small = 2 * self.head_dim + 2 * h                          # q/k norms, layer norms
        self.lm_head = config["vocab_size"] * h
        self.kv_bytes_per_token = 2 * self.layers * kv_width * 2        # bf16 K and V

    def linear_bytes(self, params: float) -> float:
        return params * (1 + 4 / (FP8_BLOCK[0] * FP8_BLOCK[1])) if self.fp8 else params * 2

    @property
    def num_sparse(self) -> int:
        return sum(self.sparse)

    @property
    def shared_linear(self) -> int:
        """Linear weights every token uses: attention and the dense MLPs."""
        return self.layers * self.attention_linear + (self.layers - self.num_sparse) * self.dense_mlp_linear

    def step_bytes(self, num_tokens: int) -> float:
        """Weights a forward over num_tokens tokens reads (KV excluded)."""
        touched = expected_touched(num_tokens, self.experts, self.top_k)
        linear = self.linear_bytes(self.shared_linear + self.num_sparse * touched * self.expert_linear)
        return linear + 2 * (self.num_sparse * self.router + self.layers * self.small + self.lm_head)

    def active_linear(self) -> int:
        """Linear weights one token multiplies (its k experts, not all of them)."""
        return self.shared_linear + self.num_sparse * (self.top_k * self.expert_linear + self.router)

    def step_flops(self, num_tokens: int) -> tuple[float, float]:
        """(FLOPs at the linear layers' rate, FLOPs at the bf16 rate: the LM head)."""
        return 2 * num_tokens * self.active_linear(), 2 * num_tokens * self.lm_head

    def prefill_flops(self, prompt_len: int) -> float:
        attention = 4 * self.layers * self.config["num_attention_heads"] * self.head_dim * prompt_len * (prompt_len + 1) / 2
        return 2 * prompt_len * self.active_linear() + attention


def decode_step_floor_s(shape: Shape, batch: int, kv_tokens: float, rates: dict) -> float:
    memory = (shape.step_bytes(batch) + kv_tokens * shape.kv_bytes_per_token) / rates["copy_bytes_per_s"]
    linear_flops, head_flops = shape.step_flops(batch)
    linear_rate = rates["fp8_flops_per_s"] if shape.fp8 else rates["bf16_flops_per_s"]
    return max(memory, linear_flops / linear_rate + head_flops / rates["bf16_flops_per_s"])


# --- stages (each runs in its own process and returns its JSON result) ---------------------------

def _timer(device: str):
    """A function timing fn() (median seconds), on the GPU with Triton's do_bench."""
    import torch

    if device.startswith("cuda"):
        import triton.testing

        return lambda fn, rep=200: triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e-3

    def cpu_time(fn, rep=0):   # the interpreted kernels take seconds: a few runs are enough
        fn()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return cpu_time


def stage_bandwidth(args: argparse.Namespace) -> dict:
    import torch

    timed = _timer(args.device)
    size = (2 << 30) if args.device.startswith("cuda") else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=args.device).random_()
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    del src, dst
    n = 8192 if args.device.startswith("cuda") else 512
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    a, b = (torch.randn(n, n, device=args.device).to(dtype) for _ in range(2))
    bf16_rate = 2 * n ** 3 / timed(lambda: a @ b)
    fp8_rate, fp8_how = 2 * bf16_rate, "assumed 2x bf16"
    if args.device.startswith("cuda"):
        try:   # cuBLAS FP8 with per-tensor scales: the hardware's FP8 rate
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
            one = torch.ones((), device=args.device)
            fp8_rate = 2 * n ** 3 / timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
            fp8_how = "torch._scaled_mm"
        except Exception as exc:  # recorded: the FP8 floor then assumes twice the bf16 rate
            fp8_how = f"assumed 2x bf16 ({type(exc).__name__}: {exc})"[:200]
    return {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "copy_bytes_per_s": 2 * size / copy_s, "bf16_flops_per_s": bf16_rate, "fp8_flops_per_s": fp8_rate,
            "fp8_rate_from": fp8_how}


def stage_moe_kernel(args: argparse.Namespace) -> dict:
    import contextlib

    import torch

    if args.device == "cpu":   # the kernels run under Triton's interpreter, patched to behave like a GPU
        from tests.support.triton_interpreter import gpu_faithful
    else:
        gpu_faithful = contextlib.nullcontext
    with gpu_faithful():
        return _moe_kernel_rows(args)


def _moe_kernel_rows(args: argparse.Namespace) -> dict:
    import torch

    from worker_svc.layers import moe, moe_kernels

    config = load_config(args, "moe")
    shape = Shape(config)
    experts, top_k = shape.experts, shape.top_k
    hidden, width = config["hidden_size"], config["moe_intermediate_size"]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    g = torch.Generator(device=args.device).manual_seed(0)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=g, device=args.device) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=g, device=args.device) * 0.02).to(dtype)
    gate = (torch.randn(experts, hidden, generator=g, device=args.device) * 0.02).to(dtype)
    timed = _timer(args.device)
    rows = []
    for batch in [int(b) for b in args.kernel_batches.split(",")]:
        x = torch.randn(batch, hidden, generator=g, device=args.device).to(dtype)
        logits = x @ gate.T

        def fused():
            return moe_kernels.fused_moe(x, logits, w13, w2, top_k, True)

        def reference():
            weights, ids = moe.route(logits, top_k, True)
            return moe.moe_reference(x, w13, w2, weights, ids)

        expected, actual = reference(), fused()
        touched = len(torch.unique(moe.route(logits, top_k, True)[1]))
        error = (actual.float() - expected.float()).abs().max().item()
        fused_s, reference_s = timed(fused), timed(reference, rep=50)
        rows.append({"batch": batch, "fused_s": fused_s, "reference_s": reference_s, "max_abs_error": error,
                     "output_max": expected.float().abs().max().item(), "touched_experts": touched,
                     "expected_touched": expected_touched(batch, experts, top_k),
                     "touched_bytes": touched * 3 * hidden * width * w13.element_size()})
    return {"rows": rows, "experts": experts, "top_k": top_k, "hidden": hidden, "width": width}


# Tile shapes tried for the FP8 GEMM besides fp8_kernels' own choice (the best is reported).
FP8_GEMM_CONFIGS = [dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4),
                    dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3),
                    dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=4),
                    dict(BLOCK_M=128, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=3)]


def stage_fp8_gemm(args: argparse.Namespace) -> dict:
    import contextlib

    if args.device == "cpu":
        from tests.support.triton_interpreter import gpu_faithful
    else:
        gpu_faithful = contextlib.nullcontext
    with gpu_faithful():
        return _fp8_gemm_rows(args)


def _fp8_gemm_rows(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    from worker_svc.layers import fp8_kernels
    from worker_svc.layers.fp8 import quantize_blocks

    config = load_config(args, "8b")
    h, i = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config.get("head_dim", 128), config["num_key_value_heads"] * config.get("head_dim", 128)
    rows_count = 8 if args.tiny else args.decode_batch
    block = (32, 32) if args.tiny else FP8_BLOCK
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    timed = _timer(args.device)
    g = torch.Generator(device=args.device).manual_seed(0)
    rows = []
    for name, (cols, width) in {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}.items():
        weight = torch.randn(cols, width, generator=g, device=args.device).to(dtype) * 0.02
        w8, scale = quantize_blocks(weight, block)
        x = torch.randn(rows_count, width, generator=g, device=args.device).to(dtype)
        x8, x_scale = fp8_kernels.per_token_group_quant(x, block[1])
        bf16_s = timed(lambda: F.linear(x, weight))
        fp8_s = timed(lambda: fp8_kernels.fp8_linear(x, w8, scale, block))
        quant_s = timed(lambda: fp8_kernels.per_token_group_quant(x, block[1]))
        sweep = []
        for candidate in FP8_GEMM_CONFIGS[:1] if args.tiny else FP8_GEMM_CONFIGS:   # interpreted: one is enough
            try:
                sweep.append((timed(lambda: fp8_kernels.block_fp8_matmul(x8, x_scale, w8, scale, block, dtype,
                                                                         config=candidate)), candidate))
            except Exception as exc:   # e.g. out of shared memory: that shape is simply not a candidate
                print(f"{name}: {candidate} failed: {exc}", file=sys.stderr)
        best_s, best = min(sweep, key=lambda c: c[0]) if sweep else (None, None)
        rows.append({"name": name, "rows": rows_count, "cols": cols, "width": width, "bf16_s": bf16_s, "fp8_s": fp8_s,
                     "quant_s": quant_s, "default_config": fp8_kernels._matmul_config(rows_count),
                     "best_gemm_s": best_s, "best_config": best,
                     "bf16_bytes": cols * width * 2, "fp8_bytes": cols * width})
    return {"rows": rows}


def _llm(args: argparse.Namespace, name: str, **options):
    from tools.offline import LLM

    return LLM(str(model_dir(args, name)), device=args.device, load_format="dummy", **options)


def stage_moe_e2e(args: argparse.Namespace) -> dict:
    from bench.workload import nano_vllm_workload
    from common.sampling import SamplingParams

    config = load_config(args, "moe")
    if args.tiny:
        load = nano_vllm_workload(8, 8, 48, 48, max_token_id=config["vocab_size"] - 1)
    else:
        load = nano_vllm_workload(args.num_requests, max_token_id=min(10000, config["vocab_size"] - 1))
    longest = max(len(p) + n for p, n in zip(load.prompts, load.max_tokens))
    started = time.perf_counter()
    llm = _llm(args, "moe", max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=longest + 16)
    startup_s = time.perf_counter() - started
    llm.generate([[1, 2, 3]], [SamplingParams(max_tokens=8, ignore_eos=True)])   # warm-up, as bench.py does
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in load.max_tokens]
    started = time.perf_counter()
    outputs = llm.generate(load.prompts, params)
    seconds = time.perf_counter() - started
    return {"output_tokens": sum(len(o) for o in outputs), "seconds": seconds, "startup_s": startup_s,
            "prompts": [len(p) for p in load.prompts], "max_tokens": load.max_tokens,
            "num_kv_blocks": llm.runner.num_kv_blocks, "block_size": llm.runner.block_size}


def moe_workload_floor(result: dict, shape: Shape, rates: dict) -> dict:
    """nano-vllm's floor (bench/workload.py) with the experts each step's batch touches: all
    requests admitted at once, prompts first, then decode step t runs every request still
    generating."""
    prompts, outputs = result["prompts"], result["max_tokens"]
    decode_s = 0.0
    for t in range(1, max(outputs)):
        running = [(p, n) for p, n in zip(prompts, outputs) if n > t]
        decode_s += decode_step_floor_s(shape, len(running), sum(p + t for p, _ in running), rates)
    prefill_s = sum(shape.prefill_flops(p) for p in prompts) / rates["bf16_flops_per_s"]
    return {"decode_s": decode_s, "prefill_s": prefill_s, "total_s": decode_s + prefill_s}


def stage_decode(args: argparse.Namespace, name: str, quantization: str) -> dict:
    from common.sampling import SamplingParams

    config = load_config(args, name)
    batch, prompt_len, steps = args.decode_batch, args.decode_prompt, args.decode_steps
    if args.tiny:
        batch, prompt_len, steps = 8, 16, 16
    started = time.perf_counter()
    llm = _llm(args, name, quantization=None if quantization == "bf16" else quantization, max_num_seqs=batch,
               max_num_batched_tokens=16384, max_model_len=prompt_len + steps + 16)
    startup_s = time.perf_counter() - started

    def run(seed: int, max_tokens: int) -> float:
        rng = random.Random(seed)
        prompts = [[rng.randrange(config["vocab_size"]) for _ in range(prompt_len)] for _ in range(batch)]
        started = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
        assert all(len(o) == max_tokens for o in outputs)
        return time.perf_counter() - started

    run(0, 1 + steps)   # compiles every shape the timed runs use
    prefill_s = statistics.median(run(seed, 1) for seed in (1, 2))
    total_s = run(3, 1 + steps)
    decode_s = total_s - prefill_s
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "decode_s": decode_s,
            "prefill_s": prefill_s, "tok_per_s": batch * steps / decode_s, "startup_s": startup_s}


STAGE_FUNCTIONS = {"bandwidth": stage_bandwidth, "moe_kernel": stage_moe_kernel, "fp8_gemm": stage_fp8_gemm,
                   "moe_e2e": stage_moe_e2e,
                   **{stage: (lambda a, _s=size, _q=q: stage_decode(a, _s, _q)) for stage, (size, q) in DECODE_STAGES.items()}}


def run_stage(args: argparse.Namespace) -> int:
    """The subprocess side: runs one stage and records its result or its error."""
    started = time.perf_counter()
    try:
        record = {"ok": True, "result": STAGE_FUNCTIONS[args.run_stage](args)}
    except Exception as exc:  # recorded, so the table shows why the row is missing
        traceback.print_exc()
        record = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    record["wall_s"] = time.perf_counter() - started
    (args.out / f"{args.run_stage}.json").write_text(json.dumps(record, indent=1))
    return 0 if record["ok"] else 1


# --- orchestration and the tables ---------------------------------------------------------------

def launch(args: argparse.Namespace, stage: str, argv: list[str]) -> None:
    log = args.out / "logs" / f"{stage}.log"
    started = time.perf_counter()
    print(f"== {stage} (log: {log})", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")   # the fused kernels, interpreted
    with log.open("w") as f:
        try:
            proc = subprocess.run([sys.executable, "-m", "bench.moe_fp8_bench", *argv, "--run-stage", stage], cwd=REPO,
                                  stdout=f, stderr=subprocess.STDOUT, timeout=args.stage_timeout, env=env)
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"killed after {args.stage_timeout:.0f} s"
            (args.out / f"{stage}.json").write_text(json.dumps({"ok": False, "error": status}))
    print(f"   {status} in {time.perf_counter() - started:.0f} s", flush=True)
    if status != "ok":
        print("   " + "\n   ".join(log.read_text().splitlines()[-15:]), flush=True)


def summarize(args: argparse.Namespace) -> dict:
    """Every stage's result with its floor, as printed and as written to all.json."""
    results = {s: json.loads((args.out / f"{s}.json").read_text()) for s in STAGES if (args.out / f"{s}.json").exists()}
    ok = {s: r["result"] for s, r in results.items() if r.get("ok")}
    summary: dict = {"errors": {s: r.get("error", "") for s, r in results.items() if not r.get("ok")}}
    rates = ok.get("bandwidth")
    summary["bandwidth"] = rates
    if "moe_kernel" in ok:
        summary["moe_kernel"] = ok["moe_kernel"]
        for row in ok["moe_kernel"]["rows"]:   # reading the touched experts once is the floor
            row["floor_s"] = row["touched_bytes"] / rates["copy_bytes_per_s"] if rates else float("nan")
    if "fp8_gemm" in ok:
        summary["fp8_gemm"] = ok["fp8_gemm"]
    if "moe_e2e" in ok:
        e2e = dict(ok["moe_e2e"])
        e2e["tok_per_s"] = e2e["output_tokens"] / e2e["seconds"]
        if rates:
            floor = moe_workload_floor(e2e, Shape(load_config(args, "moe")), rates)
            e2e["floor"] = floor
            e2e["floor_tok_per_s"] = e2e["output_tokens"] / floor["total_s"]
            e2e["of_floor"] = e2e["tok_per_s"] / e2e["floor_tok_per_s"]
        summary["moe_e2e"] = {k: v for k, v in e2e.items() if k not in ("prompts", "max_tokens")}
    decode = {}
    for stage, (name, quantization) in DECODE_STAGES.items():
        if stage not in ok:
            continue
        row = dict(ok[stage])
        if rates:
            shape = Shape(load_config(args, name), fp8=quantization == "fp8")
            kv_tokens = row["batch"] * (row["prompt_len"] + row["steps"] / 2)
            row["floor_step_s"] = decode_step_floor_s(shape, row["batch"], kv_tokens, rates)
            row["floor_tok_per_s"] = row["batch"] / row["floor_step_s"]
            row["of_floor"] = row["tok_per_s"] / row["floor_tok_per_s"]
        decode[stage] = row
    for name in ("0.6b", "8b"):
        bf16, fp8 = decode.get(f"decode_{name}_bf16"), decode.get(f"decode_{name}_fp8")
        if bf16 and fp8:
            fp8["speedup_vs_bf16"] = fp8["tok_per_s"] / bf16["tok_per_s"]
    summary["decode"] = decode
    return summary


def print_tables(args: argparse.Namespace, summary: dict) -> None:
    rates = summary.get("bandwidth")
    if rates:
        print(f"\n# {rates['device']}: copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), matmul "
              f"bf16 {rates['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, fp8 {rates['fp8_flops_per_s'] / 1e12:.0f} "
              f"TFLOP/s ({rates['fp8_rate_from']})")
    if "moe_kernel" in summary:
        k = summary["moe_kernel"]
        print(f"\nMoE layer ({k['experts']} experts, top-{k['top_k']}, hidden {k['hidden']}, width {k['width']}): "
              "fused Triton path vs reference loop")
        print(f"{'batch':>5s} {'fused ms':>9s} {'loop ms':>9s} {'speedup':>8s} {'experts':>8s} {'floor ms':>9s} "
              f"{'of floor':>8s} {'max err':>9s}")
        for r in k["rows"]:
            print(f"{r['batch']:5d} {r['fused_s'] * 1e3:9.3f} {r['reference_s'] * 1e3:9.3f} "
                  f"{r['reference_s'] / r['fused_s']:7.1f}x {r['touched_experts']:8d} {r['floor_s'] * 1e3:9.3f} "
                  f"{r['floor_s'] / r['fused_s']:8.1%} {r['max_abs_error']:9.2e}")
    if "fp8_gemm" in summary:
        model = "tiny 8b" if args.tiny else "Qwen3-8B"
        print(f"\n{model} projections at the decode batch: bf16 F.linear vs FP8 (quantize + GEMM), ms")
        print(f"{'proj':8s} {'rows':>5s} {'N x K':>13s} {'bf16':>8s} {'fp8':>8s} {'speedup':>8s} {'quant':>7s} "
              f"{'best gemm':>9s}  best tiles")
        for r in summary["fp8_gemm"]["rows"]:
            best = f"{r['best_gemm_s'] * 1e3:9.3f}  {r['best_config']}" if r["best_gemm_s"] else f"{'-':>9s}"
            print(f"{r['name']:8s} {r['rows']:5d} {r['cols']:>6d}x{r['width']:<6d} {r['bf16_s'] * 1e3:8.3f} "
                  f"{r['fp8_s'] * 1e3:8.3f} {r['bf16_s'] / r['fp8_s']:7.2f}x {r['quant_s'] * 1e3:7.3f} {best}")
    if "moe_e2e" in summary:
        e = summary["moe_e2e"]
        model = "tiny Qwen3-MoE" if args.tiny else "Qwen3-30B-A3B"
        print(f"\n{model} (dummy weights), bench.py workload in-process: {e['tok_per_s']:.0f} output tok/s "
              f"({e['output_tokens']} tokens in {e['seconds']:.1f} s; startup {e['startup_s']:.0f} s)")
        if "floor" in e:
            f = e["floor"]
            print(f"  floor {e['floor_tok_per_s']:.0f} tok/s ({f['total_s']:.1f} s: decode {f['decode_s']:.1f} + "
                  f"prefill {f['prefill_s']:.1f}) -> {e['of_floor']:.1%} of floor (target >= 50%)")
    if summary.get("decode"):
        print("\ndecode at a fixed batch, in-process engine (dummy weights)")
        print(f"{'model':14s} {'batch':>5s} {'tok/s':>9s} {'floor':>9s} {'of floor':>8s} {'vs bf16':>8s}")
        for stage, r in summary["decode"].items():
            name, quantization = DECODE_STAGES[stage]
            floor = f"{r['floor_tok_per_s']:9.0f} {r['of_floor']:8.1%}" if "floor_tok_per_s" in r else f"{'-':>9s} {'-':>8s}"
            speedup = f"{r['speedup_vs_bf16']:7.2f}x" if "speedup_vs_bf16" in r else f"{'':8s}"
            label = f"{'tiny ' + name if args.tiny else 'Qwen3-' + name.upper()} {quantization}"
            print(f"{label:14s} {r['batch']:5d} {r['tok_per_s']:9.0f} {floor} {speedup}")
        print("  (target: Qwen3-8B fp8 >= 1.3x bf16 at batch 256)")
    for stage, error in summary["errors"].items():
        print(f"# {stage} failed: {error[:300]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run_stage:
        return run_stage(args)
    (args.out / "logs").mkdir(exist_ok=True)
    for name in CONFIGS:   # written once, before the stages run in parallel-free sequence
        model_dir(args, name)
    argv = list(argv if argv is not None else sys.argv[1:])
    for stage in [s.strip() for s in args.stages.split(",") if s.strip()]:
        if stage not in STAGES:
            print(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}", file=sys.stderr)
            return 2
        launch(args, stage, argv)
    summary = summarize(args)
    (args.out / "all.json").write_text(json.dumps(summary, indent=1))
    print_tables(args, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

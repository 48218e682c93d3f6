"""Stage spec: speculative decoding on Qwen3-8B shapes (dummy weights) through the in-process
engine, greedy, against the same engine without speculation.

Two bench-only host proposers stand in for a real one: `oracle` replays the target's own greedy
continuation (recorded by the baseline run), so drafts are right at no drafting cost and its
speedup bounds every method; `p=X` proposes each replayed token with probability X (else a wrong
one), giving speedup against the measured acceptance length. The real device methods run too, with
random weights (their drafts are rejected, so each step emits one token, but a step's work is the
same whatever is accepted): the worker's eagle3 proposer with an EAGLE-3 head of the published
Qwen3-8B layout (one decoder layer, fc over three hidden states, a 32k draft vocabulary) and its
draft proposer with Qwen3-0.6B, both at k = 4, inside the target's steps. Their step time is the
verify step plus their drafting; predicted speedup of a method at acceptance length L:
    L * baseline step / the method's step
`default` runs batch 64 with the scheduler's default --speculative-max-batch-size (it does not
speculate there): the cost of a speculating worker when the threshold turns speculation off.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import pathlib
import random
import sys
import time

import numpy as np

from bench.options import config_dir, load_config

DRAFT_VOCAB = 32000       # the published Qwen3-8B EAGLE-3 heads' draft vocabulary
REPEATS = 2               # runs of each timed case; the fastest counts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-batches", default="1,8,64", help="batches of the spec stage")
    p.add_argument("--spec-ks", default="2,4,8", help="draft counts (--num-speculative-tokens) of the oracle runs")
    p.add_argument("--spec-probabilities", default="0.4,0.7,0.9",
                   help="chances of a right draft of the p=X runs (at k=4)")
    p.add_argument("--spec-prompt", type=int, default=128, help="prompt tokens of each spec request")
    p.add_argument("--spec-tokens", type=int, default=128, help="output tokens of each spec request")
    p.add_argument("--spec-methods", default="target,eagle3,draft",
                   help="which runs of the spec stage: target (no speculation, the oracle and p = X rows), eagle3, draft")
    p.add_argument("--spec-profile", action="store_true",
                   help="also profile (torch.profiler) one run of each proposer at the smallest batch, k = 4: "
                        "device ms per step by kernel")
    p.add_argument("--spec-trace", action="store_true",
                   help="with --spec-profile: record the host's side too and write each profiled run's timeline "
                        "(Chrome trace, gzipped, a shorter run) as trace-PROPOSER.json.gz under --out")


@dataclasses.dataclass
class Shape:
    batches: list[int]
    ks: list[int]
    probabilities: list[float]
    prompt: int
    tokens: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Shape":
        if args.tiny:
            return cls([1, 4], [2, 4], [0.5], 16, 12)
        return cls([int(b) for b in args.spec_batches.split(",")], [int(k) for k in args.spec_ks.split(",")],
                   [float(p) for p in args.spec_probabilities.split(",")], args.spec_prompt, args.spec_tokens)

    @property
    def max_num_seqs(self) -> int:
        """The engine's max_num_seqs: the decode graphs hold that many tokens, and a verifying step of
        b requests is b * (1 + k) of them (fewer, and the step runs eagerly)."""
        return max(self.batches) * (1 + max(max(self.ks), METHOD_K))

    @property
    def max_model_len(self) -> int:
        return self.prompt + self.tokens + max(self.ks) + 16

    def kv_blocks(self, block_size: int = 16) -> int:
        return max(self.batches) * -(-self.max_model_len // block_size) + 64


class ReplayProposer:
    """Drafts from each request's recorded greedy continuation, each right with probability p."""
    method = "ngram"
    on_device = False

    def __init__(self, batch, prompt_len: int, continuations: dict[bytes, np.ndarray], num_drafts: int,
                 p: float, vocab_size: int) -> None:
        self.batch, self.prompt_len, self.continuations = batch, prompt_len, continuations
        self.num_drafts, self.p, self.vocab_size = num_drafts, p, vocab_size
        self.rng = np.random.default_rng(0)
        self.right: dict[int, np.ndarray] = {}     # row -> which of its latest drafts are right

    def propose_on_host(self, rows: np.ndarray) -> list[np.ndarray]:
        b, out = self.batch, []
        for row in rows.tolist():
            n = int(b.num_tokens[row])
            full = self.continuations.get(b.token_ids[row, :self.prompt_len].tobytes())
            truth = full[n:n + self.num_drafts] if full is not None else np.zeros(0, np.int64)
            right = self.rng.random(len(truth)) < self.p
            self.right[row] = right
            out.append(np.where(right, truth, (truth + 1) % self.vocab_size))
        return out

    def run(self, runner, batch, aux, tokens, propose):
        raise NotImplementedError("the replay proposer proposes on the host")


def force_acceptance(runner) -> None:
    """A verified position whose draft the replay proposer made right samples that draft. Random
    weights' argmax is fragile (bf16 chunk and decode kernels round differently), so without this
    the oracle's drafts are rejected for numerics; with it the acceptance timed is the one intended."""
    import torch

    apply = runner._apply_verification

    def forced(batch, meta, tokens, spec):
        layout = spec.layout if spec is not None else None
        if layout is not None and isinstance(runner.proposer, ReplayProposer):
            right = np.zeros(layout.num_positions, bool)
            for i, row in enumerate(spec.rows.tolist()):
                n = int(layout.num_drafts[i])
                right[layout.first[i]:layout.first[i] + n] = runner.proposer.right.get(row, np.ones(n, bool))[:n]
            mask = torch.from_numpy(right)
            if tokens.device.type == "cuda":   # pinned and async: a pageable copy would wait for the forward
                mask = mask.pin_memory().to(tokens.device, non_blocking=True)
            tokens.copy_(torch.where(mask, batch.verify.next_drafts.to(tokens.dtype), tokens))
        apply(batch, meta, tokens, spec)

    runner._apply_verification = forced


class Counters:
    """Launches, verifying rows and accepted drafts of the runner, counted as they happen, and the
    worker's own times per step summed (ms: preparing the batch, launching its work, the device's
    time from the first launch to the tokens' copy): a step's period less its device time is the
    time the device waited for the host."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.launches = self.verifications = self.drafts = self.accepted = 0
        self.prepare_ms = self.launch_ms = self.device_ms = 0.0
        launch = runner.launch

        def counted_launch(step):
            self.launches += 1
            pending = launch(step)
            result = pending.result

            def timed_result():
                output = result()
                self.prepare_ms += output.prepare_ms
                self.launch_ms += output.forward_ms
                self.device_ms += output.device_ms
                return output
            pending.result = timed_result
            return pending

        runner.launch = counted_launch
        if runner.bookkeeping is not None:
            settle = runner.bookkeeping._settle

            def counted_settle(step):
                settle(step)
                if step.layout is not None and step.accepted is not None:
                    drafted = step.layout.num_drafts > 0
                    self.verifications += int(drafted.sum())
                    self.drafts += int(step.layout.num_drafts.sum())
                    self.accepted += int(step.accepted.numpy()[drafted].sum())

            runner.bookkeeping._settle = counted_settle

    def snapshot(self) -> tuple[int, int, int, int, float, float, float]:
        return (self.launches, self.verifications, self.drafts, self.accepted, self.prepare_ms, self.launch_ms,
                self.device_ms)


def run_row(label: str, k: int, batch: int, tokens: int, decode_s: float, counts: tuple,
            prefill_launches: int) -> dict:
    """One timed run's row: `counts` is the run's Counters.snapshot() delta (its prefill, which
    made prefill_launches launches, included), decode_s its time less the prefill's."""
    launches, verifications, drafts, accepted, prepare_ms, launch_ms, device_ms = counts
    steps, n = max(launches - prefill_launches, 1), max(launches, 1)
    return {"proposer": label, "k": k, "batch": batch, "decode_s": decode_s, "steps": steps,
            "step_ms": decode_s / steps * 1e3, "tok_per_s": batch * tokens / decode_s,
            "verifications": verifications, "drafts": drafts, "accepted": accepted,
            "acceptance_length": 1 + accepted / verifications if verifications else 1.0,
            "prepare_ms": prepare_ms / n, "launch_ms": launch_ms / n, "device_ms": device_ms / n}


METHOD_K = 4              # the real methods' --num-speculative-tokens
PROFILE_TOKENS = 48       # output tokens of a profiled run
TRACE_TOKENS = 12         # output tokens of a traced run (a trace of every host call is large)


def kernel_kind(name: str) -> str:
    """A kernel's family, by its name (cuBLAS, this project's Triton kernels, torch's own)."""
    n = name.lower()
    for kind, keys in (("attention", ("attn", "attention", "paged", "split_merge", "merge_")),
                       ("gemm/gemv", ("gemm", "gemv", "nvjet", "cutlass", "sm90_", "splitk", "matmul", "_linear")),
                       ("norm/rope/act", ("rms", "norm", "rotary", "rope", "silu", "act_")),
                       ("sampling", ("sampl", "softmax", "argmax", "topk", "sort", "philox", "penal", "gumbel",
                                     "exponential", "multinomial")),
                       ("copy/fill", ("copy", "memcpy", "memset", "fill", "cat", "index", "scatter", "gather"))):
        if any(key in n for key in keys):
            return kind
    return "other"


def profiled(args: argparse.Namespace, label: str, counters: "Counters", generate) -> dict:
    """Device time per step of one run of generate(max_tokens) (a whole generate: its prefill is in
    it, a small share), by kernel family and by kernel, the run's wall time per step, and where the
    worker's launch (the host work between two steps when the next waits for the last) spends its
    time, by function (cProfile while launch runs; from Python 3.12 on, cProfile sees every thread
    meanwhile, the event loop's and the waiting ones' too, so read it as the host's busy time).
    With --spec-trace, a shorter run whose timeline is written as trace-LABEL.json.gz."""
    import collections
    import cProfile
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    trace_to = args.out / f"trace-{label}.json.gz" if args.spec_trace else None
    host = cProfile.Profile()
    runner, inner = counters.runner, counters.runner.launch

    def launch(step):
        host.enable()
        try:
            return inner(step)
        finally:
            host.disable()

    cuda = torch.cuda.is_available()     # on the CPU (a smoke test) its ops stand in for kernels
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    before = counters.snapshot()[0]
    sync()
    started = time.perf_counter()
    runner.launch = launch if trace_to is None else inner   # a traced run's host times are the trace's
    try:
        activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
        if trace_to is not None and cuda:
            activities.append(ProfilerActivity.CPU)
        with profile(activities=activities) as prof:
            generate(1 + (TRACE_TOKENS if trace_to is not None else PROFILE_TOKENS))
            sync()
    finally:
        runner.launch = inner
    wall_ms = (time.perf_counter() - started) * 1e3
    steps = max(counters.snapshot()[0] - before, 1)
    if trace_to is not None:
        _write_trace(prof, trace_to)
    ms: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for event in prof.events():
        if event.device_type == device_type:
            ms[event.name] += (event.device_time if cuda else event.cpu_time) / 1e3
            calls[event.name] += 1
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, total in ms.items():
        kinds[kernel_kind(name)] += total / steps
    top = sorted(ms.items(), key=lambda kv: -kv[1])[:16]
    functions = ([] if trace_to is not None else   # cProfile did not run
                 [(f"{func} ({pathlib.Path(file).name}:{line})", tt * 1e3 / steps, ct * 1e3 / steps)
                  for (file, line, func), (_, _, tt, ct, _) in pstats.Stats(host).stats.items()])
    return {"host_own": [(f, round(tt, 4)) for f, tt, _ in sorted(functions, key=lambda f: -f[1])[:12]],
            "host_cumulative": [(f, round(ct, 4)) for f, _, ct in sorted(functions, key=lambda f: -f[2])[:16]],
            "proposer": label, "steps": steps, "wall_ms_per_step": wall_ms / steps,
            "device_ms_per_step": sum(ms.values()) / steps,
            "kernels_per_step": sum(calls.values()) / steps,
            "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [(name[:100], round(total / steps, 4), round(calls[name] / steps, 2)) for name, total in top]}


def _write_trace(prof, path) -> None:
    """The profiler's timeline as a gzipped Chrome trace (chrome://tracing, ui.perfetto.dev)."""
    import gzip
    import shutil
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as raw:
        prof.export_chrome_trace(raw.name)
        with open(raw.name, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def run(args: argparse.Namespace) -> dict:
    shape, profiles = Shape.of(args), []
    wanted = set(args.spec_methods.split(","))
    rows = _target_rows(args, shape, profiles) if "target" in wanted else []
    for method in ("eagle3", "draft"):
        if method in wanted:
            model_dir = _eagle3_dir(args) if method == "eagle3" else config_dir(args, "0.6b")
            rows += _method_rows(args, shape, method, model_dir, profiles)
    return {"rows": rows, "shape": dataclasses.asdict(shape), "profiles": profiles}


def _prompts(shape: "Shape", vocab: int) -> dict[int, list[list[int]]]:
    rng = random.Random(0)
    return {b: [[rng.randrange(3, min(vocab, 10000)) for _ in range(shape.prompt)] for _ in range(b)]
            for b in shape.batches}


# --- the target, with and without drafts -------------------------------------------------------

def _target_rows(args: argparse.Namespace, shape: Shape, profiles: list[dict]) -> list[dict]:
    from bench.stages.moe_e2e import dummy_llm
    from common.speculation import DEFAULT_MAX_BATCH_SIZE

    vocab = load_config(args, "8b")["vocab_size"]
    llm = dummy_llm(args, "8b", speculative_method="ngram", num_speculative_tokens=max(shape.ks),
                    max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=max(4096, max(shape.batches) * 16),
                    max_model_len=shape.max_model_len, num_kv_blocks=shape.kv_blocks(),
                    speculative_max_batch_size=max(shape.batches))
    runner, counters = llm.runner, Counters(llm.runner)
    bookkeeping, engine = runner.bookkeeping, llm._engine_config
    prompts = _prompts(shape, vocab)
    continuations: dict[bytes, np.ndarray] = {}
    rows, baseline = [], {}

    def timed(b: int, max_tokens: int) -> tuple[float, list[list[int]], tuple]:
        from common.sampling import SamplingParams

        before = counters.snapshot()
        started = time.perf_counter()
        outputs = llm.generate(prompts[b], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        seconds = time.perf_counter() - started
        return seconds, outputs, tuple(a - c for a, c in zip(counters.snapshot(), before))

    def measure(b: int, label: str, k: int, prefill: tuple[float, int]) -> dict:
        seconds, outputs, counts = min((timed(b, 1 + shape.tokens) for _ in range(REPEATS)), key=lambda run: run[0])
        row = run_row(label, k, b, shape.tokens, seconds - prefill[0], counts, prefill[1])
        if label == "none":
            baseline[b] = row | {"outputs": outputs}
        else:
            row["speedup"] = row["tok_per_s"] / baseline[b]["tok_per_s"]
            row["same_output"] = sum(o == r for o, r in zip(outputs, baseline[b]["outputs"])) / b
        return row

    # Baseline: the worker's speculation and the scheduler's both off (the plain decode path).
    runner.bookkeeping, llm._engine_config = None, dataclasses.replace(engine, speculative_method="off")
    timed(max(shape.batches), 1 + min(shape.tokens, 16))   # compiles and warms the plain shapes
    prefills = {}
    for b in shape.batches:
        seconds, _, counts = min((timed(b, 1) for _ in range(REPEATS)), key=lambda run: run[0])
        prefills[b] = (seconds, counts[0])
        rows.append(measure(b, "none", 0, prefills[b]))
        for prompt, output in zip(prompts[b], baseline[b]["outputs"]):
            full = np.asarray(prompt + output, np.int64)
            continuations[full[:shape.prompt].astype(runner.batch.token_ids.dtype).tobytes()] = full
    runner.bookkeeping = bookkeeping
    force_acceptance(runner)

    def speculating(k: int, p: float, max_batch: int):
        proposer = ReplayProposer(runner.batch, shape.prompt, continuations, k, p, vocab)
        runner.proposer, bookkeeping.propose_on_host = proposer, proposer.propose_on_host
        llm._engine_config = dataclasses.replace(engine, num_speculative_tokens=k, speculative_max_batch_size=max_batch)

    b0 = min(shape.batches)
    if args.spec_profile:
        runner.bookkeeping, llm._engine_config = None, dataclasses.replace(engine, speculative_method="off")
        profiles.append(profiled(args, "none", counters, lambda n: timed(b0, n)))
        runner.bookkeeping = bookkeeping
    for k in shape.ks:
        speculating(k, 1.0, max(shape.batches))
        timed(max(shape.batches), 1 + min(shape.tokens, 16))   # compiles the verify shapes of k
        rows += [measure(b, "oracle", k, prefills[b]) for b in shape.batches]
        if args.spec_profile and k == METHOD_K:
            profiles.append(profiled(args, "oracle", counters, lambda n: timed(b0, n)))
    k = 4 if 4 in shape.ks else shape.ks[0]
    for p in shape.probabilities:
        speculating(k, p, max(shape.batches))
        rows += [measure(b, f"p={p}", k, prefills[b]) for b in shape.batches]
    speculating(k, 1.0, DEFAULT_MAX_BATCH_SIZE)
    rows += [measure(b, "default", k, prefills[b]) for b in shape.batches if b > DEFAULT_MAX_BATCH_SIZE]
    _release(llm)
    return rows


# --- the real methods --------------------------------------------------------------------------

def _eagle3_dir(args: argparse.Namespace):
    """An EAGLE-3 head's config.json for the 8b target in the published layout (no weights: the
    worker draws them with --load-format dummy)."""
    out = args.out / "models" / "eagle3-head"
    if not (out / "config.json").exists():
        target = load_config(args, "8b")
        n = target["num_hidden_layers"]
        config = {key: target[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                                               "vocab_size", "max_position_embeddings") if key in target}
        config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                      hidden_act="silu", draft_vocab_size=min(DRAFT_VOCAB, target["vocab_size"]),
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3] if n >= 4
                                    else [0, n // 2, n - 1]})
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _method_rows(args: argparse.Namespace, shape: Shape, method: str, model_dir, profiles: list[dict]) -> list[dict]:
    """The target's decode with the worker's real `method` proposer (random weights) at k = 4."""
    from bench.stages.moe_e2e import dummy_llm
    from common.sampling import SamplingParams
    from common.speculation import DEFAULT_MAX_BATCH_SIZE

    vocab = load_config(args, "8b")["vocab_size"]
    llm = dummy_llm(args, "8b", speculative_method=method, speculative_model=str(model_dir),
                    num_speculative_tokens=METHOD_K, max_num_seqs=shape.max_num_seqs,
                    max_num_batched_tokens=max(4096, max(shape.batches) * 16), max_model_len=shape.max_model_len,
                    num_kv_blocks=shape.kv_blocks(), speculative_max_batch_size=max(shape.batches))
    counters, prompts = Counters(llm.runner), _prompts(shape, vocab)

    def timed(b: int, max_tokens: int) -> tuple[float, tuple]:
        before = counters.snapshot()
        started = time.perf_counter()
        llm.generate(prompts[b], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - started, tuple(a - c for a, c in zip(counters.snapshot(), before))

    def measure(b: int, label: str) -> dict:
        prefill_s, (prefill_launches, *_) = min((timed(b, 1) for _ in range(REPEATS)), key=lambda run: run[0])
        seconds, counts = min((timed(b, 1 + shape.tokens) for _ in range(REPEATS)), key=lambda run: run[0])
        return run_row(label, METHOD_K, b, shape.tokens, seconds - prefill_s, counts, prefill_launches)

    timed(max(shape.batches), 1 + min(shape.tokens, 16))   # compiles and warms
    rows = [measure(b, method) for b in shape.batches]
    if args.spec_profile:
        profiles.append(profiled(args, method, counters, lambda n: timed(min(shape.batches), n)))
    # The scheduler's default threshold: past it the worker's steps are plain ones (no proposer)
    llm._engine_config = dataclasses.replace(llm._engine_config, speculative_max_batch_size=DEFAULT_MAX_BATCH_SIZE)
    rows += [measure(b, f"{method} default") for b in shape.batches if b > DEFAULT_MAX_BATCH_SIZE]
    _release(llm)
    return rows


def _release(llm) -> None:
    import gc

    import torch

    del llm
    gc.collect()
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()


# --- the table ---------------------------------------------------------------------------------

def predicted_speedup(method_step_ms: float, base_step_ms: float, length: float) -> float:
    """Speedup of a method whose steps (verify and drafting) take method_step_ms, at acceptance
    length `length` (tokens emitted per step)."""
    return length * base_step_ms / method_step_ms


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    rows = results["spec"]["result"]["rows"]
    base = {row["batch"]: row for row in rows if row["proposer"] == "none"}
    model = "tiny 8b" if args.tiny else "Qwen3-8B"
    print(f"\nspeculative decoding, {model} shapes (dummy weights), greedy, in-process engine; speedup against "
          f"the same batch without speculation")
    print(f"{'proposer':9s} {'k':>2s} {'batch':>5s} {'step ms':>8s} {'tok/s':>9s} {'speedup':>8s} {'accept len':>10s} "
          f"{'same out':>8s} {'@ len 3':>8s} {'prep':>6s} {'launch':>6s} {'device':>6s} {'idle':>6s}")
    for row in rows:
        b = row["batch"]
        speedup = (f"{row['tok_per_s'] / base[b]['tok_per_s']:7.2f}x" if row["proposer"] != "none" and b in base
                   else f"{'-':>8s}")
        same = f"{row['same_output']:8.0%}" if "same_output" in row else f"{'-':>8s}"
        at3 = (f"{predicted_speedup(row['step_ms'], base[b]['step_ms'], 3.0):7.2f}x"
               if row["proposer"] in ("eagle3", "draft") and b in base else f"{'-':>8s}")
        print(f"{row['proposer']:9s} {row['k']:2d} {b:5d} {row['step_ms']:8.2f} {row['tok_per_s']:9.0f} {speedup} "
              f"{row['acceptance_length']:10.2f} {same} {at3} {row['prepare_ms']:6.2f} {row['launch_ms']:6.2f} "
              f"{row['device_ms']:6.2f} {max(row['step_ms'] - row['device_ms'], 0.0):6.2f}")
    print("  (eagle3, draft: the worker's proposers with random weights, so their drafts are rejected; '@ len 3' "
          "predicts their speedup at acceptance length 3 from their measured step; targets: eagle3 >= 2.0x at "
          "batch 1, and batch >= 64 never below 0.98x; prep / launch: the worker's host ms per step, device: its "
          "device ms per step, idle: step less device, the time the device waited for the host)")
    for prof in results["spec"]["result"].get("profiles", []):
        kinds = ", ".join(f"{kind} {ms:.2f}" for kind, ms in prof["by_kind"].items())
        print(f"\nprofile {prof['proposer']} at batch {min(results['spec']['result']['shape']['batches'])}: "
              f"{prof['wall_ms_per_step']:.2f} ms a step, {prof['device_ms_per_step']:.2f} of kernels "
              f"({prof['kernels_per_step']:.0f} kernels): {kinds}")
        for name, ms, n in prof["top"]:
            print(f"  {ms:7.3f} ms x{n:5.1f}  {name}")
        print("  the worker's launch, ms per step (cumulative | own):")
        for (name, cumulative), (own_name, own) in itertools.zip_longest(prof["host_cumulative"], prof["host_own"],
                                                                         fillvalue=("", 0.0)):
            print(f"  {cumulative:7.3f}  {name[:60]:60s} | {own:7.3f}  {own_name[:60]}")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))

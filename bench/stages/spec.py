"""Stage spec: speculative decoding on Qwen3-8B shapes (dummy weights) through the in-process
engine, greedy, against the same engine without speculation.

Two bench-only host proposers stand in for a real one: `oracle` replays the target's own greedy
continuation (recorded by the baseline run), so drafts are right at no drafting cost and its
speedup bounds every method; `p=X` proposes each replayed token with probability X (else a wrong
one), giving speedup against the measured acceptance length. The drafting cost of the real device
methods is measured apart, as the device time of a decode step of their shapes at each batch (they
would run on the device inside the target's step): eagle3 (one decoder layer of Qwen3-8B's width
over a 32k draft vocabulary, plus its fc over three hidden states) and draft (Qwen3-0.6B).
Predicted speedup of a method at acceptance length L with k drafts:
    L * baseline step / (verify step at k + k * drafting step)
`default` runs batch 64 with the scheduler's default --speculative-max-batch-size (it does not
speculate there): the cost of a speculating worker when the threshold turns speculation off.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
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

    def propose_on_host(self, rows: np.ndarray) -> list[np.ndarray]:
        b, out = self.batch, []
        for row in rows.tolist():
            n = int(b.num_tokens[row])
            full = self.continuations.get(b.token_ids[row, :self.prompt_len].tobytes())
            truth = full[n:n + self.num_drafts] if full is not None else np.zeros(0, np.int64)
            right = self.rng.random(len(truth)) < self.p
            out.append(np.where(right, truth, (truth + 1) % self.vocab_size))
        return out

    def run(self, runner, batch, aux, tokens, propose):
        raise NotImplementedError("the replay proposer proposes on the host")


class Counters:
    """Launches, verifying rows and accepted drafts of the runner, counted as they happen."""

    def __init__(self, runner) -> None:
        self.launches = self.verifications = self.drafts = self.accepted = 0
        launch = runner.launch

        def counted_launch(step):
            self.launches += 1
            return launch(step)

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

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.launches, self.verifications, self.drafts, self.accepted


def run(args: argparse.Namespace) -> dict:
    shape = Shape.of(args)
    drafting = {"eagle3": _drafting_ms(args, shape, _eagle3_dir(args)), "draft": _drafting_ms(args, shape, None)}
    eagle_fc = _eagle3_fc_ms(args, shape)
    for kind in ("step", "device"):
        drafting["eagle3"][kind] = {b: ms + eagle_fc[b] if ms else 0.0 for b, ms in drafting["eagle3"][kind].items()}
    return {"rows": _target_rows(args, shape), "drafting_ms": drafting,
            "shape": dataclasses.asdict(shape)}


# --- the target, with and without drafts -------------------------------------------------------

def _target_rows(args: argparse.Namespace, shape: Shape) -> list[dict]:
    from bench.stages.moe_e2e import dummy_llm
    from scheduler_svc.engine.speculation import DEFAULT_MAX_BATCH_SIZE

    vocab = load_config(args, "8b")["vocab_size"]
    llm = dummy_llm(args, "8b", speculative_method="ngram", num_speculative_tokens=max(shape.ks),
                    max_num_seqs=max(shape.batches), max_num_batched_tokens=max(4096, max(shape.batches) * 16),
                    max_model_len=shape.max_model_len, num_kv_blocks=shape.kv_blocks(),
                    speculative_max_batch_size=max(shape.batches))
    runner, counters = llm.runner, Counters(llm.runner)
    bookkeeping, engine = runner.bookkeeping, llm._engine_config
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(3, min(vocab, 10000)) for _ in range(shape.prompt)] for _ in range(b)]
               for b in shape.batches}
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
        seconds, outputs, (launches, verifications, drafts, accepted) = min(
            (timed(b, 1 + shape.tokens) for _ in range(REPEATS)), key=lambda run: run[0])
        decode_s, steps = seconds - prefill[0], max(launches - prefill[1], 1)
        row = {"proposer": label, "k": k, "batch": b, "decode_s": decode_s, "steps": steps,
               "step_ms": decode_s / steps * 1e3, "tok_per_s": b * shape.tokens / decode_s,
               "verifications": verifications, "drafts": drafts, "accepted": accepted,
               "acceptance_length": 1 + accepted / verifications if verifications else 1.0}
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

    def speculating(k: int, p: float, max_batch: int):
        proposer = ReplayProposer(runner.batch, shape.prompt, continuations, k, p, vocab)
        runner.proposer, bookkeeping.propose_on_host = proposer, proposer.propose_on_host
        llm._engine_config = dataclasses.replace(engine, num_speculative_tokens=k, speculative_max_batch_size=max_batch)

    for k in shape.ks:
        speculating(k, 1.0, max(shape.batches))
        timed(max(shape.batches), 1 + min(shape.tokens, 16))   # compiles the verify shapes of k
        rows += [measure(b, "oracle", k, prefills[b]) for b in shape.batches]
    k = 4 if 4 in shape.ks else shape.ks[0]
    for p in shape.probabilities:
        speculating(k, p, max(shape.batches))
        rows += [measure(b, f"p={p}", k, prefills[b]) for b in shape.batches]
    speculating(k, 1.0, DEFAULT_MAX_BATCH_SIZE)
    rows += [measure(b, "default", k, prefills[b]) for b in shape.batches if b > DEFAULT_MAX_BATCH_SIZE]
    _release(llm)
    return rows


# --- drafting costs ----------------------------------------------------------------------------

def _eagle3_dir(args: argparse.Namespace):
    """Qwen3-8B's config cut to the EAGLE-3 head's decoder: one layer, the draft vocabulary."""
    out = args.out / "models" / "eagle3-head"
    if not (out / "config.json").exists():
        source = config_dir(args, "8b")
        out.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.is_file():
                (out / f.name).write_bytes(f.read_bytes())
        config = json.loads((source / "config.json").read_text())
        config.update(num_hidden_layers=1, max_window_layers=1, vocab_size=min(DRAFT_VOCAB, config["vocab_size"]))
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _drafting_ms(args: argparse.Namespace, shape: Shape, model_dir) -> dict[str, dict[int, float]]:
    """A draft model's (model_dir; None: Qwen3-0.6B) decode step at each batch, ms: "step" between
    replies of the engine, "device" the median device time of its steps (CUDA events; 0 on the CPU)."""
    import statistics

    from bench.stages.moe_e2e import dummy_llm
    from common.sampling import SamplingParams
    from tools.offline import LLM

    options = dict(max_num_seqs=max(shape.batches), max_num_batched_tokens=max(4096, max(shape.batches) * 16),
                   max_model_len=shape.max_model_len, num_kv_blocks=shape.kv_blocks())
    llm = (LLM(str(model_dir), device=args.device, load_format="dummy", **options) if model_dir is not None
           else dummy_llm(args, "0.6b", **options))
    device_ms: list[float] = []
    _record_device_ms(llm.runner, device_ms)
    vocab = llm.runner.vocab_size
    rng = random.Random(1)
    result: dict[str, dict[int, float]] = {"step": {}, "device": {}}
    for b in [max(shape.batches), *shape.batches]:      # the first run compiles and warms
        prompts = [[rng.randrange(3, min(vocab, 10000)) for _ in range(shape.prompt)] for _ in range(b)]
        times = []
        for max_tokens in (1, 1 + shape.tokens):
            device_ms.clear()
            started = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            times.append(time.perf_counter() - started)
        result["step"][b] = (times[1] - times[0]) / shape.tokens * 1e3
        result["device"][b] = statistics.median(device_ms) if device_ms else 0.0   # decode steps dominate
    _release(llm)
    return result


def _record_device_ms(runner, sink: list[float]) -> None:
    """Appends each step's device time to sink as its result is read."""
    launch = runner.launch

    class Recorded:
        def __init__(self, pending) -> None:
            self.pending = pending

        def result(self):
            output = self.pending.result()
            sink.append(output.device_ms)
            return output

    runner.launch = lambda step: Recorded(launch(step))


def drafting_cost_ms(measured: dict[str, dict[int, float]], batch: int) -> float:
    """A draft step's cost inside the worker: its device time (the proposers run on the device
    right after the target's sampling), or its engine step where there is no device timing."""
    return measured["device"][batch] or measured["step"][batch]


def _eagle3_fc_ms(args: argparse.Namespace, shape: Shape) -> dict[int, float]:
    """ms of the EAGLE-3 fc (three hidden states to one) at each batch."""
    import torch

    from bench.timing import timer

    hidden = load_config(args, "8b")["hidden_size"]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    weight = torch.randn(hidden, 3 * hidden, device=args.device, dtype=dtype) * 0.02
    timed, result = timer(args.device), {}
    for b in shape.batches:
        x = torch.randn(b, 3 * hidden, device=args.device, dtype=dtype)
        result[b] = timed(lambda: torch.nn.functional.linear(x, weight)) * 1e3   # noqa: B023 (called at once)
    return result


def _release(llm) -> None:
    import gc

    import torch

    del llm
    gc.collect()
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()


# --- the table ---------------------------------------------------------------------------------

def predicted_speedup(row: dict, base_step_ms: float, drafting_ms: float, length: float) -> float:
    """Speedup of a method drafting row["k"] tokens at drafting_ms each, at acceptance length `length`."""
    return length * base_step_ms / (row["step_ms"] + row["k"] * drafting_ms)


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    r = results["spec"]["result"]
    drafting = {m: {kind: {int(b): ms for b, ms in d.items()} for kind, d in kinds.items()}
                for m, kinds in r["drafting_ms"].items()}
    rows = r["rows"]
    base = {row["batch"]: row for row in rows if row["proposer"] == "none"}
    model = "tiny 8b" if args.tiny else "Qwen3-8B"
    print(f"\nspeculative decoding, {model} shapes (dummy weights), greedy, in-process engine; speedup against "
          f"the same batch without speculation")
    print(f"{'proposer':9s} {'k':>2s} {'batch':>5s} {'step ms':>8s} {'tok/s':>9s} {'speedup':>8s} {'accept len':>10s} "
          f"{'same out':>8s} {'eagle3 @3':>9s} {'draft @3':>9s}")
    for row in rows:
        b = row["batch"]
        speedup = f"{row['speedup']:7.2f}x" if "speedup" in row else f"{'-':>8s}"
        same = f"{row['same_output']:8.0%}" if "same_output" in row else f"{'-':>8s}"
        at3 = [f"{'-':>9s}"] * 2
        if row["proposer"] == "oracle" and row["k"] >= 2:
            at3 = [f"{predicted_speedup(row, base[b]['step_ms'], drafting_cost_ms(drafting[m], b), 3.0):8.2f}x" for m in ("eagle3", "draft")]
        print(f"{row['proposer']:9s} {row['k']:2d} {b:5d} {row['step_ms']:8.2f} {row['tok_per_s']:9.0f} {speedup} "
              f"{row['acceptance_length']:10.2f} {same} {at3[0]} {at3[1]}")
    for m, kinds in drafting.items():
        print(f"{m} drafting step ms (device / engine step): " + ", ".join(
            f"b{b} {kinds['device'][b]:.2f} / {kinds['step'][b]:.2f}" for b in kinds["step"]))
    print("  (eagle3/draft @3: predicted at acceptance length 3 from the oracle's verify step and the measured "
          "drafting step; targets: eagle3 >= 2.0x at batch 1, and batch >= 64 never below 0.98x)")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))

"""Probe: is speculative sampling exact? A draft-speculating service (the tiny model drafting for itself,
on the CPU) serves rounds of identical unseeded requests (temperature 1, top-k 3, 3 tokens), each round once
with speculation and once without; every output sequence's count is tested against its exact probability
under the target, from transformers' float32 logits (27 sequences). An exact sampler gives goodness-of-fit
statistics with mean ~df for both arms; also counts tokens outside the target's top 3 (there must be none).
PERF_NOTES "The unseeded chi-square test's excess failures" has a run.

    PYTHONPATH=. python -m bench.probes.spec_sampling_exactness [--rounds 30] [--requests 300]
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import random
import shutil
import statistics
import tempfile

import torch

from common.tiny_model import write_tiny_qwen3
from tests.support.client import generate_many
from tests.support.hf_reference import hf_model
from tools.launch import running_services

TOP_K, LENGTH = 3, 3


@torch.inference_mode()
def exact_probabilities(model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """Every LENGTH-token continuation's probability at temperature 1 and top-k TOP_K."""
    def step(prefix: tuple[int, ...]) -> dict[int, float]:
        values, ids = torch.topk(model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double(), TOP_K)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist()))

    sequences = {(): 1.0}
    for _ in range(LENGTH):
        sequences = {prefix + (t,): p * q for prefix, p in sequences.items() for t, q in step(prefix).items()}
    return sequences


def goodness_of_fit(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    n, counts = len(samples), collections.Counter(samples)
    return sum((counts[k] - n * p) ** 2 / (n * p) for k, p in exact.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--requests", type=int, default=300, help="requests an arm a round")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = pathlib.Path(scratch)
        target = write_tiny_qwen3(root / "tiny-qwen3")
        draft = pathlib.Path(shutil.copytree(target, root / "tiny-self-draft"))
        rng = random.Random(5)
        prompt = [rng.randrange(3, 500) for _ in range(10)]
        exact = exact_probabilities(hf_model(target), prompt)
        worker = ("--speculative-method", "draft", "--speculative-model", str(draft), "--num-speculative-tokens", "3",
                  "--num-kv-blocks", "24")
        request = dict(token_ids=prompt, max_tokens=LENGTH, ignore_eos=True, temperature=1.0, top_k=TOP_K)
        fits: dict[bool, list[float]] = {True: [], False: []}
        outside = 0
        with running_services(target, root / "logs", worker_args=worker,
                              scheduler_args=("--max-num-batched-tokens", "48")) as svc, svc.channel() as ch:
            for round_ in range(args.rounds):
                for speculative in (True, False):
                    outputs = generate_many(ch, [request | {"speculative": speculative}] * args.requests)
                    samples = [tuple(o.token_ids) for o in outputs]
                    outside += sum(s not in exact for s in samples)
                    fits[speculative].append(goodness_of_fit(samples, exact))
                print(f"round {round_}: speculative {fits[True][-1]:.1f}, plain {fits[False][-1]:.1f}", flush=True)
    df = len(exact) - 1
    print(f"goodness of fit against the exact probabilities (df {df}; an exact sampler: mean ~{df}, sd of the mean "
          f"{(2 * df / args.rounds) ** 0.5:.1f}):")
    for speculative in (True, False):
        values = fits[speculative]
        print(f"  {'speculative' if speculative else 'plain':11s} mean {statistics.mean(values):.1f}  max {max(values):.1f}")
    print(f"outputs outside the target's top {TOP_K}: {outside}")


if __name__ == "__main__":
    main()

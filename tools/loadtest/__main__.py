"""Load-tests the Generation service: sends a dataset of prompts at a chosen arrival rate through
the public Generate (or Chat) stream and reports throughput, TTFT, TPOT, ITL and end-to-end latency.

Workloads beyond plain prompts: --json-schema-ratio constrains a seeded share of the requests with
a JSON schema (structured output); --api chat sends each prompt as a user message through the
model's chat template, with --tool definitions and --tool-choice."""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import uuid

import grpc
import numpy as np

from common.cli import ArgumentParser
from common.pb.llm.v1 import generation_pb2 as pb
from tools.loadtest import datasets, report
from tools.loadtest.client import LoadClient
from tools.loadtest.metrics import RunResult, RunSummary, parse_slos, summarize

# Independent seeded streams, so e.g. changing --num-warmups never changes the measured prompts.
_WARMUP_STREAM, _PROMPT_STREAM, _ARRIVAL_STREAM, _SCHEMA_STREAM = 0, 1, 2, 3


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rate must be positive, got {text}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(part) for part in text.split(",") if part.strip()]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m tools.loadtest", description=__doc__, env_prefix="QWEN3_SERVE_LOADTEST_")
    conn = ap.add_argument_group("connection")
    conn.add_argument("--target", default="127.0.0.1:50051", help="scheduler HOST:PORT")
    conn.add_argument("--token", help="sent as `authorization: Bearer TOKEN` metadata")
    conn.add_argument("--tls-ca", type=pathlib.Path, help="PEM root certificates: connect with TLS and verify the server")
    conn.add_argument("--timeout", type=float, help="per-request deadline in seconds (unset: none)")
    data = ap.add_argument_group("dataset")
    data.add_argument("--dataset", choices=("random", "shared-prefix", "jsonl"), default="random")
    data.add_argument("--dataset-path", type=pathlib.Path, help='jsonl: lines of {"prompt": str, "max_tokens": int?}')
    data.add_argument("--num-prompts", type=_positive_int, default=100)
    data.add_argument("--input-len", type=_positive_int, default=128, help="random prompt / shared-prefix suffix length")
    data.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens (jsonl: when a line has none)")
    data.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in L*[1-r, 1+r]")
    data.add_argument("--prefix-groups", type=_positive_int, default=4, help="shared-prefix: number of prefixes")
    data.add_argument("--prefix-len", type=_positive_int, default=256, help="shared-prefix: tokens per prefix")
    data.add_argument("--ignore-eos", action="store_true", help="jsonl: keep generating past EOS")
    shape = ap.add_argument_group("workload", "what the requests ask besides their prompt")
    shape.add_argument("--api", choices=("generate", "chat"), default="generate",
                       help="chat: each prompt is a user message rendered by the model's chat template")
    shape.add_argument("--json-schema-ratio", type=float, default=0.0, metavar="R",
                       help="share of the requests (seeded) whose output is constrained by --json-schema")
    shape.add_argument("--json-schema", default=None, metavar="SCHEMA|@FILE",
                       help="the JSON schema of constrained requests (default: a list of bounded records)")
    shape.add_argument("--tool", nargs="+", default=[], metavar="JSON|@FILE",
                       help='chat: tools, each {"name", "description", "parameters"}')
    shape.add_argument("--tool-choice", default="auto", help="chat: auto, none, required or a tool's name")
    load = ap.add_argument_group("load")
    load.add_argument("--request-rate", type=_rate, default=float("inf"), help="requests/s (inf: all at once)")
    load.add_argument("--burstiness", type=_rate, default=1.0, help="gamma shape of arrival gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=_positive_int, help="most requests in flight at once")
    load.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent before the run")
    load.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    load.add_argument("--sweep", type=_rates, help="comma-separated request rates to run in turn, e.g. 1,2,4,inf")
    out = ap.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    out.add_argument("--save-json", type=pathlib.Path, help="summary and per-request records")
    out.add_argument("--plot", type=pathlib.Path, help="PNG: latency distributions, or latency vs throughput for --sweep")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.dataset == "jsonl" and args.dataset_path is None:
        ap.error("--dataset jsonl needs --dataset-path")
    if not 0.0 <= args.range_ratio < 1.0:
        ap.error("--range-ratio must be in [0, 1)")
    if args.seed < 0 or args.num_warmups < 0:
        ap.error("--seed and --num-warmups must not be negative")
    if not 0.0 <= args.json_schema_ratio <= 1.0:
        ap.error("--json-schema-ratio must be in [0, 1]")
    if args.tool and args.api != "chat":
        ap.error("--tool needs --api chat")
    try:
        args.json_schema = _text_or_file(args.json_schema) or datasets.DEFAULT_JSON_SCHEMA
        json.loads(args.json_schema)
        args.tools = [_tool(t) for t in args.tool]
    except (OSError, ValueError, KeyError) as exc:
        ap.error(f"--json-schema or --tool: {exc}")
    try:
        args.slos = parse_slos(args.goodput)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def _text_or_file(value: str | None) -> str | None:
    return pathlib.Path(value[1:]).read_text() if value and value.startswith("@") else value


def _tool(value: str) -> pb.Tool:
    spec = json.loads(_text_or_file(value))
    spec = spec.get("function", spec)
    return pb.Tool(name=spec["name"], description=spec.get("description", ""),
                   parameters_json=json.dumps(spec["parameters"]) if "parameters" in spec else "")


def build_prompts(args: argparse.Namespace, info: pb.ModelInfo, rng: np.random.Generator, count: int,
                  schema_rng: np.random.Generator | None = None) -> list[datasets.Prompt]:
    prompts = _dataset(args, info, rng, count)
    if args.json_schema_ratio:
        prompts = datasets.with_json_schema(schema_rng or rng, prompts, args.json_schema_ratio, args.json_schema)
    return prompts


def _dataset(args: argparse.Namespace, info: pb.ModelInfo, rng: np.random.Generator, count: int) -> list[datasets.Prompt]:
    if args.dataset == "jsonl":
        return datasets.jsonl_prompts(
            rng, count, args.dataset_path, default_max_tokens=args.output_len, ignore_eos=args.ignore_eos
        )
    if info.vocab_size == 0:
        raise ValueError("the server reports no vocab size to draw random token ids from")
    lengths = dict(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio)
    if args.dataset == "shared-prefix":
        prompts = datasets.shared_prefix_prompts(
            rng, count, vocab_size=info.vocab_size, num_groups=args.prefix_groups, prefix_len=args.prefix_len, **lengths
        )
    else:
        prompts = datasets.random_prompts(rng, count, vocab_size=info.vocab_size, **lengths)
    longest = max((p.num_prompt_tokens + p.max_tokens for p in prompts), default=0)
    if info.max_model_len and longest > info.max_model_len:
        raise ValueError(f"a prompt plus its output needs {longest} tokens; the model allows {info.max_model_len}")
    return prompts


def _settings(args: argparse.Namespace, info: pb.ModelInfo) -> dict:
    given = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()
             if k not in ("token", "tools")}
    given["tools"] = [t.name for t in args.tools]
    model = {"model": info.model, "vocab_size": info.vocab_size, "max_model_len": info.max_model_len,
             "block_size": info.block_size, "num_kv_blocks": info.num_kv_blocks}
    return {**given, "server": model}


def open_channel(target: str, tls_ca: pathlib.Path | None) -> grpc.aio.Channel:
    if tls_ca is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=tls_ca.read_bytes()))


async def run_load_test(args: argparse.Namespace) -> int:
    rates = args.sweep or [args.request_rate]
    session = uuid.uuid4().hex[:8]  # request ids stay unique when several load tests share a server
    show_progress = not args.disable_tqdm
    async with open_channel(args.target, args.tls_ca) as channel:
        client = LoadClient(channel, timeout_s=args.timeout, token=args.token, api=args.api, tools=args.tools,
                            tool_choice=args.tool_choice)
        try:
            info = await client.model_info()
        except grpc.aio.AioRpcError as exc:
            print(f"GetModelInfo on {args.target} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
        try:
            warmups = build_prompts(args, info, np.random.default_rng([args.seed, _WARMUP_STREAM]), args.num_warmups)
            # Each rate of a sweep gets fresh prompts from the same distribution: reusing them would
            # let later rates hit the prefix cache the earlier ones filled.
            runs = [build_prompts(args, info, np.random.default_rng([args.seed, _PROMPT_STREAM, i]), args.num_prompts,
                                  np.random.default_rng([args.seed, _SCHEMA_STREAM, i]))
                    for i in range(len(rates))]
            if args.api == "chat":
                warmups = await client.as_text(warmups)
                runs = [await client.as_text(prompts) for prompts in runs]
        except ValueError as exc:
            print(f"cannot build the dataset: {exc}", file=sys.stderr)
            return 2
        except grpc.aio.AioRpcError as exc:
            print(f"Detokenize on {args.target} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
        if warmups:
            failed = sum(not r.ok for r in await client.send_all_at_once(warmups, f"lt-{session}-warmup"))
            print(f"warm-up: {len(warmups) - failed}/{len(warmups)} requests completed", file=sys.stderr)
        results: list[RunResult] = []
        summaries: list[RunSummary] = []
        for i, (rate, prompts) in enumerate(zip(rates, runs)):
            results.append(await client.run(
                prompts, id_prefix=f"lt-{session}-r{i}", request_rate=rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, rng=np.random.default_rng([args.seed, _ARRIVAL_STREAM, i]),
                show_progress=show_progress,
            ))
            summaries.append(summarize(results[-1], args.slos))
            print(report.format_summary(summaries[-1], f"{info.model or 'model'} @ {args.target}"))
    if args.sweep:
        print(report.format_sweep_table(summaries))
    if args.save_json:
        report.write_json(args.save_json, _settings(args, info), results, summaries)
    if args.plot:
        if args.sweep:
            report.plot_sweep(args.plot, summaries)
        else:
            report.plot_run(args.plot, results[0], summaries[0])
    return 0 if any(s.completed for s in summaries) else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run_load_test(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

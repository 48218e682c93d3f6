"""`qwen3-serve`: the one command the package installs; its first argument picks the program.

    qwen3-serve write-tiny-model --out models/tiny-qwen3
    qwen3-serve worker    --model models/tiny-qwen3 --port 50061
    qwen3-serve scheduler --model models/tiny-qwen3 --workers 127.0.0.1:50061
    qwen3-serve generate  "Once upon a time" --max-tokens 32
    qwen3-serve gateway   --target 127.0.0.1:50051 --port 8000
    qwen3-serve SUBCOMMAND --help

Each subcommand is exactly `python -m MODULE` with the same arguments (and the same QWEN3_SERVE_*
variables), so the two spellings can be mixed. A subcommand's module is imported only when it
runs, so `qwen3-serve generate` never pays for importing torch.
"""
from __future__ import annotations

import importlib
import pathlib
import shutil
import sys

# name: (module whose main(argv) runs it, one line for the list)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "scheduler": ("scheduler_svc.__main__", "the scheduler: public llm.v1 API, batching, KV-cache blocks"),
    "worker": ("worker_svc.__main__", "a worker: the model on one device (or one tensor-parallel rank)"),
    "gateway": ("gateway.__main__", "OpenAI-compatible HTTP gateway (/v1/chat/completions, ...) to a scheduler"),
    "generate": ("tools.generate", "stream one completion from a running scheduler"),
    "loadtest": ("tools.loadtest.__main__", "serving benchmark: TTFT, TPOT, ITL, throughput, goodput"),
    "write-tiny-model": ("common.tiny_model", "write the small seeded Qwen3 checkpoint the demo and tests use"),
    "healthcheck": ("common.healthcheck", "exit 0 when a server reports SERVING on grpc.health.v1"),
    "protos": ("common.commands", "print the folder of the .proto files, or copy them with --out DIR"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    return "usage: qwen3-serve SUBCOMMAND [ARGS...]\n\nsubcommands:\n" + "\n".join(lines) + "\n\n" + \
        "`qwen3-serve SUBCOMMAND --help` lists a subcommand's flags, their defaults and variables.\n"


def proto_dir() -> pathlib.Path:
    """The .proto sources: inside the installed package, or protos/ of a source checkout."""
    here = pathlib.Path(__file__).resolve().parent
    for candidate in (here / "protos", here.parent / "protos"):
        if any(candidate.rglob("*.proto")):
            return candidate
    raise FileNotFoundError(f"no .proto files beside {here}")


def protos_main(argv: list[str]) -> int:
    from common.cli import ArgumentParser

    parser = ArgumentParser(prog="qwen3-serve protos", env_prefix="QWEN3_SERVE_PROTOS_",
                            description="Where the .proto files of the API are, for code generators of other "
                                        "languages (grpc.health.v1 and grpc.reflection come from gRPC's own packages).")
    parser.add_argument("--out", metavar="DIR", help="copy the .proto tree (llm/v1/..., llm/worker/v1/...) into DIR")
    args = parser.parse_args(argv)
    source = proto_dir()
    if args.out is None:
        print(source)
        return 0
    out = pathlib.Path(args.out)
    for proto in sorted(source.rglob("*.proto")):
        target = out / proto.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(proto, target)
        print(target)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        sys.stderr.write(f"qwen3-serve: unknown subcommand {name!r}\n\n{usage()}")
        return 2
    if name == "protos":
        return protos_main(rest)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())

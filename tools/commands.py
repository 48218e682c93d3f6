"""`qwen3-serve`: the one command the package installs; its first argument picks the program.

    qwen3-serve write-tiny-model --out models/tiny-qwen3
    qwen3-serve worker    --model models/tiny-qwen3 --port 50061
    qwen3-serve scheduler --model models/tiny-qwen3 --workers 127.0.0.1:50061
    qwen3-serve generate  "Once upon a time" --max-tokens 32
    qwen3-serve gateway   --target 127.0.0.1:50051 --port 8000
    qwen3-serve SUBCOMMAND --help

This is where the programs are composed: each subcommand is the main(argv) of one module, exactly
`python -m MODULE` with the same arguments (and the same QWEN3_SERVE_* variables), so the two
spellings can be mixed. A program's module is imported only when it runs, so `qwen3-serve
generate` never pays for importing torch.
"""
from __future__ import annotations

import sys
from types import ModuleType


def load(name: str) -> ModuleType:
    """The module of program `name`: its main(argv) runs it, its build_parser() is its command line."""
    if name == "scheduler":
        import scheduler_svc.__main__ as program
    elif name == "worker":
        import worker_svc.__main__ as program
    elif name == "gateway":
        import gateway.__main__ as program
    elif name == "generate":
        import tools.generate as program
    elif name == "loadtest":
        import tools.loadtest.__main__ as program
    elif name == "write-tiny-model":
        import common.tiny_model as program
    elif name == "healthcheck":
        import common.healthcheck as program
    elif name == "protos":
        import common.proto_files as program
    else:
        raise KeyError(name)
    return program


# name: one line for `qwen3-serve --help`
PROGRAMS: dict[str, str] = {
    "scheduler": "the scheduler: public llm.v1 API, batching, KV-cache blocks",
    "worker": "a worker: the model on one device (or one tensor-parallel rank)",
    "gateway": "OpenAI-compatible HTTP gateway (/v1/chat/completions, ...) to a scheduler",
    "generate": "stream one completion from a running scheduler",
    "loadtest": "serving benchmark: TTFT, TPOT, ITL, throughput, goodput",
    "write-tiny-model": "write the small seeded Qwen3 checkpoint the demo and tests use",
    "healthcheck": "exit 0 when a server reports SERVING on grpc.health.v1",
    "protos": "print the folder of the .proto files, or copy them with --out DIR",
}


def usage() -> str:
    width = max(map(len, PROGRAMS))
    lines = [f"  {name:<{width}}  {summary}" for name, summary in PROGRAMS.items()]
    return "usage: qwen3-serve SUBCOMMAND [ARGS...]\n\nsubcommands:\n" + "\n".join(lines) + "\n\n" + \
        "`qwen3-serve SUBCOMMAND --help` lists a subcommand's flags, their defaults and variables.\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in PROGRAMS:
        sys.stderr.write(f"qwen3-serve: unknown subcommand {name!r}\n\n{usage()}")
        return 2
    return load(name).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())

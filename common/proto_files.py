"""`qwen3-serve protos`: where the .proto files of the API are, for code generators of other
languages; `--out DIR` copies the tree (llm/v1/..., llm/worker/v1/...) into DIR."""
from __future__ import annotations

import pathlib
import shutil

from common.cli import ArgumentParser


def proto_dir() -> pathlib.Path:
    """The .proto sources: inside the installed package, or protos/ of a source checkout."""
    here = pathlib.Path(__file__).resolve().parent
    for candidate in (here / "protos", here.parent / "protos"):
        if any(candidate.rglob("*.proto")):
            return candidate
    raise FileNotFoundError(f"no .proto files beside {here}")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="qwen3-serve protos", env_prefix="QWEN3_SERVE_PROTOS_",
                            description="Where the .proto files of the API are, for code generators of other "
                                        "languages (grpc.health.v1 and grpc.reflection come from gRPC's own packages).")
    parser.add_argument("--out", metavar="DIR", help="copy the .proto tree (llm/v1/..., llm/worker/v1/...) into DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())

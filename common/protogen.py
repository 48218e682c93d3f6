"""Regenerates the gRPC code under common/pb from protos/.

The generated files are committed so the services run without grpcio-tools; a test checks
that they match what this command writes. Run it after editing a .proto:

    python -m common.protogen
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "protos"
# Generated modules live in the common.pb package, so their imports read `from common.pb...`; the
# .proto files import each other by their path under protos/, as any other language's build does.
PACKAGE_PREFIX = "common/pb"
_GENERATED_IMPORT = re.compile(r"^from llm\.", re.MULTILINE)


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    """Writes the generated package tree (common/pb/...) under out_dir."""
    from grpc_tools import protoc  # imported here: only needed to regenerate
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *(p.relative_to(PROTO_DIR).as_posix() for p in proto_files()),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        for path in sorted(pathlib.Path(scratch).rglob("*.py*")):
            target = out_dir / PACKAGE_PREFIX / path.relative_to(scratch)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(_GENERATED_IMPORT.sub("from common.pb.llm.", path.read_text()))
    for pkg_dir in {p.parent for p in (out_dir / PACKAGE_PREFIX).rglob("*_pb2.py")} | {out_dir / PACKAGE_PREFIX}:
        while pkg_dir != out_dir / "common":
            (pkg_dir / "__init__.py").touch()
            pkg_dir = pkg_dir.parent


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()
    generate(REPO)
    print(f"regenerated {PACKAGE_PREFIX} from {len(proto_files())} proto files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

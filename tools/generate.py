"""A command-line client: streams one completion from a running scheduler.

    python -m tools.generate --target 127.0.0.1:50051 "Once upon a time" --max-tokens 32
"""
from __future__ import annotations

import argparse
import sys

import grpc

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--token", default=None, help="bearer token, when the server requires one")
    args = p.parse_args(argv)

    sampling = generation_pb2.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.seed is not None:
        sampling.seed = args.seed
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    with grpc.insecure_channel(args.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for msg in stub.Generate(generation_pb2.GenerateRequest(text=args.prompt, sampling=sampling),
                                     metadata=metadata, timeout=300):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    reason = generation_pb2.FinishReason.Name(msg.finish_reason)
                    print(f"\n[{reason}: {msg.usage.prompt_tokens} prompt tokens, "
                          f"{msg.usage.completion_tokens} generated, {msg.usage.cached_prompt_tokens} cached]")
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A command-line client: streams one completion from a running scheduler to stdout.

    python -m tools.generate --target 127.0.0.1:50051 "Once upon a time" --max-tokens 32

Exits 0 when the request finished, 1 when the server refused or failed it (the status is printed).
"""
from __future__ import annotations

import sys

from common.cli import ArgumentParser
from common.client import Client, RequestError


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m tools.generate", description=__doc__, env_prefix="QWEN3_SERVE_GENERATE_")
    p.add_argument("prompt")
    p.add_argument("--target", default=None, help="scheduler HOST:PORT (unset: $QWEN3_SERVE_TARGET, else 127.0.0.1:50051)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of the whole request, in seconds")
    p.add_argument("--token", default=None, help="bearer token, when the server requires one")
    p.add_argument("--token-file", default=None, help="file holding the bearer token")
    p.add_argument("--tls-ca", default=None, metavar="PATH", help="connect over TLS, trusting this PEM CA")
    args = p.parse_args(argv)

    try:
        with Client(args.target, timeout=args.timeout, ca_file=args.tls_ca, token=args.token,
                    token_file=args.token_file) as client:
            for chunk in client.stream(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                       top_p=args.top_p, seed=args.seed):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    usage = chunk.usage
                    print(f"\n[{chunk.finish_reason}: {usage.prompt_tokens} prompt tokens, "
                          f"{usage.completion_tokens} generated, {usage.cached_prompt_tokens} cached]")
    except RequestError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:   # unreadable token or CA file
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())

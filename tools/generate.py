"""A command-line client: streams one completion (or one chat turn) from a running scheduler to stdout.

    python -m tools.generate --target 127.0.0.1:50051 "Once upon a time" --max-tokens 32
    python -m tools.generate "A user record:" --json-schema @user.schema.json
    python -m tools.generate "Pick one:" --regex "(red|green|blue)" --n 3 --temperature 1 --seed 7
    python -m tools.generate --chat "Weather in Paris?" --tool @get_weather.json --tool-choice required
    python -m tools.generate --tokenize "Hello world"

Every field of the client's SamplingParams is a flag named after it (--top-p, --logprobs, --stop A B,
--stop-token-ids 7 9, --json-schema, ...; a mapping takes KEY=VALUE entries). Flags whose value may
be long (--json-schema, --grammar, --tool) read a file when it starts with `@`. Samples (--n > 1)
are printed one after the other once all are done; a single sample streams. With --logprobs or
--top-logprobs, each token's log-probabilities follow the text on stderr.

Exits 0 when the request finished, 1 when the server refused or failed it (the status is printed).
"""
from __future__ import annotations

import json
import sys

from common.cli import ArgumentParser
from common.client import Client, RequestError, Tool
from tools.sampling_flags import add_sampling_flags, sampling_options, text_or_file

# This command's defaults where they differ from the server's: short and greedy.
_DEFAULTS = {"max_tokens": 32, "temperature": 0.0}


def _tool(value: str) -> Tool:
    spec = json.loads(text_or_file(value))
    spec = spec.get("function", spec)
    return Tool(spec["name"], spec.get("description", ""), spec.get("parameters"))


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m tools.generate", description=__doc__, env_prefix="QWEN3_SERVE_GENERATE_")
    p.add_argument("prompt")
    p.add_argument("--target", default=None, help="scheduler HOST:PORT (unset: $QWEN3_SERVE_TARGET, else 127.0.0.1:50051)")
    add_sampling_flags(p, _DEFAULTS)
    chat = p.add_argument_group("chat", "send the prompt as a user message to the Chat RPC")
    chat.add_argument("--chat", action="store_true")
    chat.add_argument("--system", default=None, help="a system message before it")
    chat.add_argument("--tool", nargs="+", default=[], metavar="JSON|@FILE",
                      help='tools, each {"name", "description", "parameters": JSON schema}')
    chat.add_argument("--tool-choice", default="auto", help="auto, none, required or a tool's name")
    chat.add_argument("--thinking", choices=("on", "off"), default=None,
                      help="the chat template's enable_thinking (unset: the template's default)")
    p.add_argument("--tokenize", action="store_true", help="print the prompt's token ids and exit")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of the whole request, in seconds")
    p.add_argument("--token", default=None, help="bearer token, when the server requires one")
    p.add_argument("--token-file", default=None, help="file holding the bearer token")
    p.add_argument("--tls-ca", default=None, metavar="PATH", help="connect over TLS, trusting this PEM CA")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    try:
        options = sampling_options(args)
        tools = [_tool(t) for t in args.tool]
        with Client(args.target, timeout=args.timeout, ca_file=args.tls_ca, token=args.token,
                    token_file=args.token_file) as client:
            if args.tokenize:
                print(" ".join(map(str, client.tokenize(args.prompt))))
            elif args.chat:
                messages = ([{"role": "system", "content": args.system}] if args.system else [])
                messages.append({"role": "user", "content": args.prompt})
                _chat(client, messages, tools, args, options)
            elif (args.n or 1) > 1:
                out = client.generate(args.prompt, **options)
                for sample in out.samples:
                    print(f"--- sample {sample.index}")
                    _print_completion(sample)
            else:
                _stream(client, args.prompt, options)
    except RequestError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError, KeyError) as e:   # unreadable files, bad JSON, two constraints
        p.error(str(e))
    return 0


def _stream(client: Client, prompt: str, options: dict) -> None:
    logprobs, tops, prompt_logprobs = [], [], None
    for chunk in client.stream(prompt, **options):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        logprobs += [(t, lp) for t, lp in zip(chunk.token_ids, chunk.logprobs or ())]
        tops += chunk.top_logprobs or ()
        prompt_logprobs = prompt_logprobs or chunk.prompt_logprobs
        if chunk.finish_reason:
            _print_ending(chunk.finish_reason, chunk.usage, chunk.matched_stop)
    _print_logprobs(logprobs, tops, prompt_logprobs)


def _print_completion(out) -> None:
    print(out.text)
    _print_ending(out.finish_reason, out.usage, out.matched_stop)
    _print_logprobs(list(zip(out.token_ids, out.logprobs or ())), out.top_logprobs or [], out.prompt_logprobs)


def _chat(client: Client, messages: list, tools: list, args, options: dict) -> None:
    reasoning = False
    for chunk in client.stream_chat(messages, tools=tools, tool_choice=args.tool_choice,
                                    enable_thinking=None if args.thinking is None else args.thinking == "on",
                                    **options):
        if chunk.reasoning:
            sys.stdout.write(("<think>" if not reasoning else "") + chunk.reasoning)
            reasoning = True
        if chunk.text:
            sys.stdout.write(("</think>\n" if reasoning else "") + chunk.text)
            reasoning = False
        for call in chunk.tool_calls:
            print(f"\n[tool call {call.id}: {call.name}({json.dumps(call.arguments, ensure_ascii=False)})]")
        sys.stdout.flush()
        if chunk.finish_reason:
            prefix = f"[sample {chunk.index}] " if (args.n or 1) > 1 else ""
            print(f"\n{prefix}", end="")
            _print_ending(chunk.finish_reason, chunk.usage, chunk.matched_stop)


def _print_ending(reason: str, usage, matched_stop: str | None) -> None:
    stop = f", matched {matched_stop!r}" if matched_stop else ""
    print(f"\n[{reason}{stop}: {usage.prompt_tokens} prompt tokens, {usage.completion_tokens} generated, "
          f"{usage.cached_prompt_tokens} cached]")


def _print_logprobs(logprobs: list, tops: list, prompt_logprobs: list | None) -> None:
    if prompt_logprobs:
        print("prompt logprobs: " + " ".join(f"{lp:.3f}" for lp in prompt_logprobs), file=sys.stderr)
    for i, (token_id, logprob) in enumerate(logprobs):
        top = ""
        if i < len(tops):
            top = "  top: " + ", ".join(f"{t}:{v:.3f}" for t, v in zip(*tops[i]))
        print(f"token {token_id}: {logprob:.3f}{top}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

"""xgrammar against llguidance on what structured output must guarantee, then on speed.

Both libraries build a token bitmask from a grammar; what differs is what their grammars let
through. For each random JSON schema (tests/support/constraint_cases.py) and each regex, every backend
samples several outputs from random logits under its mask (the same logits stream for both, so
only the masks differ) and the script counts:
  - outputs that `json.loads` (strict: no raw control characters in strings) rejects,
  - outputs that do not validate against their schema (`jsonschema`), or that do not fullmatch,
  - outputs that did not finish within --max-tokens (a grammar that lets a weak model loop),
  - the longest whitespace run outside strings (JSON is compact by default here),
and the time to compile a grammar and to fill one mask + accept one token.
Both libraries run in their compact JSON mode (xgrammar: any_whitespace=False with "," and ":"
separators, as vLLM's disable-any-whitespace; llguidance: whitespace_flexible=False); the row
"service" is xgrammar as this service drives it (common/constraint.py).

    python -m bench.structured_output_choice [--model DIR] [--schemas 30] [--samples 3] [--out out.json]

llguidance is optional (`pip install llguidance==1.9.1`); without it only xgrammar runs.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import tempfile
import time

import torch

from common.tiny_model import write_tiny_qwen3
from tests.support.constraint_cases import REGEXES, random_schemas, whitespace_run

class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, kind: str, text: str):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        return self.compiler.compile_regex(text)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def finished(self, matcher) -> bool:
        return matcher.is_terminated()


class ServiceBackend(XGrammarBackend):
    """xgrammar as this service compiles it (common/constraint.py: compact JSON, fixed strings,
    special tokens masked; worker_svc/layers/grammar.py)."""
    name = "service"

    def __init__(self, hf_tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        from worker_svc.layers.grammar import GrammarCompiler
        super().__init__(hf_tokenizer, vocab_size, stop_ids)
        self.service = GrammarCompiler(hf_tokenizer, vocab_size, stop_ids)

    def compile(self, kind: str, text: str):
        from common.constraint import Constraint
        return self.service.compile(Constraint(kind, text))


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=stop_ids[0])

    def compile(self, kind: str, text: str):
        if kind == "json_schema":
            grammar = self.llg.LLMatcher.grammar_from_json_schema(text, overrides={"whitespace_flexible": False})
        else:
            grammar = self.llg.LLMatcher.grammar_from_regex(text)
        # Compiling happens when a matcher is built; building one here times it, as for xgrammar.
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def finished(self, matcher) -> bool:
        return matcher.is_stopped()


def sample_one(backend, compiled, logits_stream: torch.Tensor, vocab_size: int, stop_ids: set[int]):
    """Random-logits sampling under the mask; returns (ids, finished, seconds in fill+accept)."""
    import xgrammar as xgr
    matcher = backend.matcher(compiled)
    bitmask = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32).unsqueeze(0)
    ids, busy = [], 0.0
    for step in range(logits_stream.shape[0]):
        start = time.perf_counter()
        backend.fill(matcher, bitmask)
        busy += time.perf_counter() - start
        logits = logits_stream[step: step + 1].clone()
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=torch.Generator().manual_seed(step)))
        start = time.perf_counter()
        if not backend.accept(matcher, token):
            raise AssertionError(f"{backend.name} masked in token {token} and then refused it")
        busy += time.perf_counter() - start
        if token in stop_ids:
            return ids, True, busy, step + 1
        ids.append(token)
        if backend.finished(matcher):
            return ids, True, busy, step + 1
    return ids, False, busy, logits_stream.shape[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=pathlib.Path, help="model directory (default: the tiny checkpoint)")
    parser.add_argument("--schemas", type=int, default=30)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--device", default="cpu", help="only cpu: grammar engines run on the host")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()

    import jsonschema
    from transformers import AutoTokenizer

    model_dir = args.model or write_tiny_qwen3(pathlib.Path(tempfile.mkdtemp()) / "tiny-qwen3")
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = config["vocab_size"]
    stop_ids = [hf_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    backends = [XGrammarBackend(hf_tokenizer, vocab_size, stop_ids), ServiceBackend(hf_tokenizer, vocab_size, stop_ids)]
    try:
        backends.append(LLGuidanceBackend(hf_tokenizer, vocab_size, stop_ids))
    except ImportError:
        print("llguidance is not installed: xgrammar only")

    cases = [("json_schema", json.dumps(s)) for s in random_schemas(seed=0, count=args.schemas)]
    cases += [("regex", r) for r in REGEXES]
    generator = torch.Generator().manual_seed(0)
    streams = {(i, k): torch.randn(args.max_tokens, vocab_size, generator=generator) * 4
               for i in range(len(cases)) for k in range(args.samples)}

    results = {}
    for backend in backends:
        stats = {"compile_ms": [], "token_us": [], "bad_json": 0, "invalid": 0, "unfinished": 0,
                 "compile_errors": 0, "max_ws_run": 0, "outputs": 0, "examples": []}
        for i, (kind, text) in enumerate(cases):
            start = time.perf_counter()
            try:
                compiled = backend.compile(kind, text)
            except Exception as exc:   # noqa: BLE001 - a backend's refusal is a result here
                stats["compile_errors"] += 1
                stats["examples"].append(f"compile {kind} {text[:80]}: {exc}"[:300])
                continue
            stats["compile_ms"].append((time.perf_counter() - start) * 1e3)
            for k in range(args.samples):
                ids, finished, busy, steps = sample_one(backend, compiled, streams[(i, k)], vocab_size, set(stop_ids))
                stats["token_us"].append(busy / steps * 1e6)
                stats["outputs"] += 1
                out = hf_tokenizer.decode(ids)
                if not finished:
                    stats["unfinished"] += 1
                    continue
                if kind == "regex":
                    if not re.fullmatch(text, out):
                        stats["invalid"] += 1
                        stats["examples"].append(f"regex {text}: {out!r}")
                    continue
                stats["max_ws_run"] = max(stats["max_ws_run"], whitespace_run(out))
                try:
                    value = json.loads(out)
                except json.JSONDecodeError as exc:
                    stats["bad_json"] += 1
                    stats["examples"].append(f"json {out!r}: {exc}"[:300])
                    continue
                errors = list(jsonschema.Draft202012Validator(json.loads(text)).iter_errors(value))
                if errors:
                    stats["invalid"] += 1
                    stats["examples"].append(f"schema {text[:120]} output {out!r}: {errors[0].message}"[:400])
        results[backend.name] = {
            **{k: v for k, v in stats.items() if k not in ("compile_ms", "token_us")},
            "compile_ms_median": statistics.median(stats["compile_ms"]) if stats["compile_ms"] else None,
            "token_us_median": statistics.median(stats["token_us"]) if stats["token_us"] else None,
        }

    if args.out:
        args.out.write_text(json.dumps({"cases": len(cases), "samples": args.samples, "results": results}, indent=2))
    for name, r in results.items():
        for example in r["examples"][:8]:
            print(f"[{name}] {example}")
    header = f"{'backend':<11} {'outputs':>7} {'bad_json':>8} {'invalid':>7} {'unfinished':>10} {'compile_err':>11} " \
             f"{'max_ws':>6} {'compile_ms':>10} {'token_us':>8}"
    print(header)
    for name, r in results.items():
        print(f"{name:<11} {r['outputs']:>7} {r['bad_json']:>8} {r['invalid']:>7} {r['unfinished']:>10} "
              f"{r['compile_errors']:>11} {r['max_ws_run']:>6} {r['compile_ms_median']:>10.2f} {r['token_us_median']:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

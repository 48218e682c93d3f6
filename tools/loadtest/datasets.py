"""The prompts a load test sends: random token ids, shared-prefix groups, or a user's JSONL file,
and what shapes their outputs (a JSON schema on a seeded share of them)."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Prompt:
    """One request to send: token ids or text, and how many tokens to ask for."""

    max_tokens: int | None
    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    # Synthetic datasets set it so the requested output length always holds.
    ignore_eos: bool = False
    json_schema: str | None = None   # structured output: the text must validate against it
    temperature: float | None = None  # None: the server's default

    @property
    def num_prompt_tokens(self) -> int | None:
        """Known locally for token-id prompts; text prompts are counted by the server."""
        return None if self.token_ids is None else len(self.token_ids)


# What a load test constrains by default (--json-schema-ratio): records whose strings and item
# counts are bounded, so the grammar stays open for hundreds of tokens and every output token is
# sampled under its mask (with ignore_eos, the tokens past a completed document are EOS).
DEFAULT_JSON_SCHEMA = json.dumps({
    "type": "array", "minItems": 1, "maxItems": 256,
    "items": {"type": "object", "required": ["id", "name", "tags", "score", "ok"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "naïve", "東京"]}, "maxItems": 4},
        "score": {"type": "number", "minimum": -100, "maximum": 100},
        "ok": {"type": "boolean"},
    }},
})


def sample_lengths(rng: np.random.Generator, mean_len: int, range_ratio: float, count: int) -> np.ndarray:
    """Integer lengths uniform in [floor(L*(1-r)), ceil(L*(1+r))], at least 1 (vLLM's random dataset)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean_len * (1 - range_ratio)))
    high = max(low, math.ceil(mean_len * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count)


def _random_ids(rng: np.random.Generator, vocab_size: int, length: int) -> tuple[int, ...]:
    return tuple(int(i) for i in rng.integers(0, vocab_size, size=length))


def random_prompts(
    rng: np.random.Generator, count: int, *, vocab_size: int, input_len: int, output_len: int, range_ratio: float
) -> list[Prompt]:
    """Prompts of random token ids below vocab_size; ignore_eos makes every output exactly max_tokens long."""
    input_lens = sample_lengths(rng, input_len, range_ratio, count)
    output_lens = sample_lengths(rng, output_len, range_ratio, count)
    return [
        Prompt(max_tokens=int(out_len), token_ids=_random_ids(rng, vocab_size, int(in_len)), ignore_eos=True)
        for in_len, out_len in zip(input_lens, output_lens)
    ]


def shared_prefix_prompts(
    rng: np.random.Generator,
    count: int,
    *,
    vocab_size: int,
    num_groups: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
) -> list[Prompt]:
    """Prompts in num_groups groups; a group's prompts share one prefix_len-token "system prompt",
    followed by a random suffix of about input_len tokens. Groups take turns, so requests of one
    group are spread over the run and later ones find the prefix in the server's cache."""
    if num_groups < 1:
        raise ValueError("need at least one prefix group")
    prefixes = [_random_ids(rng, vocab_size, prefix_len) for _ in range(num_groups)]
    suffixes = random_prompts(
        rng, count, vocab_size=vocab_size, input_len=input_len, output_len=output_len, range_ratio=range_ratio
    )
    return [
        Prompt(max_tokens=p.max_tokens, token_ids=prefixes[i % num_groups] + p.token_ids, ignore_eos=True)
        for i, p in enumerate(suffixes)
    ]


def jsonl_prompts(
    rng: np.random.Generator, count: int, path: pathlib.Path, *, default_max_tokens: int, ignore_eos: bool
) -> list[Prompt]:
    """count prompts from a file of {"prompt": str, "max_tokens": int?} lines, in a seeded shuffled
    order, cycling through the file when it has fewer lines than count."""
    entries = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            text, max_tokens = entry["prompt"], entry.get("max_tokens", default_max_tokens)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f'{path}:{line_no}: expected {{"prompt": str, "max_tokens": int?}}: {exc}') from exc
        if not isinstance(text, str) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{path}:{line_no}: prompt must be a string and max_tokens a positive integer")
        entries.append(Prompt(max_tokens=max_tokens, text=text, ignore_eos=ignore_eos))
    if not entries:
        raise ValueError(f"{path} holds no prompts")
    order = rng.permutation(len(entries))
    return [entries[order[i % len(entries)]] for i in range(count)]


def with_json_schema(rng: np.random.Generator, prompts: list[Prompt], ratio: float, schema: str) -> list[Prompt]:
    """The prompts, a seeded share `ratio` of them constrained by `schema`."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"the JSON schema ratio must be in [0, 1], got {ratio}")
    chosen = rng.random(len(prompts)) < ratio
    return [dataclasses.replace(p, json_schema=schema) if c else p for p, c in zip(prompts, chosen)]

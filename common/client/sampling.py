"""How to sample, as the clients take it: `SamplingParams`, whose fields are llm.v1's
SamplingParams fields by name (the constraint oneof as its four members), and `SamplingOptions`,
the same fields as keyword arguments. None (or False, or empty) leaves an option to the server's
default. Each field's metadata holds its help line (tools/generate.py makes a flag of each field).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from common.pb.llm.v1 import generation_pb2 as pb
from common.sampling_bounds import (FLOAT_RANGES, LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS_ENTRIES, MAX_N, MAX_STOP_STRINGS,
                                    MAX_TOP_LOGPROBS)

CONSTRAINTS = ("json_schema", "regex", "grammar", "json_object")   # llm.v1's oneof: one at most


def _option(default: Any, meaning: str, **metadata: str) -> Any:
    return field(default=default, metadata={"help": meaning, **metadata})


def _bounded(name: str, meaning: str) -> str:
    return f"{FLOAT_RANGES[name]}; {meaning}"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; None (or False, or empty) leaves an option to the server's default."""
    max_tokens: int | None = _option(None, "unset: up to the model's context limit")
    temperature: float | None = _option(None, _bounded("temperature", "0 is greedy; unset means 1.0"))
    top_p: float | None = _option(None, _bounded("top_p", "unset means 1.0"))
    top_k: int | None = _option(None, "unset or 0: no top-k")
    min_p: float | None = _option(None, _bounded("min_p", "unset means 0"))
    seed: int | None = _option(None, "same seed and prompt: same tokens, whatever the batch")
    min_tokens: int | None = _option(None, "EOS and stop tokens are ignored before this many tokens")
    ignore_eos: bool = _option(False, "generate past EOS")
    stop: Sequence[str] = _option((), f"up to {MAX_STOP_STRINGS} stop strings, left out of the text")
    stop_token_ids: Sequence[int] = _option((), "token ids that end the output")
    repetition_penalty: float | None = _option(None, _bounded("repetition_penalty", "1 means none"))
    presence_penalty: float | None = _option(None, _bounded("presence_penalty", "unset means 0"))
    frequency_penalty: float | None = _option(None, _bounded("frequency_penalty", "unset means 0"))
    logprobs: bool = _option(False, "return each sampled token's log-probability")
    skip_special_tokens: bool = _option(False, "leave special tokens out of the text")
    n: int | None = _option(None, f"independent samples of the prompt, 1..{MAX_N}")
    top_logprobs: int | None = _option(None, f"0..{MAX_TOP_LOGPROBS} most likely tokens per sampled token "
                                             "(implies logprobs)")
    prompt_logprobs: bool = _option(False, "each prompt token's log-probability given the ones before it")
    json_schema: dict[str, Any] | str | None = _option(None, "structured output: a JSON schema (a dict or its text)")
    regex: str | None = _option(None, "structured output: the whole text fullmatches it")
    grammar: str | None = _option(None, "structured output: EBNF as xgrammar reads it (root ::= ...)")
    json_object: bool = _option(False, "structured output: any JSON object")
    priority: int | None = _option(None, "lower is served first; unset means 0")
    logit_bias: Mapping[int, float] | None = _option(
        None, f"token id -> {LOGIT_BIAS_RANGE} added to its logit (at most {MAX_LOGIT_BIAS_ENTRIES} ids)",
        metavar="ID=BIAS")
    speculative: bool | None = _option(None, "false: keep this request out of speculative decoding (unset: true)")

    def banning(self, token_ids: Iterable[int]) -> "SamplingParams":
        """These options with the lowest bias the server takes on each of `token_ids`."""
        bias = dict(self.logit_bias or {})
        bias.update((token_id, LOGIT_BIAS_RANGE.low) for token_id in token_ids)
        return dataclasses.replace(self, logit_bias=bias)

    def to_proto(self) -> pb.SamplingParams:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        given = [name for name in CONSTRAINTS if values[name] not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"give one constraint, not {' and '.join(given)}")
        if isinstance(values["json_schema"], dict):
            values["json_schema"] = json.dumps(values["json_schema"])
        if not values["json_object"]:
            del values["json_object"]   # a oneof member: set only when asked
        return pb.SamplingParams(**{name: value for name, value in values.items() if value is not None})


class SamplingOptions(TypedDict, total=False):
    """SamplingParams' fields as keyword arguments (for type checkers)."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    min_tokens: int
    ignore_eos: bool
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: bool
    skip_special_tokens: bool
    n: int
    top_logprobs: int
    prompt_logprobs: bool
    json_schema: dict[str, Any] | str
    regex: str
    grammar: str
    json_object: bool
    priority: int
    logit_bias: Mapping[int, float]
    speculative: bool


def with_options(sampling: SamplingParams | None, options: Mapping[str, Any]) -> SamplingParams:
    """`sampling` (or the defaults) with the keyword options over it; TypeError names the known ones."""
    try:
        return dataclasses.replace(sampling or SamplingParams(), **options)
    except TypeError as exc:
        known = ", ".join(f.name for f in dataclasses.fields(SamplingParams))
        raise TypeError(f"{exc}; sampling options are: {known}") from None

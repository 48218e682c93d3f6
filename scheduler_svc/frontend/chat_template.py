"""A model's chat template, rendered as transformers' `apply_chat_template(..., tokenize=False)`
renders it, without transformers: the frontend process then imports neither transformers nor
torch (seconds of start-up and ~300 MB per frontend process, for one Jinja render per chat).

The template is read from the model directory as transformers 5 reads it: `chat_template.jinja`,
else `chat_template` in tokenizer_config.json (a string, or a list of named templates of which
`tool_use` serves requests with tools and `default` the rest). It sees what transformers passes:
the messages (keys whose value is None dropped; reasoning under `reasoning_content` and
`thinking`), `tools`, `documents`, `add_generation_prompt`, the named special tokens (bos_token,
eos_token, ...) and the caller's keywords (enable_thinking), in the same sandboxed environment:
`trim_blocks`, `lstrip_blocks`, loop controls, `{% generation %}` blocks, and the globals and
filters transformers defines (`raise_exception`, `strftime_now`, a `tojson` that does not escape
HTML). tests/unit/test_chat.py compares every render with transformers'.
"""
from __future__ import annotations

import datetime
import json
import pathlib
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training masks):
    rendered as its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace(), refusing underscore-prefixed attributes (as transformers' does)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store the attribute {name!r} on a namespace")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_Namespace,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


class ChatTemplate:
    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str]) -> None:
        """`templates`: the model's template under "default" (and "tool_use" where it has one)."""
        env = _environment()
        self.sources = templates
        self._compiled = {name: env.from_string(source) for name, source in templates.items()}
        self.special_tokens = special_tokens

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text; a template's own refusal raises jinja2.TemplateError."""
        name = "tool_use" if tools is not None and "tool_use" in self._compiled else "default"
        template = self._compiled.get(name)
        if template is None:
            raise ValueError(f"the model's chat templates are {sorted(self._compiled)}: none is named 'default'")
        chat = [_aliased({k: v for k, v in m.items() if v is not None}) for m in messages]
        return template.render(messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                               **{**self.special_tokens, **kwargs})


def _aliased(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def load_chat_template(model_dir: pathlib.Path, tokenizer_config: dict[str, Any]) -> ChatTemplate | None:
    """The directory's chat template (None if it has none), with the named special tokens of
    tokenizer_config.json (and of a legacy special_tokens_map.json)."""
    jinja_file = model_dir / "chat_template.jinja"
    source = jinja_file.read_text() if jinja_file.is_file() else tokenizer_config.get("chat_template")
    if source is None:
        return None
    templates = ({t["name"]: t["template"] for t in source} if isinstance(source, list) else {"default": source})
    legacy = model_dir / "special_tokens_map.json"
    named = {**(json.loads(legacy.read_text()) if legacy.is_file() else {}), **tokenizer_config}
    special_tokens = {}
    for key in SPECIAL_TOKEN_NAMES:
        value = named.get(key)
        if isinstance(value, dict):       # a serialized AddedToken
            value = value.get("content")
        if value is not None:
            special_tokens[key] = str(value)
    return ChatTemplate(templates, special_tokens)

"""The scheduler's flags for the request limits (scheduler_svc/frontend/validation.py's Limits):
each flag's name, default (the Limits field's) and help are written once, here."""
from __future__ import annotations

import argparse
import dataclasses

from scheduler_svc.frontend.validation import DEFAULT_LIMITS, Limits

# Flag, Limits field, help. Each limit is checked before the work it bounds; a request past one
# is INVALID_ARGUMENT naming the field.
LIMIT_FLAGS = (
    ("--max-prompt-bytes", "max_prompt_bytes", "UTF-8 bytes of a text prompt (before tokenizing), of a Tokenize text, "
                                               "and of all the text of a chat (before rendering)"),
    ("--max-chat-messages", "max_chat_messages", "messages in one chat request"),
    ("--max-tools", "max_tools", "tools in one chat request"),
    ("--max-tool-call-argument-bytes", "max_tool_call_argument_bytes", "UTF-8 bytes of one tool call's arguments"),
    ("--max-json-depth", "max_json_depth", "nesting depth of a json_schema, a tool's parameters or a tool call's "
                                           "arguments"),
    ("--max-json-schema-nodes", "max_json_schema_nodes", "JSON values in a json_schema, or in the tools' parameters "
                                                         "together"),
    ("--max-constraint-bytes", "max_constraint_bytes", "UTF-8 bytes of a json_schema or grammar"),
    ("--max-regex-bytes", "max_regex_bytes", "UTF-8 bytes of a regex"),
    ("--max-detokenize-ids", "max_detokenize_ids", "token ids of one Detokenize call"),
    ("--max-priority", "max_priority", "priorities -N..N are accepted (lower first); 0: priority is off, a request "
                                       "setting one is refused"),
)


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("request limits", "bounds each request must keep, checked before the work they "
                                                   "bound; past one: INVALID_ARGUMENT naming the field")
    for flag, field, help_text in LIMIT_FLAGS:
        group.add_argument(flag, type=int, default=getattr(DEFAULT_LIMITS, field), help=help_text)


def limits_from_args(args: argparse.Namespace) -> Limits:
    return dataclasses.replace(DEFAULT_LIMITS, **{field: getattr(args, field) for _, field, _ in LIMIT_FLAGS})


def check_limit_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (p.error) a limit that would refuse everything: every one is positive, but
    --max-priority may be 0 (priority off)."""
    for flag, field, _ in LIMIT_FLAGS:
        lowest = 0 if field == "max_priority" else 1
        if getattr(args, field) < lowest:
            p.error(f"{flag} must be at least {lowest}, got {getattr(args, field)}")

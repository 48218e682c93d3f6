"""The scheduler's flags for the request limits: the flag() fields of
scheduler_svc/frontend/validation.py's Limits, each checked before the work it bounds."""
from __future__ import annotations

import argparse
import dataclasses

from common.cli import CLI_METADATA, ArgumentParser, add_config_arguments, config_from_args
from scheduler_svc.frontend.validation import REQUEST_LIMITS, Limits

LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(Limits) if CLI_METADATA in f.metadata)


def add_limit_arguments(p: ArgumentParser) -> None:
    add_config_arguments(p, Limits, {REQUEST_LIMITS: "bounds each request must keep, checked before the work they "
                                                     "bound; past one: INVALID_ARGUMENT naming the field"})


def limits_from_args(args: argparse.Namespace) -> Limits:
    return config_from_args(Limits, args)


def check_limit_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (p.error) a limit that would refuse everything: every one is positive, but
    --max-priority may be 0 (priority off)."""
    for field in LIMIT_FIELDS:
        lowest = 0 if field == "max_priority" else 1
        if getattr(args, field) < lowest:
            p.error(f"--{field.replace('_', '-')} must be at least {lowest}, got {getattr(args, field)}")

"""Flags generated from config dataclasses (common.cli.flag): each field's default, help, choices
and variable written once, the parser built from them and the dataclass built back; hidden
aliases of renamed flags; and docs/FLAGS.md equal to what the programs' parsers say."""
from __future__ import annotations

import argparse
import contextlib
import io
from dataclasses import dataclass

import pytest

from common.cli import ArgumentParser, add_config_arguments, config_from_args, flag


@dataclass(frozen=True)
class ToyConfig:
    model: str = flag(help="the model")
    max_num_seqs: int | None = flag(None, help="requests per step (unset: the worker's)")
    dtype: str = flag("auto", choices=("auto", "float32"), help="the dtype")
    enforce_eager: bool = flag(False, help="no graphs")
    async_scheduling: bool = flag(True, group="engine", help="one step behind")
    step_timeout_s: float = flag(300.0, name="--step-timeout", aliases=("--step-deadline",), group="engine",
                                 help="seconds")
    internal: int = 7


def toy_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="toy")
    add_config_arguments(parser, ToyConfig, {"engine": "the engine's settings"})
    return parser


def help_text(parser: ArgumentParser) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    return " ".join(out.getvalue().split())


def test_a_config_parses_back_from_its_flags_with_the_fields_defaults():
    config = config_from_args(ToyConfig, toy_parser().parse_args(["--model", "m"]))
    assert config == ToyConfig(model="m")
    config = config_from_args(ToyConfig, toy_parser().parse_args(
        ["--model", "m", "--max-num-seqs", "4", "--dtype", "float32", "--enforce-eager", "--no-async-scheduling",
         "--step-timeout", "5"]), internal=9)
    assert config == ToyConfig("m", 4, "float32", True, False, 5.0, 9)


def test_types_choices_and_required_come_from_the_field(capsys):
    with pytest.raises(SystemExit):
        toy_parser().parse_args([])
    assert "the following arguments are required: --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        toy_parser().parse_args(["--model", "m", "--max-num-seqs", "many"])
    assert "invalid int value: 'many'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        toy_parser().parse_args(["--model", "m", "--dtype", "float8"])
    assert "invalid choice: 'float8'" in capsys.readouterr().err


def test_help_shows_each_fields_help_default_variable_and_group():
    text = help_text(toy_parser())
    assert "requests per step (unset: the worker's) (default: unset; env QWEN3_SERVE_MAX_NUM_SEQS)" in text
    assert "--no-async-scheduling one step behind (default: off; env QWEN3_SERVE_NO_ASYNC_SCHEDULING)" in text
    assert "engine: the engine's settings" in text
    assert "--step-timeout STEP_TIMEOUT seconds (default: 300.0; env QWEN3_SERVE_STEP_TIMEOUT)" in text
    assert "internal" not in text


def test_a_renamed_flag_keeps_its_old_spelling_and_variable_hidden(monkeypatch):
    parser = toy_parser()
    assert parser.parse_args(["--model", "m", "--step-deadline", "7"]).step_timeout_s == 7.0
    assert "step-deadline" not in help_text(parser) and "STEP_DEADLINE" not in help_text(parser)
    monkeypatch.setenv("QWEN3_SERVE_STEP_DEADLINE", "8")
    assert parser.parse_args(["--model", "m"]).step_timeout_s == 8.0
    monkeypatch.setenv("QWEN3_SERVE_STEP_TIMEOUT", "9")         # the new variable wins over the old
    assert parser.parse_args(["--model", "m"]).step_timeout_s == 9.0
    assert parser.parse_args(["--model", "m", "--step-deadline", "1"]).step_timeout_s == 1.0
    monkeypatch.delenv("QWEN3_SERVE_STEP_TIMEOUT")
    monkeypatch.delenv("QWEN3_SERVE_STEP_DEADLINE")
    assert parser.parse_args(["--model", "m"]).step_timeout_s == 300.0


def test_a_field_of_a_type_argparse_cannot_read_needs_its_own():
    @dataclass
    class Odd:
        pairs: dict = flag(None, help="?")

    with pytest.raises(TypeError, match="Odd.pairs: a flag of type"):
        add_config_arguments(ArgumentParser(prog="odd"), Odd)


def test_flags_md_is_what_the_parsers_say():
    from tools.flags_doc import FLAGS_MD, render

    assert FLAGS_MD.read_text() == render(), "docs/FLAGS.md is stale: run python -m tools.flags_doc"


def test_flags_md_has_a_table_per_program_with_every_flag():
    from tools.commands import PROGRAMS, load
    from tools.flags_doc import render

    text = render()
    for name in PROGRAMS:
        assert f"## qwen3-serve {name}\n" in text
        for action in load(name).build_parser()._actions:
            shown = action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
            for option in action.option_strings if shown else ():
                assert f"`{option}`" in text, f"{name} {option}"

"""The shared command line (common/cli.py): flags from QWEN3_SERVE_* variables, --help that shows
every default and variable, the loopback default and the loud warning when a server is exposed,
and JSON logs that cover a process's crash as well as its ordinary lines."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from common.cli import ArgumentParser, env_var_name, is_loopback, warn_if_exposed
from tests.support.procs import REPO


def toy_parser() -> ArgumentParser:
    p = ArgumentParser(prog="toy")
    p.add_argument("--model", required=True)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument("--goodput", nargs="+", default=[])
    p.add_argument("prompt", nargs="?")
    return p


def test_a_variable_sets_a_flag_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("QWEN3_SERVE_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("QWEN3_SERVE_MODEL", "/models/a")
    assert toy_parser().parse_args([]).max_num_seqs == 8          # the variable also satisfies `required`
    args = toy_parser().parse_args(["--model", "/models/b", "--max-num-seqs", "4"])
    assert (args.model, args.max_num_seqs) == ("/models/b", 4)


def test_boolean_and_list_variables(monkeypatch):
    monkeypatch.setenv("QWEN3_SERVE_MODEL", "m")
    monkeypatch.setenv("QWEN3_SERVE_ENFORCE_EAGER", "yes")
    monkeypatch.setenv("QWEN3_SERVE_NO_ASYNC_SCHEDULING", "1")
    monkeypatch.setenv("QWEN3_SERVE_GOODPUT", "ttft:500  tpot:50")
    args = toy_parser().parse_args([])
    assert args.enforce_eager is True and args.async_scheduling is False
    assert args.goodput == ["ttft:500", "tpot:50"]
    monkeypatch.setenv("QWEN3_SERVE_ENFORCE_EAGER", "off")
    assert toy_parser().parse_args([]).enforce_eager is False


@pytest.mark.parametrize("name, value, expected", [
    ("QWEN3_SERVE_MAX_NUM_SEQS", "many", "QWEN3_SERVE_MAX_NUM_SEQS='many': invalid int value"),
    ("QWEN3_SERVE_DTYPE", "float8", "QWEN3_SERVE_DTYPE='float8': invalid choice"),
    ("QWEN3_SERVE_ENFORCE_EAGER", "maybe", "QWEN3_SERVE_ENFORCE_EAGER='maybe': expected one of"),
])
def test_a_bad_variable_is_a_usage_error_that_names_it(monkeypatch, capsys, name, value, expected):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        toy_parser().parse_args(["--model", "m"])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_a_parse_leaves_the_code_defaults_for_the_next_one(monkeypatch):
    parser = toy_parser()
    monkeypatch.setenv("QWEN3_SERVE_MAX_NUM_SEQS", "8")
    assert parser.parse_args(["--model", "m"]).max_num_seqs == 8
    monkeypatch.delenv("QWEN3_SERVE_MAX_NUM_SEQS")
    assert parser.parse_args(["--model", "m"]).max_num_seqs == 256
    assert "(default: 256; env QWEN3_SERVE_MAX_NUM_SEQS)" in parser.format_help()


def test_positionals_and_help_have_no_variable():
    names = toy_parser().env_vars()
    assert "QWEN3_SERVE_PROMPT" not in names and "QWEN3_SERVE_HELP" not in names
    assert set(names) == {"QWEN3_SERVE_MODEL", "QWEN3_SERVE_MAX_NUM_SEQS", "QWEN3_SERVE_DTYPE",
                          "QWEN3_SERVE_ENFORCE_EAGER", "QWEN3_SERVE_NO_ASYNC_SCHEDULING", "QWEN3_SERVE_GOODPUT"}


def _help_of(main, argv_prefix=()) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv_prefix, "--help"])
    return out.getvalue()


def _programs() -> list[str]:
    from tools.commands import PROGRAMS
    return list(PROGRAMS)


@pytest.mark.parametrize("program", _programs())
def test_every_flag_of_every_program_shows_its_default_and_variable_in_help(program):
    from tools.commands import load
    parser = load(program).build_parser()
    text = " ".join(_help_of(parser.parse_args).split())        # argparse wraps lines; compare words
    flags = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", text)) - {"help"}
    assert flags, text
    for flag in flags:
        variable = parser.env_prefix + flag.upper().replace("-", "_")
        assert f"env {variable})" in text, f"{program} --{flag}: no '(default: ...; env {variable})' in --help"


def test_qwen3_serve_runs_each_program_by_its_main(capsys):
    from tools.commands import main
    assert main(["protos"]) == 0 and capsys.readouterr().out.strip().endswith("protos")
    assert main(["no-such-program"]) == 2 and "unknown subcommand 'no-such-program'" in capsys.readouterr().err
    assert _help_of(main, ["write-tiny-model"]).startswith("usage: python -m common.tiny_model")


def test_the_scheduler_listens_on_loopback_unless_told(monkeypatch):
    from scheduler_svc.__main__ import parse_args
    assert parse_args(["--model", "m", "--workers", "127.0.0.1:1"]).host == "127.0.0.1"
    monkeypatch.setenv("QWEN3_SERVE_HOST", "0.0.0.0")
    assert parse_args(["--model", "m", "--workers", "127.0.0.1:1"]).host == "0.0.0.0"


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.53", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.7", False), ("no-such-host.invalid", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_an_exposed_server_without_token_or_tls_warns_and_a_protected_one_does_not(caplog):
    log = logging.getLogger("tests.cli")
    with caplog.at_level(logging.WARNING, logger="tests.cli"):
        assert warn_if_exposed("0.0.0.0", 50051, has_token=False, has_tls=False, log=log, what="the API")
        assert not warn_if_exposed("0.0.0.0", 50051, has_token=True, has_tls=False, log=log)
        assert not warn_if_exposed("0.0.0.0", 50051, has_token=False, has_tls=True, log=log)
        assert not warn_if_exposed("127.0.0.1", 50051, has_token=False, has_tls=False, log=log)
    [record] = caplog.records
    assert "the API listens on 0.0.0.0:50051" in record.getMessage()
    assert "WITHOUT authentication or TLS" in record.getMessage()


def test_env_var_name_uses_the_longest_option():
    p = ArgumentParser(prog="toy", env_prefix="X_")
    action = p.add_argument("-n", "--num-prompts", type=int, default=1)
    assert env_var_name(action, "X_") == "X_NUM_PROMPTS"


@pytest.mark.parametrize("module, args", [
    ("scheduler_svc", ["--model", "/nonexistent/model", "--workers", "127.0.0.1:9", "--host", "0.0.0.0"]),
    ("worker_svc", ["--model", "/nonexistent/model", "--port", "0", "--load-format", "safetensors"]),
])
def test_json_logs_cover_a_whole_process_even_its_crash(tmp_path, module, args):
    """Every line either service writes with --log-format json parses as JSON, including the
    exposure warning and the error that ends it (the scheduler's is an uncaught exception)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", module, *args, "--log-format", "json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.strip()]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(line) for line in lines), proc.stderr
    assert any(line["level"] in ("ERROR", "CRITICAL") and "exc" in line for line in lines), proc.stderr
    if module == "scheduler_svc":
        assert any("WITHOUT authentication or TLS" in line["msg"] for line in lines), proc.stderr

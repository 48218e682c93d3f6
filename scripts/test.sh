#!/usr/bin/env bash
# Installs what the tests need (pinned) into .venv, lints (ruff, pyproject.toml) and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
# torch through pip, which finds the build this machine's pip configuration points at (a CPU build
# on disk, or the CUDA build already installed); then the rest with uv, ~5x faster than pip, at the
# versions of the tested set (constraints.txt).
python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 uv==0.13.9
python -m uv pip install -q -r requirements-dev.txt -c constraints.txt
python -m ruff check .
# Let Python cache the bytecode it compiles: pip (--no-compile) and uv install no .pyc files, so with
# PYTHONDONTWRITEBYTECODE set every process of the suite, and every service it starts, compiled torch
# and transformers from source again (a test process's collection: 8 s of CPU cached, 21 s not).
unset PYTHONDONTWRITEBYTECODE
# Two test processes (TEST_WORKERS), each running whole files: a file's services start once.
python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"

#!/usr/bin/env bash
# Installs what the tests need (pinned) into .venv, lints (ruff, pyproject.toml) and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
python -m ruff check .
# Two test processes (TEST_WORKERS), each running whole files: a file's services start once.
python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"

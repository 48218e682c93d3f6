#!/usr/bin/env bash
# Installs what the tests need (pinned) into .venv and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
python -m pytest -q "$@"

"""The worker's wire stays at its edge: in a fresh interpreter, the runner and everything it
imports load no protobuf."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_runner_and_everything_it_imports_load_no_protobuf():
    script = ("import sys, worker_svc.model_runner\n"
              "print(sorted(m for m in sys.modules\n"
              "             if m.split('.')[0] in ('google', 'grpc') or m.startswith('common.pb')))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_scheduler_and_its_frontends_load_neither_torch_nor_transformers():
    """The scheduler renders chat templates and tokenizes with jinja2 and tokenizers alone: each of
    its processes starts without torch's and transformers' import (seconds, ~300 MB each)."""
    script = ("import sys, scheduler_svc.__main__, scheduler_svc.frontend.process\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"

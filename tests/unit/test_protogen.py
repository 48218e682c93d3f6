"""The committed stubs under common/pb are exactly what protos/ generates (never hand-edited)."""
from __future__ import annotations

import filecmp

from common.protogen import PACKAGE_PREFIX, REPO, generate


def test_committed_stubs_match_protos(tmp_path):
    generate(tmp_path)
    fresh = tmp_path / PACKAGE_PREFIX
    committed = REPO / PACKAGE_PREFIX
    fresh_files = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    committed_files = sorted(p.relative_to(committed) for p in committed.rglob("*")
                             if p.is_file() and "__pycache__" not in p.parts)
    assert fresh_files == committed_files
    _, mismatch, errors = filecmp.cmpfiles(fresh, committed, [str(p) for p in fresh_files], shallow=False)
    assert not mismatch and not errors, f"regenerate with `python -m common.protogen`: {mismatch or errors}"

"""worker_svc/structured_output.py without its packages: nothing imports xgrammar, a constrained
request fails alone with UNIMPLEMENTED naming the package, and there is no loader thread to die."""
from __future__ import annotations

import threading

import pytest
import torch

from common.constraint import Constraint
from common.features import Feature, check_feature
from worker_svc.structured_output import FeatureUnavailable, StructuredOutput

MISSING = Feature("structured_output", False, "structured output needs the Python package 'xgrammar', ...")


def test_without_its_package_a_constrained_request_fails_alone_naming_it(tmp_path):
    structured = StructuredOutput(tmp_path, 512, [2], torch.device("cpu"), feature=MISSING)
    before = threading.active_count()
    structured.load_in_background()
    assert threading.active_count() == before and structured.pool is None
    failure = structured.matcher_or_failure(7, Constraint("regex", "a+"), [])
    assert (failure.seq_id, failure.code, failure.about_constraint) == (7, "UNIMPLEMENTED", False)
    assert "'xgrammar'" in failure.message
    with pytest.raises(FeatureUnavailable, match="'xgrammar'"):
        structured.prepare(Constraint("json_object"))


def test_a_package_that_cannot_be_imported_is_named(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pydantic", None)     # import pydantic raises ImportError
    feature = check_feature("structured_output")
    assert not feature.available and "'pydantic'" in feature.detail

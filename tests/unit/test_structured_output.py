"""worker_svc/structured_output.py without its packages: nothing imports xgrammar, a constrained
request fails alone with UNIMPLEMENTED naming the package, and there is no loader thread to die.
With them: a step's masks are filled on threads of their own, terminated rows included."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from common.constraint import Constraint
from common.features import Feature, check_feature
from worker_svc.structured_output import FeatureUnavailable, StructuredOutput

MISSING = Feature("structured_output", False, "structured output needs the Python package 'xgrammar', ...")


def test_without_its_package_a_constrained_request_fails_alone_naming_it(tmp_path):
    structured = StructuredOutput(tmp_path, 512, [2], torch.device("cpu"), feature=MISSING)
    before = set(threading.enumerate())
    structured.load_in_background()
    # No thread started (other tests' threads may end meanwhile: the set only shrinks).
    assert set(threading.enumerate()) <= before and structured.pool is None
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


def test_a_terminated_row_is_filled_in_a_step_under_inference_mode(tiny_model_dir):
    """A request that goes on after its grammar ended (ignore_eos, min_tokens) has a terminated
    matcher; its row is filled on a mask thread, which is outside the step's inference mode."""
    from worker_svc.layers.grammar import GrammarCompiler    # imports xgrammar

    stop_ids = json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"]
    structured = StructuredOutput(tiny_model_dir, 512, stop_ids, torch.device("cpu"))
    compiler = GrammarCompiler.from_model_dir(tiny_model_dir, 512, stop_ids)
    matcher = compiler.matcher(Constraint("regex", "a?"))
    assert matcher.accept_token(stop_ids[0]) and matcher.is_terminated
    matcher.seq_id, matcher.failed, matcher.pending, matcher.last_cost_ms = 7, None, [], 0.0
    logits = torch.zeros(2, 512)
    with torch.inference_mode():                 # as ModelRunner's step
        fill = structured.start_fill([matcher])
        failed = structured.mask(logits, [1], fill)
    assert failed == [] and matcher.failed is None
    allowed = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert allowed == set(stop_ids) and torch.isfinite(logits[0]).all()


def test_steps_in_flight_fill_their_masks_into_buffers_of_their_own(tiny_model_dir):
    """A step's mask reaches the device by a copy that runs after its forward, so the steps launched
    meanwhile (up to three in flight) fill other host buffers; a buffer is filled again only after
    waiting for the copy out of it (the event mask() records on a GPU)."""
    from worker_svc.layers.grammar import GrammarCompiler    # imports xgrammar
    from worker_svc.structured_output import MASK_BUFFERS

    stop_ids = json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"]
    structured = StructuredOutput(tiny_model_dir, 512, stop_ids, torch.device("cpu"))
    compiler = GrammarCompiler.from_model_dir(tiny_model_dir, 512, stop_ids)
    matcher = compiler.matcher(Constraint("regex", "a+"))
    matcher.seq_id, matcher.failed, matcher.pending, matcher.last_cost_ms = 7, None, [], 0.0

    class Copy:
        waited = False

        def synchronize(self):
            self.waited = True

    pointers, copies = [], []
    with torch.inference_mode():
        for step in range(MASK_BUFFERS + 1):
            if step == MASK_BUFFERS:          # the first buffer's copy still to be waited for
                structured._copied[0] = copies[0]
            fill = structured.start_fill([matcher])
            structured.mask(torch.zeros(1, 512), [0], fill)
            pointers.append(fill.bitmask.data_ptr())
            copies.append(Copy())
    assert len(set(pointers[:MASK_BUFFERS])) == MASK_BUFFERS == 4 and pointers[MASK_BUFFERS] == pointers[0]
    assert copies[0].waited and structured._copied[0] is None and structured.masked

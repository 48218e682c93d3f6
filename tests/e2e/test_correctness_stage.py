"""bench/stages/correctness.py on the CPU over the tiny checkpoint (torch attention): beside the
bf16 engine's rows it reports the FP8 KV cache's, its logits against the bf16 cache's and
transformers fp32, and its greedy first tokens against transformers bf16; and the FP8 LM head's
(--lm-head-dtype fp8) the same way."""
from __future__ import annotations

import argparse
import math

from bench.stages import correctness


def test_the_correctness_stage_reports_the_fp8_kv_cache_and_lm_head_rows(tiny_model_dir, tmp_path, capsys):
    args = argparse.Namespace(out=tmp_path, model=tiny_model_dir, device="cpu", attention_backend="torch")
    result = correctness.run(args)
    for key in ("engine_fp8_kv_vs_engine", "engine_fp8_kv_vs_hf_fp32", "engine_fp8_head_vs_engine",
                "engine_fp8_head_vs_hf_fp32"):
        assert 0 < result[key]["relative_error"] < 1 and math.isfinite(result[key]["relative_error"]), key
        assert 0 < result[key]["top1_agreement"] <= 1, key
    for key in ("fp8_kv_greedy", "fp8_head_greedy"):
        greedy = result[key]
        assert 0 <= greedy["greedy_match_rate"] <= 1
        assert len(greedy["greedy_leading_matches"]) == correctness.CORRECTNESS_PROMPTS
    correctness.report(args, {"correctness": {"result": result}})
    printed = capsys.readouterr().out
    assert "fp8 KV cache: greedy" in printed and "fp8 LM head: greedy" in printed
    print(printed)

"""Tokenizer and incremental detokenizer against the references: transformers' own encode/decode, and
the decode of all output ids at once.

The tiny tokenizer is byte-level BPE, so random ids split UTF-8 characters almost always (nearly every
random 20-id sequence decodes with a U+FFFD somewhere): exactly the case the hold-back exists for.
"""
from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.frontend.detokenizer import PROMPT_CONTEXT_TOKENS, REPLACEMENT_CHAR, IncrementalDetokenizer
from scheduler_svc.frontend.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """transformers' tokenizer of the same directory: the reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.push(chunk) for chunk in chunks]


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    """`ids` in consecutive chunks at the given cut points (several ids per step, as with multi-token steps)."""
    bounds = [0, *sorted(c % (len(ids) + 1) for c in cuts), len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


# Ids 0..511: the three special tokens, the 256 byte tokens, merges, the added tokens (<think>...) and the
# model's padded rows past the tokenizer (vocab_size is 512).
token_ids = st.lists(st.integers(0, 511), max_size=40)
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@HYPOTHESIS
@given(prompt=token_ids, output=token_ids, cuts=st.lists(st.integers(0, 40), max_size=8), skip=st.booleans())
def test_pushes_plus_flush_equal_full_decode(tokenizer, prompt, output, cuts, skip):
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces = stream(detok, split(output, cuts))
    expected = tokenizer.decode(output, skip_special_tokens=skip)
    held = detok.flush()
    assert "".join(pieces) + held == expected
    # Without the flush the text is complete unless the full decode ends inside a character.
    if not expected.endswith(REPLACEMENT_CHAR):
        assert held == ""
    # No piece ever ends in U+FFFD: that text was held until the next token decided it.
    assert not any(piece.endswith(REPLACEMENT_CHAR) for piece in pieces)


@HYPOTHESIS
@given(text=st.text(max_size=30), skip=st.booleans())
def test_real_text_streams_back_token_by_token(tokenizer, text, skip):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"), skip_special_tokens=skip)
    pieces = stream(detok, [[i] for i in ids])
    held = detok.flush()
    assert "".join(pieces) + held == tokenizer.decode(ids, skip_special_tokens=skip)
    # A literal U+FFFD at the very end looks like a split character, so only the flush releases it.
    assert held == ("\ufffd" if text.endswith(REPLACEMENT_CHAR) else "")


def test_split_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("a😀")  # 'a' then the emoji's four UTF-8 bytes, one byte token each
    assert len(ids) == 5
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert stream(detok, [[i] for i in ids]) == ["a", "", "", "", "😀"]


def test_prompt_ending_inside_a_character_does_not_swallow_output(tokenizer):
    euro = tokenizer.encode("€")  # three byte tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("price ") + euro[:1], skip_special_tokens=False)
    pieces = stream(detok, [[i] for i in euro[1:]] + [tokenizer.encode("5")])
    # The output decodes on its own: two stray continuation bytes, then "5".
    assert "".join(pieces) == tokenizer.decode(euro[1:] + tokenizer.encode("5")) == 2 * REPLACEMENT_CHAR + "5"


def test_special_tokens_kept_or_skipped(tokenizer):
    eos = tokenizer.control_tokens["<|im_end|>"]
    ids = tokenizer.encode("Hi") + [eos]
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert "".join(stream(kept, [[i] for i in ids])) == "Hi<|im_end|>"
    assert "".join(stream(skipped, [[i] for i in ids])) + skipped.flush() == "Hi"


def test_ids_beyond_the_tokenizer_decode_to_nothing(tokenizer):
    # A model's vocab_size may exceed the tokenizer's (Qwen3: 151936 vs 151669); random weights sample them.
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert stream(detok, [[len(tokenizer) + 7], tokenizer.encode("ok")]) == ["", "ok"]


@HYPOTHESIS
@given(text=st.text(max_size=40))
def test_encode_matches_transformers(tokenizer, hf, text):
    assert tokenizer.encode(text) == hf(text)["input_ids"]


@HYPOTHESIS
@given(ids=token_ids, skip=st.booleans())
def test_decode_matches_transformers_without_space_cleanup(tokenizer, hf, ids, skip):
    assert tokenizer.decode(ids, skip_special_tokens=skip) == hf.decode(
        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
    )


def test_truncation_in_tokenizer_json_does_not_cut_prompts(tiny_model_dir, tmp_path):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    assert len(load_tokenizer(model).encode("The quick brown fox jumps over the lazy dog")) > 4


def test_missing_directory_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory .* does not exist"):
        load_tokenizer(tmp_path / "Qwen" / "Qwen3-0.6B")


class CountingTokenizer:
    """Counts the ids each decode call got."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, []
        self.backend = tokenizer.backend

    def decode(self, token_ids, *, skip_special_tokens=False):
        self.decoded.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_pushes_never_decode_the_output_only_the_flush_does_once(tokenizer):
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 100)
    detok = IncrementalDetokenizer(counting, list(range(3, 3000)), skip_special_tokens=False)
    assert counting.decoded == [PROMPT_CONTEXT_TOKENS]      # the prompt context, checked once
    assert "".join(stream(detok, [[i] for i in ids])) == tokenizer.decode(ids)
    assert counting.decoded == [PROMPT_CONTEXT_TOKENS]      # each push streams through DecodeStream
    assert detok.flush() == "" and counting.decoded == [PROMPT_CONTEXT_TOKENS, len(ids)]

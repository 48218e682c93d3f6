"""Tokenizer.max_input_bytes_per_token: derived only where the vocabulary bounds it, and then a
true bound: no text takes fewer tokens than its UTF-8 bytes divided by it."""
from __future__ import annotations

import copy
import json
import unicodedata

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import normalizers

from common.tiny_model import build_tokenizer
from scheduler_svc.frontend.tokenizer import Tokenizer, max_input_bytes_per_token

HANGUL_JAMO = "".join(chr(c) for c in range(0x1100, 0x11FF))   # three 3-byte jamo NFC-compose into one syllable


def _tokenizer(normalizer=None) -> Tokenizer:
    raw = build_tokenizer(512)
    if normalizer is not None:
        raw.normalizer = normalizer
    return Tokenizer(raw)


@pytest.fixture(scope="module")
def spec() -> dict:
    return json.loads(build_tokenizer(512).to_str())


def test_the_embedded_tokenizer_covers_at_most_its_longest_token(spec):
    longest = max([len(token) for token in spec["model"]["vocab"]]
                  + [len(token["content"].encode()) for token in spec["added_tokens"]])
    assert _tokenizer().max_input_bytes_per_token == max_input_bytes_per_token(spec) == longest == 13  # <|endoftext|>


@pytest.mark.parametrize("normalizer, factor", [
    ({"type": "NFC"}, 3), ({"type": "NFKC"}, 4),
    ({"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "NFKC"}]}, 12),
    ({"type": "Strip", "strip_left": True, "strip_right": True}, None),      # drops whitespace: unbounded
    ({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Replace"}]}, None),
])
def test_normalizers_scale_the_bound_or_void_it(spec, normalizer, factor):
    spec = dict(spec, normalizer=normalizer)
    assert max_input_bytes_per_token(spec) == (None if factor is None else 13 * factor)


def _edited(spec, edit):
    spec = copy.deepcopy(spec)
    edit(spec)
    return spec


@pytest.mark.parametrize("edit", [
    lambda s: s["model"].update(type="WordPiece"),                         # one [UNK] for a whole word
    lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),              # not byte-level
    lambda s: s["added_tokens"][0].update(rstrip=True),                    # swallows the spaces after it
    lambda s: s["model"]["vocab"].pop("Ġ"),                                # a byte it cannot spell is dropped
], ids=["wordpiece", "not-byte-level", "rstrip-token", "missing-byte"])
def test_no_bound_where_the_vocabulary_does_not_give_one(spec, edit):
    assert max_input_bytes_per_token(_edited(spec, edit)) is None


def test_a_byte_level_pre_tokenizer_inside_a_sequence_counts(spec):
    sequence = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "\\s+"},
                                                       "behavior": "Isolated", "invert": False},
                                                      dict(spec["pre_tokenizer"], use_regex=False)]}
    assert max_input_bytes_per_token(dict(spec, pre_tokenizer=sequence)) == 13


TEXTS = st.text(alphabet=st.one_of(st.characters(exclude_categories=("Cs",)),   # proto strings hold no surrogates
                                   st.sampled_from(HANGUL_JAMO + "\u0301\u0308\u1fef")), max_size=200)
NFC_TOKENIZER = _tokenizer(normalizers.NFC())
PLAIN_TOKENIZER = _tokenizer()


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(TEXTS, st.sampled_from(["\u1100\u1161\u11a8" * 50, "\u1fef" * 100, "<|endoftext|>" * 9])))
def test_no_text_needs_fewer_tokens_than_the_bound_allows(text):
    for tokenizer in (PLAIN_TOKENIZER, NFC_TOKENIZER):
        ids = tokenizer.encode(text)
        assert len(text.encode()) <= len(ids) * tokenizer.max_input_bytes_per_token


def test_nfc_can_shrink_text_threefold():
    # Why the NFC factor is 3: the bound would be wrong without it.
    jamo = "\u1100\u1161\u11a8"
    assert len(jamo.encode()) == 3 * len(unicodedata.normalize("NFC", jamo).encode())

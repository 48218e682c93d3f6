"""Tokenizer.encode: the same ids on both of its paths, a bound that refuses by count, and a long
text encoded without holding the GIL (so the frontend's event loop runs on meanwhile)."""
from __future__ import annotations

import random
import threading
import time

import pytest

from scheduler_svc.frontend.tokenizer import GIL_FREE_CHARS, TooManyTokens, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _text(rng: random.Random, num_chars: int) -> str:
    alphabet = "abcdefghij klmnop\nQRS.,!é你好🙂"
    return "".join(rng.choice(alphabet) for _ in range(num_chars))


@pytest.mark.parametrize("num_chars", [1, GIL_FREE_CHARS, GIL_FREE_CHARS + 1, 5000])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_both_paths_give_the_backend_s_ids(tokenizer, num_chars, add_special_tokens):
    rng = random.Random(num_chars)
    for _ in range(5):
        text = _text(rng, num_chars)
        expected = tokenizer.backend.encode(text, add_special_tokens=add_special_tokens).ids
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("num_chars", [100, 5000])
def test_a_bound_refuses_by_count(tokenizer, num_chars):
    text = _text(random.Random(1), num_chars)
    n = len(tokenizer.encode(text))
    assert tokenizer.encode(text, max_tokens=n) == tokenizer.encode(text)
    with pytest.raises(TooManyTokens) as e:
        tokenizer.encode(text, max_tokens=n - 1)
    assert (e.value.num_tokens, e.value.max_tokens) == (n, n - 1)


def test_a_long_text_is_encoded_while_other_threads_run(tokenizer):
    """A thread that wakes every millisecond keeps waking while a 400 kB text is encoded: its
    longest pause is a small part of the encode (which would be all of it if the GIL were held,
    since a woken thread needs the GIL to go on)."""
    text = " ".join(random.Random(2).choice(["quick", "brown", "fox", "serving"]) for _ in range(60000))
    done = threading.Event()
    took: list[float] = []

    def encode() -> None:
        started = time.perf_counter()
        tokenizer.encode(text)
        took.append(time.perf_counter() - started)
        done.set()

    worker = threading.Thread(target=encode)
    last, longest = time.perf_counter(), 0.0
    worker.start()
    while not done.is_set():
        time.sleep(0.001)       # not a busy loop: that would take a core from the encode
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    assert took[0] > 0.05, "the text encoded too fast to tell"
    assert longest < took[0] / 3, f"paused {longest * 1e3:.0f} ms of a {took[0] * 1e3:.0f} ms encode"

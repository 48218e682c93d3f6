"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of a
request's last n tokens in its own prompt and output, for n from the longest down.

It needs no model and works on the host, on the tokens the worker mirrors. The search looks at the
last SEARCH_WINDOW tokens only, so a step's work does not grow with the context: one vectorised
comparison per n over a window of fixed size.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MIN_NGRAM = 1
MAX_NGRAM = 4
SEARCH_WINDOW = 2048


def propose_ngram(tokens: np.ndarray, num_drafts: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM,
                  window: int = SEARCH_WINDOW) -> np.ndarray:
    """Up to num_drafts tokens that followed the latest earlier occurrence of the longest suffix
    of `tokens` (min_n..max_n long) found in its last `window` tokens; empty when none is."""
    tokens = tokens[-window:]
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # Occurrences that end before the last token, so that at least one token follows them.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            follow = hits[-1] + n
            return tokens[follow:follow + num_drafts]
    return tokens[:0]

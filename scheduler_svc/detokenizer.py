"""Incremental detokenization: the new text of each step's tokens, without re-decoding the whole output.

Tokens do not map to text one by one: a byte-level BPE token can hold half of a UTF-8 character, and
some tokenizers render a token differently depending on its neighbours. So, as vLLM and TGI do, each
push decodes a short window of ids: `prefix` (ids already emitted, kept as context) followed by the ids
not yet emitted, and returns the part of the window's text that goes past the prefix's text. While the
window's text ends in U+FFFD (an incomplete, or invalid, UTF-8 sequence), it is held back: the next
token may complete the character. `flush()` returns what is still held when the sequence ends.
The window is the last emitted piece's ids plus the held ones, so it grows only during a run of tokens
that each leave the text ending in U+FFFD (as in vLLM, TGI and tokenizers' DecodeStream).

Invariant (byte-level BPE, the Qwen3 tokenizer): the concatenation of every push and the flush equals
`tokenizer.decode(output_ids)`. Without the flush, it equals that decode whenever the decode does not
end in U+FFFD; otherwise the held tail (from the last clean character boundary on) is missing.
"""
from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.tokenizer import Tokenizer

# Prompt ids kept as context for the first output tokens (vLLM uses the same count): enough for
# tokenizers whose rendering of a token depends on the one before it (e.g. SentencePiece's leading
# space), few enough that the first decode stays cheap.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: joined to it, the first output bytes would turn the
            # prompt's last U+FFFD into some other character, and the prefix text would no longer
            # be a prefix of the window's text. Starting clean makes the output decode on its own.
            context, context_text = [], ""
        # Every id from the start of the prefix on; ids before it are dropped, so each push costs
        # O(window), not O(output length).
        self._window: list[int] = context
        self._read_offset = len(context)      # window index of the first id not yet emitted
        self._prefix_text = context_text      # text of window[:read_offset]

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Appends sampled ids and returns the text they complete (possibly "")."""
        self._window.extend(new_token_ids)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """The text still held back (a trailing incomplete character renders as U+FFFD). Call once, at
        the end of the sequence."""
        return self._emit(self._decode(self._window))

    def _emit(self, window_text: str) -> str:
        """Returns the window's text past the prefix and makes the ids not yet emitted the new prefix."""
        new_text = window_text[len(self._prefix_text):]
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        # Decoded afresh rather than taken from new_text: without the old prefix as context, some
        # tokenizers render these ids differently (SentencePiece drops a leading space).
        self._prefix_text = self._decode(self._window)
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

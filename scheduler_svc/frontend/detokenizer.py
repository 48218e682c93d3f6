"""Incremental detokenization: the new text of each step's tokens, without re-decoding the whole output.

Tokens do not map to text one by one: a byte-level BPE token can hold half of a UTF-8 character, and
some tokenizers render a token differently depending on its neighbours. The `tokenizers` library's
DecodeStream handles both in Rust, one call per token: it keeps a short window of ids (the last emitted
piece's and the ones not emitted yet), starting from a few prompt ids as context, and returns text only
once the window's text stops ending in U+FFFD (an incomplete, or invalid, UTF-8 sequence), since the
next token may complete the character. `flush()` returns what is still held when the sequence ends.

Invariant (byte-level BPE, the Qwen3 tokenizer): the concatenation of every push and the flush equals
`tokenizer.decode(output_ids)`. Without the flush, it equals that decode whenever the decode does not
end in U+FFFD; otherwise the held tail (from the last clean character boundary on) is missing.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from scheduler_svc.frontend.tokenizer import Tokenizer

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
        if tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: joined to it, the first output bytes would turn the
            # prompt's last U+FFFD into some other character, and the prefix text would no longer
            # be a prefix of the window's text. Starting clean makes the output decode on its own.
            context = []
        self._stream = DecodeStream(context, skip_special_tokens)
        self._backend = tokenizer.backend
        self._output_ids: list[int] = []      # for the flush, which decodes them once
        self._emitted_chars = 0

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Appends sampled ids and returns the text they complete (possibly "")."""
        pieces = []
        for token_id in new_token_ids:
            self._output_ids.append(token_id)
            piece = self._stream.step(self._backend, token_id)
            if piece:
                pieces.append(piece)
        text = "".join(pieces)
        self._emitted_chars += len(text)
        return text

    def flush(self) -> str:
        """The text still held back (a trailing incomplete character renders as U+FFFD). Call once, at
        the end of the sequence."""
        text = self._tokenizer.decode(self._output_ids, skip_special_tokens=self._skip_special_tokens)
        return text[self._emitted_chars:]

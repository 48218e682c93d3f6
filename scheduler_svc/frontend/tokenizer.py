"""The model's tokenizer, loaded from its directory only (never from a hub), behind a two-call API.

Calls go straight to the Rust `tokenizers` backend: the incremental detokenizer decodes a short
window per sampled token, and transformers' Python wrapper around the same call costs ~3x as much.
Decoding never applies `clean_up_tokenization_spaces`: that rewrite looks across token boundaries,
so text streamed piece by piece could not reproduce it.

`max_input_bytes_per_token` bounds how many UTF-8 bytes of input text one token can stand for, so
admission can refuse a text that could never fit the context without tokenizing it
(max_input_bytes_per_token says when such a bound exists).

Encoding a long text must not stop the other threads of the process (the frontend's event loop
writes every client's stream): the backend's `encode` holds the GIL throughout (~1 s per MiB), its
`encode_batch` releases it, so texts past GIL_FREE_CHARS take that path, and a text longer than
the caller's token bound is refused by its count, without building a list of its ids. Decoding
many ids takes the same care (`decode_batch` releases the GIL, `decode` does not).

`encode_plain` encodes text in which the control tokens (every added token: <|im_start|>, <think>,
<tool_call>, ...) are ordinary text, as a chat's user-supplied text is tokenized
(scheduler_svc/frontend/chat.py).
"""
from __future__ import annotations

import json
import pathlib
import threading
from collections.abc import Sequence

from tokenizers import Tokenizer as RustTokenizer
from tokenizers.pre_tokenizers import ByteLevel

from scheduler_svc.frontend.chat_template import ChatTemplate, load_chat_template

# The most UTF-8 bytes a Unicode normalization turns into one byte (computed over every code
# point; sequences do no worse): NFC/NFD map U+1FEF (3 bytes) to "`" and compose a Hangul
# syllable (3 bytes) from three jamo (9); NFKC/NFKD map U+107A5 (4 bytes) to one ASCII letter.
_NORMALIZER_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4}

# Texts longer than this (characters) are encoded with the GIL released. Below it, encode's GIL
# hold (~1 us per byte) costs less than the batch path's extra work.
GIL_FREE_CHARS = 512
_TABLE_CHUNK = 4096       # ids decoded per call while the table of every token's text is made


class TooManyTokens(ValueError):
    """The text encodes to more tokens than the caller allows (its ids were never listed)."""

    def __init__(self, num_tokens: int, max_tokens: int) -> None:
        super().__init__(f"the text encodes to {num_tokens} tokens, more than {max_tokens}")
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


class Tokenizer:
    def __init__(self, backend: RustTokenizer, chat_template: ChatTemplate | None = None) -> None:
        self._backend = backend
        self.chat_template = chat_template
        # A tokenizer.json may carry truncation or padding settings, which would silently cut or pad
        # prompts here; transformers resets them on each of its own calls, so clearing them is safe.
        self._backend.no_truncation()
        self._backend.no_padding()
        spec = self._backend.to_str()
        self.max_input_bytes_per_token = max_input_bytes_per_token(json.loads(spec))
        # A second backend (never switched back and forth: threads share both) that reads every added
        # token as text: each marked special, which encode_special_tokens then reads as text.
        self._plain = RustTokenizer.from_str(_all_added_special(spec))
        self._plain.encode_special_tokens = True
        # Every added token: the special ones (<|im_start|>, ...) and Qwen3's others (<think>, <tool_call>, ...),
        # which the tokenizer matches in any text as it matches the special ones.
        self.control_tokens: dict[str, int] = {token.content: token_id for token_id, token in
                                               backend.get_added_tokens_decoder().items()}
        self._tables: dict[bool, list[str]] = {}      # skip_special_tokens -> each id's text alone
        self._tables_lock = threading.Lock()

    @property
    def backend(self):
        """The Rust `tokenizers.Tokenizer` (what DecodeStream steps with)."""
        return self._backend

    def encode(self, text: str, *, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of raw text: only what the tokenizer's own post-processor adds (none for Qwen3),
        no chat template. A rendered chat template passes add_special_tokens=False: it already
        holds every special token the model expects. With max_tokens, a longer encoding raises
        TooManyTokens. A long text releases the GIL while it is encoded (see the module's doc)."""
        return _encode(self._backend, text, add_special_tokens, max_tokens)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of text in which control tokens are plain text (a user's "<|im_start|>" or
        "<think>" is the characters, not the control token); nothing is added."""
        return _encode(self._plain, text, False, None)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`; ids the vocabulary lacks (the model's padded rows) decode to nothing.
        Many ids are decoded with the GIL released."""
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        if len(ids) <= GIL_FREE_CHARS:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def decode_each(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> list[str]:
        """The text of each token on its own. A token's text alone never changes, so it comes from
        a table of the whole vocabulary's, made at the first call (a lookup per id after that,
        where decoding each id costs a list and a string per id)."""
        table = self._token_texts(skip_special_tokens)
        return [table[t] if t < len(table) else "" for t in token_ids]

    def _token_texts(self, skip_special_tokens: bool) -> list[str]:
        with self._tables_lock:
            table = self._tables.get(skip_special_tokens)
            if table is None:
                size, table = self._backend.get_vocab_size(with_added_tokens=True), []
                for start in range(0, size, _TABLE_CHUNK):    # chunks: each batch call releases the GIL
                    table += self._backend.decode_batch([[t] for t in range(start, min(start + _TABLE_CHUNK, size))],
                                                        skip_special_tokens=skip_special_tokens)
                self._tables[skip_special_tokens] = table
            return table

    def __len__(self) -> int:
        """Ids the tokenizer knows, added tokens included; may be below the model's vocab_size."""
        return self._backend.get_vocab_size(with_added_tokens=True)


def _encode(backend: RustTokenizer, text: str, add_special_tokens: bool, max_tokens: int | None) -> list[int]:
    if len(text) <= GIL_FREE_CHARS:
        encoding = backend.encode(text, add_special_tokens=add_special_tokens)
    else:
        encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    if max_tokens is not None and len(encoding) > max_tokens:
        raise TooManyTokens(len(encoding), max_tokens)
    return encoding.ids


def max_input_bytes_per_token(spec: dict) -> int | None:
    """The most UTF-8 bytes of raw input text that one token of this tokenizer (a parsed
    tokenizer.json) can cover, or None where no such bound follows from the vocabulary.

    Derived for byte-level BPE (Qwen, GPT-2, Llama 3): there every input byte becomes one
    character of the byte alphabet, so a vocabulary token of n characters covers n bytes of
    normalized text, and an added token covers its own content. A normalizer in
    _NORMALIZER_SHRINK may have shrunk the input by its factor first. None for anything else: a
    normalizer or added token that can drop text (Strip, Replace, lstrip/rstrip), an unknown-token
    model that may fuse any run of text into one token, or a byte alphabet the vocabulary lacks
    (BPE silently drops what it cannot spell)."""
    model, added = spec.get("model") or {}, spec.get("added_tokens") or []
    if model.get("type") != "BPE" or not _has_byte_level(spec.get("pre_tokenizer")):
        return None
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    vocab = model.get("vocab") or {}
    alphabet = ByteLevel.alphabet()
    if shrink is None or not all(char in vocab for char in alphabet):
        return None
    alphabet = set(alphabet)
    # A character outside the byte alphabet (none in a proper byte-level vocabulary) counts its
    # UTF-8 length, which can only overstate the bound.
    longest_vocab = max((sum(1 if c in alphabet else len(c.encode()) for c in token) for token in vocab), default=0)
    longest_added = max((len(token["content"].encode()) for token in added), default=0)
    return max(longest_vocab, longest_added) * shrink


def _has_byte_level(pre_tokenizer: dict | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == "ByteLevel"


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    """How many input bytes the normalizer may turn into one; None: unbounded (it may drop text)."""
    if not normalizer:
        return 1
    if normalizer.get("type") == "Sequence":
        factor = 1
        for step in normalizer.get("normalizers", []):
            step_factor = _normalizer_shrink(step)
            if step_factor is None:
                return None
            factor *= step_factor
        return factor
    return _NORMALIZER_SHRINK.get(normalizer.get("type"))


def load_tokenizer(model_dir: str | pathlib.Path) -> Tokenizer:
    """The tokenizer of a model directory (tokenizer.json, and the chat template with
    tokenizer_config.json's special tokens), from local files only: never a network call."""
    path = pathlib.Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    spec = path / "tokenizer.json"
    if not spec.is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json (the tokenizers library's file; Qwen3 ships one)")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return Tokenizer(RustTokenizer.from_file(str(spec)), load_chat_template(path, config))


def _all_added_special(spec: str) -> str:
    """A tokenizer.json with every added token marked special."""
    parsed = json.loads(spec)
    for token in parsed.get("added_tokens", ()):
        token["special"] = True
    return json.dumps(parsed)

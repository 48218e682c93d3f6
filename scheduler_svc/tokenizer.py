"""The model's tokenizer, loaded from its directory only (never from a hub), behind a two-call API.

Calls go straight to the Rust `tokenizers` backend: the incremental detokenizer decodes a short
window per sampled token, and transformers' Python wrapper around the same call costs ~3x as much.
Decoding never applies `clean_up_tokenization_spaces`: that rewrite looks across token boundaries,
so text streamed piece by piece could not reproduce it.
"""
from __future__ import annotations

import pathlib
from collections.abc import Sequence

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class Tokenizer:
    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        self.hf = hf_tokenizer
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if self._backend is None:
            raise ValueError(f"{type(hf_tokenizer).__name__} has no tokenizers backend (tokenizer.json); Qwen3 ships one")
        # A tokenizer.json may carry truncation or padding settings, which would silently cut or pad
        # prompts here; transformers resets them on each of its own calls, so clearing them is safe.
        self._backend.no_truncation()
        self._backend.no_padding()

    @property
    def backend(self):
        """The Rust `tokenizers.Tokenizer` (what DecodeStream steps with)."""
        return self._backend

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of raw text: only what the tokenizer's own post-processor adds (none for Qwen3),
        no chat template. A rendered chat template passes add_special_tokens=False: it already
        holds every special token the model expects."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`; ids the vocabulary lacks (the model's padded rows) decode to nothing."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        """Ids the tokenizer knows, added tokens included; may be below the model's vocab_size."""
        return len(self.hf)


def load_tokenizer(model_dir: str | pathlib.Path) -> Tokenizer:
    """The tokenizer of a model directory, from local files only: never a network call."""
    path = pathlib.Path(model_dir)
    if not path.is_dir():
        # Otherwise from_pretrained would read the string as a hub repo id.
        raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    return Tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False))

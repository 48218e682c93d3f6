"""Token id -> its text, for logprobs: OpenAI's logprobs name tokens by their text.

The gateway has no tokenizer of its own (it may run on another machine than the scheduler and
needs no model files), so it asks the scheduler's Detokenize once per distinct token id and
keeps the answer: a vocabulary is finite, so the cache is bounded by it, and after warm-up a
stream's logprobs cost no calls. A token that is part of a multi-byte character decodes to
U+FFFD on its own, as in vLLM's responses; `bytes` in chat logprobs is the UTF-8 of that text.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable

from common.client import AsyncClient


class TokenTexts:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._texts: dict[int, str] = {}
        self._pending: dict[int, asyncio.Future[str]] = {}   # token id -> its Detokenize call in flight

    async def texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """The text of each of `token_ids`, fetching the unknown ones concurrently (once each,
        even when several requests ask at the same time)."""
        wanted = set(token_ids)
        missing = [t for t in wanted if t not in self._texts]
        if missing:
            await asyncio.gather(*(self._fetch(t) for t in missing))
        return {t: self._texts[t] for t in wanted}

    async def _fetch(self, token_id: int) -> None:
        # Another request is fetching it: wait for that call (whatever its outcome; asyncio.wait
        # raises nothing but this task's own cancellation), then fetch it here if it failed.
        while (pending := self._pending.get(token_id)) is not None:
            await asyncio.wait({pending})
        if token_id in self._texts:
            return
        call = self._pending[token_id] = asyncio.ensure_future(
            self._client.detokenize([token_id], skip_special_tokens=False))
        try:
            self._texts[token_id] = await call
        finally:
            del self._pending[token_id]

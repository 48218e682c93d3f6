"""Token id -> its text, for logprobs: OpenAI's logprobs name tokens by their text.

The gateway has no tokenizer of its own (it may run on another machine than the scheduler and
needs no model files), so it asks the scheduler's Detokenize (each_token) for the ids it has not
seen, all of a request's in one call, and keeps the answers: a vocabulary is finite, so the cache
is bounded by it, and after warm-up a stream's logprobs cost no calls. A token that is part of a
multi-byte character decodes to U+FFFD on its own, as in vLLM's responses; `bytes` in chat
logprobs is the UTF-8 of that text.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable

from common.client import AsyncClient


class TokenTexts:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._texts: dict[int, str] = {}
        self._pending: dict[int, asyncio.Future[None]] = {}   # token id -> the call in flight that fetches it

    async def texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """The text of each of `token_ids`: the unknown ones in one call, shared with concurrent
        requests (an id another request is fetching is waited for, not asked again)."""
        wanted = set(token_ids)
        while missing := [t for t in wanted if t not in self._texts]:
            waits = {self._pending[t] for t in missing if t in self._pending}
            own = [t for t in missing if t not in self._pending]
            call = None
            if own:
                call = asyncio.ensure_future(self._fetch(own))
                # Its outcome is read here, or by nobody when this request was cancelled meanwhile.
                call.add_done_callback(lambda f: f.cancelled() or f.exception())
                self._pending.update(dict.fromkeys(own, call))
                waits.add(call)
            # asyncio.wait: a request cancelled while it waits leaves the shared call running.
            await asyncio.wait(waits)
            if call is not None and call.exception() is not None:
                raise call.exception()
            # Ids whose other call failed are missing still: the next round fetches them itself.
        return {t: self._texts[t] for t in wanted}

    async def _fetch(self, token_ids: list[int]) -> None:
        try:
            texts = await self._client.token_texts(token_ids, skip_special_tokens=False)
            self._texts.update(zip(token_ids, texts))
        finally:
            for t in token_ids:
                del self._pending[t]

"""Where a request's admission (validation and tokenization) runs, so that no request's prompt
pauses the streams of the others, which the same event loop writes.

A small request is admitted inline on the event loop: tokenizing a short text takes less time
than a hop to a thread and back. A large one (a long text, many token ids, a schema) goes to a
small pool of threads: the tokenizer releases the GIL while it encodes a long text
(Tokenizer.encode), so the event loop runs on meanwhile. Pure-Python work on a pool thread
(checking a schema, copying token ids) holds the GIL for one switch interval (5 ms) at a time, so
the pool's threads keep the event loop's OS priority: a thread of lower priority holding the GIL
is descheduled on a busy machine while the event loop waits for it (docs/PERF_NOTES.md).
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from common.pb.llm.v1 import generation_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")

# At most this much is admitted inline: ~1 ms of tokenizing, or copying and checking the ids.
INLINE_TEXT_CHARS = 1024
INLINE_TOKEN_IDS = 8192
POOL_THREADS = 2


def admits_inline(request: generation_pb2.GenerateRequest) -> bool:
    """Whether admitting the request costs less than a thread hop (by its prompt's size). A
    constrained one never is: its constraint is parsed and measured first."""
    if request.sampling.WhichOneof("constraint") is not None:
        return False
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return len(request.text) <= INLINE_TEXT_CHARS
    if kind == "token_ids":
        return len(request.token_ids.ids) <= INLINE_TOKEN_IDS
    return True


def chat_admits_inline(request: generation_pb2.ChatRequest) -> bool:
    """Whether rendering and tokenizing the chat costs less than a thread hop (by its content;
    the number of messages is bounded before this is asked)."""
    if request.tools or request.sampling.WhichOneof("constraint") is not None:
        return False              # tools and constraints are checked at length
    if any(m.tool_calls or m.reasoning_content for m in request.messages):
        return False
    return sum(len(m.content) for m in request.messages) <= INLINE_TEXT_CHARS


class AdmissionPool:
    def __init__(self, max_workers: int = POOL_THREADS) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="admission")

    async def run(self, inline: bool, admit: Callable[[], T]) -> T:
        """admit() inline, or on the pool, whose threads wait for nothing else."""
        if inline:
            return admit()
        return await asyncio.get_running_loop().run_in_executor(self._executor, admit)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""One request's output as its client sees it: tokens become text (incrementally), stop strings
cut it, and tokens are gathered into messages of `stream_interval` tokens.

It only reports what it found (`stopped` when a stop string matched); the frontend that owns it
tells the core to end the request, as vLLM's OutputProcessor returns `reqs_to_abort`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.sequence import FinishReason
from scheduler_svc.stop_strings import StopStringMatcher
from scheduler_svc.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True)
class RequestOutput:
    """One streamed message: tokens and text new since the last one."""
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason | None = None     # set on the last message only
    usage: Usage | None = None
    matched_stop: str | None = None               # the stop string that ended it, if one did

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class OutputStream:
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None
    want_logprobs: bool
    stream_interval: int = 1
    num_output_tokens: int = 0
    stopped: bool = False                        # a stop string matched: the request is over
    _tokens: list[int] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)
    _logprobs: list[float] = field(default_factory=list)
    _sent_first: bool = False

    @classmethod
    def create(cls, tokenizer: Tokenizer, prompt_token_ids: list[int], *, stop: tuple[str, ...],
               skip_special_tokens: bool, logprobs: bool, stream_interval: int) -> "OutputStream":
        return cls(len(prompt_token_ids), IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens),
                   StopStringMatcher(stop) if stop else None, logprobs, stream_interval)

    def add_token(self, token_id: int, logprob: float | None) -> None:
        """Takes the next sampled token; afterwards `stopped` tells whether a stop string ended it
        (the text then stops right before the stop string)."""
        if self.stopped:
            return
        self.num_output_tokens += 1
        self._tokens.append(token_id)
        if self.want_logprobs:
            self._logprobs.append(logprob if logprob is not None else 0.0)
        text = self.detokenizer.push((token_id,))
        if self.stops is not None:
            text, self.stopped = self.stops.feed(text)
        if text:
            self._text.append(text)

    def ready(self) -> RequestOutput | None:
        """The message to send now, if there is one: the first token at once, then one every
        stream_interval tokens."""
        if not self._tokens or (self._sent_first and len(self._tokens) < self.stream_interval):
            return None
        self._sent_first = True
        return self._take()

    def finish(self, reason: FinishReason, cached_prompt_tokens: int) -> RequestOutput:
        """The last message: whatever is buffered, the held-back text, the reason and usage."""
        if self.stopped:
            reason = FinishReason.STOP
        else:
            tail = self.detokenizer.flush()
            if self.stops is not None:
                tail, self.stopped = self.stops.feed(tail)
                if not self.stopped:
                    tail += self.stops.flush()
            if tail:
                self._text.append(tail)
        out = self._take()
        out.finish_reason = reason
        out.usage = Usage(self.num_prompt_tokens, self.num_output_tokens, cached_prompt_tokens)
        out.matched_stop = self.stops.matched if self.stops is not None else None
        return out

    def _take(self) -> RequestOutput:
        out = RequestOutput(self._tokens, "".join(self._text), self._logprobs)
        self._tokens, self._text, self._logprobs = [], [], []
        return out

"""One sample's output as its client sees it: tokens become text (incrementally), stop strings
cut it, and tokens are gathered into messages of `stream_interval` tokens.

It only reports what it found (`stopped` when a stop string matched); the frontend that owns it
tells the core to end the request, as vLLM's OutputProcessor returns `reqs_to_abort`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_svc.frontend.detokenizer import IncrementalDetokenizer
from common.sampling import SamplingParams
from scheduler_svc.engine.sequence import FinishReason
from scheduler_svc.frontend.stop_strings import StopStringMatcher
from scheduler_svc.frontend.tokenizer import Tokenizer

# The most likely tokens at one position: (token ids, logprobs), most likely first.
TopLogprobs = tuple[list[int], list[float]]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True)
class RequestOutput:
    """One streamed message of one sample: tokens and text new since its last one."""
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason | None = None     # set on the sample's last message only
    usage: Usage | None = None
    matched_stop: str | None = None               # the stop string or stop token's text that ended it
    index: int = 0                                # the sample (SamplingParams.n)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)   # per token, when asked
    prompt_logprobs: list[float] | None = None    # in the first message, when asked
    prompt_top_logprobs: list[TopLogprobs] | None = None

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
    index: int = 0
    want_top_logprobs: bool = False
    want_prompt_logprobs: bool = False
    # The tokens that end the sample when sampled (the scheduler's rule) and how to name one in
    # matched_stop.
    stop_token_ids: frozenset[int] = frozenset()
    token_text: Callable[[int], str] | None = None
    # Stop strings end the sample from its (min_tokens + 1)-th token on, as its EOS and stop tokens
    # (the scheduler's rule) and as vLLM's detokenizer has it.
    min_tokens: int = 0
    num_output_tokens: int = 0
    stopped: bool = False                        # a stop string matched: the request is over
    _tokens: list[int] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)
    _logprobs: list[float] = field(default_factory=list)
    _top: list[TopLogprobs] = field(default_factory=list)
    _prompt_logprobs: list[float] = field(default_factory=list)
    _prompt_top: list[TopLogprobs] = field(default_factory=list)
    _sent_first: bool = False
    _last_token: int | None = None

    @classmethod
    def create(cls, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams, *,
               stream_interval: int, index: int = 0, eos_token_ids=()) -> "OutputStream":
        stop_ids = params.stop_token_ids if params.ignore_eos else params.stop_token_ids | frozenset(eos_token_ids)
        return cls(len(prompt_token_ids),
                   IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens),
                   StopStringMatcher(params.stop) if params.stop else None, params.logprobs, stream_interval,
                   index=index, want_top_logprobs=params.top_logprobs > 0,
                   want_prompt_logprobs=params.prompt_logprobs, stop_token_ids=stop_ids,
                   token_text=lambda token_id: tokenizer.decode([token_id]), min_tokens=params.min_tokens)

    def add_prompt_logprobs(self, logprobs: list[float], top: list[TopLogprobs] | None) -> None:
        """Scores of the next prompt tokens (sent with the first message)."""
        self._prompt_logprobs += logprobs
        if self.want_top_logprobs:
            self._prompt_top += top if top is not None else [([], [])] * len(logprobs)

    def add_token(self, token_id: int, logprob: float | None, top: TopLogprobs | None = None) -> None:
        """Takes the next sampled token; afterwards `stopped` tells whether a stop string ended it
        (the text then stops right before the stop string)."""
        if self.stopped:
            return
        self.num_output_tokens += 1
        self._tokens.append(token_id)
        self._last_token = token_id
        if self.want_logprobs:
            self._logprobs.append(logprob if logprob is not None else 0.0)
        if self.want_top_logprobs:
            self._top.append(top if top is not None else ([], []))
        text = self.detokenizer.push((token_id,))
        if self.stops is not None:
            text, self.stopped = self.stops.feed(text, self.num_output_tokens > self.min_tokens)
        if text:
            self._text.append(text)

    def ready(self) -> RequestOutput | None:
        """The message to send now, if there is one: the first token at once, then one every
        stream_interval tokens."""
        if not self._tokens or (self._sent_first and len(self._tokens) < self.stream_interval):
            return None
        return self._take()

    def finish(self, reason: FinishReason, cached_prompt_tokens: int) -> RequestOutput:
        """The last message: whatever is buffered, the held-back text, the reason and usage."""
        if not self.stopped:
            tail = self.detokenizer.flush()
            if self.stops is not None:
                tail, self.stopped = self.stops.feed(tail, self.num_output_tokens > self.min_tokens)
                if not self.stopped:
                    tail += self.stops.flush()
            if tail:
                self._text.append(tail)
        if self.stopped:     # a stop string cut the text, in the tail the flush released too
            reason = FinishReason.STOP
        out = self._take()
        out.finish_reason = reason
        out.usage = Usage(self.num_prompt_tokens, self.num_output_tokens, cached_prompt_tokens)
        out.matched_stop = self.stops.matched if self.stops is not None else None
        if (out.matched_stop is None and reason is FinishReason.STOP and self._last_token in self.stop_token_ids
                and self.token_text is not None):
            out.matched_stop = self.token_text(self._last_token)
        return out

    def _take(self) -> RequestOutput:
        out = RequestOutput(self._tokens, "".join(self._text), self._logprobs, index=self.index, top_logprobs=self._top)
        if not self._sent_first and self.want_prompt_logprobs:
            out.prompt_logprobs = self._prompt_logprobs
            out.prompt_top_logprobs = self._prompt_top if self.want_top_logprobs else None
        self._sent_first = True
        self._tokens, self._text, self._logprobs, self._top = [], [], [], []
        return out

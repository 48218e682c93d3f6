"""A sample's output stream (scheduler_svc/frontend/output_stream.py) over a stand-in detokenizer whose
tokens are their own text: stop strings end the sample only from its (min_tokens + 1)-th token on, as
its EOS and stop tokens (the scheduler's rule) and as vLLM's detokenizer has it; a stop string that only
starts in the first min_tokens tokens still ends it, and a match in the text a finish releases is STOP."""
from __future__ import annotations

from scheduler_svc.engine.sequence import FinishReason
from scheduler_svc.frontend.output_stream import OutputStream
from scheduler_svc.frontend.stop_strings import StopStringMatcher

TEXTS = {1: "a", 2: "b", 3: "c", 4: "x"}


class Detokenizer:
    def push(self, token_ids) -> str:
        return "".join(TEXTS[t] for t in token_ids)

    def flush(self) -> str:
        return ""


def run(tokens: list[int], stops: list[str], min_tokens: int) -> tuple[str, int, FinishReason | None, str | None]:
    """(text, tokens taken, finish reason, matched stop) of a sample fed `tokens` until a stop ends it."""
    stream = OutputStream(3, Detokenizer(), StopStringMatcher(stops), want_logprobs=False, min_tokens=min_tokens)
    for token in tokens:
        stream.add_token(token, None)
        if stream.stopped:
            break
    last = stream.finish(FinishReason.LENGTH, 0)   # every token's text is in this one message
    return last.text, stream.num_output_tokens, last.finish_reason, last.matched_stop


def test_a_stop_string_within_the_first_min_tokens_tokens_does_not_end_the_sample():
    assert run([1, 2, 4, 4], ["b"], min_tokens=2) == ("abxx", 4, FinishReason.LENGTH, None)
    assert run([1, 2, 4, 2, 4], ["b"], min_tokens=2) == ("abx", 4, FinishReason.STOP, "b")


def test_without_min_tokens_the_first_stop_string_ends_it():
    assert run([1, 2, 4, 4], ["b"], min_tokens=0) == ("a", 2, FinishReason.STOP, "b")


def test_a_stop_string_that_starts_in_the_first_min_tokens_tokens_and_ends_after_them_ends_it():
    assert run([1, 2, 3, 4], ["bc"], min_tokens=2) == ("a", 3, FinishReason.STOP, "bc")


def test_a_stream_made_for_a_request_takes_its_min_tokens(tiny_model_dir):
    from common.sampling import SamplingParams
    from scheduler_svc.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode("hello world, hello")
    stop = tokenizer.decode(ids[:1])
    params = SamplingParams(max_tokens=16, stop=(stop,), min_tokens=len(ids))
    stream = OutputStream.create(tokenizer, [1, 2], params, stream_interval=1)
    assert stream.min_tokens == len(ids)
    for token in ids:   # the stop string's text, within the first min_tokens tokens
        stream.add_token(token, None)
    assert not stream.stopped

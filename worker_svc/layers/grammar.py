"""Grammar-constrained sampling: per-request grammar state and the token masks it puts on the logits.

A constrained request's matcher lives where its tokens are sampled (the worker's sampling rank):
each step, `GrammarBitmask.fill` writes the tokens every constrained row may take next into a
CPU bitmask (one bit per vocabulary id, xgrammar's layout), `apply_bitmask` sets every other
logit of those rows to -inf before any other processing, and the sampled token is fed back with
`GrammarMatcher.accept_token`. So every token of a constrained request is drawn under its grammar
and even a random model emits text the grammar accepts. The scheduler keeps the token ids: after
a preemption or a worker restart `GrammarCompiler.matcher(constraint, output_ids)` rebuilds the
state by replaying them.

Guarantees:
  - A batch without constrained rows pays nothing: `fill` returns None and `apply_bitmask`
    returns at once, touching no tensor.
  - Ids past the tokenizer (the model's padded embedding rows) are never allowed in a constrained
    row, nor special tokens (<|im_start|>, ...), except the stop tokens once the grammar is
    complete (then only they are allowed; after a stop token is accepted the matcher is terminated and its
    row keeps allowing only stop tokens, e.g. under ignore_eos).
  - Each (kind, text) is compiled once: compiled grammars are cached, least recently used first
    out once the cache passes its byte budget.
  - Works for logits on any device: the bitmask is filled on the CPU (the matcher is CPU code),
    copied once per step, and unpacked with tensor ops on the logits' device.
The filling is CPU work that depends only on tokens already accepted, so a worker can run it
while the GPU computes the step's forward pass and apply the mask just before sampling.
Constraint kinds and their grammars (and why xgrammar): common/constraint.py.
"""
from __future__ import annotations

import pathlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xgrammar as xgr

from common.constraint import Constraint, GrammarError, to_grammar

__all__ = ["Constraint", "GrammarError", "GrammarCompiler", "GrammarMatcher", "GrammarBitmask", "apply_bitmask",
           "allow_only"]

BITS = 32   # xgrammar's bitmask: int32 words, bit j of word w is token 32 * w + j
DEFAULT_CACHE_BYTES = 256 << 20


class GrammarCompiler:
    """Compiles constraints against one tokenizer and model vocabulary, with a cache."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int], *,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, max_threads: int = 1) -> None:
        """`vocab_size` is the model's (its logits' width), which may exceed the tokenizer's;
        `stop_token_ids` end a constrained output once its grammar is complete (the model's EOS
        ids). `max_threads` compile one grammar's masks in parallel."""
        if vocab_size < len(hf_tokenizer):
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(hf_tokenizer)} ids")
        if not stop_token_ids:
            raise ValueError("stop_token_ids is empty: a constrained output could never end")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.tokenizer_info = _tokenizer_info(hf_tokenizer, vocab_size, self.stop_token_ids)
        # Our own cache (keyed by the constraint, bounded in bytes): xgrammar's keys on its own
        # grammar text, which the string fix in common/constraint.py already rewrote.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[Constraint, xgr.CompiledGrammar] = OrderedDict()
        self._cache_bytes, self._cache_limit = 0, cache_bytes
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, model_dir: str | pathlib.Path, vocab_size: int, stop_token_ids: Sequence[int],
                       **kwargs) -> "GrammarCompiler":
        """From the tokenizer files of a model directory (never a hub)."""
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(pathlib.Path(model_dir), local_files_only=True)
        return cls(hf_tokenizer, vocab_size, stop_token_ids, **kwargs)

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar of `constraint`, from the cache when it has been compiled before.
        Raises GrammarError for a bad constraint. Thread-safe; compiling runs outside the lock."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                return compiled
        try:
            compiled = self._compiler.compile_grammar(to_grammar(constraint))
        except GrammarError:
            raise
        except (RuntimeError, ValueError) as exc:   # a grammar that parses but cannot be compiled
            raise GrammarError(constraint.kind, str(exc).strip().splitlines()[-1]) from None
        self._check_matches_some_output(constraint, compiled)
        self._remember(constraint, compiled)
        return compiled

    def cached(self, constraint: Constraint) -> xgr.CompiledGrammar | None:
        """The compiled grammar of `constraint` if it is in the cache (made most recently used)."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
            return compiled

    def adopt(self, constraint: Constraint, serialized: str) -> xgr.CompiledGrammar:
        """Caches and returns a grammar compiled elsewhere (CompiledGrammar.serialize_json of a
        compiler built from the same tokenizer and vocabulary, e.g. worker_svc/grammar_pool.py's)."""
        compiled = xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)
        self._remember(constraint, compiled)    # checked by the compile() that made it
        return compiled

    def _check_matches_some_output(self, constraint: Constraint, compiled: xgr.CompiledGrammar) -> None:
        """GrammarError when no token may come first, not even a stop token: a grammar whose
        language is empty (`root ::= root`, an empty character class) would otherwise end every
        request at once with an empty output that looks like a complete match."""
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(self.stop_token_ids))
        bitmask = xgr.allocate_token_bitmask(1, self.tokenizer_info.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not bitmask.any():
            raise GrammarError(constraint.kind, "it matches no output: no token may come first, not even the end")

    def matcher(self, constraint: Constraint, accepted_ids: Sequence[int] = (), *,
                stop_token_ids: Sequence[int] | None = None) -> "GrammarMatcher":
        """A fresh matcher for one request, advanced over `accepted_ids` (the output tokens it
        already has, when it is rebuilt). `stop_token_ids` replaces the compiler's stop tokens
        for this request. Raises GrammarError when the constraint is bad or the ids do not
        follow it."""
        return self.matcher_of(constraint, self.compile(constraint), accepted_ids, stop_token_ids=stop_token_ids)

    def matcher_of(self, constraint: Constraint, compiled: xgr.CompiledGrammar, accepted_ids: Sequence[int] = (), *,
                   stop_token_ids: Sequence[int] | None = None) -> "GrammarMatcher":
        """As matcher(), from a grammar compiled already."""
        matcher = GrammarMatcher(compiled, stop_token_ids or self.stop_token_ids)
        for i, token_id in enumerate(accepted_ids):
            if not matcher.accept_token(token_id):
                raise GrammarError(constraint.kind, f"output token {i} (id {token_id}) does not follow the grammar")
        return matcher

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _remember(self, constraint: Constraint, compiled: xgr.CompiledGrammar) -> None:
        size = compiled.memory_size_bytes
        with self._lock:
            if constraint in self._cache:
                return
            self._cache[constraint] = compiled
            self._cache_bytes += size
            while self._cache_bytes > self._cache_limit and len(self._cache) > 1:
                _, evicted = self._cache.popitem(last=False)
                self._cache_bytes -= evicted.memory_size_bytes


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int]) -> None:
        self.stop_token_ids = tuple(stop_token_ids)
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        """Advances over a sampled token; False (state unchanged) when the grammar forbids it,
        which a token drawn under this matcher's mask never is. After termination only stop
        tokens are accepted (and change nothing), so ignore_eos outputs stay consistent."""
        if self._matcher.is_terminated():
            return token_id in self.stop_token_ids
        if not self._matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Accepts tokens in order; stops at the first refused one and returns False."""
        return all(self.accept_token(token_id) for token_id in token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` accepted tokens (a step whose tokens were discarded)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} accepted")
        self._matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the constrained output is complete."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The text so far is a complete match: a stop token may come next."""
        return self._matcher.is_completed()

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row] (a CPU int32 tensor)."""
        if self._matcher.is_terminated():
            allow_only(bitmask[row], self.stop_token_ids)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBitmask:
    """A reusable CPU bitmask (pinned when the logits live on a GPU) for a step's constrained rows."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", *, initial_rows: int = 8,
                 max_threads: int = 1) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.words = (vocab_size + BITS - 1) // BITS
        self._pin = self.device.type == "cuda"
        self._buffer = self._allocate(initial_rows)
        self._batch = xgr.BatchGrammarMatcher(max_threads) if max_threads > 1 else None

    def fill(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor | None:
        """Row i of the returned [len(matchers), words] bitmask: the tokens matchers[i] allows.
        None when there are no matchers. The tensor is this object's buffer: apply it before the
        next fill."""
        if not matchers:
            return None
        if len(matchers) > self._buffer.shape[0]:
            self._buffer = self._allocate(max(len(matchers), 2 * self._buffer.shape[0]))
        bitmask = self._buffer[: len(matchers)]
        live = [i for i, m in enumerate(matchers) if not m.is_terminated]
        if self._batch is not None and len(live) > 1:
            self._batch.batch_fill_next_token_bitmask([matchers[i]._matcher for i in live], self._buffer, live)
            for i in set(range(len(matchers))) - set(live):
                matchers[i].fill_row(self._buffer, i)
        else:
            for i, matcher in enumerate(matchers):
                matcher.fill_row(self._buffer, i)
        return bitmask

    def rows(self, num_rows: int) -> torch.Tensor:
        """The buffer's first num_rows rows (grown as needed), for rows filled one by one."""
        if num_rows > self._buffer.shape[0]:
            self._buffer = self._allocate(max(num_rows, 2 * self._buffer.shape[0]))
        return self._buffer[:num_rows]

    def abandon(self) -> None:
        """Takes a new buffer: the old one may still be written by a fill that was given up on."""
        self._buffer = self._allocate(self._buffer.shape[0])

    def _allocate(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, self.words), dtype=torch.int32, pin_memory=self._pin)


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int] | torch.Tensor, bitmask: torch.Tensor | None) -> None:
    """Sets logits[rows[i], t] = -inf for every token t that bitmask[i] does not allow, in place.
    `logits` is [batch, vocab] on any device (columns past the bitmask's width are disallowed);
    `bitmask` is [len(rows), words] int32, from GrammarBitmask.fill. No rows: returns at once."""
    if bitmask is None or len(rows) == 0:
        return
    if bitmask.shape[0] != len(rows):
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {len(rows)} constrained logits rows")
    device, vocab = logits.device, logits.shape[-1]
    index = rows if isinstance(rows, torch.Tensor) else torch.tensor(list(rows), dtype=torch.long)
    index = index.to(device, non_blocking=True)
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(BITS, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)   # [rows, words * 32]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    masked = logits.index_select(0, index).masked_fill_(~allowed[:, :vocab], float("-inf"))
    logits.index_copy_(0, index, masked)


def _tokenizer_info(hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, in which special tokens other than the stop tokens are
    never allowed. xgrammar reads a special token (<|im_start|>, <|vision_start|>, ...) as its
    literal text, so a JSON string could hold one; the detokenizer would drop it under
    skip_special_tokens, and the model would see a control token mid-string. An empty entry is
    how xgrammar marks a token that never matches (it does so for the padded rows)."""
    detected = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
    special = set(hf_tokenizer.all_special_ids)
    special.update(i for i, token in hf_tokenizer.added_tokens_decoder.items() if token.special)
    special -= set(stop_token_ids)
    encoded = [""] * vocab_size
    for token, token_id in hf_tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = token
    return xgr.TokenizerInfo(encoded, vocab_type=detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=detected.add_prefix_space)


def allow_only(row: torch.Tensor, token_ids: Sequence[int]) -> None:
    """Writes a bitmask row that allows exactly `token_ids`."""
    words: dict[int, int] = {}
    for token_id in token_ids:
        word, bit = divmod(token_id, BITS)
        words[word] = words.get(word, 0) | (1 << bit)
    row.zero_()
    for word, value in words.items():
        row[word] = value - (1 << BITS) if value >= 1 << (BITS - 1) else value   # as a signed int32

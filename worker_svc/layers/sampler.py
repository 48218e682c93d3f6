"""Turns each sampling request's logits row into one token (and its logprob).

Order of processing: the logit bias (as vLLM applies it, before everything else), then as
transformers applies them: penalties, temperature, top-k, top-p, min-p, then a draw. A sampled token's logprob is of the logits as given, before any of that processing
(vLLM's default, raw logprobs), so it agrees with the top logprobs (worker_svc/layers/logprobs.py)
and does not depend on how the token was drawn. Draws use the exponential race (argmax of p / E with E ~ Exp(1)), which needs only
one vector of noise per row: for a seeded request that vector comes from a generator seeded by
(seed, index of the output token being sampled), so its tokens depend on nothing else — not on
the batch it shares, nor on preemption and re-admission. Unseeded requests share the worker's
generator in one batched draw.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from common.constraint import Constraint
from common.sampling_bounds import FLOAT_RANGES, LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS_ENTRIES, MAX_TOP_LOGPROBS, seed_hash
from worker_svc.layers.logits_guard import drawable_rows, with_unusable_rows_raw
from worker_svc.layers.penalties import PenaltyTable

# Temperatures below this are greedy: dividing by them would overflow the logits.
_GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """A request's sampling options on the worker: the fields of the scheduler's SamplingParams
    that the worker acts on, under the same names (the wire carries them by name)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False            # > 0 top_logprobs implies it
    top_logprobs: int = 0             # the runner computes these (layers/logprobs.py)
    prompt_logprobs: bool = False     # the runner scores the prompt
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) added before penalties, ids ascending
    constraint: Constraint | None = None             # the runner's grammar matcher (structured_output.py)
    speculative: bool = True          # the runner proposes drafts for it (when it speculates)

    def __post_init__(self) -> None:
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)

    def validate(self) -> None:
        """ValueError naming every option out of its bounds (common/sampling_bounds.py)."""
        problems = [f"{name} {getattr(self, name)} not in {bounds}"
                    for name, bounds in FLOAT_RANGES.items() if getattr(self, name) not in bounds]
        if self.top_k < 0:
            problems.append(f"top_k {self.top_k} < 0")
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            problems.append(f"top_logprobs {self.top_logprobs} > {MAX_TOP_LOGPROBS}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            problems.append(f"logit_bias has {len(self.logit_bias)} entries > {MAX_LOGIT_BIAS_ENTRIES}")
        if not all(value in LOGIT_BIAS_RANGE for _, value in self.logit_bias):
            problems.append(f"logit_bias values must be finite, within {LOGIT_BIAS_RANGE}")
        if problems:
            raise ValueError("invalid sampling options: " + "; ".join(problems))

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError when an option names a token id past the vocabulary."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise ValueError(f"logit_bias token id {self.logit_bias[-1][0]} >= vocab_size {vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    @property
    def bias_entries(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The logit bias as (token ids ascending, their biases); two empty tuples when none."""
        if not self.logit_bias:
            return (), ()
        ids, values = zip(*self.logit_bias)
        return ids, values

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class SamplingRow(Protocol):
    """What the sampler needs to know about the request behind one logits row."""
    sampling: SamplingOptions
    penalty_row: int | None

    @property
    def num_output_tokens(self) -> int: ...


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True).unsqueeze(1)


@dataclass(eq=False)
class SamplingMetadata:
    """What a step's sampling needs about its rows (the requests that sample, in batch order),
    derived once from their options and kept while the same rows sample step after step: a
    decode-heavy batch changes only when a request joins or leaves, so most steps reuse it and
    do no per-row Python work at all. Index tensors are on the sampler's device; a part that
    no row needs is None, and the sampler skips it."""
    num_rows: int
    greedy: bool                               # every row is greedy: one argmax, nothing else
    drawing: list[int]                         # rows that draw (not greedy)
    drawing_index: torch.Tensor | None         # the same, when some rows are greedy
    temperature: torch.Tensor | None           # [drawing, 1] float32, when any is not 1
    top_k: list[int] | None                    # per drawing row (vocab = off), when any row truncates
    top_k_tensor: torch.Tensor | None
    top_p: torch.Tensor | None                 # [drawing] float32; inf for rows that keep every token
    min_p: torch.Tensor | None                 # [drawing] float32, when any row asks
    seeded: list[tuple[int, int]]              # (position among drawing rows, seed)
    all_seeded: bool
    penalized_index: torch.Tensor | None       # batch rows with penalties
    penalty_rows: torch.Tensor | None          # their rows in the penalty table
    repetition: torch.Tensor | None
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    logprob_rows: torch.Tensor | None          # rows that want their token's logprob
    logprobs: bool                             # any row asked
    bias_rows: torch.Tensor | None = None      # per logit-bias entry of any row: its row,
    bias_ids: torch.Tensor | None = None       # its token id
    bias_values: torch.Tensor | None = None    # and its bias (float32)

    @classmethod
    def build(cls, options: list[SamplingOptions], penalty_rows: list[int | None], vocab_size: int,
              device: torch.device) -> "SamplingMetadata":
        n = len(options)
        drawing = [i for i, o in enumerate(options) if not o.greedy]
        drawn = [options[i] for i in drawing]
        temperature = top_k = top_k_tensor = top_p = min_p = None
        if drawn:
            if any(o.temperature != 1.0 for o in drawn):
                temperature = _column([o.temperature for o in drawn], device)
            ks = [o.top_k if 0 < o.top_k < vocab_size else vocab_size for o in drawn]
            # p = 1 keeps everything: inf, so rounding in the cumulative sum never drops the tail.
            ps = [o.top_p if o.top_p < 1 else float("inf") for o in drawn]
            if any(k < vocab_size for k in ks) or any(p < 1 for p in ps):
                top_k, top_k_tensor = ks, _index(ks, device)
                top_p = _column(ps, device).squeeze(1)
            if any(o.min_p > 0 for o in drawn):
                min_p = _column([o.min_p for o in drawn], device).squeeze(1)
        seeded = [(j, o.seed) for j, o in enumerate(drawn) if o.seed is not None]
        penalized = [i for i, row in enumerate(penalty_rows) if row is not None]
        asked = [i for i, o in enumerate(options) if o.logprobs]
        biased = [(i, token_id, value) for i, o in enumerate(options) for token_id, value in o.logit_bias]
        bias_rows, bias_ids, bias_values = zip(*biased) if biased else ((), (), ())
        return cls(
            num_rows=n,
            greedy=not drawing,
            drawing=drawing,
            drawing_index=_index(drawing, device) if drawing and len(drawing) < n else None,
            temperature=temperature, top_k=top_k, top_k_tensor=top_k_tensor, top_p=top_p, min_p=min_p,
            seeded=seeded,
            all_seeded=bool(drawing) and len(seeded) == len(drawing),
            penalized_index=_index(penalized, device) if penalized else None,
            penalty_rows=_index([penalty_rows[i] for i in penalized], device) if penalized else None,
            repetition=_column([options[i].repetition_penalty for i in penalized], device) if penalized else None,
            presence=_column([options[i].presence_penalty for i in penalized], device) if penalized else None,
            frequency=_column([options[i].frequency_penalty for i in penalized], device) if penalized else None,
            logprob_rows=_index(asked, device) if asked else None,
            logprobs=bool(asked),
            bias_rows=_index(list(bias_rows), device) if biased else None,
            bias_ids=_index(list(bias_ids), device) if biased else None,
            bias_values=_column(list(bias_values), device).squeeze(1) if biased else None,
        )


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)
        self._row_generator = torch.Generator(device)   # reseeded for every seeded row
        self.penalties = PenaltyTable(vocab_size, device)

    def add_request(self, token_ids: list[int], num_prompt_tokens: int, options: SamplingOptions) -> int | None:
        """Penalty bookkeeping for a request; returns its penalty row (None: no penalties)."""
        if not options.has_penalties:
            return None
        return self.penalties.add(token_ids[:num_prompt_tokens], token_ids[num_prompt_tokens:])

    def remove_request(self, penalty_row: int | None) -> None:
        if penalty_row is not None:
            self.penalties.release(penalty_row)

    def metadata(self, options: list[SamplingOptions], penalty_rows: list[int | None]) -> SamplingMetadata:
        return SamplingMetadata.build(options, penalty_rows, self.vocab_size, self.device)

    def sample_rows(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[list[int], list[float]]:
        """sample() for callers holding row objects: (token ids, logprobs; 0.0 where not asked)."""
        meta = self.metadata([r.sampling for r in rows], [r.penalty_row for r in rows])
        output_indices = [rows[meta.drawing[j]].num_output_tokens for j, _ in meta.seeded]
        token_ids, logprobs = self.sample(logits, meta, output_indices)
        return token_ids.tolist(), logprobs.tolist() if logprobs is not None else [0.0] * len(rows)

    def record(self, meta: SamplingMetadata, token_ids: torch.Tensor, keep: torch.Tensor) -> None:
        """Counts into the penalty state the tokens of a sample(record=False) call that `keep`
        (bool per row) marks as emitted."""
        if meta.penalized_index is not None:
            index = meta.penalized_index
            self.penalties.record(meta.penalty_rows, token_ids[index], keep[index])

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, meta: SamplingMetadata, seeded_output_indices: Sequence[int] = (),
               preceding: torch.Tensor | None = None,
               record: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [meta.num_rows, vocab] (any float dtype; not modified) -> (token ids int64,
        logprobs float32 of the logits as given, 0 where not asked, or None when no row asked),
        both on the device: nothing here waits for the device. seeded_output_indices: the output index each of meta.seeded is
        sampling. Counts the sampled tokens into the rows' penalty state. Greedy rows cost one
        argmax (over the logits as given: the same token as in float32); only the rows that draw
        go through temperature, truncation and the race. Speculative verification samples several
        positions of one request as rows: `preceding` [rows, m] (-1 padded) holds the draft tokens
        before each position, which its penalties count, and record=False leaves the counting of
        the tokens to record(), once the emitted ones are known."""
        raw = logits   # logprobs are those of the raw model distribution
        logits = adjusted_logits(logits, meta, self.penalties, preceding)
        token_ids = logits.argmax(-1) if len(meta.drawing) < meta.num_rows else None
        if meta.drawing:
            index = meta.drawing_index
            probs = truncated(logits if index is None else logits[index], meta).softmax(-1, dtype=torch.float32)
            drawable = drawable_rows(probs)   # before the race overwrites probs
            drawn = self._race(probs, meta, seeded_output_indices)
            raw_drawing = raw if index is None else raw[index]
            drawn = torch.where(drawable, drawn, raw_drawing.argmax(-1))
            token_ids = drawn if index is None else token_ids.index_copy_(0, index, drawn)
        if meta.penalized_index is not None and record:
            self.penalties.record(meta.penalty_rows, token_ids[meta.penalized_index])
        if not meta.logprobs:
            return token_ids, None
        logprobs = torch.zeros(meta.num_rows, dtype=torch.float32, device=logits.device)
        rows = meta.logprob_rows
        chosen = token_ids[rows].unsqueeze(1)
        logprobs.index_copy_(0, rows, raw[rows].float().log_softmax(-1).gather(1, chosen).squeeze(1))
        return token_ids, logprobs

    @torch.inference_mode()
    def probabilities(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution each row draws from (the module's `probabilities`); counts nothing."""
        return probabilities(logits, meta, self.penalties)

    def _race(self, probs: torch.Tensor, meta: SamplingMetadata, output_indices: Sequence[int]) -> torch.Tensor:
        """argmax(p / E), E ~ Exp(1) per token: a draw from p without a cumulative sum."""
        noise = torch.empty_like(probs)
        if not meta.all_seeded:
            noise.exponential_(generator=self.generator)
        for (j, seed), output_index in zip(meta.seeded, output_indices, strict=True):
            self._row_generator.manual_seed(seed_hash(seed, output_index))
            noise[j].exponential_(generator=self._row_generator)
        # A zero draw would turn an excluded token (p = 0) into 0/0; the floor keeps it at 0.
        # probs is the caller's scratch: dividing in place saves a vocabulary-sized buffer.
        return probs.div_(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(-1)


def adjusted_logits(logits: torch.Tensor, meta: SamplingMetadata, penalties: PenaltyTable,
                    preceding: torch.Tensor | None = None) -> torch.Tensor:
    """The logits with the rows' biases, then their penalties (a row they make unusable keeps its
    raw logits: layers/logits_guard.py); `logits` itself when no row has either. `preceding`: a
    verification's draft tokens before each row (Sampler.sample), which the penalties count."""
    raw = logits
    if meta.bias_values is not None:
        logits = logits.to(torch.float32, copy=True)
        logits.index_put_((meta.bias_rows, meta.bias_ids), meta.bias_values, accumulate=True)
    if meta.penalized_index is not None:
        if logits is raw:
            logits = logits.to(torch.float32, copy=True)
        penalties.apply(logits, meta.penalized_index, meta.penalty_rows, meta.repetition, meta.presence,
                        meta.frequency, preceding[meta.penalized_index] if preceding is not None else None)
        logits = with_unusable_rows_raw(logits, raw)   # a penalty made a row non-finite: skip it
    return logits


def truncated(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p of rows that draw (no greedy rows); excluded
    tokens get -inf. Each step is skipped when no row asks for it, so plain sampling never
    sorts the vocabulary; the result is float32 unless no step applied (then it is `logits`,
    whose softmax the caller takes in float32)."""
    if meta.temperature is not None:   # float32 / float32 of the upcast logits
        logits = logits / meta.temperature
    if meta.top_k is not None:
        logits = _top_k_top_p(logits.float(), meta.top_k, meta.top_k_tensor, meta.top_p)
    if meta.min_p is not None:
        logits = logits.float()
        probs = logits.softmax(-1)
        threshold = meta.min_p.unsqueeze(1) * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_k_tensor: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """One descending sort serves both. Top-k keeps ties with the k-th logit; top-p keeps
    the smallest prefix whose probability reaches p (always at least the top token). When
    every row has a top-k, only the largest max(k) candidates are sorted, not the vocabulary
    (then a tie with the k-th logit outside those candidates is dropped)."""
    candidates = max(top_k)
    if candidates < logits.shape[-1]:
        sorted_logits, order = logits.topk(candidates, dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_k_tensor - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


@torch.inference_mode()
def probabilities(logits: torch.Tensor, meta: SamplingMetadata, penalties: PenaltyTable) -> torch.Tensor:
    """The distribution each row draws from, [meta.num_rows, vocab] float32: its logits after the
    bias, the penalties (read from `penalties`, not counted), temperature, top-k, top-p and min-p,
    softmaxed; one-hot at the token where the row takes an argmax (greedy rows, and rows whose
    processing broke). Speculative decoding's rejection sampler compares against these."""
    raw = logits
    logits = adjusted_logits(logits, meta, penalties)
    probs = torch.zeros(meta.num_rows, logits.shape[-1], dtype=torch.float32, device=logits.device)
    probs.scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    if meta.drawing:
        index = torch.tensor(meta.drawing, dtype=torch.long, device=logits.device)
        drawing = truncated(logits[index], meta).softmax(-1, dtype=torch.float32)
        one_hot = torch.zeros_like(drawing).scatter_(1, raw[index].argmax(-1, keepdim=True), 1.0)
        probs[index] = torch.where(drawable_rows(drawing).unsqueeze(1), drawing, one_hot)
    return probs

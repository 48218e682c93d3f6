"""Turns each sampling request's logits row into one token (and its logprob).

Order of processing, as transformers applies it: penalties, temperature, top-k, top-p, min-p,
then a draw. Draws use the exponential race (argmax of p / E with E ~ Exp(1)), which needs only
one vector of noise per row: for a seeded request that vector comes from a generator seeded by
(seed, index of the output token being sampled), so its tokens depend on nothing else — not on
the batch it shares, nor on preemption and re-admission. Unseeded requests share the worker's
generator in one batched draw.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import xxhash

from worker_svc.layers.logits_guard import drawable_rows, with_unusable_rows_raw
from worker_svc.layers.penalties import PenaltyTable

# Temperatures below this are greedy: dividing by them would overflow the logits.
_GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False

    @classmethod
    def from_proto(cls, pb) -> "SamplingOptions":
        """From worker_pb2.SamplingOptions. proto3 cannot tell an unset float from 0, and 0 is
        meaningless for top_p and repetition_penalty, so 0 there means off."""
        options = cls(
            temperature=pb.temperature,
            top_p=pb.top_p or 1.0,
            top_k=pb.top_k,
            min_p=pb.min_p,
            seed=pb.seed if pb.HasField("seed") else None,
            repetition_penalty=pb.repetition_penalty or 1.0,
            presence_penalty=pb.presence_penalty,
            frequency_penalty=pb.frequency_penalty,
            logprobs=pb.logprobs,
        )
        options.validate()
        return options

    def validate(self) -> None:
        problems = [
            f"temperature {self.temperature} < 0" if not self.temperature >= 0 else "",
            f"top_p {self.top_p} not in (0, 1]" if not 0 < self.top_p <= 1 else "",
            f"top_k {self.top_k} < 0" if self.top_k < 0 else "",
            f"min_p {self.min_p} not in [0, 1]" if not 0 <= self.min_p <= 1 else "",
            f"repetition_penalty {self.repetition_penalty} <= 0" if not self.repetition_penalty > 0 else "",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("invalid sampling options: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class SamplingRow(Protocol):
    """What the sampler needs to know about the request behind one logits row."""
    sampling: SamplingOptions
    penalty_row: int | None

    @property
    def num_output_tokens(self) -> int: ...


def seeded_noise_seed(seed: int, output_index: int) -> int:
    """The generator seed for output token `output_index` of a request seeded with `seed`."""
    return xxhash.xxh64_intdigest(struct.pack("<QQ", seed & 0xFFFF_FFFF_FFFF_FFFF, output_index))


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
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

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[list[int], list[float]]:
        """logits [len(rows), vocab] (any float dtype) -> (token ids, logprobs; 0.0 where not
        asked). Counts the sampled tokens into the rows' penalty state. Greedy rows cost one
        argmax (over the logits as given: the same token as in float32); only the rows that draw
        go through temperature, truncation and the race."""
        options = [row.sampling for row in rows]
        raw = logits   # greedy logprobs are those of the raw model distribution
        penalized = [i for i, row in enumerate(rows) if row.penalty_row is not None]
        if penalized:
            logits = logits.to(torch.float32, copy=True)
            self._apply_penalties(logits, rows, penalized)
            logits = with_unusable_rows_raw(logits, raw)   # a penalty made a row non-finite: skip it
        drawing = [i for i, o in enumerate(options) if not o.greedy]
        token_ids = logits.argmax(-1) if len(drawing) < len(rows) else None
        processed = None
        if drawing:
            index = None if token_ids is None else self._tensor(drawing, torch.long)
            processed = self._process(logits if index is None else logits[index], [options[i] for i in drawing])
            probs = processed.softmax(-1, dtype=torch.float32)
            drawable = drawable_rows(probs)   # before the race overwrites probs
            drawn = self._race(probs, [rows[i] for i in drawing])
            raw_drawing = raw if index is None else raw[index]
            drawn = torch.where(drawable, drawn, raw_drawing.argmax(-1))
            token_ids = drawn if index is None else token_ids.index_copy_(0, index, drawn)
        if penalized:
            index = self._tensor(penalized, torch.long)
            table_rows = self._tensor([rows[i].penalty_row for i in penalized], torch.long)
            self.penalties.record(table_rows, token_ids[index])
        logprobs = [0.0] * len(rows)
        greedy_asked = [i for i, o in enumerate(options) if o.logprobs and o.greedy]
        drawn_asked = [i for i, o in enumerate(options) if o.logprobs and not o.greedy]
        if greedy_asked:
            values = self._chosen_logprobs(raw, greedy_asked, greedy_asked, token_ids)
            for i, value in zip(greedy_asked, values):
                logprobs[i] = value
        if drawn_asked:
            processed = with_unusable_rows_raw(processed, raw_drawing)
            processed_row = {i: j for j, i in enumerate(drawing)}
            values = self._chosen_logprobs(processed, [processed_row[i] for i in drawn_asked], drawn_asked, token_ids)
            for i, value in zip(drawn_asked, values):
                logprobs[i] = value
        return token_ids.tolist(), logprobs

    def _chosen_logprobs(self, scores: torch.Tensor, score_rows: list[int], batch_rows: list[int],
                         token_ids: torch.Tensor) -> list[float]:
        """log_softmax(scores[score_rows[j]]) at the token chosen for batch row batch_rows[j]."""
        chosen = token_ids[self._tensor(batch_rows, torch.long)].unsqueeze(1)
        picked = scores[self._tensor(score_rows, torch.long)].float()
        return picked.log_softmax(-1).gather(1, chosen).squeeze(1).tolist()

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplingRow], penalized: list[int]) -> None:
        def column(attr: str) -> torch.Tensor:
            return self._tensor([getattr(rows[i].sampling, attr) for i in penalized], torch.float32).unsqueeze(1)

        self.penalties.apply(
            logits,
            batch_rows=self._tensor(penalized, torch.long),
            table_rows=self._tensor([rows[i].penalty_row for i in penalized], torch.long),
            repetition=column("repetition_penalty"),
            presence=column("presence_penalty"),
            frequency=column("frequency_penalty"),
        )

    def _process(self, logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p of rows that draw (no greedy rows); excluded
        tokens get -inf. Each step is skipped when no row asks for it, so plain sampling never
        sorts the vocabulary; the result is float32 unless no step applied (then it is `logits`,
        whose softmax the caller takes in float32)."""
        vocab = logits.shape[-1]
        if any(o.temperature != 1.0 for o in options):   # float32 / float32 of the upcast logits
            logits = logits / self._tensor([o.temperature for o in options], torch.float32).unsqueeze(1)
        top_k = [o.top_k if 0 < o.top_k < vocab else vocab for o in options]
        # p = 1 keeps everything: inf, so rounding in the cumulative sum never drops the tail.
        top_p = [o.top_p if o.top_p < 1 else float("inf") for o in options]
        if any(k < vocab for k in top_k) or any(p < 1 for p in top_p):
            logits = self._top_k_top_p(logits.float(), top_k, self._tensor(top_p, torch.float32))
        if any(o.min_p > 0 for o in options):
            min_p = self._tensor([o.min_p for o in options], torch.float32)
            logits = logits.float()
            probs = logits.softmax(-1)
            threshold = min_p.unsqueeze(1) * probs.amax(-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    def _top_k_top_p(self, logits: torch.Tensor, top_k: list[int], top_p: torch.Tensor) -> torch.Tensor:
        """One descending sort serves both. Top-k keeps ties with the k-th logit; top-p keeps
        the smallest prefix whose probability reaches p (always at least the top token). When
        every row has a top-k, only the largest max(k) candidates are sorted, not the vocabulary
        (then a tie with the k-th logit outside those candidates is dropped)."""
        candidates = max(top_k)
        if candidates < logits.shape[-1]:
            sorted_logits, order = logits.topk(candidates, dim=-1)
        else:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
        kth = sorted_logits.gather(1, (self._tensor(top_k, torch.long) - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)

    def _race(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """argmax(p / E), E ~ Exp(1) per token: a draw from p without a cumulative sum."""
        noise = torch.empty_like(probs)
        seeded = [(i, row.sampling.seed) for i, row in enumerate(rows) if row.sampling.seed is not None]
        if len(seeded) < len(rows):
            noise.exponential_(generator=self.generator)
        for i, seed in seeded:
            self._row_generator.manual_seed(seeded_noise_seed(seed, rows[i].num_output_tokens))
            noise[i].exponential_(generator=self._row_generator)
        # A zero draw would turn an excluded token (p = 0) into 0/0; the floor keeps it at 0.
        # probs is the caller's scratch: dividing in place saves a vocabulary-sized buffer.
        return probs.div_(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(-1)

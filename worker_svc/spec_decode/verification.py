"""How a step verifies drafts: its sampled positions laid out per request, and the acceptance rule.

A request that verifies k drafts computes its newest token and the k drafts in one chunk and
samples at all k + 1 positions, each as the plain sampler would sample there if the drafts
before it had been sampled (their penalties counted, the grammar advanced over them; a seeded
request draws position j with the noise of output index i + j). Its output is the sampled tokens
up to and including the first that differs from the draft at the next position. So every token
is the one the plain sampler would have drawn: greedy output is equal token for token, seeded
output too, and unseeded output has the same distribution (each emitted token is a fresh draw
from the target's distribution given the tokens before it). This is rejection sampling with the
draft as a point mass: a draft d is accepted with probability p(d), and a rejection draws from p
without d.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def decode_rows(requests: int, num_drafts: int) -> int:
    """Decode rows of a step in which `requests` requests each verify num_drafts drafts: a verifying
    step of decodes only lays each token of a run out as a decode row (batch_prep), so the decode
    graphs (the target's, and a proposer's catch-up over the same inputs) hold that many."""
    return requests * (1 + num_drafts)


@dataclass
class VerifyLayout:
    """The sampled positions of a step, host side: position p belongs to sampling request
    owner[p] (batch order) at offset[p] in its run; request r's positions start at first[r]."""
    num_drafts: np.ndarray       # int64 [requests]: drafts each verifies (0: a plain sample)
    first: np.ndarray            # int64 [requests]
    owner: np.ndarray            # int64 [positions]
    offset: np.ndarray           # int64 [positions]
    next_drafts: np.ndarray      # int64 [positions]: the draft after each position; -1 after the last

    @classmethod
    def build(cls, num_drafts: np.ndarray, draft_tokens: np.ndarray | None) -> "VerifyLayout":
        """num_drafts per sampling request and their draft tokens ([requests, >= max drafts]; None:
        known on the device only, next_drafts then all -1 here)."""
        sizes = num_drafts + 1
        first = np.zeros(len(sizes), np.int64)
        np.cumsum(sizes[:-1], out=first[1:])
        owner = np.repeat(np.arange(len(sizes)), sizes)
        offset = np.arange(int(sizes.sum())) - first[owner]
        if draft_tokens is None:
            return cls(num_drafts, first, owner, offset, np.full(len(owner), -1, np.int64))
        has_next = offset < num_drafts[owner]
        next_drafts = np.where(has_next, draft_tokens[owner, np.minimum(offset, draft_tokens.shape[1] - 1)], -1)
        return cls(num_drafts, first, owner, offset, next_drafts)

    @property
    def num_positions(self) -> int:
        return len(self.owner)

    @property
    def max_drafts(self) -> int:
        return int(self.num_drafts.max()) if len(self.num_drafts) else 0


@dataclass
class DeviceLayout:
    """The parts of a VerifyLayout the device needs."""
    first: torch.Tensor          # int64 [requests]
    num_drafts: torch.Tensor     # int64 [requests]
    owner: torch.Tensor          # int64 [positions]
    offset: torch.Tensor         # int64 [positions]
    next_drafts: torch.Tensor    # int64 [positions]
    max_drafts: int


def accept(tokens: torch.Tensor, layout: DeviceLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted drafts per request, whether each position's token is emitted, the last emitted
    position of each request), on the device without waiting for it: request r accepts its
    drafts while the token sampled before each equals it."""
    width = layout.max_drafts + 1
    steps = torch.arange(width, device=tokens.device)
    index = (layout.first.unsqueeze(1) + steps).clamp_max_(tokens.shape[0] - 1)
    matches = (tokens[index] == layout.next_drafts[index]) & (steps <= layout.num_drafts.unsqueeze(1))
    accepted = matches.to(torch.int64).cumprod(1).sum(1)
    emitted = layout.offset <= accepted[layout.owner]
    return accepted, emitted, layout.first + accepted


def preceding_drafts(layout: DeviceLayout) -> torch.Tensor:
    """[positions, max drafts]: the drafts before each position (-1 padded), which the sampler
    counts as output tokens for penalties."""
    width = max(layout.max_drafts, 1)
    steps = torch.arange(width, device=layout.offset.device)
    index = (layout.first[layout.owner].unsqueeze(1) + steps).clamp_max_(layout.next_drafts.shape[0] - 1)
    drafts = layout.next_drafts[index]
    return torch.where(steps < layout.offset.unsqueeze(1), drafts, -1)

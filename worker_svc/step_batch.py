"""A launched step's device inputs and the host facts its sampling needs, as the model runner
prepares them (batch_prep.py) and reads them while it executes and samples."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from worker_svc.layers.attention import AttentionMetadata
    from worker_svc.spec_decode.bookkeeping import SpecStep
    from worker_svc.spec_decode.drafter import DraftPlan
    from worker_svc.spec_decode.verification import DeviceLayout


@dataclass
class StepBatch:
    """A launched step's device inputs and the host facts the sampling needs. A decode step staged
    for the graphs (`graph`) has no input tensors of its own: the graph reads its staged columns
    (a speculating worker's: its input tensors and metadata are views of the graphs' static
    buffers, which the replay writes)."""
    input_ids: torch.Tensor | None  # int64 [num_tokens]
    positions: torch.Tensor | None  # int64 [num_tokens]
    meta: AttentionMetadata | None
    logits_indices: torch.Tensor    # int64 [sampled positions]: the last token of each sampling request
    sampling_rows: np.ndarray       # rows that sample, in batch order (host)
    sampling_rows_device: torch.Tensor
    position_rows: np.ndarray       # the row of each sampled position (sampling_rows, unless drafts are verified)
    seeded_output_indices: list[int]   # the output index each seeded sampled position draws
    # Sampling positions whose rows have a grammar matcher, the matchers, and the positions on the device.
    constrained: tuple[list[int], list, torch.Tensor] | None = None
    constrained_next_drafts: list[int] | None = None   # when drafts are verified: the draft after each
    # Top logprobs: each sampling position's k (0: not asked), and the positions that asked (device).
    top_ks: np.ndarray | None = None
    top_positions: torch.Tensor | None = None
    # Prompt scoring: flat token indices and the prompt tokens they predict (device), and per
    # scored request (seq_id, first position scored, count, k).
    score_indices: torch.Tensor | None = None
    score_targets: torch.Tensor | None = None
    scored: list[tuple[int, int, int, int]] | None = None
    graph: bool = False
    # Speculative decoding: the verification's layout on the device, and the step's bookkeeping.
    verify: DeviceLayout | None = None
    verify_rows: torch.Tensor | None = None   # int64 [sampled positions]: position_rows on the device
    spec: SpecStep | None = None
    accepted: torch.Tensor | None = None   # drafts each sampling request accepted (device), once sampled
    draft_plan: DraftPlan | None = None    # a device proposer's drafting plan
    ahead: bool = False                    # launched before the step before it was settled (spec_decode/ahead.py)

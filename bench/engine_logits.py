"""The engine's logits for every position of a few prompts, computed in one varlen prefill by the
worker's own ModelRunner (its model, weights loader and attention backend), for comparison with
transformers on the same checkpoint."""
from __future__ import annotations

import pathlib

import torch

from worker_svc.config import WorkerConfig
from worker_svc.layers.attention.base import AttentionMetadata
from worker_svc.model_runner import ModelRunner


def prefill_metadata(prompt_lens: list[int], block_size: int, device: torch.device) -> AttentionMetadata:
    """A batch of fresh prompts, each in its own run of consecutive blocks."""
    blocks = [-(-n // block_size) for n in prompt_lens]
    tables = torch.zeros(len(prompt_lens), max(blocks), dtype=torch.int32)
    slots, first = [], 0
    for i, (n, b) in enumerate(zip(prompt_lens, blocks)):
        tables[i, :b] = torch.arange(first, first + b, dtype=torch.int32)
        slots.append(torch.arange(n) + first * block_size)
        first += b
    starts = torch.tensor([0, *prompt_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device), query_start_loc=starts.to(device),
        seq_lens=torch.tensor(prompt_lens, dtype=torch.int32, device=device), block_tables=tables.to(device),
        max_query_len=max(prompt_lens), max_seq_len=max(prompt_lens),
        query_lens_cpu=list(prompt_lens), seq_lens_cpu=list(prompt_lens))


@torch.inference_mode()
def engine_logits(model_dir: pathlib.Path, prompts: list[list[int]], *, device: str = "cuda",
                  attention_backend: str = "auto", dtype: str = "bfloat16",
                  kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """float32 logits [len(prompt), vocab] per prompt (every attention reads its K/V back from a
    cache of kv_cache_dtype)."""
    lens = [len(p) for p in prompts]
    # Enough blocks for any block size of 16 tokens or more (the runner picks it per backend).
    runner = ModelRunner(WorkerConfig(model=str(model_dir), device=device, dtype=dtype,
                                      attention_backend=attention_backend, enforce_eager=True,
                                      kv_cache_dtype=kv_cache_dtype,
                                      num_kv_blocks=sum(-(-n // 16) for n in lens) + 1))
    meta = prefill_metadata(lens, runner.block_size, runner.device)
    input_ids = torch.tensor([t for p in prompts for t in p], device=runner.device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(runner.device)
    hidden = runner.model(input_ids, positions, meta)
    logits = runner.model.compute_logits(hidden, torch.arange(len(input_ids), device=runner.device)).float()
    return list(logits.split(lens))

"""Model architectures the worker runs, chosen by the checkpoint's model_type."""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.layers.attention import AttentionBackend
from worker_svc.layers.fp8 import resolve_quantization


def build_model(model_config, backend: AttentionBackend, max_position: int, quantization: str | None,
                device: torch.device) -> nn.Module:
    """The model for `model_config` (worker_svc.model_config), its parameters allocated on the
    current default device and dtype. `quantization` is the --quantization flag; an FP8
    checkpoint is FP8 without it. FP8 weights stay FP8 on CUDA and are dequantized elsewhere."""
    from worker_svc.models.qwen3 import Qwen3ForCausalLM
    from worker_svc.models.qwen3_moe import Qwen3MoeForCausalLM

    model_class = Qwen3MoeForCausalLM if model_config.model_type == "qwen3_moe" else Qwen3ForCausalLM
    quant = resolve_quantization(model_config, quantization, device)
    return model_class(model_config, backend, max_position, quant)

"""The worker's settings: one dataclass whose fields are also its command-line flags
(common.cli.flag: default, help and QWEN3_SERVE_* variable in one place)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.cli import ArgumentParser, add_config_arguments, config_from_args, flag
from common.speculation import DEFAULT_MAX_BATCH_SIZE, METHODS
from worker_svc.step_limits import describe_defaults

DEFAULT_PORT = 50061
# The attention backends a worker can be told to use (worker_svc/layers/attention/registry.py has
# their modules). Named here, so that parsing a command line imports no torch.
ATTENTION_BACKEND_NAMES = ("auto", "flash_attn", "triton", "torch")
# The KV cache's element types (worker_svc/layers/attention/kv_quant.py: fp8 is e4m3 with scales).
KV_CACHE_DTYPE_NAMES = ("auto", "bfloat16", "fp8")
TENSOR_PARALLEL = "tensor parallelism"
STRUCTURED_OUTPUT = "structured output"
SAMPLER_NAMES = ("torch", "kernels", "auto")
SPECULATIVE = "speculative decoding"


@dataclass(frozen=True)
class WorkerConfig:
    model: str = flag(help="Hugging Face Qwen3 model directory")
    device: str = flag("cpu", help="cpu, cuda or cuda:N")
    dtype: str = flag("auto", choices=("auto", "float32", "bfloat16", "float16"),
                      help="auto: float32 on the CPU, the checkpoint's dtype on CUDA")
    block_size: int | None = flag(None, help="tokens per KV-cache block (unset: 16)")
    num_kv_blocks: int | None = flag(None, help="KV-cache size in blocks; overrides the two below")
    kv_cache_memory_gb: float | None = flag(None, help="KV-cache size in GiB")
    gpu_memory_utilization: float = flag(0.9, help="CUDA: share of device memory this process may use; the KV "
                                              "cache gets what is left after the weights and a warm-up forward")
    max_model_len: int | None = flag(None, help="context limit (unset: the model's max_position_embeddings)")
    attention_backend: str = flag("auto", choices=ATTENTION_BACKEND_NAMES,
                                  help="auto: the fastest that runs on this device for the model, measured at start-up")
    kv_cache_dtype: str = flag("auto", choices=KV_CACHE_DTYPE_NAMES,
                               help="auto: the model's dtype; fp8: float8 e4m3 with a scale per layer and kv head (the "
                                    "checkpoint's k_scale/v_scale, else a bound derived from the weights): twice the "
                                    "blocks of bfloat16 in the same memory")
    kernel_cache_dir: str | None = flag(None, metavar="DIR",
                                        help="where compiled attention kernels (FlashAttention-4) are kept across "
                                             "restarts (unset: ~/.cache/qwen3-serve/kernels)")
    load_format: str = flag("auto", choices=("auto", "safetensors", "dummy"),
                            help="dummy: random weights for the config (benchmarks without a download)")
    quantization: str | None = flag(None, choices=("fp8",),
                                    help="fp8: quantize the linear layers of a bf16 checkpoint at load time into block "
                                         "FP8 (128x128 blocks, as the official -FP8 checkpoints); an FP8 checkpoint "
                                         "needs no flag")
    lm_head_dtype: str = flag("auto", choices=("auto", "fp8"),
                              help="auto: the checkpoint's (the official -FP8 checkpoints keep the LM head in bfloat16); "
                                   "fp8: the LM head's weight quantized to block FP8 at load (the checkpoint's blocks, "
                                   "else 128x128), lossy: the logits move by FP8's rounding (a tied embedding stays as "
                                   "it is); Qwen3-8B FP8 decode at one row: 1.49x bf16, 1.42x with the bf16 head")
    enforce_eager: bool = flag(False, help="run every step eagerly, without CUDA graphs")
    sampler: str = flag("auto", choices=SAMPLER_NAMES,
                        help="torch: the torch sampler, after the decode graph; kernels: the Triton sampler (no sort, "
                             "no host sync), inside the decode graph on CUDA (on the CPU, interpreted: for tests); "
                             "auto: kernels on CUDA with one rank, else torch")
    seed: int = flag(0, help="seeds unseeded sampling and dummy weights")
    max_num_seqs: int = flag(256, help="most requests in one step: sizes the CUDA graphs and the warm-up; the "
                                       "scheduler schedules within it unless told less")
    max_num_batched_tokens: int | None = flag(
        None, help="most tokens in one step: sizes the warm-up (its memory is not the KV cache's); the scheduler's "
                   f"step budget unless told less (unset: {describe_defaults()})")
    grammar_compile_timeout: float = flag(10.0, group=STRUCTURED_OUTPUT, metavar="SECONDS",
                                          help="a constraint whose grammar takes longer to compile is refused "
                                               "(INVALID_ARGUMENT naming it); the compiling process is killed and "
                                               "replaced")
    grammar_compile_processes: int = flag(1, group=STRUCTURED_OUTPUT, help="processes compiling grammars side by side")
    max_mask_ms: float = flag(10.0, group=STRUCTURED_OUTPUT, metavar="MS",
                              help="CPU time a request's token mask may cost in one step (accepting the last token "
                                   "and filling the mask); a request over it is ended (INVALID_ARGUMENT naming its "
                                   "constraint) rather than slowing the batch")
    speculative_method: str | None = flag(
        None, group=SPECULATIVE, choices=METHODS,
        help="propose draft tokens for the scheduler to verify: ngram (prompt lookup in the request's own tokens), "
             "eagle3 (an EAGLE-3 head, --speculative-model) or draft (a smaller Qwen3 with the same tokenizer, "
             "--speculative-model); unset: none")
    speculative_model: str | None = flag(None, group=SPECULATIVE, metavar="DIR",
                                         help="the EAGLE-3 head's or the draft model's directory")
    num_speculative_tokens: int = flag(4, group=SPECULATIVE,
                                       help="most draft tokens proposed per request and verified in one step")
    speculative_graph_batch_size: int = flag(
        DEFAULT_MAX_BATCH_SIZE, group=SPECULATIVE,
        help="requests up to which an eagle3 or draft proposer's own passes, and a verifying step's forward "
             "(1 + K tokens each), replay CUDA graphs (larger steps run them eagerly); raise it with the "
             "scheduler's speculative batch threshold")
    tensor_parallel_size: int = flag(1, group=TENSOR_PARALLEL, help="ranks in this worker's group")
    rank: int = flag(0, group=TENSOR_PARALLEL, help="this process's rank in its group, 0..size-1")
    dist_init_addr: str | None = flag(None, group=TENSOR_PARALLEL, metavar="HOST:PORT",
                                      help="rendezvous address: rank 0 listens there, the other ranks connect to it")
    dist_backend: str = flag("auto", group=TENSOR_PARALLEL, choices=("auto", "gloo", "nccl"),
                             help="auto: nccl on CUDA, gloo on the CPU")
    dist_timeout: float = flag(60.0, group=TENSOR_PARALLEL, metavar="SECONDS",
                               help="a collective (or a silent peer) past this breaks the group: the worker exits, "
                                    "so that every rank restarts and the group forms again")


def add_worker_arguments(parser: ArgumentParser) -> None:
    add_config_arguments(parser, WorkerConfig, {
        STRUCTURED_OUTPUT: "grammars compile in processes of their own, each within a time budget, before their "
                           "request's first step",
        TENSOR_PARALLEL: "one worker process per rank; the scheduler lists the group's addresses, rank 0 first, "
                         "with --tensor-parallel-size",
        SPECULATIVE: "what this worker proposes; the scheduler decides when to verify (docs/SPECULATIVE.md)"})


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    config = config_from_args(WorkerConfig, args)
    positive = ("block_size", "num_kv_blocks", "kv_cache_memory_gb", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "tensor_parallel_size", "dist_timeout", "grammar_compile_timeout",
                "grammar_compile_processes", "max_mask_ms", "num_speculative_tokens",
                "speculative_graph_batch_size")
    for name in positive:
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {config.gpu_memory_utilization}")
    if not 0 <= config.rank < config.tensor_parallel_size:
        raise ValueError(f"--rank must be in 0..{config.tensor_parallel_size - 1}, got {config.rank}")
    if config.tensor_parallel_size > 1 and not config.dist_init_addr:
        raise ValueError("--tensor-parallel-size > 1 needs --dist-init-addr HOST:PORT (rank 0's rendezvous address)")
    if config.dist_init_addr and not config.dist_init_addr.rpartition(":")[2].isdigit():
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {config.dist_init_addr!r}")
    _check_speculative(config)
    return config


def _check_speculative(config: WorkerConfig) -> None:
    method, model = config.speculative_method, config.speculative_model
    if method in ("eagle3", "draft") and not model:
        raise ValueError(f"--speculative-method {method} needs --speculative-model DIR")
    if model and method not in ("eagle3", "draft"):
        raise ValueError("--speculative-model needs --speculative-method eagle3 or draft")

"""The worker's settings: one dataclass, filled from the command line (see common.md's CLI)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


DEFAULT_PORT = 50061
# The attention backends a worker can be told to use (worker_svc/layers/attention/registry.py has
# their modules). Named here, so that parsing a command line imports no torch.
ATTENTION_BACKEND_NAMES = ("auto", "flash_attn", "triton", "torch")


@dataclass(frozen=True)
class WorkerConfig:
    model: str                                  # Hugging Face model directory
    device: str = "cpu"
    dtype: str = "auto"                         # auto: float32 on CPU, the checkpoint's dtype on CUDA
    block_size: int | None = None               # None: 16
    num_kv_blocks: int | None = None            # explicit KV-cache size, overrides the two below
    kv_cache_memory_gb: float | None = None     # KV-cache size in GiB
    gpu_memory_utilization: float = 0.9         # CUDA: share of device memory the process may use
    max_model_len: int | None = None            # None: the model's max_position_embeddings
    attention_backend: str = "auto"             # auto: the fastest on this device, measured at start-up
    kernel_cache_dir: str | None = None         # compiled attention kernels; None: ~/.cache/qwen3-serve/kernels
    load_format: str = "auto"                   # auto/safetensors: the checkpoint; dummy: random
    quantization: str | None = None             # fp8: quantize the linear layers at load (FP8 checkpoints are FP8 without it)
    enforce_eager: bool = False                 # no CUDA graphs
    seed: int = 0                               # unseeded sampling and dummy weights
    max_num_seqs: int = 256                     # requests per step
    max_num_batched_tokens: int = 16384         # tokens per step (sizes the CUDA warm-up)
    tensor_parallel_size: int = 1               # ranks in this worker's group, one process each
    rank: int = 0                               # this process's rank in the group
    dist_init_addr: str | None = None           # HOST:PORT of rank 0's rendezvous store
    dist_backend: str = "auto"                  # auto: nccl on CUDA, gloo on the CPU
    dist_timeout: float = 60.0                  # seconds a collective (or a silent peer) may take
    grammar_compile_timeout: float = 10.0       # seconds one grammar may take to compile, else refused
    grammar_compile_processes: int = 1          # processes compiling grammars side by side
    max_mask_ms: float = 10.0                   # CPU ms a request's token mask may cost in one step


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face Qwen3 model directory")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: float32 on the CPU, the checkpoint's dtype on CUDA")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (unset: 16)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache size in blocks; overrides the two below")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV-cache size in GiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="CUDA: share of device memory this process may use; the KV cache gets what is "
                             "left after the weights and a warm-up forward")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (unset: the model's max_position_embeddings)")
    parser.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKEND_NAMES),
                        help="auto: the fastest that runs on this device for the model, measured at start-up")
    parser.add_argument("--kernel-cache-dir", default=None, metavar="DIR",
                        help="where compiled attention kernels (FlashAttention-4) are kept across restarts "
                             "(unset: ~/.cache/qwen3-serve/kernels)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                        help="dummy: random weights for the config (benchmarks without a download)")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="fp8: quantize the linear layers of a bf16 checkpoint at load time into block FP8 "
                             "(128x128 blocks, as the official -FP8 checkpoints); an FP8 checkpoint needs no flag")
    parser.add_argument("--enforce-eager", action="store_true", help="run decode eagerly, without CUDA graphs")
    parser.add_argument("--seed", type=int, default=0, help="seeds unseeded sampling and dummy weights")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step (sizes the CUDA graphs)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384, help="most tokens in one step (sizes the warm-up)")
    so = parser.add_argument_group("structured output", "grammars compile in processes of their own, each "
                                   "within a time budget, before their request's first step")
    so.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                    help="a constraint whose grammar takes longer to compile is refused (INVALID_ARGUMENT naming "
                         "it); the compiling process is killed and replaced")
    so.add_argument("--grammar-compile-processes", type=int, default=1,
                    help="processes compiling grammars side by side")
    so.add_argument("--max-mask-ms", type=float, default=10.0, metavar="MS",
                    help="CPU time a request's token mask may cost in one step (accepting the last token and "
                         "filling the mask); a request over it is ended (INVALID_ARGUMENT naming its constraint) "
                         "rather than slowing the batch")
    tp = parser.add_argument_group("tensor parallelism", "one worker process per rank; the scheduler "
                                   "lists the group's addresses, rank 0 first, with --tensor-parallel-size")
    tp.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks in this worker's group")
    tp.add_argument("--rank", type=int, default=0, help="this process's rank in its group, 0..size-1")
    tp.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                    help="rendezvous address: rank 0 listens there, the other ranks connect to it")
    tp.add_argument("--dist-backend", default="auto", choices=["auto", "gloo", "nccl"],
                    help="auto: nccl on CUDA, gloo on the CPU")
    tp.add_argument("--dist-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="a collective (or a silent peer) past this breaks the group: the worker exits, "
                         "so that every rank restarts and the group forms again")


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    config = WorkerConfig(**{f.name: getattr(args, f.name) for f in fields(WorkerConfig)})
    positive = ("block_size", "num_kv_blocks", "kv_cache_memory_gb", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "tensor_parallel_size", "dist_timeout", "grammar_compile_timeout",
                "grammar_compile_processes", "max_mask_ms")
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
    return config

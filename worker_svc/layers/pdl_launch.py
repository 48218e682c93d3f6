"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while
the kernel before it in the stream ends, and waits (griddepcontrol.wait) before it reads what that
kernel wrote; a kernel lets the next one launch early with griddepcontrol.launch_dependents.

- `pdl_launches`: whether a launch asks for PDL at all (CUDA only: the interpreter runs no PTX).
- `pdl_triggers`: whether the kernels that feed a projection let it launch at their start.
- `pdl_in_graphs`: whether CUDA graphs replay PDL correctly here (asked once per device).
- `pdl_waits`, `pdl_chain_args`, `pdl_start`: the decode layer's other kernels (the RMSNorms, SwiGLU,
  q/k norm + RoPE + store, attention and its merge) as links of one chain (PERF_NOTES v45).

The projections (gemv_kernels, fp8_kernels) read their first weights before their wait: weights
never depend on the kernel before. tools/sm90_catalogue patches the first three predicates (module
attributes, looked up at each launch) to compile the variants a Hopper runs.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The layer's other kernels (norms, SwiGLU, q/k norm + RoPE + store, attention, its merge) launched
# with PDL too (`pdl_waits`); WORKER_PDL_CHAIN=0 launches them plainly (for comparisons).
PDL_CHAIN = os.environ.get("WORKER_PDL_CHAIN", "1") != "0"


@triton.jit
def pdl_start(TRIGGER: tl.constexpr, WAIT: tl.constexpr):
    """A kernel of the PDL chain (`pdl_waits`) starts here: lets the next kernel launch, then waits
    for the one before to end (and its writes to land) before anything is read or written."""
    if TRIGGER:
        gdc_launch_dependents()
    if WAIT:
        gdc_wait()


def pdl_launches(device: torch.device) -> bool:
    """Whether a config's PDL is launched on this device: CUDA only (the interpreter runs no PTX;
    tools.sm90_catalogue says yes to compile those variants on the CPU)."""
    return device.type == "cuda"


def pdl_triggers(device: torch.device) -> bool:
    """Whether the kernels that feed a GEMV or FP8 GEMM (the RMSNorms) let it launch at their start
    (griddepcontrol.launch_dependents: Hopper and later): a kernel launched with PDL then asks for
    its first weights while they run, and waits for them before reading what they wrote; any
    other kernel after them waits for their end as ever."""
    return pdl_launches(device) and _hopper_or_later(device)


def pdl_waits(device: torch.device) -> bool:
    """Whether the kernels between the projections (the RMSNorms, SwiGLU, q/k norm + RoPE + store,
    attention and its merge) launch with PDL as the projections do, so a decode layer is one chain
    of programmatic dependent launches: each kernel's programs are resident, their launch paid,
    when the kernel before them lets them start (every one of them lets its dependents start:
    gdc_launch_dependents), and they wait (gdc_wait) before reading or writing anything. Every
    program of such a kernel waits before it returns, so its end implies its predecessor's, and a
    kernel two back is done when the next one's wait returns. Hopper and later, where CUDA graphs
    replay PDL correctly (`pdl_in_graphs`, first asked outside a capture: inside one, an unasked
    device says no), unless WORKER_PDL_CHAIN=0."""
    if not (PDL_CHAIN and pdl_triggers(device)):
        return False
    if device.type == "cuda" and _device_key(device) not in _PDL_IN_GRAPHS and torch.cuda.is_current_stream_capturing():
        return False   # pdl_in_graphs captures a graph of its own: not inside another capture
    return pdl_in_graphs(device)


def pdl_chain_args(device: torch.device) -> dict:
    """The launch arguments of a kernel of the chain that starts with `pdl_start(TRIGGER, WAIT)`:
    it lets the next kernel launch at its start, and is launched with PDL itself (pdl_waits)."""
    wait = pdl_waits(device)
    return {"TRIGGER": pdl_triggers(device), "WAIT": wait, "launch_pdl": wait}


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


_PDL_IN_GRAPHS: dict[tuple[str, int], bool] = {}


def _device_key(device: torch.device) -> tuple[str, int]:
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else 0
    return device.type, index


def pdl_in_graphs(device: torch.device) -> bool:
    """Whether programmatic dependent launches replay correctly from a CUDA graph here (driver
    and torch permitting): two chained GEMVs, the second reading the first's output, replayed
    on a new input, must equal the same chain launched plainly. The start-up candidates use
    PDL only then. Asked once per device."""
    key = _device_key(device)
    if key not in _PDL_IN_GRAPHS:
        _PDL_IN_GRAPHS[key] = _replays_pdl(device)
    return _PDL_IN_GRAPHS[key]


def _replays_pdl(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    from worker_svc.layers.gemv_kernels import GemvConfig, gemv   # (that module launches through this one)

    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(1, 256, generator=g, device=device).to(torch.bfloat16)
        w1 = (torch.randn(256, 256, generator=g, device=device) / 16).to(torch.bfloat16)
        w2 = (torch.randn(64, 256, generator=g, device=device) / 16).to(torch.bfloat16)
        plain, pdl = GemvConfig(1, 16, 64, split_k=2), GemvConfig(1, 16, 64, split_k=2, pdl=True)
        gemv(gemv(x, w1, pdl), w2, pdl)   # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemv(gemv(x, w1, pdl), w2, pdl)
        x.copy_(torch.randn(1, 256, generator=g, device=device))
        graph.replay()
        return torch.equal(out, gemv(gemv(x, w1, plain), w2, plain))
    except Exception:  # noqa: BLE001 - no PDL in graphs here: GEMVs launch plainly
        return False

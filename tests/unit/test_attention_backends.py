"""Every accelerated attention backend against the torch reference, on fresh random paged inputs.

The reference is TorchAttentionBackend run in float64 on the CPU over copies of the same inputs.
Each case draws random block tables (blocks scattered over the cache, never shared), a batch
mixing fresh prefills, chunks over a cached prefix (some longer than one query tile) and
decodes, or a pure-decode batch; blocks no request owns are poisoned with NaN, so any read
outside a request's blocks shows up, and the rows past a request's length in its last block hold
large finite garbage (see base.py: a backend may load them, and must mask them). Each backend runs
at the worker's default block size (16) and at 128, FlashAttention-4's key tile for these head
dims, where it loads pages by TMA. Without CUDA the Triton kernels run under Triton's CPU
interpreter (TRITON_INTERPRET=1) on smaller shapes and block size 16 only; flash_attn (bfloat16
only, as FlashAttention-4) is skipped where it does not import. Set ATTN_TEST_SEED to replay a
failing draw (its seed is in the assertion message).
"""
from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import pytest
import torch

from worker_svc.layers.attention.base import AttentionMetadata
from worker_svc.layers.attention.torch_backend import TorchAttentionBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    # Must be set before triton is first imported; the kernels then run in numpy.
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Relative L2 error against the float64 reference.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
_patched = False


def patch_triton_interpreter() -> None:
    """Two bugs of Triton 3.6's CPU interpreter, neither in the compiled path: under numpy >= 2.4
    a scalar derived from program_id cannot bound a `range` (triton-lang/triton#9171, fixed
    after 3.6), and tl.dot multiplies bfloat16 operands as their raw uint16 bits. Idempotent."""
    global _patched
    if _patched:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    create_dot = interpreter.InterpreterBuilder.create_dot

    def as_float32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def patched_dot(self, a, b, d, *args):
        return create_dot(self, as_float32(a), as_float32(b), d, *args)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    _patched = True


def _load_backend(name: str):
    """The backend, or a skip saying why it cannot run here."""
    from worker_svc.layers.attention.registry import describe_error, load_backend

    if DEVICE.type == "cpu" and name == "flash_attn":
        pytest.skip("flash_attn needs CUDA")
    try:
        return load_backend(name)
    except Exception as exc:  # ImportError, or a GPU it does not support
        pytest.skip(f"{name} cannot run here: {describe_error(exc)}")


BACKENDS = ("triton", "flash_attn")
BLOCK_SIZES = (16,) if INTERPRETED else (16, 128)
# Garbage in the rows of a request's last block past its length: large enough that attending to
# any of it would swamp the result.
TAIL_GARBAGE = 100.0


@pytest.fixture(scope="module", autouse=True)
def _interpreter_fixes():
    if INTERPRETED:
        pytest.importorskip("triton")
        patch_triton_interpreter()


@dataclass
class PagedCase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> "PagedCase":
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype if t.is_floating_point() and dtype else t.dtype).clone()
        m = self.meta
        meta = AttentionMetadata(
            slot_mapping=move(m.slot_mapping), query_start_loc=move(m.query_start_loc),
            seq_lens=move(m.seq_lens), block_tables=move(m.block_tables),
            max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
            query_lens_cpu=list(m.query_lens_cpu), seq_lens_cpu=list(m.seq_lens_cpu))
        return PagedCase(move(self.q), move(self.k), move(self.v), move(self.k_cache), move(self.v_cache),
                         meta, self.scale)


def random_case(rng: random.Random, *, context_lens: list[int], query_lens: list[int], num_kv_heads: int,
                group: int, head_dim: int, block_size: int, dtype: torch.dtype) -> PagedCase:
    """A step over the paged cache: request r has context_lens[r] cached tokens and computes
    query_lens[r] new ones. Slots outside every request's context hold NaN."""
    gen = torch.Generator().manual_seed(rng.randrange(2**63))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + rng.randint(1, 8)
    free = list(range(num_blocks))
    rng.shuffle(free)
    block_tables = torch.zeros(len(seq_lens), max(blocks_needed), dtype=torch.int32)
    for r, n in enumerate(blocks_needed):
        block_tables[r, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    slots = []
    for r, (ctx, seq) in enumerate(zip(context_lens, seq_lens)):
        pos = torch.arange(blocks_needed[r] * block_size)
        owned = block_tables[r, pos // block_size].long() * block_size + pos % block_size
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[owned[seq:]] = TAIL_GARBAGE
        k_cache.view(-1, num_kv_heads, head_dim)[owned[:ctx]] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        v_cache.view(-1, num_kv_heads, head_dim)[owned[:ctx]] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        slots.append(owned[ctx:seq])
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens)
    case = PagedCase(q, k, v, k_cache, v_cache, meta, 1.0 / math.sqrt(head_dim))
    return case.to(DEVICE, dtype)


def mixed_batch(rng: random.Random, max_context: int, max_chunk: int) -> tuple[list[int], list[int]]:
    """A fresh prefill, a chunk over a cached prefix longer than one query tile, a short chunk,
    and a few decodes, in random order."""
    requests = [(0, rng.randint(2, max_chunk)), (rng.randint(1, max_context), rng.randint(65, max_chunk + 65)),
                (rng.randint(1, max_context), rng.randint(2, 9))]
    requests += [(rng.randint(1, max_context), 1) for _ in range(rng.randint(2, 4))]
    rng.shuffle(requests)
    return [c for c, _ in requests], [q for _, q in requests]


def decode_batch(rng: random.Random, max_context: int, batch: int) -> tuple[list[int], list[int]]:
    return [rng.randint(0, max_context) for _ in range(batch)], [1] * batch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


def check_against_reference(backend, case: PagedCase, dtype: torch.dtype, seed: int) -> float:
    reference = case.to(torch.device("cpu"), torch.float64)
    expected = TorchAttentionBackend().forward(reference.q, reference.k, reference.v, reference.k_cache,
                                               reference.v_cache, reference.meta, reference.scale)
    out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.shape == case.q.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), f"seed {seed}: non-finite output (a read outside the context?)"
    err = relative_error(out, expected)
    assert err < TOLERANCE[dtype], f"seed {seed}: relative error {err:.2e}"
    # The new K/V landed exactly where the reference put them, and nowhere else (NaN == NaN here).
    for cache, ref_cache in ((case.k_cache, reference.k_cache), (case.v_cache, reference.v_cache)):
        assert torch.equal(cache.cpu().double().nan_to_num(7.0), ref_cache.to(dtype).double().nan_to_num(7.0)), \
            f"seed {seed}: cache contents differ"
    return err


def draw_seed() -> int:
    return int(os.environ.get("ATTN_TEST_SEED") or random.SystemRandom().randrange(2**32))


# Small shapes under the interpreter, which runs every program in Python.
MAX_CONTEXT = 40 if INTERPRETED else 3000
MAX_CHUNK = 12 if INTERPRETED else 700
DECODE_BATCH = 3 if INTERPRETED else 48


# Under the interpreter, every pair of values of (dtype, head_dim, group, batch kind) once: six
# cases where the full product is 24 (a GPU runs the full product).
INTERPRETED_CASES = {(torch.bfloat16, 64, 1, "mixed"), (torch.float32, 128, 1, "decode"),
                     (torch.bfloat16, 128, 2, "decode"), (torch.float32, 64, 2, "mixed"),
                     (torch.bfloat16, 64, 8, "decode"), (torch.float32, 128, 8, "mixed")}


def _variants() -> list:
    """(backend, dtype, head_dim, group, batch kind) to test. FlashAttention-4 has no float32
    kernels, and compiles a kernel (seconds each, the first time) per head_dim x group x block
    size x step kind: it gets Qwen3's head_dim 128 with every group, and head_dim 64 with one."""
    variants = []
    for name in BACKENDS:
        for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            for head_dim in (64, 128):
                for group in (1, 2, 8):
                    for kind in ("mixed", "decode"):
                        if name == "flash_attn" and (dtype == torch.float32 or (head_dim == 64 and group != 2)):
                            continue
                        if INTERPRETED and (dtype, head_dim, group, kind) not in INTERPRETED_CASES:
                            continue
                        variants.append(pytest.param(name, dtype, head_dim, group, kind,
                                                     id=f"{name}-{label}-d{head_dim}-g{group}-{kind}"))
    return variants


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"block{b}")
@pytest.mark.parametrize("backend_name,dtype,head_dim,group,batch_kind", _variants())
def test_backend_matches_torch_reference(backend_name, dtype, head_dim, group, batch_kind, block_size):
    backend = _load_backend(backend_name)
    seed = draw_seed()
    rng = random.Random(seed)
    context_lens, query_lens = (mixed_batch(rng, MAX_CONTEXT, MAX_CHUNK) if batch_kind == "mixed"
                                else decode_batch(rng, MAX_CONTEXT, DECODE_BATCH))
    num_kv_heads = 1 if INTERPRETED and group == 8 else 2
    case = random_case(rng, context_lens=context_lens, query_lens=query_lens, num_kv_heads=num_kv_heads,
                       group=group, head_dim=head_dim, block_size=block_size, dtype=dtype)
    check_against_reference(backend, case, dtype, seed)


def _stored_decode_case(rng: random.Random, context_lens: list[int] | None = None):
    """A float32 decode case (2 kv heads, GQA 2, head_dim 64, 16-token blocks) whose K/V the Triton
    store kernel has written, and its float64 torch reference output. context_lens: by default
    decode_batch's draw."""
    from worker_svc.layers.attention import triton_kernels

    if context_lens is None:
        context_lens, query_lens = decode_batch(rng, MAX_CONTEXT, DECODE_BATCH)
    else:
        query_lens = [1] * len(context_lens)
    case = random_case(rng, context_lens=context_lens, query_lens=query_lens, num_kv_heads=2, group=2,
                       head_dim=64, block_size=16, dtype=torch.float32)
    reference = case.to(torch.device("cpu"), torch.float64)
    expected = TorchAttentionBackend().forward(reference.q, reference.k, reference.v, reference.k_cache,
                                               reference.v_cache, reference.meta, reference.scale)
    m = case.meta
    triton_kernels.store_kv_cache(case.k, case.v, case.k_cache, case.v_cache, m.slot_mapping)
    return case, expected


@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_triton_decode_split_k_matches_reference(num_splits):
    """The split-K decode path gives the same answer for any number of splits, including
    splits that cover no key at all (short contexts, many splits)."""
    kernels = pytest.importorskip("worker_svc.layers.attention.triton_kernels")
    seed = draw_seed()
    case, expected = _stored_decode_case(random.Random(seed))
    m = case.meta
    out = kernels.paged_attention(case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens,
                                  m.block_tables, case.scale, pure_decode=True, num_splits=num_splits)
    err = relative_error(out, expected)
    assert err < TOLERANCE[torch.float32], f"seed {seed}: relative error {err:.2e}"


@pytest.mark.parametrize("kernel", ["tiles", "gqa"])
def test_split_decode_merges_only_the_splits_with_keys(kernel, monkeypatch):
    """With the fused merge, splits past a request's context return at once and the last split that
    holds keys merges those alone: partial buffers full of NaN (what an unwritten partial could
    hold) leave the output exact, a padded row without keys comes out zeros, and the counters are
    left at zero (a second launch gives the same bits)."""
    kernels = pytest.importorskip("worker_svc.layers.attention.triton_kernels")
    seed = draw_seed()
    rng = random.Random(seed)
    # 8 splits of 16-key tiles: 1..3 of them hold keys at these contexts; one padded row.
    case, expected = _stored_decode_case(rng, [rng.randint(1, 40) for _ in range(3)])
    m = case.meta
    real_buffers = kernels._split_buffers

    def poisoned(step, num_splits, fused_merge):
        part_out, part_lse, counters = real_buffers(step, num_splits, fused_merge)
        return part_out.fill_(float("nan")), part_lse.fill_(float("nan")), counters
    monkeypatch.setattr(kernels, "_split_buffers", poisoned)
    q = torch.cat([case.q, torch.randn(1, *case.q.shape[1:], device=case.q.device)])
    seq_lens = torch.cat([m.seq_lens, torch.zeros(1, dtype=m.seq_lens.dtype, device=m.seq_lens.device)])
    block_tables = torch.cat([m.block_tables, torch.zeros_like(m.block_tables[:1])])
    launch = kernels.LaunchConfig(tile_rows=16, kv_tile=16, num_warps=4, num_stages=1, kernel=kernel)

    def attend():
        query_start_loc = torch.arange(5, dtype=torch.int32, device=q.device)
        return kernels.paged_attention(q, case.k_cache, case.v_cache, query_start_loc, seq_lens, block_tables,
                                       case.scale, pure_decode=True, num_splits=8, launch=launch, fused_merge=True)
    out = attend()
    assert torch.isfinite(out).all(), f"seed {seed}: a merge read a partial no split wrote"
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), f"seed {seed}"
    err = relative_error(out[:-1], expected)
    assert err < TOLERANCE[torch.float32], f"seed {seed}: relative error {err:.2e}"
    assert torch.equal(attend(), out), f"seed {seed}: the counters were not left at zero"


@pytest.mark.parametrize("kernel,num_splits", [("tiles", 1), ("tiles", 4), ("gqa", 1), ("gqa", 4)])
def test_longest_first_decode_gives_the_same_bits(kernel, num_splits):
    """Programs handed out longest context first (AttentionMetadata.decode_order) compute what the
    launch in request order computes, bit for bit: each program's work is the same, only their
    order changes; with split-K too (the counters and merges are per request)."""
    kernels = pytest.importorskip("worker_svc.layers.attention.triton_kernels")
    seed = draw_seed()
    rng = random.Random(seed)
    case, _ = _stored_decode_case(rng)
    m = case.meta
    # Any order of the requests will do; the reversed one when the draw keeps them in place.
    permutation = rng.sample(range(len(m.seq_lens_cpu)), len(m.seq_lens_cpu))
    if permutation == sorted(permutation):
        permutation.reverse()
    order = torch.tensor(permutation, dtype=torch.int32, device=m.seq_lens.device)
    launch = kernels.LaunchConfig(tile_rows=16, kv_tile=16, num_warps=4, num_stages=1, kernel=kernel)

    def attend(decode_order):
        return kernels.paged_attention(case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens,
                                       m.block_tables, case.scale, pure_decode=True, num_splits=num_splits,
                                       launch=launch, decode_order=decode_order)
    assert torch.equal(attend(order), attend(None)), f"seed {seed}"


def test_decode_order_is_asked_of_large_pure_decode_steps_only(monkeypatch):
    """AttentionMetadata.decode_order: the requests longest first from LONGEST_FIRST_MIN_BATCH
    pure-decode requests on, computed once per metadata; None below it, for mixed steps, and while
    the threshold is 0 (off)."""
    from worker_svc.layers.attention import base

    def meta(seq_lens, query_len=1):
        n = len(seq_lens)
        return AttentionMetadata(
            slot_mapping=torch.zeros(n * query_len, dtype=torch.int64),
            query_start_loc=torch.arange(0, n * query_len + 1, query_len, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.zeros(n, 4, dtype=torch.int32),
            max_query_len=query_len, max_seq_len=max(seq_lens), query_lens_cpu=[query_len] * n,
            seq_lens_cpu=list(seq_lens))
    monkeypatch.setattr(base, "LONGEST_FIRST_MIN_BATCH", 0)   # off: never asked
    assert meta([5, 9, 7, 30, 1]).decode_order is None
    monkeypatch.setattr(base, "LONGEST_FIRST_MIN_BATCH", 4)
    assert meta([5, 9, 7]).decode_order is None
    assert meta([5, 9, 7, 30], query_len=2).decode_order is None
    step = meta([5, 9, 7, 30, 1])
    assert step.decode_order.tolist() == [3, 1, 2, 0, 4] and step.decode_order.dtype == torch.int32
    assert step.decode_order is step.decode_order   # one sort a step, whatever the layers


def test_the_warm_up_reaches_the_longest_first_variant(monkeypatch):
    """The start-up warm-up runs a pure-decode step at every request count whose launch takes other
    compile-time constants: the first ordered one (LONGEST_FIRST_MIN_BATCH) among them, so no step
    compiles it while serving; none while the order is off (0)."""
    from worker_svc.layers.attention import base
    from worker_svc.layers.attention.triton_kernels import decode_variant_counts

    cpu = torch.device("cpu")   # its 4 "SMs": never split
    monkeypatch.setattr(base, "LONGEST_FIRST_MIN_BATCH", 0)
    assert decode_variant_counts(8, 256, False, cpu)[0] == [1]
    monkeypatch.setattr(base, "LONGEST_FIRST_MIN_BATCH", 64)
    assert decode_variant_counts(8, 256, False, cpu)[0] == [1, 64]
    assert decode_variant_counts(8, 63, False, cpu)[0] == [1]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_padded_decode_rows_are_inert(backend_name):
    """CUDA-graph padding: rows with slot -1 and seq_len 0 write nothing to the cache and come
    out finite (zeros from Triton), while the real rows beside them are unaffected."""
    backend = _load_backend(backend_name)
    seed = draw_seed()
    rng = random.Random(seed)
    context_lens, query_lens = decode_batch(rng, MAX_CONTEXT, 2)
    case = random_case(rng, context_lens=context_lens, query_lens=query_lens, num_kv_heads=2, group=2,
                       head_dim=64, block_size=16, dtype=torch.bfloat16)
    real = case.to(DEVICE)
    pad = 2
    m = case.meta
    padded_meta = AttentionMetadata(
        slot_mapping=torch.cat([m.slot_mapping, torch.full((pad,), -1, dtype=m.slot_mapping.dtype, device=DEVICE)]),
        query_start_loc=torch.arange(len(query_lens) + pad + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.cat([m.seq_lens, torch.zeros(pad, dtype=torch.int32, device=DEVICE)]),
        block_tables=torch.cat([m.block_tables, torch.zeros(pad, m.block_tables.shape[1], dtype=torch.int32,
                                                            device=DEVICE)]),
        max_query_len=1, max_seq_len=m.max_seq_len,
        query_lens_cpu=[1] * (len(query_lens) + pad), seq_lens_cpu=[*m.seq_lens_cpu, 0, 0])

    def extend(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.randn(pad, *t.shape[1:], device=DEVICE).to(t.dtype)])

    out = backend.forward(extend(case.q), extend(case.k), extend(case.v), case.k_cache, case.v_cache,
                          padded_meta, case.scale)
    expected = backend.forward(real.q, real.k, real.v, real.k_cache, real.v_cache, real.meta, real.scale)
    assert torch.isfinite(out[-pad:]).all(), f"seed {seed}"
    if backend_name == "triton":
        assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:])), f"seed {seed}"
    # Only the split-K factor (chosen from the batch size) differs between the two launches.
    assert relative_error(out[:-pad], expected.double().cpu()) < TOLERANCE[torch.bfloat16], f"seed {seed}"
    assert torch.equal(case.k_cache.nan_to_num(7.0), real.k_cache.nan_to_num(7.0)), f"seed {seed}"

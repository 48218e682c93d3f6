"""Running the worker's Triton kernels on the CPU, under Triton's interpreter, as a GPU would
(the kernel tests and the benchmarks' CPU smoke runs).

Import this module before anything imports triton: without CUDA it sets TRITON_INTERPRET=1.
`gpu_faithful()` then patches five ways in which Triton 3.6's interpreter departs from compiled
kernels (or breaks under numpy 2.4):
- it casts float32 to bfloat16 by truncation, and float32 to float8_e4m3fn wrongly; compiled
  kernels round to nearest even, as torch does;
- it casts bfloat16's subnormals to float32 wrongly (and every bfloat16 through ~40 numpy
  operations); compiled kernels widen exactly, as a 16-bit shift of the pattern does;
- tl.dot multiplies bfloat16 operands as their raw 16-bit patterns (integers);
- a loop bound that is a kernel argument (`range(0, K, BLOCK_K)`) is a one-element array,
  which numpy 2.4 no longer converts to an int.
On a GPU it changes nothing.

`faster_interpreter()` makes the interpreter faster without changing what it computes: a launch
patches triton.language for the interpreter, and each call of a @triton.jit helper inside it
patched the same modules again (a third of a kernel test's time); the numpy type of each
Triton type was looked up in a table built anew on every operation; every tensor's shape
built a tuple type (a string per element) that is seldom read (now built when read); every
integer add, sub and mul computed its overflow check in int64, then dropped it (the check is a
device_assert, which the interpreter runs only with debug on, as compiled kernels do); and a
binary operation of two blocks of one shape went through the broadcasting loop.
"""
from __future__ import annotations

import contextlib
import math
import os

import numpy as np
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must be set before triton is first imported
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def gpu_faithful():
    if not INTERPRETED:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    rounding_casts = {tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16),
                      tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, np.uint8)}
    original_cast = interpreter.InterpreterBuilder.cast_impl
    original_patch = interpreter._patch_lang_tensor
    original_dot = interpreter.InterpreterBuilder.create_dot
    original_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def torch_rounded(src, dst_type):
        """float32 -> bfloat16 / float8_e4m3fn rounded by torch, or None for other casts."""
        target = rounding_casts.get(dst_type.scalar)
        if src.dtype.scalar != tl.float32 or target is None:
            return None
        dtype, bits, np_bits = target
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(dtype)
        return interpreter.TensorHandle(rounded.view(bits).numpy().view(np_bits), dst_type.scalar)

    def exactly_widened(src, dst_type):
        """bfloat16 -> float32, every value (subnormals too) exactly, or None for other casts."""
        if src.dtype.scalar != tl.bfloat16 or dst_type.scalar != tl.float32:
            return None
        wide = src.data.view(np.uint16).astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(wide.view(np.float32), tl.float32)

    def as_compiled(src, dst_type):
        """The cast as a compiled kernel does it, or None where the interpreter already agrees
        (a TensorHandle's truth is its data's, hence no `or`)."""
        rounded = torch_rounded(src, dst_type)
        return exactly_widened(src, dst_type) if rounded is None else rounded

    def rounding_cast(self, src, dst_type):
        cast = as_compiled(src, dst_type)
        return original_cast(self, src, dst_type) if cast is None else cast

    def rounding_fp_to_fp(self, src, dst_type, rounding_mode):
        cast = as_compiled(src, dst_type)
        return original_fp_to_fp(self, src, dst_type, rounding_mode) if cast is None else cast

    def bf16_as_float32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        values = torch.from_numpy(np.ascontiguousarray(handle.data).view(np.int16)).view(torch.bfloat16)
        return interpreter.TensorHandle(values.float().numpy(), tl.float32)

    def float_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, bf16_as_float32(a), bf16_as_float32(b), d, input_precision, max_num_imprecise_acc)

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    with _patched(interpreter.InterpreterBuilder, cast_impl=rounding_cast, create_fp_to_fp=rounding_fp_to_fp,
                  create_dot=float_dot), _patched(interpreter, _patch_lang_tensor=patch_lang_tensor):
        yield


@contextlib.contextmanager
def faster_interpreter():
    """Within it, a @triton.jit helper called by an interpreted kernel reuses the patches of the
    launch that runs it (the same triton.language modules) instead of making them again, and
    numpy types are looked up in one table."""
    if not INTERPRETED:
        yield
        return
    import triton.language as tl
    from triton.language import semantic
    from triton.runtime import interpreter

    core = tl.core
    init, kind = _lazy_tuple_types(core)
    with _patched(interpreter, _patch_lang=_patching_once(interpreter, tl),
                  _get_np_dtype=_np_dtype_lookup(interpreter)), _patched(core.tuple, __init__=init, type=kind), \
            _patched(core, _unwrap_if_constexpr=_quick_unwrap(core)), \
            _patched(core.block_type, __init__=_known_block_types(core)), \
            _patched(core.tensor, __init__=_tensor_shapes_of_their_type(core)), \
            _patched(tl.random, philox_impl=_philox_in_numpy(tl)), \
            _patched(semantic.TritonSemantic, binary_op_sanitize_overflow_impl=_overflow_checked_in_debug_only(semantic),
                     broadcast_impl_value=_same_shapes_as_they_are(semantic)):
        yield


def _overflow_checked_in_debug_only(semantic):
    """TritonSemantic.binary_op_sanitize_overflow_impl that does nothing when the builder's debug
    option is off: the original computes the operation again in int64 and compares it with the
    type's bounds, then hands the answer to device_assert, which drops it without debug."""
    original = semantic.TritonSemantic.binary_op_sanitize_overflow_impl

    def sanitize(self, lhs, rhs, binary_op):
        if not self.builder.options.debug:
            return None
        return original(self, lhs, rhs, binary_op)
    return sanitize


def _same_shapes_as_they_are(semantic):
    """TritonSemantic.broadcast_impl_value answering two blocks of one shape (most binary
    operations) at once, as the original does after its loop over their dimensions."""
    original = semantic.TritonSemantic.broadcast_impl_value

    def broadcast(self, lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        if lhs_ty.is_block() and rhs_ty.is_block() and lhs_ty.shape.values == rhs_ty.shape.values:
            return lhs, rhs
        return original(self, lhs, rhs)
    return broadcast


def _philox_in_numpy(tl):
    """triton.language.random.philox_impl (the rounds of tl.philox) on whole numpy arrays: the
    same uint32 arithmetic (products modulo 2**32 and their high halves, keys raised by
    wrapping adds) as its ~80 interpreted operations per call. 64-bit counters, fewer than
    three rounds (whose outputs may keep their inputs' own shapes) or scalar states go to the
    original."""
    original = tl.random.philox_impl
    key_a, key_b, round_a, round_b = 0x9E3779B9, 0xBB67AE85, 0xD2511F53, 0xCD9E8D57
    low = np.uint64(0xFFFFFFFF)
    from triton.runtime.interpreter import TensorHandle

    def shape_of(x):
        return tuple(tl.core._unwrap_if_constexpr(d) for d in x.shape) if x.type.is_block() else ()

    def philox_impl(c0, c1, c2, c3, k0, k1, n_rounds=tl.random.N_ROUNDS_DEFAULT):
        rounds = tl.core._unwrap_if_constexpr(n_rounds)
        values = (c0, c1, c2, c3, k0, k1)
        if (rounds < 3 or not all(isinstance(x, tl.tensor) and x.dtype == tl.uint32 for x in values)):
            return original(c0, c1, c2, c3, k0, k1, n_rounds)
        shape = np.broadcast_shapes(*(shape_of(x) for x in values))
        if not shape:
            return original(c0, c1, c2, c3, k0, k1, n_rounds)
        c0, c1, c2, c3, k0, k1 = (np.broadcast_to(x.handle.data, shape).astype(np.uint64) for x in values)
        for _ in range(rounds):
            product_b, product_a = np.uint64(round_b) * c2, np.uint64(round_a) * c0
            c0, c2 = (product_b >> np.uint64(32)) ^ c1 ^ k0, (product_a >> np.uint64(32)) ^ c3 ^ k1
            c1, c3 = product_b & low, product_a & low
            k0, k1 = (k0 + np.uint64(key_a)) & low, (k1 + np.uint64(key_b)) & low
        kind = tl.block_type(tl.uint32, list(shape))
        return tuple(tl.tensor(TensorHandle(x.astype(np.uint32), tl.uint32), kind) for x in (c0, c1, c2, c3))
    philox_impl.original = original       # for the test that holds the two to the same answers
    return philox_impl


def _quick_unwrap(core):
    """core._unwrap_if_constexpr answering the common cases (a constexpr, a tensor, a number)
    without its chain of isinstance checks; anything else goes to the original."""
    original = core._unwrap_if_constexpr
    constexpr = core.constexpr
    as_is = {core.tensor, int, float, bool, str, type(None)}

    def unwrap(o):
        kind = type(o)
        if kind is constexpr:
            return o.value
        if kind in as_is:
            return o
        return original(o)
    return unwrap


def _known_block_types(core):
    """block_type.__init__ that remembers each shape's checks and name: a shape of ints (or
    constexpr ints) seen before skips the unwrapping, the power-of-two checks and the formatting,
    and its type carries the constexprs that a tensor of that shape takes (_tensor_shape).
    Any other shape goes to the original."""
    original = core.block_type.__init__
    constexpr = core.constexpr
    known: dict = {}

    def init(self, element_ty, shape):
        values = shape if type(shape) is list else shape.values if type(shape) is core.tuple else None
        if values is None:
            return original(self, element_ty, shape)
        dims = tuple(d.value if type(d) is constexpr else d for d in values)
        key = (dims, str(element_ty))
        answer = known.get(key)
        if answer is None:
            original(self, element_ty, shape)
            if all(type(d) is int for d in dims):
                answer = known[key] = (self.shape, self.numel, self.name, _tensor_shape(core, self))
                self._tensor_shape = answer[3]
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name, self._tensor_shape = answer
    return init


def _tensor_shape(core, block_type):
    """The constexprs of the shape and numel of a tensor of this block type."""
    return [core.constexpr(s) for s in block_type.shape], core.constexpr(math.prod(block_type.shape))


def _tensor_shapes_of_their_type(core):
    """tl.tensor.__init__ that takes the constexprs of its shape and numel from its type, made
    once per shape, instead of making them anew for every tensor (constexprs are values: tensors
    may share them; each tensor still gets its own tl.tuple of them)."""
    scalar = ([], core.constexpr(1))

    def init(self, handle, type):
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        if type.is_block():
            dims, numel = type.__dict__.get("_tensor_shape") or type.__dict__.setdefault(
                "_tensor_shape", _tensor_shape(core, type))
        else:
            dims, numel = scalar
        self.numel = numel
        self.shape = core.tuple(dims)
    return init


def _lazy_tuple_types(core):
    """tl.tuple's __init__ and a `type` property that builds its tuple_type when first read: the
    interpreter makes a tl.tuple for every tensor's shape (each a tuple_type of named types, a
    string built per element) and reads few of their types."""
    def init(self, args, type=None):
        self.values = list(args)
        if type is not None and not isinstance(type, core.tuple_type):
            type = core.tuple_type(type)
        self.__dict__["_type"] = type      # __dict__: tl.tuple's __getattr__ reads its type's fields

    def get(self):
        kind = self.__dict__.get("_type")
        if kind is None:
            kind = self.__dict__["_type"] = core._type_for_tuple_values(self.values)
        return kind

    def put(self, kind) -> None:
        self.__dict__["_type"] = kind
    return init, property(get, put)


def _np_dtype_lookup(interpreter):
    """interpreter._get_np_dtype, its answers kept (a Triton type always has the same numpy type)."""
    original = interpreter._get_np_dtype
    known: dict = {}

    def np_dtype(tt_dtype):
        key = (type(tt_dtype), tt_dtype.name)     # the name spells the element type (and shape)
        answer = known.get(key)
        if answer is None:
            answer = known[key] = original(tt_dtype)
        return answer
    return np_dtype


def _patching_once(interpreter, tl):
    """interpreter._patch_lang that skips a helper's patching when its launch has done it."""

    original_patch_lang = interpreter._patch_lang
    patched: set[str] = set()      # the modules patched since the launch in progress began
    in_launch = []

    def patch_lang(fn):
        langs = {name for name, module in (("tl", tl), ("core", tl.core))
                 if any(value is module for value in fn.__globals__.values())}
        if in_launch and langs <= patched:
            return interpreter._LangPatchScope()    # a helper inside the launch: already patched
        scope = original_patch_lang(fn)
        patched.update(langs)
        if in_launch:
            return scope             # a helper's patches stay, as triton leaves them
        in_launch.append(True)
        restore = scope.restore

        def restore_and_end_launch():
            in_launch.clear()
            patched.clear()
            restore()
        scope.restore = restore_and_end_launch
        return scope
    return patch_lang


@contextlib.contextmanager
def _patched(owner, **attributes):
    """Sets owner's attributes for the duration, then puts the originals back."""
    missing = object()
    originals = {name: owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(owner, name)
                 for name in attributes}
    for name, value in attributes.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

"""Running the worker's Triton kernels on the CPU, under Triton's interpreter, as a GPU would
(the kernel tests and the benchmarks' CPU smoke runs).

Import this module before anything imports triton: without CUDA it sets TRITON_INTERPRET=1.
`gpu_faithful()` then patches four ways in which Triton 3.6's interpreter departs from compiled
kernels (or breaks under numpy 2.4):
- it casts float32 to bfloat16 by truncation, and float32 to float8_e4m3fn wrongly; compiled
  kernels round to nearest even, as torch does;
- tl.dot multiplies bfloat16 operands as their raw 16-bit patterns (integers);
- a loop bound that is a kernel argument (`range(0, K, BLOCK_K)`) is a one-element array,
  which numpy 2.4 no longer converts to an int.
On a GPU it changes nothing.

`faster_interpreter()` makes the interpreter faster without changing what it computes: a launch
patches triton.language for the interpreter, and each call of a @triton.jit helper inside it
patched the same modules again (a third of a kernel test's time); the numpy type of each
Triton type was looked up in a table built anew on every operation; and every tensor's shape
built a tuple type (a string per element) that is seldom read (now built when read).
"""
from __future__ import annotations

import contextlib
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

    def rounding_cast(self, src, dst_type):
        rounded = torch_rounded(src, dst_type)
        return original_cast(self, src, dst_type) if rounded is None else rounded

    def rounding_fp_to_fp(self, src, dst_type, rounding_mode):
        rounded = torch_rounded(src, dst_type)
        return original_fp_to_fp(self, src, dst_type, rounding_mode) if rounded is None else rounded

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
    from triton.runtime import interpreter

    init, kind = _lazy_tuple_types(tl.core)
    with _patched(interpreter, _patch_lang=_patching_once(interpreter, tl),
                  _get_np_dtype=_np_dtype_lookup(interpreter)), _patched(tl.core.tuple, __init__=init, type=kind):
        yield


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

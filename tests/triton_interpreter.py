"""Fixes for Triton 3.6's CPU interpreter (TRITON_INTERPRET=1), which runs this project's Triton
kernels in the CPU tests and in the benchmarks' --device cpu smoke runs. Neither bug is in the
compiled (GPU) path."""
from __future__ import annotations

_patched = False


def patch_triton_interpreter() -> None:
    """Under numpy >= 2.4 a scalar derived from program_id cannot bound a `range`
    (triton-lang/triton#9171, fixed after 3.6), and tl.dot multiplies bfloat16 operands as their
    raw uint16 bits. Idempotent."""
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

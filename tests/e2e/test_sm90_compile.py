"""Every Triton kernel of the worker compiles for a Hopper GPU (sm_90), and no step size makes one
compile again: tools/sm90_compile.py, in a process of its own (Triton imported without the
interpreter the other kernel tests use), compiling with Triton's own binder, LLVM and ptxas."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compiler_env(cache=None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    if cache is not None:   # a cache of the test's own: every kernel really compiled, nothing written elsewhere
        env["TRITON_CACHE_DIR"] = str(cache)
    return env


def _has_cuda_backend() -> bool:
    """Triton's CUDA backend and its ptxas, which runs."""
    probe = ("import subprocess; from triton.backends.nvidia.compiler import CUDABackend, get_ptxas; "
             "subprocess.run([get_ptxas(90).path, '--version'], check=True, capture_output=True)")
    try:
        return subprocess.run([sys.executable, "-c", probe], env=_compiler_env(), capture_output=True,
                              timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


pytestmark = pytest.mark.skipif(not _has_cuda_backend(), reason="this Triton has no CUDA backend (ptxas)")


def test_every_kernel_compiles_for_sm90_and_no_step_size_compiles_another(tmp_path):
    out = tmp_path / "sm90.json"
    proc = subprocess.run([sys.executable, "-m", "tools.sm90_compile", "--json", str(out)], cwd=REPO,
                          env=_compiler_env(tmp_path / "cache"), capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}, result["errors"]
    assert result["varying"] == {}, (
        "kernels that compile a new variant when a step's size changes (mark the arguments "
        f"do_not_specialize or do_not_specialize_on_alignment): {result['varying']}")
    # The catalogue reaches each family of kernels (a case that stopped launching would pass silently).
    for kernel in ("_gemv_kernel", "_block_fp8_matmul_kernel", "_rms_norm_fp8_kernel", "_silu_and_mul_fp8_kernel",
                   "_paged_decode_kernel", "_paged_attention_kernel", "_qk_norm_rope_store_kernel",
                   "_grouped_gemm_kernel", "_finish_kernel", "_scan_kernel", "_unpack_kernel", "_derive_kernel"):
        assert result["kernels"].get(kernel, 0) >= 1, (kernel, sorted(result["kernels"]))
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_the_check_sees_an_argument_that_follows_the_step_size(tmp_path):
    """A kernel specialised on its row count compiles once for 1 row, once for 16 and once for 13:
    the tool names the argument; marked do_not_specialize, one variant serves them all."""
    script = textwrap.dedent("""
        import json, torch, triton, triton.language as tl
        from tools.sm90_compile import offline_compiles

        @triton.jit
        def specialised(x_ptr, num_rows, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < num_rows) * 2, mask=offs < num_rows)

        @triton.jit(do_not_specialize=["num_rows"])
        def marked(x_ptr, num_rows, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < num_rows) * 2, mask=offs < num_rows)
        with offline_compiles() as record:
            for rows in (1, 13, 16, 31, 64):
                x = torch.zeros(64)
                specialised[(1,)](x, rows, BLOCK=64)
                marked[(1,)](x, rows, BLOCK=64)
        print(json.dumps({"varying": record.varying_arguments(),
                          "variants": {k: len(v) for k, v in record.compiled.items()}, "errors": record.errors}))
    """)
    (tmp_path / "kernels.py").write_text(script)   # Triton reads a kernel's source from its file
    proc = subprocess.run([sys.executable, str(tmp_path / "kernels.py")], cwd=REPO, env=_compiler_env(tmp_path / "c"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert result["varying"] == {"specialised": ["num_rows"]}
    assert result["variants"] == {"specialised": 3, "marked": 1}   # 1, a multiple of 16, any other

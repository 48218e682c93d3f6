"""One-call probe (H100/H200, torch 2.11+cu130): why cuBLAS block-scaled FP8 refuses, and how fast
cuBLAS (F.scaled_mm 1x128 x 128x128), DeepGEMM (sgl-deep-gemm 0.1.5.post1) and the project's Triton
GEMM run on Qwen3-8B's shapes. Usage (repo root on the device):
    PYTHONUNBUFFERED=1 python3 bench/probes/fp8_block_gemm.py [cublas|deepgemm|all]
Writes nothing but stdout (tee it into $OUT)."""
import ctypes
import itertools
import os
import subprocess
import sys
import time
import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
SHAPES = [(6144, 4096, "qkv"), (4096, 4096, "o"), (24576, 4096, "gate_up"), (4096, 12288, "down")]
dev = "cuda"


def quant_rows(x, g=128):          # per token, per 128 columns; scales [M, K/128] row-major
    m, k = x.shape
    xg = x.float().view(m, k // g, g)
    s = xg.abs().amax(-1).clamp_min(1e-4) / 448.0
    return (xg / s[..., None]).clamp(-448, 448).to(FP8).view(m, k), s


def quant_blocks(w, b=128):        # 128x128 blocks; scales [N/128, K/128] row-major
    n, k = w.shape
    wb = w.float().view(n // b, b, k // b, b)
    s = wb.abs().amax(dim=(1, 3)).clamp_min(1e-4) / 448.0
    return (wb / s[:, None, :, None]).clamp(-448, 448).to(FP8).view(n, k), s


def reference(a, sa, w, sw):
    m, k = a.shape
    n = w.shape[0]
    ad = (a.float().view(m, k // 128, 128) * sa[..., None]).view(m, k)
    wd = (w.float().view(n // 128, 128, k // 128, 128) * sw[:, None, :, None]).view(n, k)
    return ad @ wd.t()


def rel(out, ref):
    return float((out.float() - ref).norm() / ref.norm())


def bench(fn, iters=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        fn()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / iters * 1e-3


def cycling(call, copies):
    """A function of no arguments that calls call(*copy) on the next of the copies each time."""
    nxt = itertools.cycle(copies).__next__
    return lambda: call(*nxt())


def weights(n, k, copies_bytes=160 << 20):   # several copies so the weights stream from HBM, not L2
    w, sw = quant_blocks(torch.randn(n, k, device=dev) * 0.02)
    copies = max(1, -(-copies_bytes // (n * k)))
    return [(w.clone(), sw.clone()) for _ in range(copies)]


def env():
    p = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__} cuda {torch.version.cuda} device {p.name} sm{p.major}{p.minor} SMs {p.multi_processor_count}")
    for lib in ("libcublasLt.so.13", "libcublasLt.so.12"):
        try:
            print(lib, "cublasLtGetVersion", ctypes.CDLL(lib).cublasLtGetVersion())
            break
        except OSError:
            pass
    print("nvcc:", subprocess.run("which nvcc; nvcc --version | tail -2", shell=True, capture_output=True, text=True).stdout.strip())


def cublas_call(a, sa_rows, w, sw, v2=True):
    sa = sa_rows.t().contiguous().t()                         # [M, K/128], strides (1, M)
    L = sw.shape[1]
    sb = F.pad(sw, (0, -L % 4)).t()                           # [L4, N/128], strides (1, L4)
    if v2:
        return F.scaled_mm(a, w.t(), sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                           output_dtype=torch.bfloat16)
    return torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)


def run_cublas():
    print("== cuBLAS block-scaled (1x128 x 128x128), bf16 out")
    for n, k, name in SHAPES:
        ws = weights(n, k)
        one = torch.ones((), device=dev)
        for m in (1, 3, 4, 64, 256, 2048):
            a, sa = quant_rows(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            line = f"{name:8s} M={m:5d} N={n} K={k}: "
            for v2 in (True, False):
                try:
                    out = cublas_call(a, sa, *ws[0], v2=v2)
                    err = rel(out, reference(a, sa, *ws[0]))
                    t = bench(cycling(lambda w, sw, a=a, sa=sa, v2=v2: cublas_call(a, sa, w, sw, v2=v2), ws))
                    line += f"{'v2' if v2 else 'v1'} ok rel={err:.4f} {t*1e6:.1f}us {2*m*n*k/t/1e12:.0f}TF | "
                except Exception as e:  # noqa: BLE001
                    line += f"{'v2' if v2 else 'v1'} FAIL {type(e).__name__}: {str(e).splitlines()[0][:110]} | "
            if m in (256, 2048):         # baselines on the same machine
                b16 = [wq.to(torch.bfloat16) for wq, _ in ws[:3]]
                x16 = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                t = bench(cycling(lambda w, x16=x16: x16 @ w.t(), [(w,) for w in b16]))
                del b16
                line += f"bf16 {2*m*n*k/t/1e12:.0f}TF | "
                t = bench(lambda a=a, w=ws[0][0], one=one: torch._scaled_mm(a, w.t(), one, one, out_dtype=torch.bfloat16))
                line += f"fp8 per-tensor {2*m*n*k/t/1e12:.0f}TF"
            print(line, flush=True)
        del ws
        torch.cuda.empty_cache()


def log_one_failure():
    """cuBLASLt's own reason for one refused call (M=256, o_proj), logged to a file."""
    code = ("import sys; sys.path.insert(0, 'bench/probes'); import fp8_block_gemm as p, torch;"
            "w, sw = p.quant_blocks(torch.randn(4096, 4096, device='cuda') * 0.02);"
            "a, sa = p.quant_rows(torch.randn(256, 4096, device='cuda', dtype=torch.bfloat16));"
            "p.cublas_call(a, sa, w, sw); torch.cuda.synchronize(); print('M=256 call OK under logging')")
    log = os.path.join(os.environ.get("OUT", "/tmp"), "cublaslt_log.txt")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, CUBLASLT_LOG_LEVEL="5", CUBLASLT_LOG_FILE=log))
    print("logged run:", r.stdout.strip()[-300:], r.stderr.strip()[-600:])
    try:
        lines = open(log).read().splitlines()
        keep = [l for l in lines if any(w in l for w in ("Error", "Hint", "Warn", "Heuristic"))] or lines[-20:]
        print("\n".join(keep)[-3000:])
    except OSError:
        pass


def run_deepgemm():
    print("== DeepGEMM fp8_gemm_nt (sgl-deep-gemm), bf16 out")
    os.environ.setdefault("DG_JIT_CACHE_DIR", "/tmp/dg_cache")
    t = time.time()
    import deep_gemm
    print("deep_gemm", getattr(deep_gemm, "__version__", "?"), "imported in", round(time.time() - t, 1), "s")
    for n, k, name in SHAPES:
        ws = weights(n, k)
        for m in (1, 64, 256, 2048):
            a, sa = quant_rows(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            ma = -(-m // 4) * 4                                   # TMA-aligned, M-major: no transform kernel
            sfa = torch.empty(k // 128, ma, device=dev)[:, :m].t()
            sfa.copy_(sa)
            d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            line = f"{name:8s} M={m:5d} N={n} K={k}: "
            try:
                t = time.time()
                deep_gemm.fp8_gemm_nt((a, sfa), ws[0], d)
                torch.cuda.synchronize()
                first = time.time() - t
                err = rel(d, reference(a, sa, *ws[0]))
                tt = bench(cycling(lambda w, sw, a=a, sfa=sfa, d=d: deep_gemm.fp8_gemm_nt((a, sfa), (w, sw), d), ws))
                line += f"ok first call {first:.1f}s rel={err:.4f} {tt*1e6:.1f}us {2*m*n*k/tt/1e12:.0f}TF"
            except Exception as e:  # noqa: BLE001
                line += f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(line, flush=True)
        del ws
        torch.cuda.empty_cache()


def run_triton():
    print("== project Triton GEMM (worker_svc.layers.fp8_kernels.block_fp8_matmul, pre-quantized x)")
    sys.path.insert(0, os.getcwd())
    from worker_svc.layers import fp8_kernels as fk
    for n, k, name in SHAPES:
        ws = weights(n, k)
        for m in (256, 2048):
            a, sa = quant_rows(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            fk.block_fp8_matmul(a, sa, *ws[0], (128, 128), torch.bfloat16)
            tt = bench(cycling(lambda w, sw, a=a, sa=sa: fk.block_fp8_matmul(a, sa, w, sw, (128, 128), torch.bfloat16),
                               ws))
            print(f"{name:8s} M={m:5d}: {tt*1e6:.1f}us {2*m*n*k/tt/1e12:.0f}TF", flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    torch.manual_seed(0)
    env()
    for name, fn in (("cublas", run_cublas), ("cublaslog", log_one_failure), ("triton", run_triton),
                     ("deepgemm", run_deepgemm)):
        if what in (name, "all"):
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                print(f"{name} stage failed: {type(e).__name__}: {e}")

"""Benchmark: the fused vocabulary ops against the naive path that materialises (N, V) logits.

    python -m kernels                  # CPU: N=4096, H=576, V=49152 (SmolLM2's head), float32 and bfloat16
    python -m kernels --device cuda    # GPU: bfloat16, N=16384, (H, V) = (4096, 128256), (896, 151936), (1536, 151936)
    python -m kernels --device cuda --tiles   # ... and the fused ops at a few candidate tiles (tuning)
    python -m kernels --target sm_90   # no GPU: compile for an H100, registers / spills / shared memory
    ncu --profile-from-start off ... python -m kernels --device cuda --profile 4096,128256   # what bounds them
    python -m kernels --device cuda --sweep 4096,128256   # the forwards at a few pipeline stages and vocab splits

Rows: logprob+entropy (`linear_logprob_entropy`) and exact KL (`linear_kl`), each fused vs naive
(float32 logits, log_softmax, gather / sum; the op's reference function on CPU). "fwd" runs under
torch.no_grad() (scoring old_logp); "fwd+bwd" runs with grad and backpropagates random per-token
upstream gradients into hidden and weight.

Peak memory is the extra memory the call needed on top of its inputs:
  CPU: every (op, impl, dtype, pass) runs in a fresh subprocess; VmHWM is reset through
       /proc/self/clear_refs right before the call and peak = VmHWM - VmRSS at that moment.
       The same call is timed; every cell runs --rounds times (naive and fused interleaved), the best
       time is shown. Each (op, dtype)'s rows print once its cells are measured (GPU: each row).
  GPU: torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated() before the call.
GPU TFLOP/s use the fused algorithm's matmul work for every column: logprob+entropy 2NHV forward,
8NHV forward+backward (forward, recompute, dh, dW); KL 4NHV and 12NHV (two models). They are compared
with a measured cuBLAS bf16 (N, H) @ (H, V) matmul. Liger-Kernel's LigerFusedLinearCrossEntropyLoss
(cross-entropy only: no entropy, scalar mean loss) is shown when importable.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import torch

from kernels import (aot, linear_kl, linear_kl_reference, linear_logprob_entropy, linear_logprob_entropy_kl,
                     linear_logprob_entropy_reference)
from kernels.kl import DEFAULT_KL_CONFIG
from kernels.utils import DEFAULT_CONFIG

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLOPS = {"logprob+entropy": (2, 8), "kl": (4, 12)}  # x N H V: forward, forward+backward
GPU_SHAPES = ((4096, 128256), (896, 151936), (1536, 151936))  # (H, V): Llama-3-8B's, Qwen2.5-0.5B's and -1.5B's heads

# -----------------------------------------------------------------------------
# inputs and the two implementations of each op


def make_inputs(op, N, H, V, dtype, device, requires_grad):
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    # logits with a std of about 2: a realistic spread for an LM head
    hidden = randn(N, H).requires_grad_(requires_grad)
    weight = randn(V, H, std=2.0 / H**0.5).requires_grad_(requires_grad)
    grads = [torch.randn(N, generator=g, device=device)]  # per-token upstream gradients
    if op == "logprob+entropy":
        labels = torch.randint(0, V, (N,), generator=g, device=device)
        return (hidden, weight, labels), grads + [torch.randn(N, generator=g, device=device)]
    ref_hidden = (hidden.detach() + randn(N, H, std=0.1)).to(dtype)
    ref_weight = (weight.detach() + randn(V, H, std=0.01)).to(dtype)
    return (hidden, weight, ref_hidden, ref_weight), grads


def naive_gpu(op):
    """What training code usually writes on a GPU: a bf16 matmul, then float32 logits."""
    def logits(h, w):
        return (h @ w.T).float()  # (N, V)

    if op == "logprob+entropy":
        def fn(h, w, y):
            logp_all = torch.log_softmax(logits(h, w), dim=-1)
            return logp_all.gather(1, y[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)
        return fn

    def fn(h, w, rh, rw):
        logp, logq = torch.log_softmax(logits(h, w), -1), torch.log_softmax(logits(rh, rw), -1)
        return (logp.exp() * (logp - logq)).sum(-1)
    return fn


def implementation(op, impl, device):
    if impl == "fused":
        return linear_logprob_entropy if op == "logprob+entropy" else linear_kl
    if device == "cuda":
        return naive_gpu(op)
    # CPU: the references upcast to float32 before the matmul (bf16 GEMMs are ~10-100x slower on CPUs)
    return linear_logprob_entropy_reference if op == "logprob+entropy" else linear_kl_reference


def step(fn, inputs, grads, backward):
    if not backward:
        with torch.no_grad():
            fn(*inputs)
        return
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grads)  # per-token upstream gradients
    for t in inputs[:2]:
        t.grad = None


# -----------------------------------------------------------------------------
# CPU: one fresh subprocess per measurement


def _status_kb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def cpu_worker(spec):
    torch.manual_seed(0)
    backward = spec["pass"] == "fwd+bwd"
    inputs, grads = make_inputs(spec["op"], spec["N"], spec["H"], spec["V"], DTYPES[spec["dtype"]], "cpu", backward)
    fn = implementation(spec["op"], spec["impl"], "cpu")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status_kb("VmRSS")
    t0 = time.perf_counter()
    step(fn, inputs, grads, backward)
    print(json.dumps({"time_s": time.perf_counter() - t0, "peak_mb": (_status_kb("VmHWM") - base) / 1024}))


def cpu_table(args):
    N, H, V = args.n, args.h, args.v
    print(f"CPU ({os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads), "
          f"N={N} H={H} V={V}; time = best of {args.rounds} rounds, naive and fused interleaved "
          "(shared machine: timings are noisy)")
    header = f"{'op':16s} {'dtype':9s} {'impl':6s} {'fwd s':>8s} {'fwd MB':>8s} {'fwd+bwd s':>10s} {'fwd+bwd MB':>11s}"
    print(header)
    print("-" * len(header), flush=True)
    for op in args.ops:  # each (op, dtype) measured, then its rows printed: a run cut short keeps what it measured
        for dtype in args.dtypes:
            keys = [(impl, pas) for pas in ("fwd", "fwd+bwd") for impl in ("naive", "fused")]
            runs = {k: [] for k in keys}
            for _ in range(args.rounds):
                for impl, pas in keys:
                    spec = dict(op=op, impl=impl, dtype=dtype, N=N, H=H, V=V, **{"pass": pas})
                    out = subprocess.run([sys.executable, "-m", "kernels", "--worker", json.dumps(spec)],
                                         capture_output=True, text=True)
                    if out.returncode != 0:
                        raise RuntimeError(f"benchmark worker {spec} failed:\n{out.stderr}")
                    runs[impl, pas].append(json.loads(out.stdout.strip().splitlines()[-1]))
            best = {k: (min(r["time_s"] for r in v), max(r["peak_mb"] for r in v)) for k, v in runs.items()}
            cells = {}
            for impl in ("naive", "fused"):
                (tf, mf), (tb, mb) = best[impl, "fwd"], best[impl, "fwd+bwd"]
                cells[impl] = (tf, mf, tb, mb)
                print(f"{op:16s} {dtype:9s} {impl:6s} {tf:8.2f} {mf:8.0f} {tb:10.2f} {mb:11.0f}")
            r = [f / n for f, n in zip(cells["fused"], cells["naive"])]
            print(f"{'':16s} {dtype:9s} {'ratio':6s} {r[0]:8.2f} {r[1]:8.3f} {r[2]:10.2f} {r[3]:11.3f}", flush=True)
    print("naive = the op's reference (float32 logits materialised; bf16 inputs upcast first); "
          "fused = chunked torch path; ratio = fused / naive; MB = peak resident memory above the inputs")


# -----------------------------------------------------------------------------
# GPU


def cuda_measure(fn, inputs, grads, backward, reps):
    """Median time (ms) over reps after one warm-up call (which also JIT-compiles), and peak extra MB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    try:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(fn, inputs, grads, backward)
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(fn, inputs, grads, backward)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2], peak_mb
    except torch.cuda.OutOfMemoryError:
        for t in inputs[:2]:
            t.grad = None
        torch.cuda.empty_cache()
        return None, None


def liger_fn():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="mean")

    def fn(h, w, y):
        out = loss_fn(w, h, y)
        return out[0] if isinstance(out, tuple) else out
    return fn


def matmul_rate(N, H, V, dev, reps, measure=None):
    """(ms, TFLOP/s) of cuBLAS's bf16 (N, H) @ (H, V), the ceiling every table compares with. measure: cuda_measure
    (looked up when called, so that a test's stand-in takes its place)."""
    a = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
    b = torch.randn(V, H, device=dev, dtype=torch.bfloat16)
    ms, _ = (measure or cuda_measure)(lambda x, w: x @ w.T, (a, b), None, False, reps)
    return ms, 2 * N * H * V / ms / 1e9


def cuda_table(args, dev=torch.device("cuda"), shapes=GPU_SHAPES):
    print(f"GPU: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, bfloat16, N={args.gpu_n}", flush=True)
    liger = liger_fn()
    if liger is None:
        print("Liger-Kernel not importable (pip install liger-kernel): its column is skipped")
    header = (f"{'H':>5s} {'V':>7s} {'op':16s} {'impl':14s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'%mm':>5s} {'fwd MB':>8s} "
              f"{'f+b ms':>8s} {'TFLOP/s':>8s} {'%mm':>5s} {'f+b MB':>8s}")
    for H, V in shapes:
        N = args.gpu_n
        mm_ms, mm_tflops = matmul_rate(N, H, V, dev, args.repeat)
        print(f"\ncuBLAS bf16 ({N}, {H}) @ ({H}, {V}): {mm_ms:.2f} ms = {mm_tflops:.0f} TFLOP/s")
        print(header)
        print("-" * len(header), flush=True)
        for op in args.ops:
            variants = [("naive", naive_gpu(op)), ("fused", implementation(op, "fused", "cuda"))]
            if op == "logprob+entropy" and liger is not None:
                variants.append(("liger", liger))
            if args.tiles:  # the tile candidates of kernels/aot.py (its report says which compile without spills)
                fused = implementation(op, "fused", "cuda")
                variants += [(f"{n},{v},{h}/{w}/{s}", functools.partial(fused, config=aot.tiles(n, v, h, w, s)))
                             for n, v, h, w, s in aot.CANDIDATES]
            inputs, grads = make_inputs(op, N, H, V, torch.bfloat16, dev, False)
            for impl, fn in variants:
                cells = []
                for backward in (False, True):
                    for t in inputs[:2]:
                        t.requires_grad_(backward)
                    failed = "OOM"
                    try:  # liger: scalar mean loss, no per-token gradients
                        ms, mb = cuda_measure(fn, inputs, grads if impl != "liger" else None, backward, args.repeat)
                    except Exception as err:  # an installed Liger whose API differs must not end the table
                        if impl != "liger":
                            raise
                        print(f"liger failed: {type(err).__name__}: {err}")
                        ms, mb, failed = None, None, "error"
                    if ms is None:
                        cells.append(f"{failed:>8s} {'':>8s} {'':>5s} {'':>8s}")
                        continue
                    tflops = FLOPS[op][backward] * N * H * V / ms / 1e9
                    cells.append(f"{ms:8.1f} {tflops:8.0f} {100 * tflops / mm_tflops:5.0f} {mb:8.0f}")
                print(f"{H:5d} {V:7d} {op:16s} {impl:14s} " + " ".join(cells), flush=True)
            del inputs, grads
    print("\nnaive = bf16 matmul -> float32 logits -> log_softmax; liger = cross-entropy only (no entropy), "
          "mean loss; n,v,h/w/s = the fused op at those tiles, warps and stages; TFLOP/s count the fused "
          "algorithm's work (see the module docstring) for every column")


def profiled_calls(N, H, V, device):
    """(name, fn, inputs, grads, backward) of each fused kernel's work at one head, as step() runs it, for a profiler
    to look at one call of each: cuBLAS's (N, H) @ (H, V) product (the ceiling), logprob+entropy's forward,
    scoring's one pass over both heads, and the KL forward then backward (its first vocab chunk's dz kernel and two
    GEMMs come first)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(N, H, generator=g, device=device).to(torch.bfloat16)
    b = torch.randn(V, H, generator=g, device=device).to(torch.bfloat16)
    (h, w, y), _ = make_inputs("logprob+entropy", N, H, V, torch.bfloat16, device, False)
    kl_inputs, kl_grads = make_inputs("kl", N, H, V, torch.bfloat16, device, True)
    return [("cuBLAS (N, H) @ (H, V)", lambda x, wt: x @ wt.T, (a, b), None, False),
            ("logprob+entropy forward", linear_logprob_entropy, (h, w, y), None, False),
            ("scoring's one pass forward", linear_logprob_entropy_kl, (h, w, y, *kl_inputs[2:]), None, False),
            ("kl forward + backward", linear_kl, kl_inputs, kl_grads, True)]


def cuda_profile(args, H, V):
    """One call of each of profiled_calls between cudaProfilerStart and cudaProfilerStop (after a warm-up that
    compiles), for Nsight Compute's `--profile-from-start off`; each call's median time outside the range first."""
    dev = torch.device("cuda")
    calls = profiled_calls(args.gpu_n, H, V, dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, bfloat16, N={args.gpu_n}, H={H}, "
          f"V={V}; median of {args.repeat} calls each (outside the profiled range)", flush=True)
    for name, *call in calls:  # each compiled by cuda_measure's first call
        ms, _ = cuda_measure(*call, args.repeat)
        print(f"  {name:30s} {ms:8.2f} ms", flush=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _, *call in calls:
        step(*call)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled one call of each, in this order", flush=True)


def scoring_losses(hidden, weight, labels, ref_hidden, ref_weight, config=None):
    """linear_logprob_entropy_kl's three differentiable outputs: logprob, entropy, kl (training with the KL loss)."""
    logprob, entropy, _, kl = linear_logprob_entropy_kl(hidden, weight, labels, ref_hidden, ref_weight, config=config)
    return logprob, entropy, kl


def cuda_sweep(args, H, V, dev=torch.device("cuda"), measure=cuda_measure):
    """The forwards (and the KL's and scoring's forward+backward) at a few pipeline stages and, for the KL alone,
    vocab splits, side by side in one process: what profiling suggested. Scoring keeps linear_logprob_entropy's
    splits (its logprob must be that op's, bit for bit), so only its stages move."""
    N = args.gpu_n
    mm_ms, mm_tflops = matmul_rate(N, H, V, dev, args.repeat, measure)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    print(f"GPU: {gpu}, torch {torch.__version__}, bfloat16, N={N}, H={H}, V={V}; "
          f"cuBLAS bf16 {mm_ms:.2f} ms = {mm_tflops:.0f} TFLOP/s; median of {args.repeat} calls", flush=True)
    lpe_inputs, lpe_grads = make_inputs("logprob+entropy", N, H, V, torch.bfloat16, dev, False)
    kl_inputs, kl_grads = make_inputs("kl", N, H, V, torch.bfloat16, dev, False)
    h, w, y = lpe_inputs
    score_inputs = (h, w, y, kl_inputs[2], kl_inputs[3])
    # (op, inputs, upstream gradients, forward+backward work x NHV, base config, [(stages, splits), ...])
    rows = [("logprob+entropy", linear_logprob_entropy, lpe_inputs, None, 2, DEFAULT_CONFIG, [(3, 0), (4, 0)]),
            ("scoring", linear_logprob_entropy_kl, score_inputs, None, 4, DEFAULT_CONFIG, [(2, 0), (3, 0), (4, 0)]),
            ("kl", linear_kl, kl_inputs, None, 4, DEFAULT_KL_CONFIG,
             [(3, 0), (4, 0), (3, 32), (4, 32), (3, 64), (4, 64)]),
            ("logprob+entropy fwd+bwd", linear_logprob_entropy, lpe_inputs, lpe_grads, 8, DEFAULT_CONFIG,
             [(3, 0), (4, 0)]),
            ("scoring fwd+bwd", scoring_losses, score_inputs, [lpe_grads[0]] * 3, 12, DEFAULT_CONFIG,
             [(2, 0), (3, 0), (4, 0)]),
            ("kl fwd+bwd", linear_kl, kl_inputs, kl_grads, 12, DEFAULT_KL_CONFIG, [(3, 0), (4, 0)])]
    print(f"{'op':23s} {'tiles n,v,h/warps':18s} {'stages':>6s} {'splits':>6s} {'ms':>8s} {'TFLOP/s':>8s} {'%mm':>5s}")
    for op, fn, inputs, grads, work, base, variants in rows:
        backward = grads is not None
        for t in inputs[:2]:
            t.requires_grad_(backward)
        for stages, splits in variants:
            cfg = replace(base, num_stages=stages, num_splits=splits)
            ms, _ = measure(functools.partial(fn, config=cfg), inputs, grads, backward, args.repeat)
            tflops = work * N * H * V / ms / 1e9
            tiles = f"{cfg.block_n},{cfg.block_v},{cfg.block_h}/{cfg.num_warps}"
            print(f"{op:23s} {tiles:18s} {stages:6d} {splits or 'auto':>6} {ms:8.2f} {tflops:8.0f} "
                  f"{100 * tflops / mm_tflops:5.0f}", flush=True)
    print("splits auto: the launchers' own (at least 16); TFLOP/s count each op's work: logprob+entropy 2NHV, scoring "
          "4NHV (each head's logits once), kl 4NHV; forward+backward 8NHV, 12NHV and 12NHV")


def head_shape(text):
    try:
        H, V = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not H,V (two integers, e.g. 4096,128256)")
    return H, V


# -----------------------------------------------------------------------------


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--n", type=int, default=4096, help="CPU: tokens")
    p.add_argument("--h", type=int, default=576, help="CPU: hidden size")
    p.add_argument("--v", type=int, default=49152, help="CPU: vocabulary size")
    p.add_argument("--gpu_n", type=int, default=16384, help="GPU: tokens")
    p.add_argument("--ops", nargs="+", default=["logprob+entropy", "kl"], choices=list(FLOPS))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES), help="CPU dtypes")
    p.add_argument("--rounds", type=int, default=2, help="CPU: fresh-process runs of every cell, best time kept")
    p.add_argument("--repeat", type=int, default=5, help="GPU: timed calls per cell (median)")
    p.add_argument("--tiles", action="store_true", help="GPU: also time the fused ops at each tile candidate of "
                   "kernels/aot.py (n,v,h/warps/stages)")
    p.add_argument("--target", choices=("sm_90",), help="compile for this GPU (no GPU needed) and print the "
                   "machine-code report of kernels/aot.py at (--gpu_n, 4096, 128256) instead of timing")
    p.add_argument("--profile", type=head_shape, metavar="H,V", help="GPU: one call of each fused kernel at this "
                   "head (and cuBLAS's product) between cudaProfilerStart and Stop, for Nsight Compute: "
                   "`ncu --profile-from-start off ... python -m kernels --device cuda --profile 4096,128256`")
    p.add_argument("--sweep", type=head_shape, metavar="H,V", help="GPU: the fused ops at this head, forward and "
                   "forward+backward, at a few pipeline stages and (the KL) vocab splits, side by side")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main():
    args = parser().parse_args()
    if args.worker:
        cpu_worker(json.loads(args.worker))
    elif args.target:
        if not aot.available():
            sys.exit("--target: needs a compiled (not TRITON_INTERPRET=1) Triton with the JIT binder of "
                     "triton.runtime.jit; this one has none")
        aot.report(N=args.gpu_n)
    elif args.device == "cuda" or args.profile or args.sweep:
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device visible to torch")
        if args.profile:
            cuda_profile(args, *args.profile)
        elif args.sweep:
            cuda_sweep(args, *args.sweep)
        else:
            cuda_table(args)
    else:
        cpu_table(args)


if __name__ == "__main__":
    main()

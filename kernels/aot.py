"""Compile the Triton kernels for a Hopper GPU (sm_90a) on a machine that has none, and read what the
compiler made of them: registers, local-memory (spill) bytes, shared memory, and in the machine code
whether the dots became wgmma (HGMMA) and the operand loads asynchronous copies (LDGSTS: the software
pipeline that `num_stages` asks for).

    python -m kernels --target sm_90               # the table, the default tiles and a few candidates

Why: the tests run the kernels under TRITON_INTERPRET=1, which executes them with numpy. The interpreter
accepts programs the compiler rejects and says nothing about registers or pipelining; this compiles the
same programs to sm_90a machine code with the ptxas that ships inside Triton, no GPU needed.

The arguments are those the CUDA launchers pass (bf16 dz, the split count for 132 SMs), specialised by
Triton's own binder exactly as a launch specialises them: pointer alignment, integers equal to 1 or
divisible by 16. That decides the code: with unit strides unknown, the loads cannot be vectorised and
the pipeliner leaves them synchronous. The JIT compiles one variant per specialisation, so the table
has a row count divisible by 16 ("aligned") and one that is not ("ragged"). The binder is Triton
internals (triton.runtime.jit): `available()` says whether this Triton has what is used here.
"""

import os
import re
import subprocess
import tempfile
from dataclasses import replace

import torch

from kernels import kl, logprob_entropy
from kernels.kl import DEFAULT_KL_CONFIG
from kernels.utils import (DEFAULT_CONFIG, TileConfig, cdiv, default_config, dot_precision, interpreted,
                           pipeline_stages, vocab_chunk, vocab_splits)

H100_SMS = 132
H100_SMEM = 227 * 1024  # the most shared memory one block may hold on sm_90
TRITON_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# bf16 tile shapes to time on a GPU (python -m kernels --device cuda --tiles)
CANDIDATES = (  # (block_n, block_v, block_h, num_warps, num_stages)
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (128, 256, 64, 8, 3),
)


def available() -> bool:
    """Whether this Triton has the JIT binder used here, and the kernels are compiled ones (not the
    interpreter's: TRITON_INTERPRET=1 at import)."""
    try:
        from triton.compiler import ASTSource, make_backend  # noqa: F401
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError:
        return False
    return hasattr(JITFunction, "_pack_args") and not interpreted(logprob_entropy._logprob_entropy_fwd_kernel)


def _bin(tool):
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def tiles(n, v, h, warps, stages, base=DEFAULT_CONFIG) -> TileConfig:
    return replace(base, block_n=n, block_v=v, block_h=h, num_warps=warps, num_stages=stages)


# -----------------------------------------------------------------------------
# the four launches, with the arguments the CUDA launchers pass


def launches(dtype: torch.dtype, N: int, H: int, V: int, cfg: TileConfig = None, kl_cfg: TileConfig = None):
    """(name, kernel, args, kwargs) of every Triton launch of the three ops on CUDA, with the ops' default tiles
    for `dtype` unless cfg / kl_cfg are given (the one pass over both heads takes cfg). The tensors are tiny
    stand-ins: the binder reads only their dtype and alignment; sizes and strides are the integers."""
    def ptr(dt):
        return torch.empty(64, dtype=dt)

    cfg = cfg or default_config(dtype)
    kl_cfg = kl_cfg or default_config(dtype, DEFAULT_KL_CONFIG)
    h, w, f32, labels = ptr(dtype), ptr(dtype), ptr(torch.float32), ptr(torch.int64)
    strides = (H, 1, H, 1)  # contiguous (N, H) hidden and (V, H) weight
    for op, c in (("logprob+entropy", cfg), ("kl", kl_cfg)):
        BN, BV = c.block_n, c.block_v
        _, per_split = vocab_splits(c, torch.device("cuda"), N, V, sms=H100_SMS)  # as the launchers split V
        # the backward's first vocab chunk [0, v1): dz's rows are vc apart, vc a whole number of tiles, which
        # passes V when the chunk holds all of V (then V is its end)
        vc = vocab_chunk(c, N, V, c.gpu_chunk_elems, BV)
        v1 = min(vc, V)
        flags = dict(BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=c.block_h, DOT_PRECISION=dot_precision(dtype), UPCAST=False,
                     num_warps=c.num_warps, num_stages=pipeline_stages(c, dtype.itemsize))
        if op == "logprob+entropy":
            yield (f"{op} fwd", logprob_entropy._logprob_entropy_fwd_kernel,
                   (h, w, labels, f32, N, V, H, per_split, *strides, 1.0), flags)
            yield (f"{op} bwd", logprob_entropy._logprob_entropy_bwd_kernel,
                   (h, w, labels, f32, f32, f32, f32, f32, ptr(dtype), N, H, 0, v1, *strides, vc, 1.0), flags)
        else:
            flags.update(REF_DOT_PRECISION=dot_precision(dtype), REF_UPCAST=False)
            yield (f"{op} fwd", kl._kl_fwd_kernel,
                   (h, w, h, w, f32, N, V, H, H, per_split, *strides, *strides, 1.0), flags)
            yield (f"{op} bwd", kl._kl_bwd_kernel,
                   (h, w, h, w, f32, f32, f32, ptr(dtype), N, H, H, 0, v1, *strides, *strides, vc, 1.0), flags)
    # the one pass over both heads (scoring, training with the KL loss): linear_logprob_entropy's tiles and splits
    _, per_split = vocab_splits(cfg, torch.device("cuda"), N, V, sms=H100_SMS)
    vc = vocab_chunk(cfg, N, V, cfg.gpu_chunk_elems, cfg.block_v)
    v1 = min(vc, V)
    flags = dict(BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, DOT_PRECISION=dot_precision(dtype),
                 UPCAST=False, num_warps=cfg.num_warps, num_stages=pipeline_stages(cfg, dtype.itemsize))
    yield ("score fwd", kl._score_fwd_kernel,
           (h, w, h, w, labels, f32, N, V, H, H, per_split, *strides, *strides, 1.0), flags)
    yield ("score bwd", kl._score_bwd_kernel,
           (h, w, h, w, labels, f32, f32, f32, f32, f32, f32, ptr(dtype), N, H, H, 0, v1, *strides, *strides, vc, 1.0),
           flags)


def compile_sm90(kernel, args, kwargs):
    """The CompiledKernel a launch of `kernel(*args, **kwargs)` would build on an sm_90 GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


SPILL_SHARE = 0.01  # spill accesses above this share of the instructions inside loops cost speed


def loop_local_accesses(sass: str) -> dict:
    """Local-memory loads and stores (LDL / STL: spilled registers) inside the loops of the SASS listing. A
    loop is the address range between a backward branch and its target. A spill outside every loop (a
    value parked across the main loop) costs a few accesses per program; one inside costs them per
    iteration. Returns the accesses in any loop ("loops"), those in innermost loops ("inner": loops that
    hold no other loop, in the forwards the tl.dot K loops, run H / BLOCK_H times per tile) and the
    instructions inside loops ("instructions"): a few reloads in the vocab loop, once per tile, are cheap
    beside its thousands of instructions."""
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, op in code:
        jump = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", op)
        if jump and int(jump.group(1), 16) < addr:
            loops.append((int(jump.group(1), 16), addr))
    inner = [(a, b) for a, b in loops if not any((a, b) != (c, d) and a <= c and d <= b for c, d in loops)]

    def count(ranges, local_only=True):
        return sum(1 for addr, op in code if (not local_only or re.search(r"\b(?:LDL|STL)\b", op))
                   and any(a <= addr <= b for a, b in ranges))

    return dict(loops=count(loops), inner=count(inner), instructions=count(loops, local_only=False))


def machine_code_report(compiled) -> dict:
    """Registers, stack bytes and shared memory from cuobjdump; instruction counts from the SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_bin("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True)
        sass = subprocess.run([_bin("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
    field = dict(re.findall(r"(\w+):(\d+)", usage.stdout.split("Function", 1)[1]))
    in_loops = loop_local_accesses(sass)
    return dict(
        regs=int(field["REG"]), stack=int(field["STACK"]),
        shared=compiled.metadata.shared,  # dynamic shared memory (the pipeline's buffers), bytes
        hgmma=len(re.findall(r"\bHGMMA\b", sass)), ldgsts=len(re.findall(r"\bLDGSTS\b", sass)),
        local=len(re.findall(r"\b(?:LDL|STL)\b", sass)), local_in_loops=in_loops["loops"],
        local_in_inner=in_loops["inner"], loop_instructions=in_loops["instructions"],
        i32_offsets=i32_offsets(compiled.asm["ttir"]),
    )


def i32_offsets(ttir: str) -> int:
    """Pointer offsets computed in 32 bits in Triton IR (tt.addptr's offset i32, or a tensor of i32): row x stride
    wraps past 2^31 elements (Llama-3's head at 16k rows is 2.1e9 logits), so every offset is widened first."""
    return len(re.findall(r"tt\.addptr [^\n]*(?:\b|x)i32>?\s+loc\(", ttir))


def problems(r: dict, dtype: torch.dtype, stages: int) -> list:
    """What would cost speed on the GPU: spills inside the innermost loops, or more than SPILL_SHARE of the
    instructions inside loops (see loop_local_accesses), too much shared memory, dots off the tensor cores
    (bf16), loads outside the software pipeline, pointer offsets that could wrap (32 bits)."""
    out = []
    if r["local_in_inner"]:
        out.append(f"{r['local_in_inner']} spill accesses in innermost loops")
    if r["local_in_loops"] > SPILL_SHARE * r["loop_instructions"]:
        out.append(f"{r['local_in_loops']} spill accesses in loops ({r['local_in_loops'] / r['loop_instructions']:.1%} "
                   "of their instructions)")
    if r["shared"] > H100_SMEM:
        out.append(f"shared memory {r['shared']} > {H100_SMEM}")
    if dtype != torch.float32 and r["hgmma"] == 0:  # float32 takes exact fp32 FMAs (dot_precision "ieee")
        out.append("no HGMMA")
    if stages > 1 and r["ldgsts"] == 0:
        out.append("loads not pipelined")
    if r["i32_offsets"]:
        out.append(f"{r['i32_offsets']} pointer offsets in 32 bits")
    return out


def compile_report(dtype, N, H, V, cfg=None, kl_cfg=None, only=None) -> list:
    """One dict per launch (see launches; only: the one kernel of that name): the machine-code report, the
    stages used and its problems."""
    rows = []
    for name, kernel, args, kwargs in launches(dtype, N, H, V, cfg, kl_cfg):
        if only is not None and name != only:
            continue
        r = machine_code_report(compile_sm90(kernel, args, kwargs))
        r.update(kernel=name, stages=kwargs["num_stages"], warps=kwargs["num_warps"],
                 tiles=(kwargs["BLOCK_N"], kwargs["BLOCK_V"], kwargs["BLOCK_H"]),
                 problems=problems(r, dtype, kwargs["num_stages"]))
        rows.append(r)
    return rows


def report(N=16384, H=4096, V=128256, candidates=CANDIDATES):
    """The defaults in bf16 and fp32, at a row count divisible by 16 and a ragged one (N and N + 7, or N rounded up
    to 16 and N where N is ragged: the binder compiles one variant for each), then the candidate tiles in bf16 (all
    three ops) at the first, one row per launch."""
    import triton
    aligned, ragged = (N, N + 7) if N % 16 == 0 else (cdiv(N, 16) * 16, N)
    print(f"sm_90a machine code, Triton {triton.__version__}, compiled without a GPU; N={aligned} (ragged: {ragged}), "
        f"H={H}, V={V}. regs: per thread; stack: bytes per thread; shared: KiB per program; local: LDL/STL (in "
        "loops / in innermost loops)")
    head = (f"{'tiles':9s} {'dtype':5s} {'rows':7s} {'kernel':20s} {'n,v,h':11s} {'warps':>5s} {'stages':>6s} "
            f"{'regs':>4s} {'stack':>5s} {'shared':>6s} {'HGMMA':>5s} {'LDGSTS':>6s} {'local':>12s}  problems")
    print(head)
    print("-" * len(head))
    runs = [("default", dt, n, None) for dt in TRITON_DTYPES for n in (aligned, ragged)]
    runs += [("candidate", "bf16", aligned, tiles(*c)) for c in candidates]
    for label, dt, n, cfg in runs:
        for r in compile_report(TRITON_DTYPES[dt], n, H, V, cfg, cfg):
            local = f"{r['local']} ({r['local_in_loops']}/{r['local_in_inner']})"
            print(f"{label:9s} {dt:5s} {'aligned' if n % 16 == 0 else 'ragged':7s} {r['kernel']:20s} "
                f"{','.join(map(str, r['tiles'])):11s} {r['warps']:5d} {r['stages']:6d} {r['regs']:4d} "
                f"{r['stack']:5d} {r['shared'] / 1024:6.0f} {r['hgmma']:5d} {r['ldgsts']:6d} {local:>12s}  "
                + ("; ".join(r["problems"]) or "-"), flush=True)

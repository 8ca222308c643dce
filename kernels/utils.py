"""Pieces shared by the fused vocabulary ops: tile configuration, input checks, backend choice, dtypes.

The ops (`logprob_entropy.py`; `kl.py`, with the one pass over both heads) follow the same plan: logits
z = h W^T / T are produced one (rows, vocab) tile at a time, reduced on the fly, and recomputed in the
backward pass, so no (N, V) tensor ever exists. This file holds what they would otherwise repeat: the
Triton building block all use (`logits_tile`, one (BLOCK_N, BLOCK_V) tile of x W^T by tl.dot) and the
backwards' chunk loops (`torch_backward`, `triton_backward`), which take each op's dz as a function.
"""

import functools
import os
import warnings
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

BACKENDS = ("auto", "triton", "torch")
HALF_DTYPES = (torch.float16, torch.bfloat16)
TRITON_DTYPES = (torch.float32,) + HALF_DTYPES
# On CUDA both backwards round dz to the half input dtype before their two GEMMs (tensor-core operands);
# on a CPU they keep it in float32 (CPU half GEMMs are slow). EMULATE_CUDA (KERNELS_EMULATE_CUDA=1 before the
# import; tests set the attribute) makes CPU tensors take the CUDA casts too, so that a CPU run, the Triton
# interpreter included, computes the gradients CUDA computes: see cuda_casts and grad_operand
EMULATE_CUDA = os.environ.get("KERNELS_EMULATE_CUDA", "0") == "1"


def _fix_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a loop bound computed from tl.program_id (held as a 1-element array)
    into an int with int(array), which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted").
    Triton 3.7 squeezes the array first; this applies the same one-line change to 3.6, the Triton that
    torch 2.11's CUDA build pins. Compiled kernels never take this path."""
    if os.environ.get("TRITON_INTERPRET") != "1" or not triton.__version__.startswith("3.6."):
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


_fix_interpreter_loop_bounds()


@dataclass(frozen=True)
class TileConfig:
    """Tile and chunk sizes. Defaults aim at an H100 with bf16 inputs, chosen from a few candidates timed on an H100
    and an H200 (`python -m kernels --device cuda --tiles`, `--sweep`; no autotuning at run time); tests pass small
    values so that the Triton interpreter stays fast and odd sizes exercise masking."""

    block_n: int = 128  # Triton: rows per program
    block_v: int = 128  # Triton: vocab columns per tl.dot tile
    block_h: int = 64  # Triton: hidden (reduction) step of tl.dot
    num_splits: int = 0  # Triton forward: vocab ranges per row block (0 = enough programs to fill the GPU)
    num_warps: int = 8
    num_stages: int = 4  # (3 to 4 on an H200: the one pass over both heads up to 1.10x, logprob+entropy 1.07x)
    chunk_rows: int = 4096  # torch path: rows per chunk; with chunk_elems it also fixes the vocab chunk width
    chunk_vocab: int = 0  # both backwards and the torch forward: vocab columns per chunk (0 = from chunk_elems)
    chunk_elems: int = 1 << 23  # torch path: elements in one (chunk_rows, vocab) float32 chunk, 32 MiB
    gpu_chunk_elems: int = 1 << 27  # Triton backward: elements in the (N, vocab chunk) dz buffer


DEFAULT_CONFIG = TileConfig()
# Float32 inputs take exact fp32 products on the FMA units (dot_precision "ieee"), not the tensor cores, and
# the (128, 128) fp32 dot of the bf16 tiles spills thousands of registers to local memory on an H100
# (`python -m kernels --target sm_90`). These tiles compile without spills in every kernel; chosen from
# the compiler's report, not yet timed on a GPU. The chunk sizes (the torch path) are the same for all dtypes.
FP32_TILES = dict(block_n=32, block_v=64, block_h=32, num_warps=4, num_stages=2)


def default_config(dtype: torch.dtype, base: TileConfig = DEFAULT_CONFIG) -> TileConfig:
    """The op's default tiles for inputs of `dtype` (the wider of the two models' for the KL)."""
    return replace(base, **FP32_TILES) if dtype == torch.float32 else base


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def vocab_chunk(cfg: TileConfig, rows: int, vocab: int, budget: int, multiple: int) -> int:
    """Columns per vocab chunk: cfg.chunk_vocab if set, else budget // rows; a multiple of `multiple`.

    The chunk boundaries fix the order in which a row's per-chunk partial results are merged (forward
    statistics, dh accumulation), so they decide its last bits. The torch path passes rows =
    cfg.chunk_rows (see chunk_shape): its chunks are a function of (config, V, n_models) only, never of N.
    The Triton backward passes rows = N so that its (N, Vc) dz buffer stays within gpu_chunk_elems: there
    the width, and with it dh's last bits, follow N unless cfg.chunk_vocab pins it (on CUDA dh is equal
    across N only to float rounding anyway: cuBLAS picks its kernel from the shape).
    The Triton backward passes BLOCK_V so that its tiles sit where the forward's did: every logit is then
    recomputed with the same tile shape and K order as in the forward (bit for bit under the interpreter).
    That matters at large logits: with z ~ 1e4, one float32 ulp moves sum p away from 1 by 1e-3."""
    if cfg.chunk_vocab > 0:
        cols = cdiv(cfg.chunk_vocab, multiple) * multiple
    else:
        cols = max(multiple, budget // max(rows, 1) // multiple * multiple)
    return min(cols, cdiv(vocab, multiple) * multiple)


def check_config(cfg: TileConfig, where: str) -> None:
    for name in ("block_n", "block_v", "block_h"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{where}: TileConfig.{name}={v} must be a power of two >= 16 (tl.dot tiles)")
    for name in ("chunk_rows", "chunk_elems", "gpu_chunk_elems", "num_warps", "num_stages"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{where}: TileConfig.{name} must be positive, got {getattr(cfg, name)}")
    if cfg.num_splits < 0 or cfg.chunk_vocab < 0:
        raise ValueError(f"{where}: TileConfig.num_splits and chunk_vocab must be >= 0")


def check_linear(where: str, hname: str, hidden: torch.Tensor, wname: str, weight: torch.Tensor) -> None:
    """hidden (N, H) and weight (V, H): same dtype (float), same device, matching H."""
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{where}: {hname} and {wname} must be tensors")
    if hidden.dim() != 2:
        raise ValueError(f"{where}: {hname} must be (N, H), got shape {tuple(hidden.shape)}; flatten (B, T, H) first")
    if weight.dim() != 2:
        raise ValueError(f"{where}: {wname} must be (V, H), got shape {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{where}: {hname} has H={hidden.shape[1]} but {wname} has H={weight.shape[1]}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise TypeError(f"{where}: {hname} ({hidden.dtype}) and {wname} ({weight.dtype}) must share one float dtype")
    if hidden.device != weight.device:
        raise ValueError(f"{where}: {hname} is on {hidden.device} but {wname} is on {weight.device}")
    if weight.shape[0] == 0:
        raise ValueError(f"{where}: {wname} has an empty vocabulary")


def check_temperature(where: str, temperature: float) -> float:
    t = float(temperature)
    if not (t > 0.0 and t < float("inf")):
        raise ValueError(f"{where}: temperature must be a positive finite number, got {temperature}")
    if 1.0 / t > torch.finfo(torch.float32).max:  # the kernels scale the logits by 1/T in float32: inf, then NaN
        raise ValueError(f"{where}: temperature {temperature} is too small: 1/T overflows float32 (T must be "
                         f">= {1.0 / torch.finfo(torch.float32).max:.3g})")
    return t


def check_label_vector(where: str, labels, hidden: torch.Tensor, vocab: int) -> None:
    """labels: an integer (N,) tensor on hidden's device, N = hidden's rows, all in [0, vocab) (check_labels)."""
    N = hidden.shape[0]
    if not isinstance(labels, torch.Tensor) or labels.shape != (N,) or labels.is_floating_point():
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"{where}: labels must be an integer tensor of shape ({N},), got {got}")
    if labels.device != hidden.device:
        raise ValueError(f"{where}: labels are on {labels.device} but hidden is on {hidden.device}")
    check_labels(where, labels, vocab)  # no host sync on CUDA


def check_labels(where: str, labels: torch.Tensor, vocab: int, sync=None) -> None:
    """labels (N,) integer (not bool), all in [0, vocab). On CUDA (sync=None) the check runs on the device: reading
    min/max back would stall the host every micro-batch. A failure there is a device-side assert, raised at
    a later synchronisation, and it leaves the CUDA context unusable; elsewhere a ValueError with the range."""
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():  # (True would be read as 1)
        raise ValueError(f"{where}: labels must be integer token ids, got dtype {labels.dtype}")
    if labels.numel() == 0:
        return
    if sync is None:
        sync = labels.device.type != "cuda"
    if sync:
        lo, hi = (int(x) for x in labels.aminmax())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{where}: labels must lie in [0, {vocab}), got [{lo}, {hi}]")
    else:
        torch._assert_async(((labels >= 0) & (labels < vocab)).all(), f"{where}: labels must lie in [0, {vocab})")


def on_its_device(launcher):
    """A Triton launcher run with hidden's GPU as the current CUDA device: Triton launches on the current device and
    its current stream, whatever device the tensors are on (another GPU's tensors: an illegal address, or a read
    unordered with that GPU's stream)."""
    @functools.wraps(launcher)
    def run(hidden, *args, **kw):
        if not hidden.is_cuda:
            return launcher(hidden, *args, **kw)
        with torch.cuda.device(hidden.device):
            return launcher(hidden, *args, **kw)
    return run


def resolve_backend(where: str, backend: str, device: torch.device, dtypes, kernel) -> str:
    """auto: Triton on CUDA (float32/16, bfloat16 inputs), chunked torch elsewhere. An explicit
    "triton" on CPU tensors needs the interpreter, which Triton picks when the kernel is decorated:
    TRITON_INTERPRET=1 must be set before this package is imported."""
    if backend not in BACKENDS:
        raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {backend!r}")
    supported = all(dt in TRITON_DTYPES for dt in dtypes)
    if backend == "auto":
        return "triton" if device.type == "cuda" and supported else "torch"
    if backend == "triton":
        if not supported:
            raise TypeError(f"{where}: the Triton kernels take float32/float16/bfloat16, got {tuple(dtypes)}; "
                            "use backend='torch'")
        if device.type != "cuda" and not interpreted(kernel):
            raise RuntimeError(
                f"{where}: backend='triton' on {device.type} tensors needs the Triton interpreter: "
                "set TRITON_INTERPRET=1 before importing `kernels`"
            )
    if backend == "triton" and device.type == "cuda" and interpreted(kernel):
        warnings.warn(f"{where}: TRITON_INTERPRET=1 with CUDA tensors: the Triton kernels run on the interpreter "
                      "(on the host, far slower than compiled, and storing bf16 by truncation); unset it before "
                      "importing `kernels` for the compiled ones", stacklevel=3)
    return backend


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs: exact fp32 products (torch's default matmul does not use TF32 either);
    # half inputs use the tensor cores' native bf16/fp16 products with fp32 accumulation.
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreted(kernel) -> bool:
    """True when Triton built `kernel` for its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def upcast_dot(kernel, dtype: torch.dtype) -> bool:
    # the interpreter's tl.dot multiplies bf16 bit patterns (stored as uint16) as integers
    return interpreted(kernel) and dtype in HALF_DTYPES


def gemm_operand(t: torch.Tensor) -> torch.Tensor:
    """Half-precision GEMMs are fast on CUDA and very slow on most CPUs: upcast on CPU only."""
    if t.dtype in HALF_DTYPES and t.device.type != "cuda":
        return t.float()
    return t


def cuda_casts(device: torch.device) -> bool:
    """Whether the backward on `device` rounds dz as the CUDA paths do: on CUDA, and anywhere under EMULATE_CUDA."""
    return device.type == "cuda" or EMULATE_CUDA


def grad_operand(dz: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dz (rows, vocab chunk), float32 or already rounded, as the backward GEMMs of inputs of `dtype` take it.
    With the CUDA casts a half dtype rounds it to that dtype, to nearest even as the CUDA kernels' store
    does (the Triton interpreter's store to bf16 truncates instead: there the kernel stores float32 and
    this rounds); on a CPU the rounded values come back upcast, exactly, for a float32 GEMM."""
    if dtype in HALF_DTYPES and cuda_casts(dz.device):
        dz = dz.to(dtype)
    return gemm_operand(dz)


# column_reduce's row groups: a (V, H) head reduces over (V / G, H) slices first, G x H partials
REDUCE_GROUPS = 256


def column_reduce(x: torch.Tensor, reduce) -> torch.Tensor:
    """reduce(t, dim) over the rows of x (V, H) -> (H,), in two stages: within each of REDUCE_GROUPS groups of
    rows (a (G, V // G, H) view, and the V % G rows left over), then over the partials. On CUDA one reduction
    over dim 0 of a head spreads each of its H columns over many blocks, which stage their partials in a global
    buffer: 119 MiB for SmolLM2's 54 MiB head, 252 MiB for Llama-3-8B's (sum to float32 on an H200, torch 2.11;
    half that for amin or amax), allocated in the middle of the fused head's backward. With G x H outputs each
    block finishes its own, and what the two stages hold is the (G, H) partials (4 MiB at H = 4096)."""
    V, H = x.shape
    n = V - V % REDUCE_GROUPS
    parts = [reduce(x[:n].view(REDUCE_GROUPS, n // REDUCE_GROUPS, H), 1)] if n else []
    if n < V:
        parts.append(reduce(x[n:], 0)[None])
    return reduce(torch.cat(parts), 0)


def shared_row(weight: torch.Tensor):
    """c (H,), in weight's dtype: the part of W's V rows that they all share, where taking it away is exact; None
    where no column is (a trained head's columns mix signs), so that the backwards copy no W - 0 per chunk.

    Each row of dz sums to 0 (softmax is shift invariant: adding a_i to every logit of row i changes no
    output), so dh = dz W = dz (W - 1 c^T) for any c, and the backwards multiply dz by W - 1 c^T. The
    rounding of dz (to bf16 on CUDA) and the GEMM's float32 sums then meet only what differs between
    W's rows: a column of W shared by all rows is a logit offset h c^T shared by the whole row, and with
    W[:, 0] = 1e4 (every logit shifted by about 1e4) bf16 dz made dh[:, 0] 56-106 where its exact value is 0.
    c_h is the column's mean where every entry lies within a factor of 2 of it, so that W_vh - c_h is
    exact in any floating-point format (Sterbenz's lemma), and 0 elsewhere, leaving those columns as they are."""
    acc = accum_dtype(weight.dtype)
    c = column_reduce(weight, lambda x, d: x.sum(d, dtype=acc)).div_(weight.shape[0]).to(weight.dtype)
    lo = column_reduce(weight, lambda x, d: x.amin(d))  # on a CPU 6x faster than aminmax(dim=0) over a (V, H) head
    hi = column_reduce(weight, lambda x, d: x.amax(d))
    exact = torch.where(c > 0, (lo >= c / 2) & (hi <= 2 * c), (hi <= c / 2) & (lo >= 2 * c))
    c = torch.where(exact, c, 0.0)
    return c if bool(c.any()) else None  # (one host sync a backward)


@functools.lru_cache(maxsize=None)
def _mm_has_out_dtype(device: torch.device) -> bool:
    a = torch.zeros(16, 16, device=device, dtype=torch.bfloat16)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):  # older torch, or no such kernel on this device
        return False


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 (or float64) result. Half inputs on CUDA keep their tensor-core GEMM and
    accumulate in fp32; torch.mm(out_dtype=) returns that accumulator unrounded where torch has it
    (otherwise one rounding to the half dtype per call)."""
    if a.dtype in HALF_DTYPES:
        if _mm_has_out_dtype(a.device):
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b).float()
    return a @ b


@functools.lru_cache(maxsize=None)
def _addmm_has_out_dtype(device: torch.device) -> bool:
    """Whether torch.addmm(c, a, b, out_dtype=float32, out=c) adds a half product into a float32 c in place on
    this device (CUDA in torch 2.8+; checked by value, once)."""
    a, c = torch.full((16, 16), 0.5, device=device, dtype=torch.bfloat16), torch.ones(16, 16, device=device)
    try:
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return bool((c == 5.0).all())  # 1 + 16 * 0.25
    except (TypeError, RuntimeError, NotImplementedError):  # older torch, no such kernel (or values) on this device
        return False


def addmm_f32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, out float32/64: in place (no temporary) when the operands already have out's dtype, and for
    half operands into float32 where torch has addmm(out_dtype=) (without it, a float32 product of out's size is
    made and added: dh's traffic, N x H x 4 bytes three times a vocab chunk)."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        out.addmm_(a, b)
    elif a.dtype in HALF_DTYPES and a.dtype == b.dtype and out.dtype == torch.float32 and \
            _addmm_has_out_dtype(out.device):
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out += mm_f32(a, b).to(out.dtype)


def addmm_rows(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """addmm_f32 for a product whose rows are tokens (dh): on oneDNN where rows_exact, so that each row of out gets
    the same bits whatever rows a holds besides it."""
    if rows_exact(a, b, out):
        out += onednn_linear(a, b.T)
    else:
        addmm_f32(out, a, b)


def rows_exact(*ts) -> bool:
    """Whether a product of these tensors runs on oneDNN: float32 on a CPU, where PyTorch has oneDNN. oneDNN rounds
    each row of x @ w^T the same whatever rows x holds besides it (tested at any row count and place); MKL, which
    torch.mm calls, does not: at SmolLM2's hidden size (576) it rounds a row differently in a product of 8 rows
    than of 16, and with AVX2 code (an Intel CPU without AVX-512) by the row's place in its blocks of 6. The torch
    path's per-token products (the logits, dh) need that property: a row's logprob must not depend on the other
    rows of the call (PPO's first ratio of exactly 1). dW's product sums over rows and stays on torch.mm."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts) and torch.backends.mkldnn.is_available()


def onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T on oneDNN, x (M, K), w (N, K) float32 CPU tensors (model.py sends F.linear's float32 there too)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


# CPU GEMMs (MKL) round a row differently when the matrix has few rows that are not a multiple of 4
# (measured with torch 2.13's MKL on AVX-512, M = 1-3, 5-7, 9-11 with 2 threads and up to 27 with 16; never
# at multiples of 4), so the torch path pads the M of every GEMM that produces per-row results (logits, dh)
# to a multiple of ROW_ALIGN: 8 for margin, at most 7 zero rows per row chunk. Padding is not enough at real
# hidden sizes (rows_exact: float32 products run on oneDNN); it stays for the products that still take MKL
# (float64, a build without oneDNN) and for one code path on every device. cuBLAS also picks its kernel from
# the shape, so on CUDA rows agree across N only to rounding
ROW_ALIGN = 8


def aligned_rows(n: int) -> int:
    return cdiv(n, ROW_ALIGN) * ROW_ALIGN


def chunk_shape(cfg: TileConfig, N: int, V: int, n_models: int):
    """(rows, cols) of one torch-path logit chunk: up to chunk_rows rows, and chunk_elems split between the
    n_models whose logits are live at once, at chunk_rows rows (buffers hold aligned_rows(rows) * cols).

    cols is a function of (config, V, n_models) only: a row's result must not depend on the other rows of
    the call (PPO's first minibatch recomputes in training micro-batches, bit for bit, the logprobs that
    scoring computed in differently grouped ones: ratio == 1). A width from chunk_elems // min(chunk_rows, N)
    would move the vocab chunk boundaries, hence each row's order of max/sum merges, with N. Rows are
    independent across row chunks, so chunking rows (by chunk_rows, for memory) is free to follow N."""
    rows = max(1, min(cfg.chunk_rows, N))
    return rows, vocab_chunk(cfg, aligned_rows(cfg.chunk_rows), V, cfg.chunk_elems // n_models, 8)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t (n, K) with zero rows appended up to `rows` (t itself when n == rows): a GEMM operand whose M is
    aligned_rows(n), see ROW_ALIGN. The zero rows give finite logits that are sliced away."""
    n = t.shape[0]
    if n == rows:
        return t
    out = t.new_zeros(rows, t.shape[1])
    out[:n] = t
    return out


def chunk_view(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous (rows, cols) view at the start of a flat chunk buffer (the last chunks are smaller)."""
    return buf[: rows * cols].view(rows, cols)


def chunk_logits(out: torch.Tensor, h_op: torch.Tensor, w_op: torch.Tensor, scale: float) -> torch.Tensor:
    """out = h_op @ w_op^T * scale, written into a preallocated chunk buffer: (R, H) x (C, H) -> (R, C)."""
    if rows_exact(h_op, w_op, out):
        out.copy_(onednn_linear(h_op, w_op))
    elif h_op.dtype == out.dtype and w_op.dtype == out.dtype:
        torch.mm(h_op, w_op.T, out=out)
    else:  # half GEMM on CUDA, float32 result
        out.copy_(mm_f32(h_op, w_op.T))
    return out.mul_(scale) if scale != 1.0 else out


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32 whatever the input; float64 stays float64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def prepare_grad(g, n: int, device, dtype) -> torch.Tensor:
    """Upstream per-token gradient as a dense (N,) vector (it may be None, or a stride-0 expand from .sum())."""
    if g is None:
        return torch.zeros(n, device=device, dtype=dtype)
    return g.reshape(n).to(dtype).contiguous()


SMEM_BUDGET = 160 * 1024  # bytes of pipelined operand tiles per program; an H100 block may hold 227 KiB


def pipeline_stages(cfg: TileConfig, itemsize: int) -> int:
    """cfg.num_stages, lowered until the software-pipelined tl.dot operands fit in shared memory: each stage holds
    a (BLOCK_N, BLOCK_H) and a (BLOCK_H, BLOCK_V) tile. The kernels over both heads (kl.py) run one K loop after the
    other, and Triton gives the second loop the first's buffers: one pair's stages are what a program holds (Nsight
    Compute on an H200, Triton 3.6: scoring's one pass at 128 x 128 tiles and 2 stages took 65.5 KB, the KL forward
    at 128 x 64 and 3 stages 73.7 KB; counting both pairs had lowered the one pass's 3 stages to 2 and the KL's 4 to
    3). Matters for float32 inputs, twice the bytes of bf16."""
    stages = cfg.num_stages
    per_stage = (cfg.block_n + cfg.block_v) * cfg.block_h * itemsize
    while stages > 1 and stages * per_stage > SMEM_BUDGET:
        stages -= 1
    return stages


def num_splits(cfg: TileConfig, device: torch.device, row_blocks: int, vocab_tiles: int, sms: int = None) -> int:
    """Vocab ranges per row block in the Triton forwards. On CUDA: about 4 programs per SM, and at least
    16 splits so that the programs resident at once cover few row blocks of h (each stays in L2 while the
    splits walk their W tiles) instead of 132 different row blocks that together overflow L2.

    Row independence: an explicit cfg.num_splits, and the single split off CUDA (the interpreter), make the
    split boundaries a function of V alone, so a row's merge order does not depend on N. On CUDA with
    num_splits=0 the split count follows the number of row blocks, i.e. N: a row's split merges (and the
    backward's cuBLAS kernels, chosen by shape) can differ between batch sizes, so there a row's results
    are equal across N only to float rounding. Under the interpreter tl.dot is numpy's matmul, whose
    float32 rounding depends on a row's position inside its (BLOCK_N, BLOCK_H) tile. sms: the GPU's
    multiprocessor count, read from the device when not given."""
    if cfg.num_splits > 0:
        return min(cfg.num_splits, vocab_tiles)
    if device.type != "cuda":
        return 1
    sms = sms or torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(vocab_tiles, max(16, cdiv(4 * sms, row_blocks))))


def torch_backward(hidden, weight, need_dh, need_dw, R, C, dt, chunk_dz, ref_hidden=None):
    """The chunked torch backwards' loop over (R rows, C vocab columns) chunks, dt the accumulation dtype (float32,
    float64 for float64 inputs). chunk_dz(r0, r1, v0, v1, h_op, w_op, rh_op, dz) writes dz = d loss / d logits
    (1/T folded in) of rows [r0, r1) and columns [v0, v1) into dz (r1 - r0, v1 - v0), dt, given the GEMM operands
    h_op (n_pad, H) and rh_op (n_pad, H_ref; None without ref_hidden), rows padded to ROW_ALIGN, and w_op (C, H);
    then dh += dz (W - 1 c^T) (c: shared_row) and dW += dz^T h, accumulated in dt. A row's dh does not depend on
    the other rows (padded GEMMs, fixed chunks). Returns (dh, dW) in the inputs' dtypes, None where not needed."""
    N, V = hidden.shape[0], weight.shape[0]
    dh = torch.zeros(hidden.shape, device=hidden.device, dtype=dt) if need_dh else None
    dw = torch.zeros(weight.shape, device=weight.device, dtype=dt) if need_dw else None
    w_shared = shared_row(weight) if need_dh else None  # (H,), or None
    dz_buf = torch.empty(aligned_rows(R) * C, device=hidden.device, dtype=dt)
    for r0 in range(0, N, R):
        r1 = min(r0 + R, N)
        n, n_pad = r1 - r0, aligned_rows(r1 - r0)
        h_op = pad_rows(gemm_operand(hidden[r0:r1]), n_pad)
        rh_op = None if ref_hidden is None else pad_rows(gemm_operand(ref_hidden[r0:r1]), n_pad)
        # dh of this row chunk, with the padding rows the GEMM writes (a scratch when there are any)
        dh_c = (dh[r0:r1] if n == n_pad else dh.new_zeros(n_pad, dh.shape[1])) if need_dh else None
        for v0 in range(0, V, C):
            v1 = min(v0 + C, V)
            w_op = gemm_operand(weight[v0:v1])
            dz_pad = chunk_view(dz_buf, n_pad, v1 - v0)
            dz_pad[n:].zero_()  # padding rows: only their own (discarded) dh rows see them
            chunk_dz(r0, r1, v0, v1, h_op, w_op, rh_op, dz_pad[:n])
            g_op = grad_operand(dz_pad, weight.dtype)  # half dz for CUDA's GEMMs (see EMULATE_CUDA)
            # (the operands in dz's dtype: float64 for a float32 actor beside a float64 reference's KL)
            if need_dh:  # (n_pad, C) @ (C, H); exact
                addmm_rows(dh_c, g_op, (w_op if w_shared is None else w_op - w_shared).to(g_op.dtype))
            if need_dw:
                addmm_f32(dw[v0:v1], g_op[:n].T, h_op[:n].to(g_op.dtype))  # (C, n) @ (n, H)
        if need_dh and n != n_pad:
            dh[r0:r1] = dh_c[:n]
    return (dh.to(hidden.dtype) if need_dh else None), (dw.to(weight.dtype) if need_dw else None)


def add_label_term(dz, labels, v0, v1, g):
    """dz (n, v1 - v0) += g at each row's label column, where the label lies in [v0, v1): without a boolean-mask
    index (a device->host sync on CUDA), rows whose label lies in another chunk add +0.0 at a clamped column."""
    inside = (labels >= v0) & (labels < v1)
    cols = (labels - v0).clamp(0, v1 - v0 - 1)[:, None]
    dz.scatter_add_(1, cols, torch.where(inside, g, 0.0)[:, None])


def triton_backward(hidden, weight, need_dh, need_dw, vc, launch_dz):
    """The Triton backwards' chunk loop. Per vocab chunk [v0, v1) of width vc, launch_dz(dz, v0, v1) has a kernel
    write dz = d loss / d logits (scaled by 1/T) into dz (N, v1 - v0); two GEMMs then give dW[v0:v1] = dz^T h
    (complete, one rounding) and dh += dz (W[v0:v1] - 1 c^T) (float32 accumulator; c: shared_row). dz is in the
    weight dtype on CUDA (tensor-core GEMMs, rounded by the kernel's store) and float32 elsewhere, rounded by
    grad_operand under EMULATE_CUDA (the interpreter's store to bf16 truncates). Returns (dh, dW), None where
    not needed."""
    N, H = hidden.shape
    V = weight.shape[0]
    dz_dtype = weight.dtype if hidden.is_cuda else accum_dtype(weight.dtype)
    # off CUDA (the interpreter) the dh GEMM's M is padded to ROW_ALIGN, as on the torch path, and the product runs
    # on oneDNN (addmm_rows), so that a row rounds the same for any N; the padding rows of dz stay 0 (the kernels
    # write rows < N only)
    n_pad = N if hidden.is_cuda else aligned_rows(N)
    dz_buf = torch.empty(n_pad, vc, device=hidden.device, dtype=dz_dtype)  # (n_pad, Vc), reused per chunk
    dz_buf[N:].zero_()
    dh = torch.zeros(n_pad, H, device=hidden.device, dtype=torch.float32) if need_dh else None
    dw = torch.empty(V, H, device=weight.device, dtype=weight.dtype) if need_dw else None
    h_op = gemm_operand(hidden)
    w_shared = shared_row(weight) if need_dh else None  # (H,), or None
    for v0 in range(0, V, vc):
        v1 = min(v0 + vc, V)
        dz_pad = dz_buf[:, : v1 - v0]
        launch_dz(dz_pad[:N], v0, v1)
        g_op = grad_operand(dz_pad, weight.dtype)
        if need_dh:  # dz (W - 1 c^T) = dz W, see shared_row: (n_pad, Vc) @ (Vc, H), fp32 accumulation
            addmm_rows(dh, g_op, gemm_operand(weight[v0:v1] if w_shared is None else weight[v0:v1] - w_shared))
        if need_dw:
            dw[v0:v1] = (g_op[:N].T @ h_op).to(dw.dtype)  # (Vc, N) @ (N, H): each row of dW done in one GEMM
    return (dh[:N].to(hidden.dtype) if need_dh else None), dw


def vocab_splits(cfg: TileConfig, device: torch.device, N: int, V: int, sms: int = None) -> tuple:
    """(splits, columns per split) of a Triton forward's grid over N rows: about num_splits' count, each split a
    whole number of BLOCK_V tiles (so that no tile crosses into the next split) and every split owning a column."""
    splits = num_splits(cfg, device, cdiv(N, cfg.block_n), cdiv(V, cfg.block_v), sms)
    per_split = cdiv(cdiv(V, splits), cfg.block_v) * cfg.block_v
    return cdiv(V, per_split), per_split


@triton.jit
def logits_tile(
    x_ptr, w_ptr, rows, cols, row_ok, col_ok, K,
    stride_xn, stride_xk, stride_wv, stride_wk,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """x[rows] @ w[cols]^T as a (BLOCK_N, BLOCK_V) fp32 tile; rows and cols are int64 index vectors.
    UPCAST: only under the Triton interpreter, whose tl.dot multiplies bf16 bit patterns as integers;
    bf16 products are exact in fp32, so the result is what the tensor cores compute."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xn + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
        wt = tl.load(w_ptr + cols[None, :] * stride_wv + ks[:, None] * stride_wk,
                     mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # (BLOCK_K, BLOCK_V), W^T tile
        if UPCAST:
            x = x.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(x, wt, acc, input_precision=DOT_PRECISION)
    return acc

"""Fused exact KL(pi || pi_ref) per token over the whole vocabulary, never storing either model's logits.

For the actor's hidden states h (N, H) and head W (V, H), the frozen reference's h_ref (N, H_ref) and
W_ref (V, H_ref), and temperature T (the same for both, as in sampling):

    z = h W^T / T,   zr = h_ref W_ref^T / T                (N, V) each: never materialised
    p = softmax(z),  q = softmax(zr)
    kl_i = sum_v p_iv (log p_iv - log q_iv)

This is the exact divergence, not a sampled estimator (k1/k2/k3 use only the sampled token): it is >= 0
up to float rounding, and 0 when actor == reference.

Why fuse: the naive version materialises two (N, V) float32 logit tensors plus their log_softmax; at
16k tokens and a 152k vocabulary that is 40 GB. Here both logits are produced one tile at a time. Over
the tiles of a row we keep the running maxima m, mr, the sums s = sum exp(z - m), sr = sum exp(zr - mr),
and b = sum exp(z - m) ((z - m) - (zr - mr)). When the maxima move to m', mr',

    b' = exp(m - m') (b + ((m - m') - (mr - mr')) s)

and at the end kl = b / s - log s + log sr. Every term is relative to the running maxima, so a shift of
both models' logits by a large constant (~1e4) cancels exactly instead of through lse - lse_ref.

Backward, w.r.t. the actor's logits only (the reference is frozen), with per-token upstream g:

    d kl_i / dz_iv = p_iv ((log p_iv - log q_iv) - kl_i)
    dh = g dz W / T,   dW = (g dz)^T h / T

(dz's rows sum to 0 here too: dh is formed with W - 1 c^T, see logprob_entropy.py and utils.shared_row)

recomputing both models' logits tile by tile from the saved maxima, log sums and kl (log p is formed as
(z - m) - log s, never z - lse: see logprob_entropy.py).

The Triton design is the one of logprob_entropy.py (split-vocab forward with tl.dot tiles and merged
partial statistics; per-vocab-chunk dz kernel followed by two cuBLAS GEMMs), with a second tl.dot
K loop for the reference in each tile. Reference and actor may differ in H (e.g. a smaller reference),
not in V. The chunked torch path gives a row the same kl and dh bit for bit whatever the other rows of
the call, as there (fixed vocab chunks, GEMM rows padded to utils.ROW_ALIGN).

Scoring (linear_logprob_entropy_kl) needs the actor's logprob and entropy, the reference's logprob and this
KL for every response token. Three calls compute 4 NHV of logits (linear_kl computes both models' again);
the one pass computes each model's once (2 NHV) and folds logprob_entropy's statistics of both and b from
them. Its Triton kernel folds each model's tile with logprob_entropy.fold_tile, with that op's tiles and
splits, so that scoring's logprob is training's (the first minibatch's ratio of 1). Both logit tiles are live
while b is folded: compiled for an H100 at the bf16 default tiles it reloads 13 values from local memory once
a vocab tile, none inside the K loops (`python -m kernels --target sm_90`). Training with the KL loss takes
the same op: its backward recomputes both models' logits once and forms one dz for all three losses,

    dz = g_lp (onehot - p) - g_ent p (log p + H) + g_kl p ((log p - log q) - kl)      (times 1/T)

then the two GEMMs (4 NHV, where the separate backwards take 3 + 4).

Tests: the kernels/ section of test_ppo.py (pytest test_ppo.py); the benchmark: python -m kernels
"""

import torch
import triton
import triton.language as tl

from kernels.logprob_entropy import fold_tile, linear_logprob_entropy, merge_stats, shift_and_pick
from kernels.utils import (
    TileConfig,
    accum_dtype,
    add_label_term,
    aligned_rows,
    cdiv,
    check_config,
    check_label_vector,
    check_linear,
    check_temperature,
    chunk_logits,
    chunk_shape,
    chunk_view,
    default_config,
    dot_precision,
    gemm_operand,
    logits_tile,
    on_its_device,
    pad_rows,
    pipeline_stages,
    prepare_grad,
    resolve_backend,
    torch_backward,
    triton_backward,
    upcast_dot,
    vocab_chunk,
    vocab_splits,
)

# two (BLOCK_N, BLOCK_V) fp32 logit tiles are live at once: half the columns of logprob_entropy's default, and
# 4 warps. The fastest of aot.CANDIDATES on an H100 and an H200 (`python -m kernels --device cuda --tiles`, at 3
# stages): 1.18-1.34x forward+backward over the former 64 x 128 tiles with 8 warps on the three heads there; 4
# stages and 32 or 64 vocab splits were no faster (`--sweep`, H200). The forward is bound by L2 (93% of its
# throughput, `--profile` under Nsight Compute): each 64-column tile reads its rows of both hidden states again.
# It reloads 20 spilled values once a vocab tile (0.8% of its loops' instructions), none in a K loop.
DEFAULT_KL_CONFIG = TileConfig(block_n=128, block_v=64, num_warps=4, num_stages=3)

# -----------------------------------------------------------------------------
# plain-torch reference: materialises both (N, V) logit tensors


def linear_kl_reference(hidden, weight, ref_hidden, ref_weight, temperature=1.0):
    """Naive reference: float32 (float64 for float64 inputs) logits of both models, exact KL(p || q)."""
    dt = torch.float64 if torch.float64 in (hidden.dtype, ref_hidden.dtype) else torch.float32
    logp = torch.log_softmax((hidden.to(dt) @ weight.to(dt).T) / temperature, dim=-1)  # (N, V)
    logq = torch.log_softmax((ref_hidden.to(dt) @ ref_weight.to(dt).T) / temperature, dim=-1)  # (N, V)
    return (logp.exp() * (logp - logq)).sum(-1)  # (N,)


# -----------------------------------------------------------------------------
# online statistics, shared by the Triton split merge and the torch chunk loop


def merge_kl_stats(m, s, mr, sr, b):
    """Merge K partial (m, s, mr, sr, b) of the same rows (see the module docstring): (K, N) -> (N,)."""
    m_all, mr_all = m.amax(0), mr.amax(0)  # (N,)
    w, wr = torch.exp(m - m_all), torch.exp(mr - mr_all)  # (K, N)
    s_all, sr_all = (w * s).sum(0), (wr * sr).sum(0)
    b_all = (w * (b + ((m - m_all) - (mr - mr_all)) * s)).sum(0)
    return m_all, s_all, mr_all, sr_all, b_all


# -----------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _kl_fwd_kernel(
    h_ptr, w_ptr, rh_ptr, rw_ptr, stats_ptr,  # stats: (5, splits, N) fp32 = m, s, mr, sr, b
    N, V, H, RH, vocab_per_split,
    stride_hn, stride_hh, stride_wv, stride_wh,
    stride_rhn, stride_rhh, stride_rwv, stride_rwh,
    scale,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    REF_DOT_PRECISION: tl.constexpr, REF_UPCAST: tl.constexpr,
):
    pid_s = tl.program_id(0)  # vocab split: fastest-varying, so resident programs share row blocks
    pid_n = tl.program_id(1)
    splits = tl.num_programs(0)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    v_start = pid_s * vocab_per_split
    v_end = tl.minimum(v_start + vocab_per_split, V)

    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)  # running maxima start at -inf
    mr = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sr = tl.zeros((BLOCK_N,), dtype=tl.float32)
    b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_ok = cols < v_end
        z = logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H,
                        stride_hn, stride_hh, stride_wv, stride_wh,
                        BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, UPCAST) * scale
        zr = logits_tile(rh_ptr, rw_ptr, rows, cols, row_ok, col_ok, RH,
                         stride_rhn, stride_rhh, stride_rwv, stride_rwh,
                         BLOCK_N, BLOCK_V, BLOCK_H, REF_DOT_PRECISION, REF_UPCAST) * scale
        z = tl.where(col_ok[None, :], z, float("-inf"))  # padded columns are absent, not logit 0
        zr = tl.where(col_ok[None, :], zr, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        mr_new = tl.maximum(mr, tl.max(zr, axis=1))
        e = tl.exp(z - m_new[:, None])  # padded: 0
        d = (tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
             - tl.where(col_ok[None, :], zr - mr_new[:, None], 0.0))  # (z - m) - (zr - mr), padded: 0
        alpha = tl.exp(m - m_new)
        first = s == 0.0  # first tile: m = mr = -inf and s = 0, nothing to rescale (avoid 0 * inf)
        shift = tl.where(first, 0.0, m - m_new) - tl.where(first, 0.0, mr - mr_new)
        b = alpha * (b + shift * s) + tl.sum(e * d, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        sr = tl.exp(mr - mr_new) * sr + tl.sum(tl.exp(zr - mr_new[:, None]), axis=1)
        m = m_new
        mr = mr_new

    out = stats_ptr + pid_s.to(tl.int64) * N + rows
    plane = splits.to(tl.int64) * N
    tl.store(out, m, mask=row_ok)
    tl.store(out + plane, s, mask=row_ok)
    tl.store(out + 2 * plane, mr, mask=row_ok)
    tl.store(out + 3 * plane, sr, mask=row_ok)
    tl.store(out + 4 * plane, b, mask=row_ok)


@triton.jit
def _kl_bwd_kernel(
    h_ptr, w_ptr, rh_ptr, rw_ptr, norm_ptr, kl_ptr, g_ptr, dz_ptr,  # norm: (4, N) = m, log s, mr, log sr
    N, H, RH, v_start, v_stop,
    stride_hn, stride_hh, stride_wv, stride_wh,
    stride_rhn, stride_rhh, stride_rwv, stride_rwh, stride_dzn,
    scale,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    REF_DOT_PRECISION: tl.constexpr, REF_UPCAST: tl.constexpr,
):
    """dz[:, v_start:v_stop] / T for one vocab chunk: recompute z and zr, then g p ((log p - log q) - kl)."""
    pid_v = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = v_start + pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < v_stop
    z = logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H,
                    stride_hn, stride_hh, stride_wv, stride_wh,
                    BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, UPCAST) * scale
    zr = logits_tile(rh_ptr, rw_ptr, rows, cols, row_ok, col_ok, RH,
                     stride_rhn, stride_rhh, stride_rwv, stride_rwh,
                     BLOCK_N, BLOCK_V, BLOCK_H, REF_DOT_PRECISION, REF_UPCAST) * scale
    m = tl.load(norm_ptr + rows, mask=row_ok, other=0.0)
    log_s = tl.load(norm_ptr + (N + rows), mask=row_ok, other=0.0)
    mr = tl.load(norm_ptr + (2 * N + rows), mask=row_ok, other=0.0)
    log_sr = tl.load(norm_ptr + (3 * N + rows), mask=row_ok, other=0.0)
    kl = tl.load(kl_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)  # per-token vector, not a scalar

    # padded columns: log p = log q = 0 and p = 0, so dz = 0 and nothing overflows
    logp = tl.where(col_ok[None, :], (z - m[:, None]) - log_s[:, None], 0.0)
    logq = tl.where(col_ok[None, :], (zr - mr[:, None]) - log_sr[:, None], 0.0)
    p = tl.where(col_ok[None, :], tl.exp(logp), 0.0)
    dz = p * ((logp - logq) - kl[:, None]) * (g * scale)[:, None]  # fp32 until the store
    out = dz_ptr + rows[:, None] * stride_dzn + (cols - v_start)[None, :]
    tl.store(out, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# -----------------------------------------------------------------------------
# Triton launchers


def _strides(hidden, weight, ref_hidden, ref_weight):
    return (hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            ref_hidden.stride(0), ref_hidden.stride(1), ref_weight.stride(0), ref_weight.stride(1))


def _dot_flags(hidden, ref_hidden):
    return dict(
        DOT_PRECISION=dot_precision(hidden.dtype), UPCAST=upcast_dot(_kl_fwd_kernel, hidden.dtype),
        REF_DOT_PRECISION=dot_precision(ref_hidden.dtype), REF_UPCAST=upcast_dot(_kl_fwd_kernel, ref_hidden.dtype),
    )


def _stages(cfg, hidden, ref_hidden):
    return pipeline_stages(cfg, max(hidden.element_size(), ref_hidden.element_size()))


@on_its_device
def _forward_triton(hidden, weight, ref_hidden, ref_weight, scale, cfg: TileConfig):
    N, H = hidden.shape
    V, RH = weight.shape[0], ref_hidden.shape[1]
    splits, vocab_per_split = vocab_splits(cfg, hidden.device, N, V)
    stats = torch.empty(5, splits, N, device=hidden.device, dtype=torch.float32)
    _kl_fwd_kernel[(splits, cdiv(N, cfg.block_n))](
        hidden, weight, ref_hidden, ref_weight, stats,
        N, V, H, RH, vocab_per_split,
        *_strides(hidden, weight, ref_hidden, ref_weight),
        scale,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, **_dot_flags(hidden, ref_hidden),
        num_warps=cfg.num_warps, num_stages=_stages(cfg, hidden, ref_hidden),
    )
    m, s, mr, sr, b = merge_kl_stats(*stats)
    log_s, log_sr = torch.log(s), torch.log(sr)
    kl = b / s - log_s + log_sr
    return kl, torch.stack([m, log_s, mr, log_sr])


@on_its_device
def _backward_triton(hidden, weight, ref_hidden, ref_weight, norm, kl, g, scale, need_dh, need_dw, cfg):
    N, H = hidden.shape
    BN, BV = cfg.block_n, cfg.block_v

    def launch_dz(dz, v0, v1):
        _kl_bwd_kernel[(cdiv(v1 - v0, BV), cdiv(N, BN))](
            hidden, weight, ref_hidden, ref_weight, norm, kl, g, dz,
            N, H, ref_hidden.shape[1], v0, v1,
            *_strides(hidden, weight, ref_hidden, ref_weight), dz.stride(0),
            scale,
            BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=cfg.block_h, **_dot_flags(hidden, ref_hidden),
            num_warps=cfg.num_warps, num_stages=_stages(cfg, hidden, ref_hidden),
        )

    vc = vocab_chunk(cfg, N, weight.shape[0], cfg.gpu_chunk_elems, BV)
    return triton_backward(hidden, weight, need_dh, need_dw, vc, launch_dz)


# -----------------------------------------------------------------------------
# chunked torch path: three preallocated chunk buffers (see logprob_entropy.py)


def _forward_torch(hidden, weight, ref_hidden, ref_weight, scale, cfg: TileConfig):
    N, V = hidden.shape[0], weight.shape[0]
    dt = torch.float64 if torch.float64 in (hidden.dtype, ref_hidden.dtype) else torch.float32
    kl = torch.empty(N, device=hidden.device, dtype=dt)
    norm = torch.empty(4, N, device=hidden.device, dtype=dt)  # m, log s, mr, log sr
    R, C = chunk_shape(cfg, N, V, n_models=2)  # C fixed by the config: a row's merge order is the same for any N
    zbuf, zrbuf, ebuf = (torch.empty(aligned_rows(R) * C, device=hidden.device, dtype=dt) for _ in range(3))
    for r0 in range(0, N, R):
        r1 = min(r0 + R, N)
        n, n_pad = r1 - r0, aligned_rows(r1 - r0)
        # (n_pad, H) and (n_pad, H_ref): GEMM rows padded to a multiple of ROW_ALIGN
        h_op, rh_op = pad_rows(gemm_operand(hidden[r0:r1]), n_pad), pad_rows(gemm_operand(ref_hidden[r0:r1]), n_pad)
        for v0 in range(0, V, C):
            v1 = min(v0 + C, V)
            z = chunk_logits(chunk_view(zbuf, n_pad, v1 - v0), h_op, gemm_operand(weight[v0:v1]), scale)[:n]
            zr = chunk_logits(chunk_view(zrbuf, n_pad, v1 - v0), rh_op, gemm_operand(ref_weight[v0:v1]), scale)[:n]
            mc, mrc = z.amax(1), zr.amax(1)
            z -= mc[:, None]
            zr -= mrc[:, None]
            er = torch.exp(zr, out=chunk_view(ebuf, n, v1 - v0))
            src = er.sum(1)
            d = zr.neg_().add_(z)  # (z - m) - (zr - mr), in place over zr
            e = torch.exp(z, out=er)
            sc = e.sum(1)
            bc = e.mul_(d).sum(1)
            if v0 == 0:
                m, s, mr, sr, b = mc, sc, mrc, src, bc
            else:  # fold this chunk into the running statistics
                m, s, mr, sr, b = merge_kl_stats(*(torch.stack(p) for p in
                                                   ((m, mc), (s, sc), (mr, mrc), (sr, src), (b, bc))))
        log_s, log_sr = torch.log(s), torch.log(sr)
        kl[r0:r1] = b / s - log_s + log_sr
        norm[:, r0:r1] = torch.stack([m, log_s, mr, log_sr])
    return kl, norm


def _backward_torch(hidden, weight, ref_hidden, ref_weight, norm, kl, g, scale, need_dh, need_dw, cfg):
    N, V = hidden.shape[0], weight.shape[0]
    dt = norm.dtype
    # with e = exp(z - m) = s p and d = (z - m) - (zr - mr) = (log p - log q) + (log s - log sr):
    #   dz = g p ((log p - log q) - kl) / T = e (d - c) A,   c = log s - log sr + kl,   A = g / (s T)
    m, log_s, mr, log_sr = norm
    c = log_s - log_sr + kl
    A = g * torch.exp(-log_s) * scale
    R, C = chunk_shape(cfg, N, V, n_models=2)  # the forward's chunks
    zbuf, zrbuf = (torch.empty(aligned_rows(R) * C, device=hidden.device, dtype=dt) for _ in range(2))

    def chunk_dz(r0, r1, v0, v1, h_op, w_op, rh_op, dz):
        n, n_pad = r1 - r0, h_op.shape[0]
        zs = chunk_logits(chunk_view(zbuf, n_pad, v1 - v0), h_op, w_op, scale)[:n].sub_(m[r0:r1, None])
        zr = chunk_logits(chunk_view(zrbuf, n_pad, v1 - v0), rh_op, gemm_operand(ref_weight[v0:v1]), scale)[:n]
        e = torch.exp(zs, out=dz)
        d = zs.sub_(zr.sub_(mr[r0:r1, None]))
        e.mul_(d.sub_(c[r0:r1, None]).mul_(A[r0:r1, None]))  # fp32

    return torch_backward(hidden, weight, need_dh, need_dw, R, C, dt, chunk_dz, ref_hidden)


# -----------------------------------------------------------------------------
# autograd


class LinearKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, temperature, backend, cfg):
        scale = 1.0 / temperature
        fwd = _forward_triton if backend == "triton" else _forward_torch
        kl, norm = fwd(hidden, weight, ref_hidden, ref_weight, scale, cfg)
        ctx.save_for_backward(hidden, weight, ref_hidden, ref_weight, norm, kl)
        ctx.scale, ctx.backend, ctx.cfg = scale, backend, cfg
        ctx.set_materialize_grads(False)
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        hidden, weight, ref_hidden, ref_weight, norm, kl = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g is None or not (need_dh or need_dw):
            return None, None, None, None, None, None, None
        g = prepare_grad(g, hidden.shape[0], hidden.device, kl.dtype)
        bwd = _backward_triton if ctx.backend == "triton" else _backward_torch
        dh, dw = bwd(hidden, weight, ref_hidden, ref_weight, norm, kl, g, ctx.scale, need_dh, need_dw, ctx.cfg)
        return dh, dw, None, None, None, None, None


def linear_kl(hidden, weight, ref_hidden, ref_weight, temperature=1.0, backend="auto", config=None):
    """Exact per-token KL(pi || pi_ref) of softmax(hidden @ weight.T / T) and softmax(ref_hidden @ ref_weight.T / T).

    hidden (N, H), weight (V, H): the actor; ref_hidden (N, H_ref), ref_weight (V, H_ref): the frozen
    reference (must not require grad). Returns kl (N,) float32 (float64 for float64 inputs on the torch
    path), differentiable w.r.t. hidden and weight. backend: "auto" | "triton" | "torch"; config: TileConfig.
    """
    where = "linear_kl"
    check_linear(where, "hidden", hidden, "weight", weight)
    check_linear(where, "ref_hidden", ref_hidden, "ref_weight", ref_weight)
    temperature = check_temperature(where, temperature)
    cfg = config if config is not None else default_config(torch.promote_types(hidden.dtype, ref_hidden.dtype),
                                                           DEFAULT_KL_CONFIG)
    check_config(cfg, where)
    if ref_hidden.shape[0] != hidden.shape[0]:
        raise ValueError(f"{where}: hidden has N={hidden.shape[0]} rows but ref_hidden has {ref_hidden.shape[0]}")
    if ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"{where}: weight has V={weight.shape[0]} but ref_weight has V={ref_weight.shape[0]}")
    if ref_hidden.device != hidden.device:
        raise ValueError(f"{where}: ref_hidden is on {ref_hidden.device} but hidden is on {hidden.device}")
    if torch.is_grad_enabled() and (ref_hidden.requires_grad or ref_weight.requires_grad):
        raise ValueError(f"{where}: the reference is frozen and gets no gradient, but ref_hidden or ref_weight "
                         "requires grad; compute it under torch.no_grad() or pass .detach()")
    backend = resolve_backend(where, backend, hidden.device, (hidden.dtype, ref_hidden.dtype), _kl_fwd_kernel)
    if hidden.shape[0] == 0:
        f64 = torch.float64 in (hidden.dtype, ref_hidden.dtype)  # either model float64: the KL in float64
        dt = torch.float64 if backend == "torch" and f64 else torch.float32
        return (hidden.sum() + weight.sum()).to(dt).mul(0).expand(0)  # keeps the graph connected
    return LinearKL.apply(hidden, weight, ref_hidden, ref_weight, temperature, backend, cfg)


# -----------------------------------------------------------------------------
# scoring: both heads' logprobs, the actor's entropy and the exact KL from one pass over the two logit sets


@triton.jit
def _score_fwd_kernel(
    h_ptr, w_ptr, rh_ptr, rw_ptr, label_ptr, stats_ptr,  # stats: (8, splits, N) fp32, see _score_triton
    N, V, H, RH, vocab_per_split,
    stride_hn, stride_hh, stride_wv, stride_wh,
    stride_rhn, stride_rhh, stride_rwv, stride_rwh,
    scale,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """_logprob_entropy_fwd_kernel's fold_tile on the reference's tile and on the actor's (so the same tiles give
    the same statistics), with _kl_fwd_kernel's b folded in from the two tiles while both are live."""
    pid_s = tl.program_id(0)  # vocab split: fastest-varying, as in the other forwards
    pid_n = tl.program_id(1)
    splits = tl.num_programs(0)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    labels = tl.load(label_ptr + rows, mask=row_ok, other=-1)
    v_start = pid_s * vocab_per_split
    v_end = tl.minimum(v_start + vocab_per_split, V)

    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    mr = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sr = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    z_label = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zr_label = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_ok = cols < v_end
        # the reference's tile first, keeping only its shifted logits zrs (fewer registers than the other order)
        zr = logits_tile(rh_ptr, rw_ptr, rows, cols, row_ok, col_ok, RH,
                         stride_rhn, stride_rhh, stride_rwv, stride_rwh,
                         BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, UPCAST) * scale
        mr_new, sr, _, zr_label, _, zrs, _ = fold_tile(zr, cols, col_ok, labels, mr, sr, sr, zr_label)  # no entropy
        z = logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H,
                        stride_hn, stride_hh, stride_wv, stride_wh,
                        BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, UPCAST) * scale
        m_new, s_new, a, z_label, e, zs, alpha = fold_tile(z, cols, col_ok, labels, m, s, a, z_label)
        # the KL's b = sum exp(z - m) ((z - m) - (zr - mr)), rescaled to the new maxima as in _kl_fwd_kernel
        shift = tl.where(s > 0.0, m - m_new, 0.0) - tl.where(s > 0.0, mr - mr_new, 0.0)  # first tile: s = 0, m = -inf
        b = alpha * (b + shift * s) + tl.sum(e * (zs - zrs), axis=1)
        m, s, mr = m_new, s_new, mr_new

    out = stats_ptr + pid_s.to(tl.int64) * N + rows
    plane = splits.to(tl.int64) * N
    tl.store(out, m, mask=row_ok)
    tl.store(out + plane, s, mask=row_ok)
    tl.store(out + 2 * plane, a, mask=row_ok)
    tl.store(out + 3 * plane, z_label, mask=row_ok)
    tl.store(out + 4 * plane, mr, mask=row_ok)
    tl.store(out + 5 * plane, sr, mask=row_ok)
    tl.store(out + 6 * plane, zr_label, mask=row_ok)
    tl.store(out + 7 * plane, b, mask=row_ok)


@on_its_device
def _score_triton(hidden, weight, labels, ref_hidden, ref_weight, scale, cfg: TileConfig):
    """One launch over both heads, with linear_logprob_entropy's tiles and splits for `cfg` (so the actor's numbers
    and the reference's logprob are its, bit for bit under the interpreter); the splits merged as it merges them."""
    N, H = hidden.shape
    V, RH = weight.shape[0], ref_hidden.shape[1]
    splits, vocab_per_split = vocab_splits(cfg, hidden.device, N, V)
    stats = torch.empty(8, splits, N, device=hidden.device, dtype=torch.float32)
    _score_fwd_kernel[(splits, cdiv(N, cfg.block_n))](
        hidden, weight, ref_hidden, ref_weight, labels, stats,
        N, V, H, RH, vocab_per_split,
        *_strides(hidden, weight, ref_hidden, ref_weight),
        scale,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, DOT_PRECISION=dot_precision(hidden.dtype),
        UPCAST=upcast_dot(_score_fwd_kernel, hidden.dtype),
        num_warps=cfg.num_warps, num_stages=_stages(cfg, hidden, ref_hidden),
    )
    m, s, a = merge_stats(stats[0], stats[1], stats[2])
    _, _, mr, sr, b = merge_kl_stats(stats[0], stats[1], stats[4], stats[5], stats[7])
    log_s, log_sr = torch.log(s), torch.log(sr)
    logprob = (stats[3].sum(0) - m) - log_s  # a label's logit lives in exactly one split
    entropy = log_s - a / s
    ref_logprob = (stats[6].sum(0) - mr) - log_sr
    return logprob, entropy, ref_logprob, b / s - log_s + log_sr, torch.stack([m, log_s, mr, log_sr])


def _score_torch(hidden, weight, labels, ref_hidden, ref_weight, scale, cfg: TileConfig):
    """The chunk loop of logprob_entropy._forward_torch run on both models at once, with this module's KL
    statistics folded in. Its chunks (logprob_entropy's, not linear_kl's narrower ones) and its operations on the
    actor's logits are that function's, op for op, so logprob and entropy come out bit for bit as
    linear_logprob_entropy gives them, and ref_logprob as linear_logprob_entropy gives the reference's: the
    first minibatch's ratio of 1 rests on that."""
    N, V = hidden.shape[0], weight.shape[0]
    dt = accum_dtype(hidden.dtype)
    logprob, entropy, ref_logprob, kl = (torch.empty(N, device=hidden.device, dtype=dt) for _ in range(4))
    norm = torch.empty(4, N, device=hidden.device, dtype=dt)  # m, log s, mr, log sr: what the backward needs
    R, C = chunk_shape(cfg, N, V, n_models=1)
    zbuf, zrbuf, ebuf = (torch.empty(aligned_rows(R) * C, device=hidden.device, dtype=dt) for _ in range(3))
    for r0 in range(0, N, R):
        r1 = min(r0 + R, N)
        n, n_pad = r1 - r0, aligned_rows(r1 - r0)
        h_op, rh_op = pad_rows(gemm_operand(hidden[r0:r1]), n_pad), pad_rows(gemm_operand(ref_hidden[r0:r1]), n_pad)
        y = labels[r0:r1]
        z_label, zr_label = (torch.zeros(n, device=hidden.device, dtype=dt) for _ in range(2))
        for v0 in range(0, V, C):
            v1 = min(v0 + C, V)
            z = chunk_logits(chunk_view(zbuf, n_pad, v1 - v0), h_op, gemm_operand(weight[v0:v1]), scale)[:n]
            zr = chunk_logits(chunk_view(zrbuf, n_pad, v1 - v0), rh_op, gemm_operand(ref_weight[v0:v1]), scale)[:n]
            mc, picked = shift_and_pick(z, y, v0, v1)
            z_label += picked
            mrc, picked = shift_and_pick(zr, y, v0, v1)
            zr_label += picked
            src = torch.exp(zr, out=chunk_view(ebuf, n, v1 - v0)).sum(1)
            e = torch.exp(z, out=chunk_view(ebuf, n, v1 - v0))
            sc = e.sum(1)
            bc = zr.neg_().add_(z).mul_(e).sum(1)  # sum exp(z - m) ((z - m) - (zr - mr)), in place over zr
            ac = e.mul_(z).sum(1)  # sum exp(z - m)(z - m)
            if v0 == 0:
                m, s, a, mr, sr, b = mc, sc, ac, mrc, src, bc
            else:  # fold this chunk into the running statistics: the actor's as logprob_entropy does, then the KL's
                pairs = [torch.stack(p) for p in ((m, mc), (s, sc), (a, ac), (mr, mrc), (sr, src), (b, bc))]
                (m, s, a), (_, _, mr, sr, b) = merge_stats(*pairs[:3]), merge_kl_stats(*pairs[:2], *pairs[3:])
        log_s, log_sr = torch.log(s), torch.log(sr)
        logprob[r0:r1] = (z_label - m) - log_s
        entropy[r0:r1] = log_s - a / s
        ref_logprob[r0:r1] = (zr_label - mr) - log_sr
        kl[r0:r1] = b / s - log_s + log_sr
        norm[:, r0:r1] = torch.stack([m, log_s, mr, log_sr])
    return logprob, entropy, ref_logprob, kl, norm


@triton.jit
def _score_bwd_kernel(
    h_ptr, w_ptr, rh_ptr, rw_ptr, label_ptr, norm_ptr, ent_ptr, kl_ptr, g_lp_ptr, g_ent_ptr, g_kl_ptr, dz_ptr,
    N, H, RH, v_start, v_stop,
    stride_hn, stride_hh, stride_wv, stride_wh,
    stride_rhn, stride_rhh, stride_rwv, stride_rwh, stride_dzn,
    scale,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dz[:, v_start:v_stop] / T of g_lp logprob + g_ent entropy + g_kl kl for one vocab chunk: both models'
    logits recomputed (in the forward's tiles), then _logprob_entropy_bwd_kernel's dz plus _kl_bwd_kernel's."""
    pid_v = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = v_start + pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < v_stop
    zr = logits_tile(rh_ptr, rw_ptr, rows, cols, row_ok, col_ok, RH,
                     stride_rhn, stride_rhh, stride_rwv, stride_rwh,
                     BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, UPCAST) * scale
    mr = tl.load(norm_ptr + (2 * N + rows), mask=row_ok, other=0.0)
    log_sr = tl.load(norm_ptr + (3 * N + rows), mask=row_ok, other=0.0)
    logq = tl.where(col_ok[None, :], (zr - mr[:, None]) - log_sr[:, None], 0.0)
    z = logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H,
                    stride_hn, stride_hh, stride_wv, stride_wh,
                    BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, UPCAST) * scale
    m = tl.load(norm_ptr + rows, mask=row_ok, other=0.0)
    log_s = tl.load(norm_ptr + (N + rows), mask=row_ok, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
    kl = tl.load(kl_ptr + rows, mask=row_ok, other=0.0)
    labels = tl.load(label_ptr + rows, mask=row_ok, other=-1)
    g_lp = tl.load(g_lp_ptr + rows, mask=row_ok, other=0.0)  # per-token vectors, not scalars
    g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
    g_kl = tl.load(g_kl_ptr + rows, mask=row_ok, other=0.0)

    # padded columns: log p = log q = 0 and p = 0, so dz = 0 there; log p = (z - m) - log s, see logprob_entropy.py
    logp = tl.where(col_ok[None, :], (z - m[:, None]) - log_s[:, None], 0.0)
    p = tl.where(col_ok[None, :], tl.exp(logp), 0.0)
    onehot = cols[None, :] == labels[:, None]
    dz = tl.where(onehot, g_lp[:, None], 0.0) + p * (g_kl[:, None] * ((logp - logq) - kl[:, None])
                                                      - g_lp[:, None] - g_ent[:, None] * (logp + ent[:, None]))
    dz = dz * scale  # fp32 until the store
    out = dz_ptr + rows[:, None] * stride_dzn + (cols - v_start)[None, :]
    tl.store(out, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@on_its_device
def _score_backward_triton(hidden, weight, labels, ref_hidden, ref_weight, norm, entropy, kl, g_lp, g_ent, g_kl,
                           scale, need_dh, need_dw, cfg):
    N, H = hidden.shape
    BN, BV = cfg.block_n, cfg.block_v

    def launch_dz(dz, v0, v1):
        _score_bwd_kernel[(cdiv(v1 - v0, BV), cdiv(N, BN))](
            hidden, weight, ref_hidden, ref_weight, labels, norm, entropy, kl, g_lp, g_ent, g_kl, dz,
            N, H, ref_hidden.shape[1], v0, v1,
            *_strides(hidden, weight, ref_hidden, ref_weight), dz.stride(0),
            scale,
            BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=cfg.block_h, DOT_PRECISION=dot_precision(hidden.dtype),
            UPCAST=upcast_dot(_score_bwd_kernel, hidden.dtype),
            num_warps=cfg.num_warps, num_stages=_stages(cfg, hidden, ref_hidden),
        )

    vc = vocab_chunk(cfg, N, weight.shape[0], cfg.gpu_chunk_elems, BV)
    return triton_backward(hidden, weight, need_dh, need_dw, vc, launch_dz)


def _score_backward_torch(hidden, weight, labels, ref_hidden, ref_weight, norm, entropy, kl, g_lp, g_ent, g_kl,
                          scale, need_dh, need_dw, cfg):
    """logprob_entropy._backward_torch and this module's _backward_torch in one chunk loop: each chunk of both
    models' logits is recomputed once and gives one dz for the logprob, entropy and KL losses."""
    N, V = hidden.shape[0], weight.shape[0]
    dt = norm.dtype
    # with e = exp(z - m) = s p, zs = z - m and d = zs - (zr - mr) (see both backwards), 1/T folded in:
    #   dz = g_lp onehot / T + e (zs A + B + (d - c) Ak)
    #   A = -g_ent / (s T),  B = -(g_lp + g_ent (H - log s)) / (s T),  Ak = g_kl / (s T),  c = log s - log sr + kl
    m, log_s, mr, log_sr = norm
    inv_sT = torch.exp(-log_s) * scale
    A, Ak = -g_ent * inv_sT, g_kl * inv_sT
    B = -(g_lp + g_ent * (entropy - log_s)) * inv_sT
    c = log_s - log_sr + kl
    R, C = chunk_shape(cfg, N, V, n_models=1)  # the forward's chunks
    zbuf, zrbuf = (torch.empty(aligned_rows(R) * C, device=hidden.device, dtype=dt) for _ in range(2))

    def chunk_dz(r0, r1, v0, v1, h_op, w_op, rh_op, dz):
        n, n_pad = r1 - r0, h_op.shape[0]
        zs = chunk_logits(chunk_view(zbuf, n_pad, v1 - v0), h_op, w_op, scale)[:n].sub_(m[r0:r1, None])
        zr = chunk_logits(chunk_view(zrbuf, n_pad, v1 - v0), rh_op, gemm_operand(ref_weight[v0:v1]), scale)[:n]
        e = torch.exp(zs, out=dz)
        # where e = 0 (z - m < -1e3, see logprob_entropy._backward_torch) zs and d are set to values that keep
        # zs A and d Ak finite: at a tiny T (A, Ak ~ 1/T) they overflowed to inf there, and 0 * inf made dz NaN
        zs.clamp_(min=-1e3)
        d = zr.sub_(mr[r0:r1, None]).neg_().add_(zs).masked_fill_(zs == -1e3, 0.0)  # in place over zr
        e.mul_(zs.mul_(A[r0:r1, None]).add_(B[r0:r1, None]).add_(d.sub_(c[r0:r1, None]).mul_(Ak[r0:r1, None])))
        add_label_term(dz, labels[r0:r1], v0, v1, g_lp[r0:r1] * scale)

    return torch_backward(hidden, weight, need_dh, need_dw, R, C, dt, chunk_dz, ref_hidden)


class LinearLogprobEntropyKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ref_hidden, ref_weight, temperature, backend, cfg):
        scale = 1.0 / temperature
        one_pass = _score_triton if backend == "triton" else _score_torch
        logprob, entropy, ref_logprob, kl, norm = one_pass(hidden, weight, labels, ref_hidden, ref_weight, scale, cfg)
        ctx.save_for_backward(hidden, weight, labels, ref_hidden, ref_weight, norm, entropy, kl)
        ctx.scale, ctx.backend, ctx.cfg = scale, backend, cfg
        ctx.mark_non_differentiable(ref_logprob)  # the reference is frozen
        ctx.set_materialize_grads(False)
        return logprob, entropy, ref_logprob, kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent, _, g_kl):
        hidden, weight, labels, ref_hidden, ref_weight, norm, entropy, kl = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None and g_kl is None) or not (need_dh or need_dw):
            return (None,) * 8
        g_lp, g_ent, g_kl = (prepare_grad(g, hidden.shape[0], hidden.device, kl.dtype) for g in (g_lp, g_ent, g_kl))
        bwd = _score_backward_triton if ctx.backend == "triton" else _score_backward_torch
        dh, dw = bwd(hidden, weight, labels, ref_hidden, ref_weight, norm, entropy, kl, g_lp, g_ent, g_kl, ctx.scale,
                     need_dh, need_dw, ctx.cfg)
        return dh, dw, None, None, None, None, None, None


def linear_logprob_entropy_kl(hidden, weight, labels, ref_hidden, ref_weight, temperature=1.0, backend="auto",
                              config=None):
    """The four per-token numbers of scoring, and of training with the KL loss: (logprob, entropy, ref_logprob, kl),
    each (N,), the first two as linear_logprob_entropy(hidden, weight, labels) gives them, ref_logprob as it gives
    the reference's, kl as linear_kl; logprob, entropy and kl differentiable w.r.t. hidden and weight, the reference
    frozen. Both backends compute each model's logits once in the forward (2 head products a token instead of the
    4 of the three calls: linear_kl recomputes both models' logits) and once more in the backward, which gives one
    dz for all three losses (4 products instead of 7): the torch path in linear_logprob_entropy's chunks, the
    Triton path in kernels with its tiles and splits, so that the first three come out as linear_logprob_entropy
    gives them with the same config and backend (bit for bit on the torch path and under the Triton interpreter;
    test_cuda_kernels_match_float64 checks a GPU). Models of different dtypes make the three calls; the two models
    must share a device."""
    where = "linear_logprob_entropy_kl"
    check_linear(where, "hidden", hidden, "weight", weight)
    check_linear(where, "ref_hidden", ref_hidden, "ref_weight", ref_weight)
    if ref_hidden.shape[0] != hidden.shape[0] or ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"{where}: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} against "
                         f"ref_hidden {tuple(ref_hidden.shape)} and ref_weight {tuple(ref_weight.shape)}: the rows "
                         "and the vocabulary must agree")
    if ref_hidden.device != hidden.device:
        raise ValueError(f"{where}: hidden is on {hidden.device} and ref_hidden on {ref_hidden.device}: the two "
                         "models' hidden states and heads must be on one device")
    if torch.is_grad_enabled() and (ref_hidden.requires_grad or ref_weight.requires_grad):
        raise ValueError(f"{where}: the reference is frozen and gets no gradient, but ref_hidden or ref_weight "
                         "requires grad; compute it under torch.no_grad() or pass .detach()")
    temperature = check_temperature(where, temperature)
    cfg = config if config is not None else default_config(hidden.dtype)
    check_config(cfg, where)
    N = hidden.shape[0]
    check_label_vector(where, labels, hidden, weight.shape[0])
    backend = resolve_backend(where, backend, hidden.device, (hidden.dtype, ref_hidden.dtype), _score_fwd_kernel)
    if hidden.dtype != ref_hidden.dtype or N == 0:
        logprob, entropy = linear_logprob_entropy(hidden, weight, labels, temperature, backend, cfg)
        with torch.no_grad():
            ref_logprob, _ = linear_logprob_entropy(ref_hidden, ref_weight, labels, temperature, backend, config)
        return logprob, entropy, ref_logprob, linear_kl(hidden, weight, ref_hidden, ref_weight, temperature, backend,
                                                        config)
    return LinearLogprobEntropyKL.apply(hidden, weight, labels.long().contiguous(), ref_hidden, ref_weight,
                                        temperature, backend, cfg)

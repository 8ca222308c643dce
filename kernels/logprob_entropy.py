"""Fused LM-head log-probability and entropy: per token, log p(label) and H(p), never storing the logits.

For hidden states h (N, H), LM head W (V, H), sampled tokens y (N,) and temperature T:

    z = h W^T / T                                   (N, V), the logits: never materialised
    lse_i = log sum_v exp(z_iv)
    logprob_i = z_{i, y_i} - lse_i
    entropy_i = -sum_v p_iv log p_iv = lse_i - sum_v p_iv z_iv,      p = softmax(z)

Why fuse: PPO needs these for every response token at every step. Materialised, z is N * V * 4 bytes
in float32: 8-10 GB at N = 16k tokens and a 128k-152k vocabulary (plus as much again for log_softmax
and its gradient). Here z is produced one (rows, vocab) tile at a time and reduced on the fly with the
online-softmax recurrence (Milakov & Gimelshein 2018). Over the tiles of a row we keep the running max m,
s = sum exp(z - m) and a = sum exp(z - m) (z - m); when the max moves from m to m',

    s' = exp(m - m') s,      a' = exp(m - m') (a + (m - m') s)

and at the end lse = m + log s, entropy = log s - a / s. Shifting by the running max keeps every term
bounded (no catastrophic cancellation of lse - E[z] when logits are ~1e4).

Backward (per-token upstream gradients g_lp, g_ent; derived from p = softmax(z)):

    d logprob_i / dz_iv = 1[v = y_i] - p_iv
    d entropy_i / dz_iv = -p_iv (log p_iv + entropy_i)
    dz = g_lp (onehot - p) - g_ent p (log p + entropy)
    dh = dz W / T,   dW = dz^T h / T

Each row of dz sums to 0 (softmax is shift invariant), so dh = dz (W - 1 c^T) / T for any (H,) vector c. The
backward takes c = utils.shared_row(W), what all rows of W share where taking it away is exact: the rounding
of dz (to bf16 on CUDA) and the GEMM's float32 sums then never meet a logit offset the whole row shares.

The backward recomputes z tile by tile from the saved m, log s and entropy (the flash-attention trade:
one more h W^T instead of N * V stored floats). It forms log p = (z - m) - log s, not z - lse: with
logits ~ 1e4, a float32 lse carries float32's 1e-3 spacing at 1e4, and sum p would drift from 1 by as much.

Triton design (CUDA):
  forward: grid (vocab splits, row blocks). A program owns BLOCK_N rows and one vocab range, loops over
    BLOCK_V tiles computing z with tl.dot (fp32 accumulator, K loop over H), and folds each tile into
    (m, s, a, z_label). The splits' partial statistics are merged in torch (a few (splits, N) vectors).
    Splits vary fastest in the grid, so the programs resident at once share a handful of row blocks of h
    and a handful of W tiles: both stay in L2.
  backward: per vocab chunk of width Vc, a kernel recomputes the (N, Vc) logits with tl.dot and writes
    dz (already scaled by 1/T, rounded once to the GEMM dtype after the fp32 arithmetic); two cuBLAS GEMMs
    then give dW[chunk] = dz^T h (complete, one rounding) and dh += dz (W[chunk] - 1 c^T) (fp32 accumulator).
    Rounding dz to bf16 keeps both GEMMs on the tensor cores; it adds to dh about one more bf16 rounding
    (utils.EMULATE_CUDA runs these casts on a CPU).
    A fully fused backward would need either a (BLOCK_N, H) fp32 accumulator per program (does not fit in
    registers for H = 4096) or fp32 atomics on both dh and dW (N V H (1/BLOCK_N + 1/BLOCK_V) atomic adds);
    handing the two gradient products to cuBLAS keeps 4 of the 6 NHV backward FLOPs at GEMM speed with
    N * Vc extra memory.
Chunked torch path (CPU, or backend="torch"): the same recurrence over (chunk_rows, chunk_vocab) blocks
of float32 logits, and the same recompute-per-chunk backward; weight gradients accumulate in float32.
A row's logprob, entropy and dh do not depend on the other rows of the call, bit for bit (what PPO's
ratio == 1 on the first minibatch needs): the vocab chunks are fixed by the config (utils.chunk_shape)
and every GEMM's row count is padded to a multiple of utils.ROW_ALIGN. The Triton path is row-independent
in the same sense only off CUDA and with fixed splits (utils.num_splits).

Tests: the kernels/ section of test_ppo.py (pytest test_ppo.py); the benchmark: python -m kernels
"""

import torch
import triton
import triton.language as tl

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

# -----------------------------------------------------------------------------
# plain-torch reference: materialises the (N, V) logits


def linear_logprob_entropy_reference(hidden, weight, labels, temperature=1.0):
    """Naive reference: float32 (float64 for float64 inputs) logits, log_softmax, gather, entropy."""
    dt = accum_dtype(hidden.dtype)
    logits = (hidden.to(dt) @ weight.to(dt).T) / temperature  # (N, V)
    logp_all = torch.log_softmax(logits, dim=-1)  # (N, V)
    logprob = logp_all.gather(1, labels.long()[:, None]).squeeze(1)  # (N,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
    return logprob, entropy


# -----------------------------------------------------------------------------
# online-softmax statistics, shared by the Triton split merge and the torch chunk loop


def merge_stats(m, s, a):
    """Merge K partial (max, sum exp(z - max), sum exp(z - max)(z - max)) of the same rows: (K, N) -> (N,)."""
    m_all = m.amax(0)  # (N,)
    w = torch.exp(m - m_all)  # (K, N)
    s_all = (w * s).sum(0)
    a_all = (w * (a + (m - m_all) * s)).sum(0)
    return m_all, s_all, a_all


# -----------------------------------------------------------------------------
# Triton kernels


@triton.jit
def fold_tile(z, cols, col_ok, labels, m, s, a, z_label):
    """Folds a (BLOCK_N, BLOCK_V) tile of logits z (columns cols, valid where col_ok) into its rows' running max m,
    s = sum exp(z - m), a = sum exp(z - m)(z - m) and label logit. Returns the four, and for a caller that takes
    more from the same tile: e = exp(z - m'), zs = z - m' (0 at padded columns) and alpha = exp(m - m').
    Scoring's one pass (kl.py) folds both models' tiles with it: the same operations give the same bits."""
    z = tl.where(col_ok[None, :], z, float("-inf"))  # padded columns are absent, not logit 0
    m_new = tl.maximum(m, tl.max(z, axis=1))
    e = tl.exp(z - m_new[:, None])  # padded: exp(-inf) = 0
    zs = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
    alpha = tl.exp(m - m_new)  # first tile: exp(-inf) = 0
    shift = tl.where(s > 0.0, m - m_new, 0.0)  # first tile: s = 0 and m = -inf, avoid 0 * inf
    a = alpha * (a + shift * s) + tl.sum(e * zs, axis=1)
    s = alpha * s + tl.sum(e, axis=1)
    z_label += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
    return m_new, s, a, z_label, e, zs, alpha


@triton.jit
def _logprob_entropy_fwd_kernel(
    h_ptr, w_ptr, label_ptr, stats_ptr,  # stats: (4, splits, N) fp32 = max, sumexp, a, label logit
    N, V, H, vocab_per_split,
    stride_hn, stride_hh, stride_wv, stride_wh,
    scale,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_s = tl.program_id(0)  # vocab split: fastest-varying, so resident programs share row blocks
    pid_n = tl.program_id(1)
    splits = tl.num_programs(0)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    labels = tl.load(label_ptr + rows, mask=row_ok, other=-1)
    v_start = pid_s * vocab_per_split
    v_end = tl.minimum(v_start + vocab_per_split, V)

    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)  # running max starts at -inf, not 0
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    z_label = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_ok = cols < v_end
        z = logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H,
                        stride_hn, stride_hh, stride_wv, stride_wh,
                        BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, UPCAST) * scale
        m, s, a, z_label, _, _, _ = fold_tile(z, cols, col_ok, labels, m, s, a, z_label)

    out = stats_ptr + pid_s.to(tl.int64) * N + rows
    plane = splits.to(tl.int64) * N
    tl.store(out, m, mask=row_ok)
    tl.store(out + plane, s, mask=row_ok)
    tl.store(out + 2 * plane, a, mask=row_ok)
    tl.store(out + 3 * plane, z_label, mask=row_ok)


@triton.jit
def _logprob_entropy_bwd_kernel(
    h_ptr, w_ptr, label_ptr, max_ptr, logsum_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, dz_ptr,
    N, H, v_start, v_stop,
    stride_hn, stride_hh, stride_wv, stride_wh, stride_dzn,
    scale,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dz[:, v_start:v_stop] / T for one vocab chunk: recompute z, then g_lp (onehot - p) - g_ent p (log p + H)."""
    pid_v = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = v_start + pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < v_stop
    z = logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H,
                    stride_hn, stride_hh, stride_wv, stride_wh,
                    BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, UPCAST) * scale
    labels = tl.load(label_ptr + rows, mask=row_ok, other=-1)
    row_max = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
    log_sum = tl.load(logsum_ptr + rows, mask=row_ok, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(g_lp_ptr + rows, mask=row_ok, other=0.0)  # per-token vectors, not scalars
    g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)

    # log p = (z - m) - log s, see the docstring; padded columns get p = 0 (and stay finite)
    logp = tl.where(col_ok[None, :], (z - row_max[:, None]) - log_sum[:, None], 0.0)
    p = tl.where(col_ok[None, :], tl.exp(logp), 0.0)
    onehot = cols[None, :] == labels[:, None]
    # everything in fp32; the single rounding to the GEMM dtype happens at the store
    dz = tl.where(onehot, g_lp[:, None], 0.0) - p * (g_lp[:, None] + g_ent[:, None] * (logp + ent[:, None]))
    dz = dz * scale
    out = dz_ptr + rows[:, None] * stride_dzn + (cols - v_start)[None, :]
    tl.store(out, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# -----------------------------------------------------------------------------
# Triton launchers


@on_its_device
def _forward_triton(hidden, weight, labels, scale, cfg: TileConfig):
    N, H = hidden.shape
    V = weight.shape[0]
    splits, vocab_per_split = vocab_splits(cfg, hidden.device, N, V)
    stats = torch.empty(4, splits, N, device=hidden.device, dtype=torch.float32)
    _logprob_entropy_fwd_kernel[(splits, cdiv(N, cfg.block_n))](
        hidden, weight, labels, stats,
        N, V, H, vocab_per_split,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        scale,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, DOT_PRECISION=dot_precision(hidden.dtype),
        UPCAST=upcast_dot(_logprob_entropy_fwd_kernel, hidden.dtype),
        num_warps=cfg.num_warps, num_stages=pipeline_stages(cfg, hidden.element_size()),
    )
    m, s, a = merge_stats(stats[0], stats[1], stats[2])
    log_s = torch.log(s)
    logprob = (stats[3].sum(0) - m) - log_s  # the label logit lives in exactly one split
    entropy = log_s - a / s
    return logprob, entropy, m, log_s


@on_its_device
def _backward_triton(hidden, weight, labels, row_max, log_sum, entropy, g_lp, g_ent, scale, need_dh, need_dw, cfg):
    N, H = hidden.shape
    BN, BV = cfg.block_n, cfg.block_v

    def launch_dz(dz, v0, v1):
        _logprob_entropy_bwd_kernel[(cdiv(v1 - v0, BV), cdiv(N, BN))](
            hidden, weight, labels, row_max, log_sum, entropy, g_lp, g_ent, dz,
            N, H, v0, v1,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), dz.stride(0),
            scale,
            BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=cfg.block_h, DOT_PRECISION=dot_precision(hidden.dtype),
            UPCAST=upcast_dot(_logprob_entropy_fwd_kernel, hidden.dtype),
            num_warps=cfg.num_warps, num_stages=pipeline_stages(cfg, hidden.element_size()),
        )

    vc = vocab_chunk(cfg, N, weight.shape[0], cfg.gpu_chunk_elems, BV)
    return triton_backward(hidden, weight, need_dh, need_dw, vc, launch_dz)


# -----------------------------------------------------------------------------
# chunked torch path: same recurrence and recompute over (rows, vocab) chunks of float32 logits, written
# into two preallocated chunk buffers (a fresh 32 MiB tensor per chunk costs as much in page faults as
# the exp over it)


def shift_and_pick(z, labels, v0, v1):
    """For a chunk z (n, C) of logits over vocab columns [v0, v1): subtracts each row's max from z in place and
    returns (max (n,), the label's logit where the label lies in the chunk, else 0 (n,))."""
    mc = z.amax(1)
    z -= mc[:, None]
    inside = (labels >= v0) & (labels < v1)
    picked = z.gather(1, (labels - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1) + mc
    return mc, torch.where(inside, picked, 0.0)


def _forward_torch(hidden, weight, labels, scale, cfg: TileConfig):
    N, V = hidden.shape[0], weight.shape[0]
    dt = accum_dtype(hidden.dtype)
    logprob = torch.empty(N, device=hidden.device, dtype=dt)
    entropy, row_max, log_sum = torch.empty_like(logprob), torch.empty_like(logprob), torch.empty_like(logprob)
    R, C = chunk_shape(cfg, N, V, n_models=1)  # C fixed by the config: a row's merge order is the same for any N
    zbuf, ebuf = (torch.empty(aligned_rows(R) * C, device=hidden.device, dtype=dt) for _ in range(2))
    for r0 in range(0, N, R):
        r1 = min(r0 + R, N)
        n, n_pad = r1 - r0, aligned_rows(r1 - r0)
        h_op, y = pad_rows(gemm_operand(hidden[r0:r1]), n_pad), labels[r0:r1]  # (n_pad, H), see ROW_ALIGN
        z_label = torch.zeros(n, device=hidden.device, dtype=dt)
        for v0 in range(0, V, C):
            v1 = min(v0 + C, V)
            w_op = gemm_operand(weight[v0:v1])
            z = chunk_logits(chunk_view(zbuf, n_pad, v1 - v0), h_op, w_op, scale)[:n]  # (n, C)
            mc, picked = shift_and_pick(z, y, v0, v1)
            z_label += picked
            e = torch.exp(z, out=chunk_view(ebuf, n, v1 - v0))
            sc = e.sum(1)
            ac = e.mul_(z).sum(1)  # sum exp(z - m)(z - m)
            if v0 == 0:
                m, s, a = mc, sc, ac
            else:  # fold this chunk into the running statistics
                m, s, a = merge_stats(torch.stack([m, mc]), torch.stack([s, sc]), torch.stack([a, ac]))
        log_s = torch.log(s)
        row_max[r0:r1], log_sum[r0:r1] = m, log_s
        logprob[r0:r1] = (z_label - m) - log_s
        entropy[r0:r1] = log_s - a / s
    return logprob, entropy, row_max, log_sum


def _backward_torch(hidden, weight, labels, row_max, log_sum, entropy, g_lp, g_ent, scale, need_dh, need_dw, cfg):
    N, V = hidden.shape[0], weight.shape[0]
    dt = accum_dtype(hidden.dtype)
    # with e = exp(z - m) = s p and log p = (z - m) - log s, the gradient (1/T folded in) is
    #   dz = g_lp onehot / T - p (g_lp + g_ent (log p + H)) / T = g_lp onehot / T + e ((z - m) A + B)
    #   A = -g_ent / (s T),  B = -(g_lp + g_ent (H - log s)) / (s T)       (per row, no large m inside)
    inv_sT = torch.exp(-log_sum) * scale
    A = -g_ent * inv_sT
    B = -(g_lp + g_ent * (entropy - log_sum)) * inv_sT
    R, C = chunk_shape(cfg, N, V, n_models=1)  # the forward's chunks
    zbuf = torch.empty(aligned_rows(R) * C, device=hidden.device, dtype=dt)

    def chunk_dz(r0, r1, v0, v1, h_op, w_op, _, dz):
        zs = chunk_logits(chunk_view(zbuf, h_op.shape[0], v1 - v0), h_op, w_op, scale)[: r1 - r0]
        zs.sub_(row_max[r0:r1, None])  # z - m
        # e = 0 wherever z - m < -1e3 (float32 and float64); the clamp changes no product e (zs A + B) but keeps
        # zs A finite there, where at a tiny T (A ~ 1/T) it overflowed to inf and 0 * inf made dz NaN
        torch.exp(zs, out=dz).mul_(zs.clamp_(min=-1e3).mul_(A[r0:r1, None]).add_(B[r0:r1, None]))  # fp32
        add_label_term(dz, labels[r0:r1], v0, v1, g_lp[r0:r1] * scale)

    return torch_backward(hidden, weight, need_dh, need_dw, R, C, dt, chunk_dz)


# -----------------------------------------------------------------------------
# autograd


class LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, backend, cfg):
        scale = 1.0 / temperature
        fwd = _forward_triton if backend == "triton" else _forward_torch
        logprob, entropy, row_max, log_sum = fwd(hidden, weight, labels, scale, cfg)
        ctx.save_for_backward(hidden, weight, labels, row_max, log_sum, entropy)
        ctx.scale, ctx.backend, ctx.cfg = scale, backend, cfg
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels, row_max, log_sum, entropy = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (need_dh or need_dw):
            return None, None, None, None, None, None
        N = hidden.shape[0]
        g_lp = prepare_grad(g_lp, N, hidden.device, entropy.dtype)
        g_ent = prepare_grad(g_ent, N, hidden.device, entropy.dtype)
        bwd = _backward_triton if ctx.backend == "triton" else _backward_torch
        dh, dw = bwd(hidden, weight, labels, row_max, log_sum, entropy, g_lp, g_ent, ctx.scale, need_dh, need_dw,
                     ctx.cfg)
        return dh, dw, None, None, None, None


def linear_logprob_entropy(hidden, weight, labels, temperature=1.0, backend="auto", config=None):
    """log p(labels) and entropy of softmax(hidden @ weight.T / temperature), without the (N, V) logits.

    hidden (N, H), weight (V, H), labels (N,) int. Returns (logprob (N,), entropy (N,)) in float32
    (float64 for float64 inputs on the torch path), both differentiable w.r.t. hidden and weight.
    backend: "auto" (Triton on CUDA, chunked torch elsewhere), "triton", or "torch".
    config: a TileConfig (tile and chunk sizes); None for the defaults.
    """
    where = "linear_logprob_entropy"
    check_linear(where, "hidden", hidden, "weight", weight)
    temperature = check_temperature(where, temperature)
    cfg = config if config is not None else default_config(hidden.dtype)
    check_config(cfg, where)
    N, V = hidden.shape[0], weight.shape[0]
    check_label_vector(where, labels, hidden, V)
    backend = resolve_backend(where, backend, hidden.device, (hidden.dtype,), _logprob_entropy_fwd_kernel)
    if N == 0:
        dt = accum_dtype(hidden.dtype) if backend == "torch" else torch.float32
        zero = (hidden.sum() + weight.sum()).to(dt) * 0  # keeps the graph connected
        return zero.expand(0), zero.expand(0)
    labels = labels.long().contiguous()
    return LinearLogprobEntropy.apply(hidden, weight, labels, temperature, backend, cfg)

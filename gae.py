"""
Per-token rewards, GAE, the other advantage estimators (GRPO, RLOO, REINFORCE++), masked statistics, the KL
coefficient controllers and the running score normaliser.

Everything here works on (B, T) tensors over the RESPONSE positions only
(T = response length), with `mask` (B, T) marking the real response tokens: a run
of ones starting at column 0 (the EOS token included, padding after it excluded).
Slots outside the mask may hold anything, NaN and inf included: they are always
dropped with torch.where, never multiplied by the mask (NaN * 0 = NaN), and every
output is exactly zero there.

KL estimators, d_t = logp_t - ref_logp_t (Schulman, "Approximating KL divergence"):
    k1 = d                      unbiased, can be negative
    k2 = d^2 / 2                biased, >= 0
    k3 = exp(-d) - 1 + d        unbiased, >= 0
    exact = sum_v pi(v) (log pi(v) - log ref(v))   over the whole vocabulary (kernels/kl.py)
  They live in one table, KL_ESTIMATORS, where a fork adds its own.

Per-token reward (Ziegler et al. 2019; Stiennon et al. 2020):
    r_t = -beta * kl_t                          for every response token
    r_t += score                                at the LAST response token only:
                                                the EOS token when the row ended,
                                                else the last generated token
  The score is clipped to [-score_clip, score_clip] when asked, then a length penalty is added
  (DAPO's soft overlong punishment, Yu et al. 2025: 0 up to max_len - buffer tokens, falling
  linearly to -factor at max_len); a row that never reached EOS gets the fixed
  `non_stop_penalty` as its score when that is set.
  Some libraries put the score on the first pad after EOS instead; we don't.

GAE (Schulman et al. 2016), with V_{t+1} = 0 after the last response token:
    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}   (= sum_l (gamma*lam)^l delta_{t+l})
    R_t     = A_t + V_t                          (the value target)

Whitening uses the statistics of ALL masked entries on ALL ranks (when
torch.distributed is initialised): one all_reduce for count and sum, then a second
for the sum of squared deviations about the global mean (two-pass, float64
accumulators), so 1 process and N processes holding the same rows agree.
The variance is the unbiased one (divides by n - 1), as in TRL's masked_whiten.

Importance weights for the sampler-trainer mismatch (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"). The tokens come from the sampler (the cached decode, maybe one update stale
with --async_rollout), PPO credits them to pi_old (the training forward: old_logp). Per response token
    r_t = exp(old_logp_t - sampler_logp_t)
and a detached weight w_t multiplies the token's policy-gradient term, one function per mode in IS_CORRECTIONS:
    tis       w = min(r, C)                                       truncated IS, C = 2 (verl, slime, SkyRL)
    icepop    w = r if lo <= r <= hi else 0                       Ring-1T's IcePop, [0.5, 5]
    seq_mask  w = min(r, C), and 0 on the whole response when the geometric mean of its r,
              exp(mean_t log r_t), leaves [lo, hi] (default [0.99, 1.01], SkyRL's geometric band)
    none      w = 1
Where w is 0 the token still counts in the loss's denominator (ppo.py: a token mean over all of the
minibatch's response tokens): see is_weights.

Loss aggregation (--loss_agg, LOSS_AGGREGATIONS), the actor's terms x_bt over a minibatch of N rows on all ranks:
    token_mean                 sum_bt x_bt / (response tokens)                 the default (DAPO)
    seq_mean_token_mean        sum_b (sum_t x_bt / len_b) / N                  GRPO's
    seq_mean_token_sum_norm    sum_bt x_bt / (N x max_new_tokens)              Dr. GRPO's
  The value loss stays a token mean.

Adaptive KL (Ziegler et al. 2019, section 2.2):
    beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon)

Self-check (GAE vs. the brute-force sum, and timings):
    python gae.py
"""

import functools
import math
import time

import torch
import torch.distributed as dist

# |d| under which k3 uses its Taylor series, per compute dtype (see kl_estimate)
K3_SERIES_BELOW = {torch.float32: 0.1, torch.float64: 0.01}

# -----------------------------------------------------------------------------
# small helpers


def _float_dtype(*tensors):
    # compute in at least float32 (bf16 logprobs/values would lose the small terms)
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _shapes(x):
    """What a function returned, by its tensors' shapes: a tensor's shape, a tuple's of each item, else the type."""
    if torch.is_tensor(x):
        return tuple(x.shape)
    return tuple(_shapes(i) for i in x) if isinstance(x, tuple) else None if x is None else type(x).__name__


def _check_returned(what, out, want, needs):
    """out, as `what` (a function of one of the tables below, a fork's say) returned it, against `want` (its shapes,
    as _shapes gives them); refused naming the function. A (B,) or 0-dim tensor where (B, T) is due broadcasts
    against the mask, silently where B == T (each row's value spread down a column), so it is not let through."""
    if _shapes(out) != want:
        raise ValueError(f"{what} returned {_shapes(out)}, expected {want}: {needs}")
    return out


def _check_mask(mask, shape, name="mask"):
    """Return `mask` as bool after checking shape and 0/1 values."""
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    if mask.dtype != torch.bool:
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError(f"{name} must hold only 0 and 1 (or be bool)")
        mask = mask.bool()
    return mask


def _response_lengths(mask, name="mask"):
    """(B, T) bool prefix mask -> (B,) number of response tokens; rejects masks with holes."""
    if mask.dim() != 2:
        raise ValueError(f"{name} must be (B, T), got shape {tuple(mask.shape)}")
    lengths = mask.sum(dim=1)  # (B,)
    prefix = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]  # (B, T)
    if not torch.equal(prefix, mask):
        bad = (prefix != mask).any(dim=1).nonzero()[0].item()
        raise ValueError(f"{name} row {bad} is not a run of ones starting at column 0: "
                         f"{mask[bad].int().tolist()}")
    return lengths


def _distributed():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce_sum(t):
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


# -----------------------------------------------------------------------------
# KL estimators and per-token rewards


def _k3(logp, ref_logp, kl_exact):
    # exp(-d) - 1 + d written as expm1(-d) + d; for small |d| that sum cancels (relative error
    # ~ 2 eps / |d|), so below K3_SERIES_BELOW (0.1 in float32, 0.01 in float64) its Taylor series
    # d^2/2 - d^3/6 + ... - d^7/5040 is used (truncation ~ d^6 / 20160 relative: 5e-11 at 0.1)
    d = logp - ref_logp
    series = d.square() * (1 / 2 + d * (-1 / 6 + d * (1 / 24 + d * (-1 / 120 + d * (
        1 / 720 - d / 5040)))))
    return torch.where(d.abs() < K3_SERIES_BELOW[d.dtype], series, torch.expm1(-d) + d)


def _exact(logp, ref_logp, kl_exact):
    if kl_exact is None:
        raise ValueError("the 'exact' KL estimator needs kl_exact, the per-token KL over the vocabulary")
    return kl_exact


# The one table of per-token KL(pi || ref) estimators: name -> f(logp, ref_logp, kl_exact), each (B, T).
# ppo.py validates --kl_estimator against it and logs every entry; a new estimator is one line here.
KL_ESTIMATORS = {
    "k1": lambda logp, ref_logp, kl_exact: logp - ref_logp,
    "k2": lambda logp, ref_logp, kl_exact: 0.5 * (logp - ref_logp).square(),
    "k3": _k3,
    "exact": _exact,  # sum over the whole vocabulary (kernels/kl.py), not a sampled estimate
}


def kl_estimate(logp, ref_logp, kind="k1", kl_exact=None):
    """Per-token KL(pi || ref) from KL_ESTIMATORS, computed in at least float32; same shape as the inputs."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}, expected one of {list(KL_ESTIMATORS)}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ in shape")
    dtype = _float_dtype(logp, ref_logp)
    if kl_exact is not None:
        if kl_exact.shape != logp.shape:  # (B, 1) would broadcast, one token's KL on the whole row
            raise ValueError(f"kl_exact {tuple(kl_exact.shape)} and logp {tuple(logp.shape)} differ in shape")
        kl_exact = kl_exact.to(dtype)
    return _check_returned(f"KL estimator {kind!r}", KL_ESTIMATORS[kind](logp.to(dtype), ref_logp.to(dtype), kl_exact),
                           tuple(logp.shape), "one KL a token, (B, T) as logp")


def overlong_penalty(lengths, max_len, buffer, factor=1.0):
    """(B,) float32 DAPO's soft overlong punishment for responses of `lengths` tokens that could run to `max_len`:
    0 up to max_len - buffer tokens, then falling linearly to -factor at max_len (and below it past max_len, where a
    fork's longer responses would go). buffer 0: no penalty (zeros)."""
    if not 0 <= buffer <= max_len:
        raise ValueError(f"the overlong buffer must be in [0, max_len {max_len}], got {buffer}")
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    if buffer == 0:
        return torch.zeros_like(lengths)
    return -factor * (lengths - (max_len - buffer)).clamp(min=0) / buffer


def final_score(score, ended=None, score_clip=None, non_stop_penalty=None, length_penalty=None):
    """(B,) the score that goes into the reward: the model's score clipped to [-score_clip, score_clip]
    when asked, plus `length_penalty` (B,) when given (overlong_penalty), replaced by `non_stop_penalty` for rows
    that never reached EOS when that is set. A fork that builds its own advantages (group-relative, say) takes this,
    not the raw score."""
    B = score.shape[0]
    if score_clip is not None and score_clip <= 0:
        raise ValueError(f"score_clip must be > 0, got {score_clip}")
    seq_score = score.to(_float_dtype(score))
    if score_clip is not None:
        seq_score = seq_score.clamp(-score_clip, score_clip)
    if length_penalty is not None:
        if tuple(length_penalty.shape) != (B,):
            raise ValueError(f"length_penalty has shape {tuple(length_penalty.shape)}, expected ({B},)")
        seq_score = seq_score + length_penalty.to(seq_score)
    if non_stop_penalty is not None:
        if ended is None:
            raise ValueError("non_stop_penalty needs `ended` (B,) bool: which rows reached EOS")
        if tuple(ended.shape) != (B,):
            raise ValueError(f"ended has shape {tuple(ended.shape)}, expected ({B},)")
        seq_score = torch.where(ended.to(device=score.device, dtype=torch.bool), seq_score, float(non_stop_penalty))
    return seq_score


def shape_rewards(score, logp, ref_logp, mask, kl_coef, kl_estimator="k1",
                  use_absolute_kl=False, score_clip=None, ended=None, non_stop_penalty=None, kl_exact=None):
    """KL-shaped per-token rewards.

    score (B,) sequence score; logp, ref_logp, mask (B, T) over response positions;
    ended (B,) bool, True where the row reached EOS (needed for non_stop_penalty);
    kl_exact (B, T), needed only by the "exact" estimator.
    Returns (rewards, kl), both (B, T) and zero outside the mask; kl is the per-token
    estimate that went into the reward (abs'd when use_absolute_kl), for logging.
    A row with no response token has nowhere to put its score: it gets none.
    score_clip and non_stop_penalty go through final_score (the penalty replaces the clipped score);
    ppo.py calls final_score itself, so that the score it used is in hand, and passes neither.
    """
    B, T = logp.shape
    mask = _check_mask(mask, (B, T))
    if tuple(score.shape) != (B,):
        raise ValueError(f"score has shape {tuple(score.shape)}, expected ({B},)")
    seq_score = final_score(score, ended, score_clip, non_stop_penalty)  # (B,)
    kl = kl_estimate(logp, ref_logp, kl_estimator, kl_exact)  # (B, T)
    if use_absolute_kl:
        kl = kl.abs()
    kl = torch.where(mask, kl, 0.0)
    dtype = _float_dtype(kl, seq_score)

    rewards = torch.where(mask, -kl_coef * kl.to(dtype), 0.0)
    return rewards + score_on_last_token(seq_score.to(dtype), mask), kl


def score_on_last_token(score, mask):
    """(B,) sequence scores -> (B, T): each row's score on its last response token (column length - 1; none for a
    row without response tokens), 0 elsewhere."""
    lengths = _response_lengths(mask)  # (B,)
    is_last = torch.arange(mask.size(1), device=mask.device) == (lengths - 1)[:, None]  # (B, T)
    return torch.where(is_last, score[:, None], 0.0)


# -----------------------------------------------------------------------------
# importance weights for the sampler-trainer mismatch: one function per mode, chosen by --is_correction
# Each takes log_r (B, T) = old_logp - sampler_logp (0 off the mask), the mask, and the Config (its is_* settings,
# or a field of a fork's own), and returns (w, cut): the weights and the tokens it truncated or zeroed, (B, T) each;
# is_weights cleans them off the mask.


def _tis(log_r, mask, cfg):
    r = log_r.exp()
    return r.clamp(max=cfg.is_cap), r > cfg.is_cap


def _icepop(log_r, mask, cfg):
    r, (lo, hi) = log_r.exp(), cfg.is_band
    keep = (r >= lo) & (r <= hi)
    return torch.where(keep, r, 0.0), ~keep


def _seq_mask(log_r, mask, cfg):
    w, cut = _tis(log_r, mask, cfg)
    geo = (log_r.sum(-1) / mask.sum(-1).clamp(min=1)).exp()  # (B,) geometric mean of r over each response
    lo, hi = cfg.is_seq_band
    keep = ((geo >= lo) & (geo <= hi))[:, None]  # (B, 1)
    return torch.where(keep, w, 0.0), cut | ~keep


IS_CORRECTIONS = {
    "tis": _tis,
    "icepop": _icepop,
    "seq_mask": _seq_mask,
    "none": lambda log_r, mask, cfg: (torch.ones_like(log_r), torch.zeros_like(mask)),
}
# the is_* Config fields each mode reads
IS_SETTINGS = {"tis": ("is_cap",), "icepop": ("is_band",), "seq_mask": ("is_cap", "is_seq_band"), "none": ()}


def is_settings_unread(mode):
    """The is_* Config fields mode does not read (ppo.derive refuses them set, as doing nothing); a fork's mode
    missing from IS_SETTINGS may read any."""
    every = ("is_cap", "is_band", "is_seq_band")
    return [k for k in every if k not in IS_SETTINGS.get(mode, every)]


def is_weights(old_logp, sampler_logp, mask, cfg):
    """-> (w, cut), (B, T) each: the detached weight on each response token's policy-gradient term
    (IS_CORRECTIONS[cfg.is_correction] of r = exp(old_logp - sampler_logp)), and the tokens whose weight was
    truncated or zeroed (val/is_clipfrac); w is 0 and cut False off the mask, whatever the inputs hold there (NaN
    included). cfg: the run's Config (is_correction, is_cap, is_band, is_seq_band), or anything with those fields.

    A zeroed token (icepop outside its band, seq_mask's dropped responses) stays in the loss's denominator:
    the loss is sum_t w_t pg_t / (response tokens of the minibatch), the importance-sampling estimate of the
    per-token mean under pi_old from tokens drawn by the sampler, where rejecting a token means counting it
    with weight 0. Dividing by the surviving tokens instead (self-normalising) would scale the rest up by the
    fraction rejected: a minibatch with most of its tokens out of band, the one least like pi_old, would
    take a full-sized step on its few survivors. It also keeps the denominator what it is without the
    correction: known from the mask before any forward, and the same on any number of ranks or micro-batches."""
    mode = cfg.is_correction
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"unknown importance-weight mode {mode!r}, expected one of {list(IS_CORRECTIONS)}")
    if old_logp.shape != sampler_logp.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)} and sampler_logp {tuple(sampler_logp.shape)} "
                         "differ in shape")
    mask = _check_mask(mask, old_logp.shape)
    dtype = _float_dtype(old_logp, sampler_logp)
    log_r = torch.where(mask, old_logp.detach().to(dtype) - sampler_logp.detach().to(dtype), 0.0)  # (B, T)
    w, cut = _check_returned(f"importance-weight mode {mode!r}", IS_CORRECTIONS[mode](log_r, mask, cfg),
                             (tuple(mask.shape),) * 2, "(w, cut), a weight and a bool a token, (B, T) each as the mask")
    cut = _check_mask(cut, mask.shape, f"the cut of importance-weight mode {mode!r}")  # a float 0/1 mask too
    return torch.where(mask, w, 0.0), cut & mask


# -----------------------------------------------------------------------------
# how the actor's per-token loss terms aggregate over a minibatch: one function per mode, chosen by --loss_agg
# Each takes the response lengths (B,) of a micro-batch's rows (EOS included) and the Config, and returns each row's
# weight on the sum of its tokens' terms, (B, 1) float32; the token mean has no function (None): ppo_losses computes
# it as it always has (the sum over the micro-batch divided by the minibatch's response tokens on all ranks). A row's
# weight needs nothing but its own length and the minibatch's row count (cfg.mini_batch_size, over all ranks), so
# every mode, like the token mean, gives the same loss and gradient however a minibatch is split into micro-batches
# or across ranks. A response whose terms are left out (--mask_truncated, seq_mask) still counts as a row.


def _seq_mean_token_mean(lengths, cfg):  # GRPO's: each response's token mean, averaged over the responses
    return (1.0 / (lengths.clamp(min=1).float() * cfg.mini_batch_size))[:, None]


def _seq_mean_token_sum_norm(lengths, cfg):  # Dr. GRPO's: the token sum over a constant, rows x max_new_tokens
    return torch.full((lengths.numel(), 1), 1.0 / (cfg.max_new_tokens * cfg.mini_batch_size), device=lengths.device)


LOSS_AGGREGATIONS = {
    "token_mean": None,  # every token alike (DAPO; verl's token-mean): the default
    "seq_mean_token_mean": _seq_mean_token_mean,  # a long response's tokens count less (verl's seq-mean-token-mean)
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,  # (verl's seq-mean-token-sum-norm)
}


def loss_weights(lengths, cfg):
    """(B, 1) weights of the rows on their tokens' sums in the actor loss, LOSS_AGGREGATIONS[cfg.loss_agg] of their
    response lengths (B,), checked as they return; None for the token mean."""
    if cfg.loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {cfg.loss_agg!r}, expected one of {list(LOSS_AGGREGATIONS)}")
    fn = LOSS_AGGREGATIONS[cfg.loss_agg]
    return None if fn is None else _check_returned(f"loss aggregation {cfg.loss_agg!r}", fn(lengths, cfg),
                                                   (lengths.numel(), 1), "each row's weight, (B, 1)")


# -----------------------------------------------------------------------------
# GAE


def compute_gae(rewards, values, mask, gamma, lam):
    """Advantages and returns, (B, T) each, zero outside the mask.

    Reverse loop over T, vectorised across B (as in CleanRL's ppo.py). Values
    outside the mask are never read: V_{t+1} past the last response token is 0.
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"need 0 <= gamma <= 1 and 0 <= lam <= 1, got gamma={gamma}, lam={lam}")
    if rewards.dim() != 2 or rewards.shape != values.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} "
                         "must both be (B, T)")
    B, T = rewards.shape
    mask = _check_mask(mask, (B, T))
    _response_lengths(mask)
    dtype = _float_dtype(rewards, values)
    r = torch.where(mask, rewards.to(dtype), 0.0)  # (B, T)
    v = torch.where(mask, values.to(dtype), 0.0)  # (B, T)
    # prefix mask: v[:, t+1] is already 0 past the last response token
    next_v = torch.cat([v[:, 1:], v.new_zeros(B, 1)], dim=1)  # (B, T)
    delta = r + gamma * next_v - v  # (B, T), 0 on padding
    adv = torch.empty_like(delta)
    lastgaelam = delta.new_zeros(B)
    for t in reversed(range(T)):
        lastgaelam = delta[:, t] + gamma * lam * lastgaelam
        adv[:, t] = lastgaelam
    adv = torch.where(mask, adv, 0.0)
    returns = torch.where(mask, adv + v, 0.0)
    return adv, returns


def compute_gae_reference(rewards, values, mask, gamma, lam):
    """Brute force, float64 Python loops: A_t = sum_l (gamma*lam)^l delta_{t+l} per row.

    The slow twin of compute_gae, for tests. Returns float64 (B, T) tensors.
    """
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        idx = [t for t in range(T) if bool(mask[b, t])]
        r = [float(rewards[b, t]) for t in idx]
        v = [float(values[b, t]) for t in idx]
        n = len(idx)
        delta = [r[i] + gamma * (v[i + 1] if i + 1 < n else 0.0) - v[i] for i in range(n)]
        for i in range(n):
            a = 0.0
            for l in range(n - i):
                a += (gamma * lam) ** l * delta[i + l]
            adv[b, idx[i]] = a
            ret[b, idx[i]] = a + v[i]
    return adv, ret


# -----------------------------------------------------------------------------
# masked statistics (over all ranks by default)


def masked_sum(x, mask, dim=None):
    """Sum of x over mask (local to this rank); NaN outside the mask is ignored."""
    mask = _check_mask(mask, x.shape)
    x = torch.where(mask, x, 0.0)
    return x.sum() if dim is None else x.sum(dim=dim)


def _masked_moments(x, mask, unbiased, all_ranks):
    """Global (count, mean, var) of x over mask as float64 0-d tensors; two-pass."""
    mask = _check_mask(mask, x.shape)
    # the statistics over all ranks are for no-grad use (advantage whitening, logging): an all_reduce is invisible
    # to autograd, so a gradient through it would miss the other ranks. Refused on one process too, where it would
    # be right, so that code which runs on one process runs on N.
    if all_ranks and x.requires_grad:
        raise RuntimeError("masked statistics over all ranks got a tensor that requires grad; "
                           "pass all_ranks=False (local, differentiable) or detach it")
    reduce = all_ranks and _distributed()
    x64 = torch.where(mask, x.to(torch.float64), 0.0)
    stats = torch.stack([mask.sum().to(torch.float64), x64.sum()])  # [count, sum]
    if reduce:
        stats = _all_reduce_sum(stats)
    count, total = stats[0], stats[1]
    mean = total / count.clamp(min=1.0)  # 0 when nothing is masked in
    sq_dev = torch.where(mask, (x64 - mean).square(), 0.0).sum()
    if reduce:
        sq_dev = _all_reduce_sum(sq_dev)
    denom = count - 1.0 if unbiased else count
    var = torch.where(denom > 0, sq_dev / denom.clamp(min=1.0), 0.0)  # 0 for n <= 1
    return count, mean, var


def masked_mean(x, mask, dim=None, all_ranks=True):
    """Mean of x over mask. dim=None: over all masked entries of all ranks (float64
    accumulation, cast back to x's float dtype); dim given: local along that dim.
    Zero where nothing is masked in."""
    if dim is None:
        _, mean, _ = _masked_moments(x, mask, unbiased=True, all_ranks=all_ranks)
        return mean.to(_float_dtype(x))
    mask = _check_mask(mask, x.shape)
    total = torch.where(mask, x, 0.0).sum(dim=dim)
    return total / mask.sum(dim=dim).clamp(min=1)


def masked_var(x, mask, unbiased=True, all_ranks=True):
    """Variance of x over all masked entries (of all ranks); unbiased by default; 0 for n <= 1."""
    _, _, var = _masked_moments(x, mask, unbiased=unbiased, all_ranks=all_ranks)
    return var.to(_float_dtype(x))


def masked_whiten(x, mask, shift_mean=True, eps=1e-8, all_ranks=True):
    """(x - mean) / sqrt(var + eps) over masked entries of all ranks; zero outside the mask.
    shift_mean=False keeps the mean (scales only): (x - mean) / std + mean."""
    _, mean, var = _masked_moments(x, mask, unbiased=True, all_ranks=all_ranks)
    mask = _check_mask(mask, x.shape)
    x64 = torch.where(mask, x.to(torch.float64), 0.0)
    whitened = (x64 - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0).to(_float_dtype(x))


# -----------------------------------------------------------------------------
# advantage estimators: one function each, chosen by --advantage_estimator
#
# Each gets the step's tensors over the response positions and returns (adv, ret), (B, T) each and 0 off the mask;
# ret is the critic's value target, None for an estimator that needs no critic (then none is built):
#     score      (B,)    the sequence score as used (final_score: clipped, non-stop penalty)
#     kl_reward  (B, T)  the per-token KL penalty -beta * kl_t, 0 off the mask
#     values     (B, T)  the critic's values; None for a critic-free estimator
#     mask       (B, T)  the real response tokens
#     cfg        the run's Config: gamma, lam, samples_per_prompt, whiten_advantages, any field a fork adds
# Rows come in groups of cfg.samples_per_prompt consecutive rows, the samples of one prompt; a group never
# straddles ranks, so a group baseline is local. Whitening (gae's option, reinforce_pp's definition) is over all
# ranks. How the KL penalty meets the score:
#     gae           r_t = kl_reward_t + [t last] score; GAE over r and the critic's values
#     grpo, dr_grpo, rloo   the baseline acts on the sequence score only: s' = (s - mean) / std of its group
#                   (grpo), s - mean of its group (dr_grpo) or s - mean of the group's other samples (rloo);
#                   A_t = sum_{u >= t} gamma^(u-t) r_u with r_u = kl_reward_u + [u last] s', so each token still
#                   answers for the KL of what follows it
#     reinforce_pp  A_t = the same return-to-go of the raw score and the KL penalty, whitened over the batch
#                   (Hu 2025, REINFORCE++): the batch statistics are the baseline; reinforce_pp_baseline: of
#                   s - mean of its group, then whitened over the batch

ADVANTAGE_ESTIMATORS = {}  # name -> estimator function (its .critic says whether it needs a critic)


def advantage_estimator(name, critic=False, groups=False, reads=None):
    """Decorator: registers an estimator under `name`, for --advantage_estimator=name. critic: it needs the critic's
    values; groups: it compares a prompt's samples, so the run needs --samples_per_prompt >= 2 (ppo.derive); reads:
    which of ESTIMATOR_FLAGS it reads (None, a fork's default: it may read any; see estimator_unread). What is
    registered, and returned, is fn with its result checked (_check_returned)."""
    def register(fn):
        @functools.wraps(fn)
        def checked(score, kl_reward, values, mask, cfg):  # (adv, ret) as ppo.py reads them, or an error naming fn
            want = (tuple(mask.shape), tuple(mask.shape) if critic else None)
            return _check_returned(f"advantage estimator {name!r} ({fn.__qualname__})", fn(score, kl_reward, values,
                                   mask, cfg), want, "(adv, ret): adv (B, T) as the mask; ret the critic's targets "
                                   "(B, T) with critic=True, else None")
        checked.critic, checked.groups, checked.reads = critic, groups, reads
        ADVANTAGE_ESTIMATORS[name] = checked
        return checked
    return register


ESTIMATOR_FLAGS = ("lam", "whiten_advantages")  # Config fields that only some estimators read


def estimator_unread(name):
    """The Config fields --advantage_estimator=name leaves unread, which ppo.derive refuses set (as doing nothing):
    the critic's learning rate and value clip without a critic, and the ESTIMATOR_FLAGS outside its reads."""
    est = ADVANTAGE_ESTIMATORS[name]
    reads = ESTIMATOR_FLAGS if est.reads is None else est.reads
    critic = [] if est.critic else ["critic_lr", "loss_clip_val", "critic_warmup_steps"]
    return critic + [k for k in ESTIMATOR_FLAGS if k not in reads]


def returns_to_go(rewards, mask, gamma):
    """(B, T) -> sum_{u >= t} gamma^(u-t) r_u per row, 0 off the mask: GAE with zero values and lam = 1."""
    return compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0]


def _groups(score, n):
    """(B,) -> (B / n, n): the samples of each prompt in a row."""
    if n < 2 or score.numel() % n:
        raise ValueError(f"a group baseline needs groups of n >= 2 samples per prompt; got {score.numel()} rows, n={n}")
    return score.view(-1, n)


def grpo_scores(score, n, eps=1e-6):
    """(B,) -> (s - mean) / (std + eps) within each group of n consecutive rows (Shao et al. 2024, GRPO; the
    unbiased std, as TRL and OpenRLHF use). In float64: a group of equal float32 scores sums exactly there, so it
    gets 0, where float32's mean may miss the score by an ulp and (s - mean) / (ulp + eps) is of order 1."""
    s = _groups(score, n).double()
    return ((s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + eps)).flatten().to(score.dtype)


def mean_scores(score, n):
    """(B,) -> s minus the mean of its group of n consecutive rows (Liu et al. 2025, Dr. GRPO: GRPO's baseline
    without the division by the group's std, which weights a prompt by how little its samples' scores differ); in
    float64, so that a group of equal scores gets exactly 0, as in grpo_scores."""
    s = _groups(score, n).double()
    return (s - s.mean(1, keepdim=True)).flatten().to(score.dtype)


def rloo_scores(score, n):
    """(B,) -> s minus the mean of the other n - 1 samples of its group (Ahmadian et al. 2024, RLOO); in float64,
    so that a group of equal scores gets exactly 0, as in grpo_scores."""
    s = _groups(score, n).double()
    return (s - (s.sum(1, keepdim=True) - s) / (n - 1)).flatten().to(score.dtype)


@advantage_estimator("gae", critic=True, reads=("lam", "whiten_advantages"))
def gae_advantages(score, kl_reward, values, mask, cfg):
    adv, ret = compute_gae(kl_reward + score_on_last_token(score, mask), values, mask, cfg.gamma, cfg.lam)
    return (masked_whiten(adv, mask) if cfg.whiten_advantages else adv), ret


@advantage_estimator("grpo", groups=True, reads=())
def grpo_advantages(score, kl_reward, values, mask, cfg):
    s = grpo_scores(score, cfg.samples_per_prompt).to(kl_reward.dtype)
    return returns_to_go(kl_reward + score_on_last_token(s, mask), mask, cfg.gamma), None


@advantage_estimator("dr_grpo", groups=True, reads=())
def dr_grpo_advantages(score, kl_reward, values, mask, cfg):
    s = mean_scores(score, cfg.samples_per_prompt).to(kl_reward.dtype)
    return returns_to_go(kl_reward + score_on_last_token(s, mask), mask, cfg.gamma), None


@advantage_estimator("rloo", groups=True, reads=())
def rloo_advantages(score, kl_reward, values, mask, cfg):
    s = rloo_scores(score, cfg.samples_per_prompt).to(kl_reward.dtype)
    return returns_to_go(kl_reward + score_on_last_token(s, mask), mask, cfg.gamma), None


@advantage_estimator("reinforce_pp", reads=())
def reinforce_pp_advantages(score, kl_reward, values, mask, cfg):
    ret = returns_to_go(kl_reward + score_on_last_token(score.to(kl_reward.dtype), mask), mask, cfg.gamma)
    return masked_whiten(ret, mask), None


@advantage_estimator("reinforce_pp_baseline", groups=True, reads=())
def reinforce_pp_baseline_advantages(score, kl_reward, values, mask, cfg):
    s = mean_scores(score, cfg.samples_per_prompt).to(kl_reward.dtype)
    return masked_whiten(returns_to_go(kl_reward + score_on_last_token(s, mask), mask, cfg.gamma), mask), None


# -----------------------------------------------------------------------------
# KL coefficient controllers


class AdaptiveKLController:
    """beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon).

    Ziegler et al. 2019 (section 2.2): KL is the mean over the batch of each sequence's
    summed per-token KL, n_steps the number of samples since the last update, and
    horizon is in samples (their 10000), over 0.2 n_steps: the step 1 - 0.2 n_steps / horizon must leave beta > 0.
    """

    def __init__(self, init_kl_coef, target, horizon):
        if init_kl_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"need init_kl_coef >= 0, target > 0, horizon > 0; got "
                             f"{init_kl_coef}, {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps):
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        if 0.2 * n_steps >= self.horizon:  # a KL under target would scale beta by 1 - 0.2 n / horizon <= 0
            raise ValueError(f"n_steps {n_steps} must be under 5 x the horizon {self.horizon:g}: "
                             "beta would turn 0 or negative, rewarding the KL")
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self):
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state):
        # restore everything, so a resumed run follows the same beta trajectory
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


class FixedKLController:
    """Constant beta, same interface as AdaptiveKLController."""

    def __init__(self, kl_coef):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps):
        return self.value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])


class ScoreNorm:
    """--score_norm: a call takes a step's scores (B,) on this rank, adds those of every rank to running moments over
    the run (count, mean and the sum of squared deviations, float64, merged as Chan et al. merge two sets'), and
    returns them standardised by the moments so far, this step's included: (score - mean) / std, the population std
    (1 while every score so far was the same). As TRL's score normalisation, for a reward model whose scale is
    arbitrary and drifts. Off (on=False): the scores as they came, no moments kept. The state (state_dict) goes into
    a training checkpoint, so a resumed run standardises as the uninterrupted one."""

    def __init__(self, on):
        self.on, self.count, self.mean, self.m2 = bool(on), 0.0, 0.0, 0.0

    def __call__(self, score):
        if not self.on:
            return score
        n, mean, var = (float(v) for v in _masked_moments(score.detach(), torch.ones_like(score, dtype=torch.bool),
                                                          unbiased=False, all_ranks=True))
        total, delta = self.count + n, mean - self.mean
        self.m2 += var * n + delta * delta * self.count * n / total
        self.mean, self.count = self.mean + delta * n / total, total
        std = math.sqrt(self.m2 / total)
        return ((score.double() - self.mean) / (std if std > 0 else 1.0)).to(_float_dtype(score))

    @property
    def metrics(self):
        std = math.sqrt(self.m2 / self.count) if self.count else 0.0
        return {"val/score_norm_mean": self.mean, "val/score_norm_std": std} if self.on else {}

    def state_dict(self):
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state):
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


def uses_reference(cfg):
    """Whether a run reads the reference: for the KL penalty in the reward (kl_coef > 0; --target_kl adapts it) or
    the KL loss (kl_loss_coef > 0). Without either no reference is built, run or planned, and no KL is measured."""
    return cfg.kl_coef > 0 or cfg.kl_loss_coef > 0


def kl_controller(kl_coef, target_kl=0.0, horizon=10000):
    """The run's beta: adaptive towards target_kl when it is > 0 (AdaptiveKLController), else fixed at kl_coef."""
    return AdaptiveKLController(kl_coef, target_kl, horizon) if target_kl > 0 else FixedKLController(kl_coef)


# -----------------------------------------------------------------------------
# self-check: fast GAE vs. brute force


def random_prefix_mask(B, T, generator=None):
    """(B, T) bool mask whose rows hold 0..T leading ones (ragged, empty and full rows)."""
    lengths = torch.randint(0, T + 1, (B,), generator=generator)
    lengths[0] = T  # a full row
    if B > 1:
        lengths[1] = 1  # a one-token row
    if B > 2:
        lengths[2] = 0  # an empty row
    return torch.arange(T) < lengths[:, None]


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    print(f"{'B':>4} {'T':>5} {'gamma':>6} {'lam':>5} {'max|adv err|':>13} {'max|ret err|':>13} "
          f"{'fast ms':>9} {'brute ms':>10}")
    for B, T, gamma, lam in [(8, 17, 1.0, 0.95), (8, 33, 0.99, 0.9), (8, 33, 1.0, 1.0),
                             (8, 33, 0.9, 0.0), (64, 512, 1.0, 0.95)]:
        mask = random_prefix_mask(B, T, g)
        rewards = torch.randn(B, T, generator=g)
        values = torch.randn(B, T, generator=g)
        t0 = time.perf_counter()
        adv, ret = compute_gae(rewards, values, mask, gamma, lam)
        t1 = time.perf_counter()
        ref_adv, ref_ret = compute_gae_reference(rewards, values, mask, gamma, lam)
        t2 = time.perf_counter()
        err_a = (adv.double() - ref_adv).abs().max().item()
        err_r = (ret.double() - ref_ret).abs().max().item()
        print(f"{B:>4} {T:>5} {gamma:>6} {lam:>5} {err_a:>13.2e} {err_r:>13.2e} "
              f"{(t1 - t0) * 1e3:>9.2f} {(t2 - t1) * 1e3:>10.0f}")

"""
The step's metrics from its tensors: the names of README's metrics table (objective/*, policy/*, loss/*, val/*,
perf/*), each a sum over this rank's rows, summed over ranks (runtime.all_sum), so 1 and N ranks log the same numbers.
Per-minibatch statistics (the losses, clip fractions, ratios) are token means over each minibatch, then averaged
over every minibatch of the step, not the last one's (CleanRL logs the last minibatch's and calls it the mean).
Beside them, the step's bookkeeping: episode and epoch (counters), lr and critic_lr, the phases' seconds (time/*).
"""
import functools
from math import nan

import torch
import torch.distributed as dist

from gae import KL_ESTIMATORS, is_weights, kl_estimate, masked_sum, masked_var
from runtime import all_sum


def finite_mean(x, dim=None):
    """The mean of x's finite entries (over dim, else all; NaN where none is): a skipped update's non-finite loss or
    gradient norm would make the step's mean NaN, hiding the updates that were fine."""
    x = torch.where(x.isfinite(), x, nan)
    return x.nanmean() if dim is None else x.nanmean(dim)


def step_metrics(mask, sc, score, kl, rewards, ret, ended, sampler_logp, updates, beta, B_all, trained, cfg):
    """The step's metrics from its tensors: sums over this rank's rows, summed over ranks (an all_sum each for the
    per-response sums, the per-token sums, the minibatches' sums and the token slots; masked_var adds its own),
    per-minibatch means averaged over every minibatch of the step. Without a critic (ret None) no value metric is
    logged; with --is_correction=none no importance-weight metric; without a reference (no KL penalty or loss: sc has
    no ref_logp) no KL metric."""
    tok = functools.partial(masked_sum, mask=mask)  # over the response tokens; select, don't multiply
    w, cut = is_weights(sc["old_logp"], sampler_logp, mask, cfg)

    kls = {"objective/kl": tok(kl), **{f"objective/kl_{k}": tok(kl_estimate(sc["old_logp"], sc["ref_logp"], k,
                                                                             sc["kl_exact"])) for k in KL_ESTIMATORS}
           } if "ref_logp" in sc else {}
    seq = {"objective/scores": sc["score"].sum(), **kls,
           "objective/rlhf_reward": tok(rewards), "objective/score_used": score.sum(), "val/stop_rate": ended.sum()}
    per_tok = {"objective/entropy": tok(sc["entropy"]),
               "val/sampler_logprob_diff": tok((sampler_logp - sc["old_logp"]).abs()),
               "val/mismatch_k3": tok(kl_estimate(sampler_logp, sc["old_logp"], "k3")),  # r - 1 - log r (gae.py)
               **({"val/is_weight_mean": tok(w), "val/is_clipfrac": tok(cut.float())}
                  if cfg.is_correction != "none" else {}), "n": mask.sum()}
    keys = list(updates[0]["sums"])
    tot_seq = all_sum(torch.stack([v.double() for v in seq.values()]))  # (n_seq,)
    tot_tok = all_sum(torch.stack([v.double() for v in per_tok.values()]))  # (n_tok,)
    tot_mb = all_sum(torch.stack([torch.stack([u["sums"][k] for k in keys]) for u in updates]))  # (n_mb, n_keys)
    n_resp = tot_tok[-1].item()
    n_mb = torch.tensor([u["n_tokens"] for u in updates], dtype=torch.float64)[:, None]
    per_mb = dict(zip(keys, (tot_mb / n_mb).T))  # (n_mb,) token means of each minibatch
    avg = {k: finite_mean(v).item() for k, v in per_mb.items()}
    norms = finite_mean(torch.stack([u["norms"] for u in updates]), 0).tolist()  # (val/skipped_updates counts the rest)
    slots, pad = all_sum([sc["slots"] + sum(u["slots"][0] for u in updates),
                          sc["pad"] + sum(u["slots"][1] for u in updates)]).tolist()  # scoring and training forwards
    out = {k: v / B_all for k, v in zip(seq, tot_seq.tolist())}
    out.update({k: v / n_resp for k, v in zip(list(per_tok)[:-1], tot_tok.tolist())})
    out.update({
        **({"objective/kl_coef": beta, "objective/non_score_reward": -beta * out["objective/kl"]}
           if "ref_logp" in sc else {}),
        "policy/approxkl_avg": avg["approxkl"], "policy/clipfrac_avg": avg["clipfrac"],
        "policy/entropy_avg": avg["entropy"], "loss/policy_avg": avg["policy_loss"],
        "val/ratio": avg["ratio"],
        "val/ratio_var": finite_mean(per_mb["ratio_sq"] - per_mb["ratio"].square()).item(),  # each minibatch's own
        "val/response_length": n_resp / B_all,
        **{f"val/grad_norm_{name}": norm for name, norm in zip(trained, norms)},
        "val/skipped_updates": sum(u["skipped"] for u in updates),
        "perf/padding_frac": pad / slots,
    })
    if ret is not None:
        var = float(masked_var(ret, mask))  # 0 when every return is the same: nothing to explain (NaN, as CleanRL)
        out.update({"loss/value_avg": avg["value_loss"], "val/clipfrac_avg": avg["vf_clipfrac"],
                    "val/explained_var": 1.0 - float(masked_var(ret - sc["values"], mask)) / var if var > 0 else nan})
    named = {"policy_loss", "entropy", "approxkl", "clipfrac", "ratio", "ratio_sq", "value_loss", "vf_clipfrac"}
    out.update({f"loss/{k}_avg": v for k, v in avg.items() if k not in named})  # ptx, and a fork's own terms
    return out


def counters(step, cfg, sampler):
    """episode: the prompts the run has trained on after `step` steps; epoch: its passes over the prompt set (the
    sampler's; --async_rollout draws a batch ahead after step 0)."""
    return dict(episode=step * cfg.rollout_batch_size, epoch=sampler.passes(back=int(cfg.async_rollout and step > 0)))


def learning_rates(m, trained):
    """Each trained model's learning rate from its scheduler: lr (the actor's), critic_lr."""
    return {("lr" if name == "actor" else f"{name}_lr"): m[name + "_sched"].get_last_lr()[0] for name in trained}


def phase_times(t0, t1, t2, t3, t4, tokens):
    """time/*: the seconds of each phase of the step from the ends t1-t3 of rollout, score and train (t0: the step's
    start, t4: its end), and the response tokens of the step per second."""
    return {"time/rollout": t1 - t0, "time/score": t2 - t1, "time/train": t3 - t2, "time/step": t4 - t0,
            "time/tokens_per_sec": tokens / (t4 - t0)}


def reward_means(extras, prefix="reward/"):
    """{prefix + name: mean over the responses of every rank whose reward call reported name} from a batch's
    RewardCaller.extras ({name: float} per response): what a reward function returned beside the score (accuracy,
    a format check). The names are gathered from every rank first (a rank may have seen none, or other ones), so
    every rank sums the same list; a name no response reported is not logged."""
    names = [sorted({k for e in extras for k in e})]
    if dist.is_initialized() and dist.get_world_size() > 1:
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted({k for e in extras for k in e}))
    names = sorted(set().union(*names))
    if not names:
        return {}
    sums = all_sum([[sum(e.get(k, 0.0) for e in extras), sum(k in e for e in extras)] for k in names]).tolist()
    return {prefix + k: s / n for k, (s, n) in zip(names, sums)}

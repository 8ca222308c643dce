"""
Held-out evaluation: the actor's responses to a fixed prompt set (--eval_prompts), scored through the code path that
scores the training rollouts. ppo.py runs it before the first step, every --eval_every steps and after the last
one, and logs a line of its own in metrics.jsonl at the step whose weights it evaluated:

    eval/score             mean score (reward model or function), before clipping, as objective/scores is; with
                           --eval_samples_per_prompt=n, over the n responses to each prompt (mean@n)
    eval/score_std         standard deviation of the scores over the prompts (of each prompt's mean score):
                           eval/score's standard error is eval/score_std / sqrt(prompts)
    eval/score_best        n > 1 only: mean over the prompts of each one's best score (pass@n for a 0/1 reward)
    eval/score_best@k      for k = 2, 4, 8, ... below n: the same for k of the n responses, the expected best of k
                           drawn without replacement, computed exactly (best_of: pass@k for a 0/1 reward)
    eval/score_maj         n > 1, and a reward function that returns the answer it read as "pred" (reward.RewardCaller):
                           mean over the prompts of the score of the majority answer (majority_score: maj@n)
    eval/kl                mean over responses of the summed per-token KL estimate that the reward uses
                           (--kl_estimator, |.| with --use_absolute_kl), actor against reference logprobs at the
                           training temperature, as objective/kl is. On greedy responses (--eval_temperature=0, the
                           default) it is the KL penalty those responses would pay, not an unbiased estimate of
                           KL(pi || pi_ref): they are not samples of pi (kl_estimator=exact sums the exact KL
                           along them)
    eval/response_length   mean response length in tokens (EOS included)
    eval/stop_rate         fraction of responses that ended with EOS
    eval/reward_errors     reward calls that failed or timed out, scored --reward_on_error (reward functions only)
    eval/reward/<name>     mean of what a reward function returned under that name beside the score (a dict:
                           reward.RewardCaller), over the prompts whose call did
    time/eval              seconds (with --async_rollout, first waiting for the batch drawn ahead, since the
                           evaluation refills the generation copy it is drawn from)
and its rows (prompt, response, score, kl, length, stopped, with n > 1 sample, pred where a call gave one, and
reward/<name>, null where a call did not report them) in out_dir/samples/step-N.jsonl (runtime.Logger). Row g of the
E x n is sample g % n of prompt g // n, as in training.

Keyed, so it repeats and leaves training alone: the sampling noise of eval row g comes from rollout.eval_seeds
(seed, g), a key space training never draws from, the same at every evaluation (two evaluations differ by their
weights alone). Nothing here draws from a global generator, moves a sampler or the KL controller, or changes a
trained model: a run trains the same with or without evaluation, bitwise (tested).

On W ranks each rank takes ceil(E n / W) consecutive rows of the E n, the shares that run past the last row padded
with copies of it, up to whole shares of copies (every rank must run the same FSDP forwards); the padding is generated
and scored, then dropped. The rows are gathered on every rank in the file's order and the metrics computed from them
in that order, so W changes them by the float rounding of the forwards only.

    python ppo.py --eval_prompts=heldout.jsonl --eval_every=50 --eval_temperature=0
"""
import math
import statistics
import time

import torch
import torch.distributed as dist

from gae import kl_estimate, masked_sum
from reward import combined_scores
from rollout import StopStrings, eval_seeds, generate
from runtime import all_sum, progress


ROW = ("prompt", "response", "score", "kl", "length", "stopped")  # an eval row's columns, before reward/<name>


def due(step, cfg):
    """Whether ppo.py evaluates after `step` (0: before the first step, on a run that starts there; a run resumed at or
    past its total_steps, --total_steps=0 the evaluation alone among them, evaluates the weights it resumed)."""
    return step == 0 or (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step >= cfg.total_steps


def best_of(scores, k):
    """The expected best score of k responses drawn without replacement from one prompt's n: with the scores sorted,
    s_0 <= ... <= s_(n-1), the i-th is the best of a k-subset when the other k - 1 come from the i below it, so
    best@k = sum_i s_i C(i, k - 1) / C(n, k). Exact, no resampling; k = n gives the max, k = 1 the mean, and for a 0/1
    reward it is the unbiased pass@k of Chen et al. (2021), 1 - C(n - c, k) / C(n, k), c of the n correct."""
    n = len(scores)
    return sum(s * (math.comb(i, k - 1) / math.comb(n, k)) for i, s in enumerate(sorted(scores)) if i >= k - 1)


def majority_score(scores, preds):
    """The score of a prompt's majority answer (self-consistency): among its responses' preds (None: no answer read,
    no vote), the one given most often, the first of them in sample order on a tie, scored as the mean score of the
    responses that gave it (the same score for a verifier of the answer alone). With no vote, the mean score."""
    votes = [p for p in preds if p is not None]
    if not votes:
        return statistics.fmean(scores)
    counts = {p: votes.count(p) for p in votes}  # in sample order
    top = max(counts, key=counts.get)  # the first of the most frequent
    return statistics.fmean(s for s, p in zip(scores, preds) if p == top)


def score_metrics(per_prompt, preds=None):
    """eval/score, eval/score_std and, with n > 1 responses a prompt, eval/score_best and eval/score_best@k (k = 2, 4,
    ... below n), from each prompt's n scores; with preds (each prompt's n answers, None where none was read) and
    n > 1, eval/score_maj."""
    n = len(per_prompt[0])
    out = {"eval/score": statistics.fmean(s for scores in per_prompt for s in scores),
           "eval/score_std": statistics.stdev(map(statistics.fmean, per_prompt)) if len(per_prompt) > 1 else math.nan}
    if n > 1:
        out["eval/score_best"] = statistics.fmean(map(max, per_prompt))
        out.update({f"eval/score_best@{k}": statistics.fmean(best_of(scores, k) for scores in per_prompt)
                    for k in (2 ** j for j in range(1, n.bit_length())) if k < n})
        if preds is not None:
            out["eval/score_maj"] = statistics.fmean(map(majority_score, per_prompt, preds))
    return out


def summary(rows, n, names, has_pred, prefix="eval/"):
    """The metrics of evaluation rows (n a prompt, in order) under prefix: score_metrics', the mean KL, length and
    stop rate, and the mean of each reward/<name> over the rows that report it."""
    col = lambda key: [float(r[key]) for r in rows]  # noqa: E731
    score = col("score")
    per_prompt = [score[i : i + n] for i in range(0, len(score), n)]  # each prompt's n scores
    preds = [[r["pred"] for r in rows[i : i + n]] for i in range(0, len(rows), n)] if has_pred else None
    out = {prefix + k[len("eval/"):]: v for k, v in score_metrics(per_prompt, preds).items()}
    if rows[0]["kl"] is not None:  # (None: no reference)
        out[prefix + "kl"] = statistics.fmean(col("kl"))
    out.update({prefix + "response_length": statistics.fmean(col("length")),
                prefix + "stop_rate": statistics.fmean(col("stopped"))})
    return out | {prefix + name: statistics.fmean(v) for name in names
                  if (v := [r[name] for r in rows if r[name] is not None])}


@torch.no_grad()
def evaluate(step, counters, m, prompts, reward, score_batch, cfg, run, tokenizer, stop_ids, pad_id, generate=generate,
             wait=None):
    """The actor m["actor"] after `step` steps on every prompt of `prompts` (a data.PromptSet) -> (metrics, rows):
    the eval/* numbers with step and `counters` (episode, epoch), and one dict per prompt in the file's order.
    reward: a reward.RewardCaller, or None with a reward model. score_batch: ppo.score_batch, the training loop's
    scoring forward (passed in: this file sits below ppo.py), run here without the critic. generate: rollout.generate,
    or ppo.py's async_rollout.Rollouts.generate_beside, which runs it where the rollouts are generated. wait: called
    first, its time in time/eval: Rollouts.wait, for a batch --async_rollout draws from the copy this refills."""
    t0 = time.time()
    if wait is not None:
        wait()
    E, W, n = len(prompts), run.world, cfg.eval_samples_per_prompt
    G = E * n  # global eval rows: row g is sample g % n of prompt g // n
    k = math.ceil(G / W)
    mine = range(run.rank * k, (run.rank + 1) * k)  # global eval rows; those >= G pad the last rank's share
    idx, n_real = [min(g, G - 1) // n for g in mine], max(0, min(k, G - run.rank * k))  # the rows' prompts
    m["gen"].copy_weights_from(m["actor"])  # the weights after this step's update
    ro = generate(m["gen"], [prompts.ids[i] for i in idx], cfg.max_new_tokens, temperature=cfg.eval_temperature,
                  top_p=getattr(cfg, "eval_top_p", 1.0),  # (a nucleus only here: training's logprobs are the full ones)
                  eos_token_id=stop_ids, pad_token_id=pad_id, seeds=eval_seeds(cfg.seed, mine).to(run.device),
                  micro_batch_size=run.rollout_micro, max_prompt_len=cfg.max_prompt_len,
                  progress=progress(f"eval {step} rollout"), stop=StopStrings.of(getattr(cfg, "stop_strings", ()),
                                                                                 tokenizer))
    mask = ro.response_mask  # (k, R)
    texts = ro.texts(tokenizer, n_real)
    batch = dict(tokens=ro.tokens, attention_mask=ro.attention_mask, position_ids=ro.position_ids, response_mask=mask,
                 P=ro.prompt_len)
    sc = score_batch(m["actor"], m["ref"], None, m["reward_model"], batch, cfg, run, progress(f"eval {step} score"))
    errors = 0
    if reward is not None:
        scores, errors = reward([prompts.records[i] for i in idx[:n_real]], texts)
        if m.get("reward_model") is not None:  # and a reward model (--reward_fn_coef): their sum, as the steps'
            scores = combined_scores(sc["score"][:n_real], scores, cfg.reward_fn_coef, reward.extras,
                                     run.device).tolist()
    else:
        scores = sc["score"][:n_real].tolist()
    if "ref_logp" in sc:  # (a run without a KL penalty or loss has no reference, and measures no KL)
        kl = kl_estimate(sc["old_logp"], sc["ref_logp"], cfg.kl_estimator, sc["kl_exact"])  # (k, R)
        kl = masked_sum(kl.abs() if cfg.use_absolute_kl else kl, mask, dim=1).tolist()  # (k,) summed per response
    else:
        kl = [None] * len(idx)
    extras = reward.extras if reward is not None else [{}] * n_real  # what a reward function returned beside scores
    preds = reward.preds if reward is not None else [None] * n_real  # the answers it read ("pred"), or None
    mine_rows = [dict(prompt=prompts.texts[i], response=t, score=s, kl=x, length=L, stopped=e,
                      **({"sample": g % n} if n > 1 else {}), **({"pred": p} if p is not None else {}),
                      **{f"reward/{name}": v for name, v in more.items()})
                 for g, i, t, s, x, L, e, more, p in zip(mine, idx, texts, scores, kl, mask.sum(1).tolist(),
                                                         ro.ended.tolist(), extras, preds)]
    rows = [None] * W
    dist.all_gather_object(rows, mine_rows)
    rows = [r for part in rows for r in part]  # (G,) in the file's order: rank r holds rows [r k, (r + 1) k)
    for name, lo, hi in prompts.sets:  # several held-out files: which one each row's prompt came from
        for r in rows[lo * n : hi * n]:
            r["set"] = name
    names = sorted({name for r in rows for name in r if name.startswith("reward/")})
    has_pred = any("pred" in r for r in rows)
    columns = (*(("set",) if prompts.sets else ()), *ROW, *(("sample",) if n > 1 else ()),
               *(("pred",) if has_pred else ()), *names)
    rows = [{c: r.get(c) for c in columns} for r in rows]  # every row the same columns (None: not reported)
    bad = [r for r in rows if not math.isfinite(r["score"])]
    if bad:  # on every rank alike (the gathered rows), as training refuses its own
        raise FloatingPointError(f"eval after step {step}: the reward gave non-finite scores to {len(bad)} of the {G} "
                                 f"{'prompts' if n == 1 else f'responses ({n} a prompt)'} of {prompts.path} "
                                 f"({[r['score'] for r in bad[:4]]}), the first to {bad[0]['prompt']!r:.100}")
    metrics = {"step": step, **counters, **summary(rows, n, names, has_pred)}  # score_std: NaN (null) for one prompt
    for name, lo, hi in prompts.sets:  # and each file's own, beside their union's
        metrics.update(summary(rows[lo * n : hi * n], n, names, has_pred, f"eval/{name}/"))
    if reward is not None:
        metrics["eval/reward_errors"] = all_sum(float(errors)).item()
    return dict(metrics, **{"time/eval": time.time() - t0}), rows

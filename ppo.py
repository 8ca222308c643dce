"""
PPO for RLHF, top to bottom: one main() with the whole algorithm in view.

Four models (Ouyang et al. 2022; Ziegler et al. 2019):
    actor      trained, starts from the SFT checkpoint            (FSDP2, AdamW)
    critic     trained, one value per token, from the reward model (FSDP2, AdamW)
               or from the actor with a fresh scalar head; none with a critic-free advantage estimator
    reference  frozen copy of the initial actor, for the KL penalty                (FSDP2, compute dtype)
    reward     frozen sequence-classification model, a reward function of (prompt record, response), or both
Built on the meta device, filled from one read of each checkpoint on rank 0 (checkpoint.py); --dry_run (plan.py).
--lora_rank: the actor and the critic train adapters on frozen bases; the reference is the actor with its adapters
off, and a critic from the reward model is the reward model plus adapters (lora.py): two base weight sets, not four.

Each step:
    1. rollout   sample samples_per_prompt responses to each prompt with a KV cache (rollout.py) from the actor's
                 full weights (async_rollout.py: --async_rollout, during the previous step; --dynamic_sampling, DAPO's)
    2. score     no grad: old_logp, entropy (actor), ref_logp (reference), values (critic), score (reward)
    3. reward    r_t = -beta * kl_t on every response token, + score on the last one (gae.py)
    4. advantage GAE with the critic's values (whitened), or critic-free: grpo, dr_grpo, rloo, reinforce_pp (gae.py)
    5. optimise  ppo_epochs x minibatches x micro-batches (w: the sampler-trainer importance weight, gae.is_weights):
                   ratio = exp(logp - old_logp)                   [--ratio_level=sequence: the response's mean]
                   pg    = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high))  [dual: min(pg, -c*A) for A < 0]
                   vf    = 0.5 * max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)
                   actor loss = w pg - entropy_coef * H [+ kl_loss_coef * KL(pi || ref)] [+ ptx_coef * SFT NLL]
    6. adaptive KL (optional): beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon
    7. evaluate  every eval_every steps, before the first and after the last; after the checkpoint (evaluate.py)

Loss aggregation: every per-token term is summed over the minibatch's response tokens and divided by their
number across ALL ranks (a token mean over the minibatch), so the loss and its gradient do not change when a
minibatch is split into micro-batches or across ranks; the SFT (ptx) term likewise over its own batch.
--loss_agg weighs the actor's terms by response instead (GRPO's, Dr. GRPO's: gae.LOSS_AGGREGATIONS), as invariant.
Micro-batches hold rows of similar length, cropped to them (data.micro_batches). logprob, entropy and KL come
from the fused kernels in kernels/: the (tokens, vocab) logits are never materialised. The same temperature
divides the logits in sampling and in every logprob of the PPO terms (the SFT term's NLL: temperature 1).

Randomness is keyed, not drawn from a running generator: the sampling noise of global row g at step s from
(seed, s, g) (rollout.py), the minibatch order of epoch e from (seed, s, e) (data.py); row g is sample g % n of
prompt g // n. So a run gives the same samples and minibatches on any number of ranks, up to float rounding,
and a resumed run repeats the uninterrupted one (checkpoint.py).

    python ppo.py                                               # the embedded default (CPU, see README)
    python ppo.py --help                                        # every option, its default and meaning
    torchrun --nproc_per_node 8 ppo.py --model=... --reward_model=... --prompts=...
    python ppo.py --reward_fn=my_rewards.py:verify              # verify(record: dict, response: str) -> float
From Python: main(Config(...), reward_fn=f), f(record, response) -> a float, or a dict: "score", and reward/<name>s.
"""
import functools
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import checkpoint
import plan
from async_rollout import Rollouts, check_rollout_flags
from data import PromptSampler, left_pad, load_inputs, micro_batches, minibatch_rows
from evaluate import due, evaluate
from gae import (ADVANTAGE_ESTIMATORS, IS_CORRECTIONS, KL_ESTIMATORS, LOSS_AGGREGATIONS, ScoreNorm, estimator_unread,
                 final_score, is_settings_unread, is_weights, kl_controller, kl_estimate, loss_weights, masked_mean,
                 masked_sum, overlong_penalty, shape_rewards, uses_reference)
from hf import gguf_parsed_once
from lora import TARGETS, LoRAConfig, seed_dropout
from metrics import counters, learning_rates, phase_times, reward_means, step_metrics
from model import cpu_has_bf16, reward_at_last_token
from reward import FLOAT32_MAX, RewardCaller, check_reward_flag, combined_scores, recorded_name, reward_function
from rollout import MIN_TEMPERATURE, generate
from runtime import (Logger, StopSignal, all_sum, bad_updates_in_a_row, doc_from_comments, grad_norm, hold_to_types,
                     keep_freed_memory, need, phase_end, print0, progress, run_command, setup_distributed)


@doc_from_comments
@dataclass
class Config:
    # models and data
    model: str = "smollm2"  # actor and reference: HF folder, Hub id, .gguf file, or "smollm2" (embedded)
    reward_model: str = ""  # sequence-classification reward model; "" uses the reward function reward_fn
    reward_model_random_head: bool = False  # let a causal LM be the reward model under a random score head (benchmarks)
    reward_fn: str = "sentiment"  # without a reward model: a built-in (REWARD_FNS), or FILE.py:NAME, a file's function
    reward_fn_coef: float = 0.0  # with --reward_model: score = the model's + this x reward_fn's; 0: the model alone
    prompts: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl")  # JSONL prompts
    prompt_key: str = "prompt"  # field holding a prompt string
    messages_key: str = "messages"  # field holding a chat message list
    prompt_template: str = ""  # the user turn's text, a line's prompt string in place of {prompt}; "": the prompt as is
    system_prompt: str = ""  # a system turn opening every prompt's chat that has none of its own; "": none
    max_prompt_len: int = 64  # longer prompts are dropped (and counted), never cut
    stop_token_ids: tuple = ()  # token ids that also end a response, besides the checkpoint's EOS ids
    stop_strings: tuple[str, ...] = ()  # texts that end a response where they appear (kept in it), e.g. </answer>
    sft_data: str = ""  # optional JSONL of prompt/response pairs for the ptx (SFT) loss
    ptx_coef: float = 0.0  # weight of the SFT loss mixed into the actor loss (needs sft_data)
    ptx_batch_size: int = 8  # SFT pairs per optimizer step, over all ranks
    out_dir: str = "out"  # metrics.jsonl, checkpoints and the HF-format actor; one run at a time (out_dir/.lock)
    overwrite: bool = False  # a new run into an out_dir that holds one moves the old run aside (out_dir.old-<time>)
    # rollout
    total_steps: int = 16  # PPO steps (one rollout batch each); 0: evaluate on --eval_prompts and stop
    rollout_batch_size: int = 16  # prompts per step, over all ranks (each sampled samples_per_prompt times)
    samples_per_prompt: int = 1  # responses sampled per prompt: a step has rollout_batch_size x this many rows
    max_new_tokens: int = 24  # response length limit
    temperature: float = 0.7  # sampling temperature, also used in every logprob of the PPO terms
    # reward
    kl_coef: float = 0.05  # beta: weight of the KL penalty in the per-token reward
    kl_estimator: str = "k1"  # per-token KL in the reward, a key of gae.KL_ESTIMATORS: k1 | k2 | k3 | exact
    use_absolute_kl: bool = False  # penalise |kl_t| instead of kl_t (NeMo-Aligner)
    target_kl: float = 0.0  # adaptive KL target (sum over a response); 0 keeps beta fixed
    kl_horizon: int = 10000  # adaptive KL horizon, in samples (over a step's rows / 5, so that beta stays > 0)
    kl_loss_coef: float = 0.0  # weight of the exact KL(pi || ref) over the vocabulary as an actor loss term
    kl_loss_estimator: str = "exact"  # the KL loss term's, a key of gae.KL_ESTIMATORS: exact | k1 | k2 | k3 (GRPO's)
    score_norm: bool = False  # standardise scores by the running mean and std of all the run's scores (TRL's)
    score_clip: float = 0.0  # clip the score to [-c, c]; 0 disables
    non_stop_penalty: float | None = None  # score given to responses that never reached EOS; None disables
    mask_truncated: bool = False  # leave responses that never reached EOS out of the losses (DAPO's overlong filter)
    overlong_buffer: int = 0  # DAPO's overlong penalty: the score falls linearly over the last N of max_new_tokens
    overlong_penalty: float = 1.0  # with overlong_buffer: how far it falls, at max_new_tokens (gae.overlong_penalty)
    reward_workers: int = 1  # threads calling the reward function (a verifier or judge that waits); 1: in series
    reward_timeout: float = 0.0  # seconds a reward function call may take (0: no limit); a late call has failed
    reward_on_error: float | None = None  # score of a response whose reward call failed (val/reward_errors); None: stop
    advantage_estimator: str = "gae"  # gae.ADVANTAGE_ESTIMATORS: gae | grpo | dr_grpo | rloo | reinforce_pp[_baseline]
    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE lambda
    # held-out evaluation (evaluate.py)
    eval_prompts: str = "auto"  # JSONL (a,b: several); auto: eval_prompts.jsonl beside the shipped prompts; "": none
    eval_every: int = 8  # evaluate every N steps, besides before the first step and after the last; 0: those two only
    eval_temperature: float = 0.0  # sampling temperature of the evaluation; 0 = greedy
    eval_samples_per_prompt: int = 1  # responses to each held-out prompt (eval_temperature > 0): mean@n and best@n
    eval_top_p: float = 1.0  # nucleus sampling in the evaluation (eval_temperature > 0; R1's protocol: 0.95); 1: off
    # PPO
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batch_size: int = 8  # rows (sampled responses) per optimizer step, over all ranks
    micro_batch_size: int = 8  # sequences per forward/backward on one rank (capped at the rank's minibatch share)
    inference_micro_batch_size: int = 8  # sequences per no-grad scoring forward on one rank (capped at its share)
    rollout_micro_batch_size: int = 32  # rows (samples) generated at once on a rank (capped at its share): the KV cache
    async_rollout: bool = False  # generate step k+1's batch during step k's scoring and training, from step k's weights
    dynamic_sampling: int = 0  # DAPO: draw up to N prompt batches a step for groups whose scores differ; 0: off
    clip_coef: float = 0.2  # policy ratio clip epsilon
    clip_coef_high: float = 0.0  # the ratio's upper clip, 1 + this (DAPO's clip-higher: 0.28); 0: clip_coef's
    ratio_level: str = "token"  # token | sequence: each token's ratio is its response's geometric mean ratio (GSPO)
    dual_clip: float = 0.0  # dual clip constant c > 1 (Ye et al. 2020); 0 disables
    loss_clip_val: float = 0.2  # critic value clip eps_v around the rollout values; 0 disables
    entropy_coef: float = 0.0  # entropy bonus weight
    whiten_advantages: bool = True  # gae: normalise advantages over the batch (all ranks); reinforce_pp always does
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean (GRPO) | seq_mean_token_sum_norm (Dr. GRPO)
    is_correction: str = "tis"  # pg weights for sampler != trainer (gae.IS_CORRECTIONS): tis | icepop | seq_mask | none
    is_cap: float = 2.0  # tis, seq_mask: w = min(r, is_cap), r = exp(old_logp - sampler_logp)
    is_band: tuple[float, float] = (0.5, 5.0)  # icepop: w = r inside [lo, hi], else 0
    is_seq_band: tuple[float, float] = (0.99, 1.01)  # seq_mask: w = 0 if a response's geometric-mean r leaves [lo, hi]
    lr: float = 5e-5  # actor learning rate
    critic_lr: float = 2.5e-4  # critic learning rate (5x the actor's: a fresh value head must catch up fast)
    critic_warmup_steps: int = 0  # the first N steps train the critic alone; the actor and its LR schedule wait
    warmup_steps: int = 0  # linear warmup, in optimizer steps
    lr_schedule: str = "constant"  # constant | linear | cosine (each decays to 0 after the last optimizer step)
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping per model
    # LoRA (lora.py): adapters on frozen bases; the reference, and a reward model under the critic, are "adapters off"
    lora_rank: int = 0  # rank r of the actor's and the critic's adapters; 0: full fine-tuning
    lora_alpha: float = 16.0  # adapters' output scaled by lora_alpha / lora_rank (16: OpenRLHF's and verl's default)
    lora_dropout: float = 0.0  # dropout on the adapters' input in training forwards (PPO keeps dropout off)
    lora_targets: tuple[str, ...] = TARGETS  # each block's adapted projections, e.g. q_proj,v_proj (default: all seven)
    # system
    activation_checkpointing: str = "auto"  # recompute each block in the backward: on | off | auto (on on CUDA)
    offload_frozen: bool = False  # keep the reference and reward model shards on the CPU between forwards (CUDA)
    offload_optimizer: bool = False  # trained models' shards, grads, AdamW states pinned on CPU, stepped there (CUDA)
    dtype: str = "auto"  # compute dtype: bf16 (fp32 master weights) | fp32 | auto: bf16 where fast (model.cpu_has_bf16)
    seed: int = 1  # seeds everything: sampling noise, minibatch order, the critic's fresh head
    log_every: int = 1  # metrics line every N steps
    sample_every: int = 4  # print one prompt/response every N steps; 0 disables
    save_every: int = 0  # training checkpoint + HF-format actor every N steps (and at the end); 0 = only at the end
    resume: str = ""  # a checkpoint folder, or "auto" for the newest complete one in out_dir/checkpoints
    max_bad_updates: int = 3  # stop after this many non-finite updates in a row (each one is skipped)
    keep_checkpoints: int = 2  # training checkpoints kept in out_dir/checkpoints (the newest ones), >= 1
    wandb: bool = False  # also log to Weights & Biases (wandb_project)
    wandb_project: str = "ppo"  # the Weights & Biases project
    dry_run: int = 0  # N > 0: print the per-GPU memory plan for N GPUs (reads config.json only, see plan.py) and exit
    gpu_memory_gb: float = 80.0  # memory of one GPU, for --dry_run

    def __post_init__(self):  # fire reads "--lr=1" as an int and "--model=7" as one: hold fields to their types
        hold_to_types(self)

@dataclass
class Run:
    """What follows from the Config and the launch, kept apart from what the user set."""
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype  # compute dtype
    local_rollout: int  # this rank's prompts per step
    local_rows: int  # this rank's rows per step: local_rollout x samples_per_prompt
    local_mini: int  # this rank's sequences per minibatch
    local_micro: int  # sequences per forward/backward
    infer_micro: int  # sequences per scoring forward
    rollout_micro: int  # prompts generated at once
    activation_checkpointing: bool  # for the actor and the critic
    offload_frozen: bool  # reference and reward model shards on the CPU between forwards
    offload_optimizer: bool  # actor and critic shards, grads and AdamW states on the CPU
    lora: LoRAConfig | None  # adapters on the actor and the critic, or None (full fine-tuning)
    critic: bool  # the advantage estimator needs a critic (else none is built)
    rows: int  # rows per step over all ranks: rollout_batch_size x samples_per_prompt

    @property
    def trained(self):  # the models with an optimizer
        return ("actor", "critic") if self.critic else ("actor",)


# Every number of Config has its range here but the signed four (derive: finite); outside it, or NaN/inf, is refused.
LIMITS = {
    ">= 1": ("rollout_batch_size", "samples_per_prompt", "max_new_tokens", "max_prompt_len",
             "ppo_epochs", "mini_batch_size", "micro_batch_size", "inference_micro_batch_size",
             "rollout_micro_batch_size", "ptx_batch_size", "kl_horizon", "log_every", "max_bad_updates",
             "keep_checkpoints", "reward_workers", "eval_samples_per_prompt"),
    ">= 0": ("lr", "critic_lr", "weight_decay", "warmup_steps", "kl_coef", "target_kl", "kl_loss_coef", "ptx_coef",
             "score_clip", "loss_clip_val", "clip_coef_high", "sample_every", "save_every", "dry_run", "reward_timeout",
             "eval_every", "eval_temperature", "lora_rank", "total_steps", "overlong_buffer", "overlong_penalty",
             "critic_warmup_steps", "dynamic_sampling"),
    "> 0": ("temperature", "clip_coef", "max_grad_norm", "gpu_memory_gb", "is_cap", "lora_alpha", "eval_top_p"),
    "in [0, 1)": ("lora_dropout",), "in [0, 1]": ("gamma", "lam"), "in [0, 2**32)": ("seed",),  # NumPy's seed range
}
IN_RANGE = {">= 1": lambda v: v >= 1, ">= 0": lambda v: v >= 0, "in [0, 2**32)": lambda v: 0 <= v < 2**32,
            "> 0": lambda v: v > 0, "in [0, 1)": lambda v: 0 <= v < 1, "in [0, 1]": lambda v: 0 <= v <= 1}


def derive(cfg, rank, W, device):
    """The derived values of a run of W ranks, after checking every flag of the Config for it (a UsageError names
    the flag and what it expects); the files are checked next, by load_inputs, before any model loads."""
    for rule, names in LIMITS.items():
        for k, v in ((k, getattr(cfg, k)) for k in names):  # None: a fork's X | None field, off
            need(v is None or IN_RANGE[rule](v) and math.isfinite(v), f"--{k} must be {rule}, not {v!r}")
    for k, v in (("temperature", cfg.temperature), ("eval_temperature", cfg.eval_temperature or MIN_TEMPERATURE)):
        need(v >= MIN_TEMPERATURE, f"--{k} must be {'0 (greedy) or ' * (k[0] == 'e')}>= {MIN_TEMPERATURE:g}, not {v!r}")
    for k in ("entropy_coef", "dual_clip", "non_stop_penalty", "reward_on_error", "reward_fn_coef"):  # either sign
        need(abs(getattr(cfg, k) or 0.0) <= FLOAT32_MAX, f"--{k} must be finite in float32, not {getattr(cfg, k)}")
    for k, choices in dict(kl_estimator=list(KL_ESTIMATORS), kl_loss_estimator=list(KL_ESTIMATORS),
                           advantage_estimator=list(ADVANTAGE_ESTIMATORS), is_correction=list(IS_CORRECTIONS),
                           loss_agg=list(LOSS_AGGREGATIONS), lr_schedule=["constant", "linear", "cosine"],
                           ratio_level=["token", "sequence"],
                           dtype=["auto", "bf16", "fp32"], activation_checkpointing=["auto", "on", "off"]).items():
        need(getattr(cfg, k) in choices, f"--{k} must be one of {choices}, not {getattr(cfg, k)!r}")
    for k in ("model", "prompts", "prompt_key", "messages_key", "out_dir") + (("wandb_project",) if cfg.wandb else ()):
        need(getattr(cfg, k).strip(), f"--{k} must not be empty")
    need(cfg.prompt_key != cfg.messages_key, f"--prompt_key and --messages_key must differ, both {cfg.prompt_key!r}")
    n, rows = cfg.samples_per_prompt, cfg.rollout_batch_size * cfg.samples_per_prompt
    for k in ("rollout_batch_size", "mini_batch_size") + (("ptx_batch_size",) if cfg.ptx_coef > 0 else ()):
        need(getattr(cfg, k) % W == 0, f"--{k} {getattr(cfg, k)} must divide by {W} ranks")
    need(rows % cfg.mini_batch_size == 0, f"--rollout_batch_size x --samples_per_prompt = {rows} rows must be a "
                                          f"multiple of mini_batch_size {cfg.mini_batch_size}")
    need(n >= 2 or not ADVANTAGE_ESTIMATORS[cfg.advantage_estimator].groups, f"--advantage_estimator="
         f"{cfg.advantage_estimator} baselines a sample by its group: needs samples_per_prompt >= 2")
    local_micro = min(cfg.micro_batch_size, cfg.mini_batch_size // W)  # at most one per minibatch
    need((cfg.mini_batch_size // W) % local_micro == 0,
         f"per-rank minibatch {cfg.mini_batch_size // W} must be a multiple of --micro_batch_size {local_micro}")
    check_reward_flag(cfg)  # a built-in's name, FILE.py:NAME, or a function passed from Python
    need(cfg.ptx_coef == 0 or cfg.sft_data, "--ptx_coef > 0 needs --sft_data")
    need(cfg.dual_clip == 0 or cfg.dual_clip > 1, "--dual_clip must be > 1 (or 0 to disable)")
    bad = [t for i, t in enumerate(cfg.lora_targets) if t not in TARGETS or t in cfg.lora_targets[:i]] or "none"
    need(cfg.lora_targets and bad == "none",
         f"--lora_targets must be some of {','.join(TARGETS)}, each once, not {bad}")
    for k, (lo, hi) in (("is_band", cfg.is_band), ("is_seq_band", cfg.is_seq_band)):
        need(0 <= lo <= hi and math.isfinite(hi), f"--{k} must be lo,hi with 0 <= lo <= hi, not {lo},{hi}")
    for on, flags, why in (  # flags read only while `on`: set with it off, they would do nothing, and are refused
        (cfg.lora_rank, ("lora_alpha", "lora_dropout", "lora_targets"), "without --lora_rank: LoRA is off"),
        (not cfg.reward_model or cfg.reward_fn_coef, ("reward_fn", "reward_workers", "reward_timeout",
         "reward_on_error"), "with --reward_model and no --reward_fn_coef, where the model scores alone"),
        (cfg.dry_run, ("gpu_memory_gb",), "without --dry_run"),
        (cfg.reward_model, ("reward_model_random_head", "reward_fn_coef"), "without --reward_model"),
        (cfg.wandb, ("wandb_project",), "without --wandb"),
        (cfg.ptx_coef > 0, ("sft_data", "ptx_batch_size"), "without --ptx_coef"),
        (cfg.target_kl > 0, ("kl_horizon",), "without --target_kl"),
        (uses_reference(cfg), ("kl_estimator", "use_absolute_kl"), "with no KL penalty or loss: no KL is measured"),
        (cfg.kl_loss_coef > 0, ("kl_loss_estimator",), "without --kl_loss_coef"),
        (cfg.overlong_buffer, ("overlong_penalty",), "without --overlong_buffer"),
        (False, is_settings_unread(cfg.is_correction), f"with --is_correction={cfg.is_correction}"),
        (False, estimator_unread(cfg.advantage_estimator), f"with --advantage_estimator={cfg.advantage_estimator}"),
    ):
        idle = [f"--{k}" for k in flags if getattr(cfg, k) != getattr(Config, k)]
        need(on or not idle, f"{', '.join(idle)} set {why}, so {'they' if len(idle) > 1 else 'it'} would do nothing")
    need(cfg.overlong_buffer <= cfg.max_new_tokens, f"--overlong_buffer must be <= max_new_tokens {cfg.max_new_tokens}")
    need(cfg.target_kl == 0 or cfg.kl_coef > 0, "--target_kl > 0 needs kl_coef > 0: the controller scales it, from 0")
    need(cfg.target_kl == 0 or 5 * cfg.kl_horizon > rows,
         f"--kl_horizon must be over a step's {rows} rows / 5: beta x (1 - 0.2 rows / horizon) <= 0")
    need(cfg.resume in ("", "auto") or os.path.isdir(cfg.resume),
         f"--resume={cfg.resume}: {'not a' if os.path.exists(cfg.resume) else 'no such'} folder (expected a checkpoint "
         "folder, or auto)")
    cuda = device.type == "cuda"
    check_rollout_flags(cfg, device)  # --async_rollout's and --dynamic_sampling's
    dtype = cfg.dtype if cfg.dtype != "auto" else "bf16" if cuda or cpu_has_bf16() else "fp32"
    ac = cfg.activation_checkpointing == "on" or cfg.activation_checkpointing == "auto" and cuda
    local_rollout = cfg.rollout_batch_size // W
    lora = LoRAConfig(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets) if cfg.lora_rank else None
    return Run(rank, W, device, torch.bfloat16 if dtype == "bf16" else torch.float32, local_rollout, local_rollout * n,
               cfg.mini_batch_size // W, local_micro, min(cfg.inference_micro_batch_size, local_rollout * n),
               min(cfg.rollout_micro_batch_size, local_rollout * n), ac, cfg.offload_frozen and cuda,
               cfg.offload_optimizer and cuda, lora, ADVANTAGE_ESTIMATORS[cfg.advantage_estimator].critic, rows)


# -----------------------------------------------------------------------------
# the forward passes PPO needs, and its update, on a batch dict (one micro-batch at a time)
#   tokens, attention_mask, position_ids (B, P+R); response_mask (B, R); P = prompt width


def policy_forward(actor, mb, temperature, ref=None):
    """logp and entropy (B, R) of the actor; with `ref` also ref_logp and the exact kl to it.
    float32, 0 off the response. The reference is frozen: no gradient flows into it."""
    P, tokens, kw = mb["P"], mb["tokens"], {}
    labels = torch.full_like(tokens, -100)  # (B, P+R): position t predicts token t+1; -100 outside the response
    labels[:, P - 1 : -1] = torch.where(mb["response_mask"], tokens[:, P:], -100)
    if ref is not None:
        with torch.no_grad():
            ref_h = ref(mb["tokens"], mb["attention_mask"], mb["position_ids"], return_hidden=True)[labels != -100]
        kw = dict(ref_hidden=ref_h, ref_weight=ref.lm_head_weight)  # (N, H) at the scored tokens; (B, T, H) freed
    out = actor(mb["tokens"], mb["attention_mask"], mb["position_ids"], labels=labels, temperature=temperature, **kw)
    return {k: v[:, P - 1 : -1] for k, v in out.items()}


def value_forward(critic, mb):
    """values (B, R) float32: the critic's estimate at the state before each response token."""
    return critic(mb["tokens"], mb["attention_mask"], mb["position_ids"])[:, mb["P"] - 1 : -1].float()


@torch.no_grad()
def score_batch(actor, ref, critic, reward_model, batch, cfg, run, progress=None):
    """Step 2, in micro-batches through the training forward's code path (so the first ratio is 1):
    old_logp, entropy, ref_logp, kl_exact, values (B, R) if there is a critic, and the reward model's score (B,) if any;
    "slots" and "pad", the token slots computed and how many were padding. progress: wraps the micro-batch loop."""
    (B, R), out = batch["response_mask"].shape, dict(slots=0, pad=0)
    mbs = micro_batches(batch, torch.arange(B, device=batch["tokens"].device), run.infer_micro)
    for rows, mb in progress(mbs, -(-B // run.infer_micro)) if progress else mbs:
        pol = policy_forward(actor, mb, cfg.temperature, ref=ref)  # ref None (no KL in the run): no ref_logp, kl
        part = dict(old_logp=pol["logp"], entropy=pol["entropy"], ref_logp=pol.get("ref_logp"), kl_exact=pol.get("kl"))
        if critic is not None:
            part["values"] = value_forward(critic, mb)
        if reward_model is not None:  # read where transformers' *ForSequenceClassification reads, on the
            rm_pad = reward_model.hf_config.pad_token_id  # padding written with the reward model's own pad id
            tokens = mb["tokens"] if rm_pad is None else torch.where(mb["attention_mask"].bool(), mb["tokens"], rm_pad)
            v = reward_model(tokens, mb["attention_mask"], mb["position_ids"])
            part["score"] = reward_at_last_token(v, tokens, rm_pad)
        for k, v in filter(lambda kv: kv[1] is not None, part.items()):  # into (B, R) or (B,): rows[, cropped cols]
            out.setdefault(k, v.new_zeros((B, R)[: v.dim()]))[(rows, slice(0, v.size(-1)))[: v.dim()]] = v
        out["slots"], out["pad"] = out["slots"] + mb["slots"], out["pad"] + mb["pad"]
    checkpoint.reshard(actor, ref, critic, reward_model)
    return out


def ppo_losses(actor, critic, mb, cfg, n_tokens, world, ref=None, train_actor=True):
    """Step 5 on one micro-batch -> (actor_loss, critic_loss (None: no critic), stats: dict of 0-dim float64 sums).

    Per-token terms are summed over the micro-batch's response tokens and divided by n_tokens, the minibatch's
    response-token count over all ranks, then multiplied by the world size because FSDP averages gradients over
    ranks: summed over micro-batches and ranks this is the token mean over the minibatch (--loss_agg: the actor's
    terms weighted by response instead, gae.LOSS_AGGREGATIONS). Rollout tensors are cleaned outside the mask first,
    so a NaN in a padded slot reaches neither the loss nor the gradient. Each token's policy term carries its
    importance weight (--is_correction, gae.is_weights, from mb["sampler_logp"]); a token weighted 0 still counts in
    n_tokens, as does a response that never ended with --mask_truncated, whose tokens every term leaves out.
    train_actor False (--critic_warmup_steps): the actor's forward has no gradient."""
    mask = mb["response_mask"] & mb["ended"][:, None] if cfg.mask_truncated else mb["response_mask"]
    adv, old_logp = (torch.where(mask, mb[k], 0.0) for k in ("adv", "old_logp"))
    with torch.set_grad_enabled(train_actor and torch.is_grad_enabled()):
        pol = policy_forward(actor, mb, cfg.temperature, ref=ref if cfg.kl_loss_coef > 0 else None)

    # clipped surrogate (Schulman et al. 2017), optional dual clip (Ye et al. 2020)
    # the log-ratio clamped before exp (as verl and OpenRLHF do): past ~88.7 float32's exp is inf, and the gradient
    # NaN; at +-20 the clip has long made the token's gradient 0 or its ratio irrelevant
    logratio = torch.where(mask, pol["logp"] - old_logp, 0.0).clamp(-20.0, 20.0)
    if cfg.ratio_level == "sequence":  # GSPO (Zheng et al. 2025): the value its response's mean, the gradient its own
        logratio = torch.where(mask, masked_mean(logratio.detach(), mask, 1)[:, None] + logratio - logratio.detach(), 0)
    ratio = logratio.exp()
    pg_losses = -adv * ratio
    pg_losses2 = -adv * ratio.clamp(1 - cfg.clip_coef, 1 + (cfg.clip_coef_high or cfg.clip_coef))
    pg = torch.max(pg_losses, pg_losses2)
    if cfg.dual_clip > 0:
        pg = torch.where(adv < 0, torch.min(pg, -cfg.dual_clip * adv), pg)
    clipped = pg != pg_losses  # a clip (the ratio's or the dual) is the active term: the token's gradient is 0
    pg = pg * is_weights(old_logp, mb["sampler_logp"], mask, cfg)[0]
    actor_tok = pg - cfg.entropy_coef * pol["entropy"]
    if cfg.kl_loss_coef > 0:
        actor_tok = actor_tok + cfg.kl_loss_coef * kl_estimate(pol["logp"], pol["ref_logp"], cfg.kl_loss_estimator,
                                                               pol["kl"])  # exact: over the vocabulary

    tsum = functools.partial(masked_sum, mask=mask)  # over the response tokens; select, don't multiply
    stats = dict(policy_loss=tsum(pg), entropy=tsum(pol["entropy"]), approxkl=tsum(0.5 * logratio.square()),
                 clipfrac=tsum(clipped.float()), ratio=tsum(ratio), ratio_sq=tsum(ratio.square()))
    critic_loss, scale = None, world / n_tokens
    if critic is not None:
        # clipped value loss around the rollout's values (off the response the critic's output is cleaned too:
        # a non-finite value there would turn the zero gradient of the square into NaN)
        ret, old_values = torch.where(mask, mb["ret"], 0.0), torch.where(mask, mb["old_values"], 0.0)
        vpred = torch.where(mask, value_forward(critic, mb), 0.0)
        vf_losses = (vpred - ret).square()
        eps_v = cfg.loss_clip_val  # 0: no clip, the clipped term is the unclipped one
        vf_losses2 = ((vpred.clamp(old_values - eps_v, old_values + eps_v) if eps_v > 0 else vpred) - ret).square()
        vf = 0.5 * torch.max(vf_losses, vf_losses2)
        stats.update(value_loss=tsum(vf), vf_clipfrac=tsum((vf_losses2 > vf_losses).float()))
        critic_loss = tsum(vf) * scale
    rows_w = loss_weights(mb["response_mask"].sum(1), cfg)  # --loss_agg: (B, 1), or None: the token mean
    actor_loss = tsum(actor_tok) * scale if rows_w is None else tsum(actor_tok * rows_w) * world
    return actor_loss, critic_loss, {k: v.detach().double() for k, v in stats.items()}


def ptx_loss(actor, pairs, n_tokens, world, device):
    """Supervised NLL of (prompt, response) pairs, summed over their response tokens and scaled like
    ppo_losses: summed over micro-batches and ranks, the token mean over the whole ptx batch."""
    tokens, attn, pos = (t.to(device) for t in left_pad([p + r for p, r in pairs], 0))
    labels, T = torch.full_like(tokens, -100), tokens.size(1)
    for b, (p, r) in enumerate(pairs):  # position t predicts token t+1: the response tokens
        labels[b, T - len(r) - 1 : T - 1] = tokens[b, T - len(r) :]
    return -actor(tokens, attn, pos, labels=labels)["logp"].sum() * (world / n_tokens)


def update(m, batch, rows, n_tokens, cfg, run, ptx_pairs, key=()):
    """One optimizer step of the trained models (actor, and critic if any) on one minibatch (`rows` of this rank,
    n_tokens over all ranks): micro-batches, optional ptx batch, clipping, step. A non-finite gradient or loss skips it.
    key: (step, update of the step): in the step's --critic_warmup_steps the critic alone steps; with the micro-batch
    and the rank it keys --lora_dropout's masks."""
    trained = ("critic",) if key and key[0] <= cfg.critic_warmup_steps else run.trained
    sums, slots = {}, [0, 0]  # token slots computed, and how many of them were padding
    for i, (_, mb) in enumerate(micro_batches(batch, rows, run.local_micro)):
        if cfg.lora_dropout > 0:
            seed_dropout(cfg.seed, *key, i, run.rank)
        actor_loss, critic_loss, st = ppo_losses(m["actor"], m.get("critic"), mb, cfg, n_tokens, run.world, m["ref"],
                                                 "actor" in trained)  # train_actor
        (actor_loss if critic_loss is None else actor_loss + critic_loss).backward()
        sums = {k: sums.get(k, 0.0) + v for k, v in st.items()}
        slots = [slots[0] + mb["slots"], slots[1] + mb["pad"]]
    pairs, n_ptx = ptx_pairs if ptx_pairs and "actor" in trained else ([], 0)
    for i in range(0, len(pairs), run.local_micro):
        ptx = ptx_loss(m["actor"], pairs[i : i + run.local_micro], n_ptx, run.world, run.device)
        (cfg.ptx_coef * ptx).backward()
        sums["ptx"] = sums.get("ptx", 0.0) + ptx.detach().double() * (n_tokens / run.world)  # a token mean x n_tokens
    norms = torch.stack([grad_norm(m[name], cfg.max_grad_norm) for name in run.trained])
    losses = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=norms.device) for v in sums.values()])
    finite = bool(torch.isfinite(norms).all()) and all_sum(float(not losses.isfinite().all())).item() == 0  # (a NaN
    # log-ratio's clamp passes a zero gradient: its loss is NaN, its gradient finite), the same on every rank
    for name in trained:
        if finite:
            m[name + "_opt"].step()
        m[name + "_opt"].zero_grad(set_to_none=True)
        m[name + "_sched"].step()
    return dict(sums=sums, n_tokens=n_tokens, norms=norms.double().cpu(), skipped=not finite, slots=slots)


# -----------------------------------------------------------------------------
# the main loop


def main(cfg: Config, reward_fn=None):
    """Trains with PPO. reward_fn(record, response) -> float replaces the built-in cfg.reward_fn; the run records it
    as cfg.reward_fn = "python:module.name", so that a resume without it (or with another name) is refused."""
    cfg = replace(cfg, reward_fn=recorded_name(reward_fn, cfg))  # as the config saves it
    if cfg.dry_run:  # the memory plan, from the config.json files alone: no process group, no GPU
        return plan.dry_run(cfg, derive(cfg, 0, cfg.dry_run, torch.device("cuda")))  # sizes as on a GPU
    rank, world, device = setup_distributed()
    run = derive(cfg, rank, world, device)  # every flag checked
    # a GGUF policy's header parsed once for the tokenizer, the config and the weights; an out-of-memory error while
    # the models load gets a note, as the steps' do
    with gguf_parsed_once(), plan.out_of_memory_noted(cfg, run):
        reward_fn = None if cfg.reward_model and not cfg.reward_fn_coef else reward_fn or reward_function(cfg.reward_fn)
        tokenizer, stop_ids, pad_id, prompts, sft, evalset = load_inputs(cfg, reward_fn)  # every file read, no model
        ckpt = checkpoint.find(cfg)  # to resume from: verified and checked against cfg, before any model is read
        # the same seeds on every rank: the critic's fresh head must agree before sharding
        random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed)
        release = checkpoint.claim(cfg.out_dir, cfg.resume, cfg.overwrite, ckpt)  # out_dir is this run's, or a refusal
        print0(f"config: {json.dumps(asdict(cfg))}\nrun: world {world}, device {device}, dtype {run.dtype}, "
               f"micro-batch {run.local_micro}")
        if rank == 0:  # the plan's peak against this GPU, or this machine's available memory, before any model loads
            print(plan.preflight(cfg, run), flush=True)

        # ---- models (actor, critic, reference, generation copy, reward model), data, KL controller
        mesh = init_device_mesh(device.type, (world,))
        m = checkpoint.add_optimizers(checkpoint.build_models(cfg, run, mesh), cfg, run)
    if device.type == "cpu":  # the steps' freed blocks reused, not returned to the kernel and faulted in again
        keep_freed_memory()
    reward = RewardCaller(reward_fn, cfg.reward_workers, cfg.reward_timeout, cfg.reward_on_error) if reward_fn else None
    sampler = PromptSampler(len(prompts), cfg.rollout_batch_size, rank, world, cfg.seed)
    sft_sampler = PromptSampler(len(sft), cfg.ptx_batch_size, 0, 1, cfg.seed) if sft else None  # the global batch
    kl_ctl = kl_controller(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)  # fixed, or adaptive with --target_kl
    score_norm = ScoreNorm(cfg.score_norm)  # --score_norm's running moments (gae.py); off: the scores as they come
    rollouts = Rollouts(m, prompts, sampler, cfg, run, stop_ids, pad_id, generate, reward, tokenizer)  # or one ahead
    stateful = dict(**{f"{name}_sched": m[name + "_sched"] for name in run.trained}, kl_ctl=kl_ctl, sampler=sampler,
                    sft_sampler=sft_sampler, rollouts=rollouts, score_norm=score_norm if cfg.score_norm else None)
    evaluate_at = functools.partial(evaluate, m=m, prompts=evalset, reward=reward, score_batch=score_batch, cfg=cfg,
                                    run=run, tokenizer=tokenizer, stop_ids=stop_ids, pad_id=pad_id,
                                    generate=rollouts.generate_beside, wait=rollouts.wait)

    # ---- resume: models, optimizers, schedulers, KL controller, samplers, metrics so far
    with plan.out_of_memory_noted(cfg, run):  # (ckpt None: a new run at step 0)
        tr = checkpoint.resume(ckpt, m, run.trained, cfg, stateful)
    history, first_step, run_id, bad_in_a_row = tr["metrics"], tr["step"] + 1, tr["run_id"], tr.get("bad_in_a_row", 0)
    log, stop = Logger(cfg, history, rank == 0, tr.get("wandb_id")), StopSignal()

    try:
        step = done = first_step - 1  # the steps the weights have seen; a checkpoint is written before its evaluation
        if evalset and due(done, cfg) and not (cfg.total_steps and any("eval/score" in h and h["step"] == done
                                                                         for h in history)):  # (0: evaluate again)
            log.log_eval(*evaluate_at(done, counters(done, cfg, sampler)))
        for step in range(first_step, cfg.total_steps + 1):
            peaks = {}
            t0 = phase_end(device, peaks, None)
            # ---- 1. rollout: sample from the actor's weights with a KV cache; noise keyed by (seed, step, row)
            rows, ro = rollouts.take(step)  # --async_rollout: drawn during the previous step, from its weights
            mask, texts = ro.response_mask, ro.texts(tokenizer)  # (B, R) bool; the responses as text
            batch = dict(tokens=ro.tokens, attention_mask=ro.attention_mask, position_ids=ro.position_ids,
                         response_mask=mask, P=ro.prompt_len, sampler_logp=ro.logprobs, ended=ro.ended)
            t1 = phase_end(device, peaks, "rollout")

            # ---- 2. score (no grad), through the training forward's code path
            sc = score_batch(m["actor"], m["ref"], m.get("critic"), m["reward_model"], batch, cfg, run,
                             progress(f"step {step} score"))
            if reward is not None:  # in series or in threads, failed calls scored reward_on_error; --dynamic_sampling:
                scores, reward_errors = rollouts.scored or reward([prompts.records[i] for i in rows], texts)  # at once
                sc["score"] = combined_scores(sc.get("score"), scores, cfg.reward_fn_coef, reward.extras, device)
            if not torch.isfinite(sc["score"]).all():
                raise FloatingPointError(f"step {step}, rank {rank}: non-finite reward scores {sc['score'].tolist()}")

            # ---- 3. per-token reward: -beta * kl_t, plus the score (clipped / penalised) at the last response token
            overlong = overlong_penalty(mask.sum(1), cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
            score = final_score(score_norm(sc["score"]), ro.ended, cfg.score_clip or None, cfg.non_stop_penalty,
                                overlong)  # standardised (--score_norm), clipped, penalised: the score used
            rewards, kl = shape_rewards(score, sc["old_logp"], sc.get("ref_logp", sc["old_logp"]), mask, kl_ctl.value,
                                        cfg.kl_estimator, cfg.use_absolute_kl, kl_exact=sc.get("kl_exact"))  # 0: no ref

            # ---- 4. advantages (GAE with the critic's values by default; gae.ADVANTAGE_ESTIMATORS)
            kl_reward = torch.where(mask, -kl_ctl.value * kl, 0.0)  # (B, R), the reward's KL part
            adv, ret = ADVANTAGE_ESTIMATORS[cfg.advantage_estimator](score, kl_reward, sc.get("values"), mask, cfg)
            batch.update(old_logp=sc["old_logp"], adv=adv)
            if ret is not None:
                batch.update(old_values=sc["values"], ret=ret)
            t2 = phase_end(device, peaks, "score")

            # ---- 5. PPO epochs x minibatches (the same on any number of ranks) x micro-batches
            updates = []
            for epoch in range(cfg.ppo_epochs):
                mbs = minibatch_rows(run.rows, cfg.mini_batch_size, rank, world, cfg.seed, step,
                                     epoch).to(device)  # (K, local_mini)
                n_tokens = all_sum(torch.stack([mask[r].sum() for r in mbs])).tolist()  # per minibatch, all ranks
                for mb_rows, n in progress(f"step {step} minibatches")(zip(mbs, n_tokens), len(mbs)):
                    ptx = sft.rank_share(sft_sampler.next_batch(), rank, world) if sft else None  # the global ptx batch
                    updates.append(update(m, batch, mb_rows, n, cfg, run, ptx, key=(step, len(updates))))
                    bad_in_a_row = bad_updates_in_a_row(bad_in_a_row, updates[-1], step, cfg, run.critic)  # or stop
            checkpoint.reshard(m["ref"], m["actor"])  # roots gathered by no-grad forwards (--kl_loss_coef, warmup)
            t3 = phase_end(device, peaks, "train")

            # ---- 6. adaptive KL controller, on the KL that went into the reward
            metrics = step_metrics(mask, sc, score, kl, rewards, ret, ro.ended, ro.logprobs, updates, kl_ctl.value,
                                   run.rows, run.trained, cfg)  # kl_ctl.value: the step's beta, before the update
            kl_ctl.update(metrics.get("objective/kl", 0.0), run.rows)  # (no reference: beta 0, fixed)

            # ---- log, and checkpoint every save_every steps, at the end, and when a signal asks to stop
            counted = counters(step, cfg, sampler)
            metrics.update({"val/reward_errors": all_sum(float(reward_errors)).item(),  # all ranks
                            **reward_means(reward.extras)} if reward else {})  # what the function said beside scores
            times = phase_times(t0, t1, t2, t3, time.time(), metrics["val/response_length"] * run.rows)
            metrics.update(step=step, **learning_rates(m, run.trained), **counted, **times, **peaks, **rollouts.metrics,
                           **score_norm.metrics)
            log.log(dict(sorted(metrics.items())), sample=(sc["score"][0].item(), prompts.texts[rows[0]], texts[0]))
            stopping = stop.requested(all_sum)  # every rank stops at the same step
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.total_steps or stopping:
                checkpoint.save_step(cfg, step, m, run.trained, stateful, run_id=run_id, bad_in_a_row=bad_in_a_row,
                                     **log.state())
                checkpoint.export(m["actor"], tokenizer, cfg, stop_ids, pad_id)
            if evalset and due(step, cfg) and not stopping:  # after the checkpoint: a failed evaluation loses no step
                log.log_eval(*evaluate_at(step, counted))
            if stopping:
                print0(f"stopped by signal {stop.received[0] if stop.received else '(on another rank)'} "
                       f"after step {step}; resume with --resume=auto --out_dir={cfg.out_dir}")
                break
        if 0 < cfg.total_steps < first_step:  # resumed after its last step, perhaps killed in its export: export again
            print0(f"no step left after step {done} (total_steps {cfg.total_steps}): exporting its actor again")
            checkpoint.export(m["actor"], tokenizer, cfg, stop_ids, pad_id)
    except torch.OutOfMemoryError as e:  # where it ran out, the phase's plan, and the flags that would shrink it
        e.add_note(plan.out_of_memory(cfg, run, step, e))
        raise
    finally:
        stop.close()  # the caller's SIGTERM / SIGINT handlers back (a Ctrl-C after main() interrupts again)
        rollouts.close()
        release()  # out_dir/.lock (a run killed before this point leaves a stale lock: the next run takes it over)
    log.close()
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()
    return log.history[-1] if log.history else None


def command_line(argv=None):
    """`python ppo.py [flags]` (argv, else sys.argv[1:]): fire parses the flags into a Config and main() runs it.
    The exit status: 0; 1 for a dry run that does not fit; 2 for a usage error, one line without a traceback
    (PPO_DEBUG=1 shows it; runtime.run_command)."""
    script = os.path.basename(sys.argv[0])  # ppo.py, or a fork's script that ends with ppo.command_line()
    result = run_command(Config, main, argv, name=script if script.endswith(".py") else "ppo.py")
    return result if isinstance(result, int) else 1 if result and result.get("fits") is False else 0


if __name__ == "__main__":
    status = command_line()
    # Skip the interpreter's teardown, where torch's gloo backend can abort under load ("terminate called without an
    # active exception", after destroy_process_group), failing a finished run or turning exit status 2 into an abort.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(status)

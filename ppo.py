"""
PPO for RLHF, top to bottom: one main() with the whole algorithm in view.

Four models (Ouyang et al. 2022; Ziegler et al. 2019):
    actor      trained, starts from the SFT checkpoint            (FSDP2, AdamW)
    critic     trained, one value per token, from the reward model (FSDP2, AdamW)
               or, with a built-in reward function, from the actor with a fresh scalar head
    reference  frozen copy of the initial actor, for the KL penalty
    reward     frozen sequence-classification model, or a built-in reward function

Each step:
    1. rollout   sample responses with a KV cache (rollout.py) from the actor's full weights
    2. score     no grad: old_logp and entropy (actor), ref_logp (reference), values (critic),
                 the sequence score (reward model / function)
    3. reward    r_t = -beta * kl_t on every response token, + score on the last one (gae.py)
    4. GAE       advantages and returns, advantages whitened over the whole batch (all ranks)
    5. optimise  ppo_epochs x minibatches x micro-batches:
                   ratio = exp(logp - old_logp)
                   pg    = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))   [dual clip: min(pg, -c*A) for A < 0]
                   vf    = 0.5 * max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)
                   actor loss = pg - entropy_coef * H [+ kl_loss_coef * KL(pi || ref)] [+ ptx_coef * SFT NLL]
    6. adaptive KL (optional): beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon

Loss aggregation: every per-token term is summed over the minibatch's response tokens and
divided by their number across ALL ranks (a token mean over the minibatch), so the loss and its
gradient do not change when a minibatch is split into micro-batches or across ranks.
logprob, entropy and KL come from the fused kernels in kernels/ on the actor's hidden states:
the (tokens, vocab) logits are never materialised in the training step.
The same temperature divides the logits in sampling and in every logprob.

    python ppo.py                                               # the embedded default (CPU, ~10 min)
    torchrun --nproc_per_node 8 ppo.py --model=... --reward_model=... --prompts=...
"""
import json
import math
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from data import PromptSampler, left_pad, load_prompts, load_sft
from gae import (AdaptiveKLController, FixedKLController, compute_gae, kl_estimate, masked_var, masked_whiten,
                 shape_rewards)
from kernels import linear_logprob_entropy
from model import Transformer, load_tokenizer, reward_at_last_token
from rollout import generate


@dataclass
class Config:
    # models and data
    model: str = "smollm2"  # actor and reference: HF folder, Hub id, .gguf file, or "smollm2" (embedded)
    reward_model: str = ""  # sequence-classification reward model; "" uses the built-in reward_fn
    reward_fn: str = "sentiment"  # built-in reward when there is no reward model (see REWARD_FNS)
    prompts: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl")  # JSONL prompts
    prompt_key: str = "prompt"  # field holding a prompt string
    messages_key: str = "messages"  # field holding a chat message list
    max_prompt_len: int = 64  # longer prompts are dropped (and counted), never cut
    sft_data: str = ""  # optional JSONL of prompt/response pairs for the ptx (SFT) loss
    ptx_coef: float = 0.0  # weight of the SFT loss mixed into the actor loss (needs sft_data)
    out_dir: str = "out"  # metrics.jsonl and checkpoints
    # rollout
    total_steps: int = 16  # PPO steps (one rollout batch each)
    rollout_batch_size: int = 16  # prompts per step, over all ranks
    max_new_tokens: int = 24  # response length limit
    temperature: float = 0.7  # sampling temperature, also used in every logprob
    # reward
    kl_coef: float = 0.05  # beta: weight of the KL penalty in the per-token reward
    kl_estimator: str = "k1"  # k1 | k2 | k3 (d = logp - ref_logp: d, d^2/2, exp(-d)-1+d)
    use_absolute_kl: bool = False  # penalise |kl_t| instead of kl_t (NeMo-Aligner)
    target_kl: float = 0.0  # adaptive KL target (sum over a response); 0 keeps beta fixed
    kl_horizon: int = 10000  # adaptive KL horizon, in samples
    kl_loss_coef: float = 0.0  # weight of the exact KL(pi || ref) over the vocabulary as an actor loss term
    score_clip: float = 0.0  # clip the score to [-c, c]; 0 disables
    non_stop_penalty: float | None = None  # score given to responses that never reached EOS; None disables
    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE lambda
    # PPO
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batch_size: int = 8  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 8  # sequences per forward/backward on one rank (gradient accumulation)
    clip_coef: float = 0.2  # policy ratio clip epsilon
    dual_clip: float = 0.0  # dual clip constant c > 1 (Ye et al. 2020); 0 disables
    loss_clip_val: float = 0.2  # critic value clip eps_v around the rollout values; 0 disables
    entropy_coef: float = 0.0  # entropy bonus weight
    whiten_advantages: bool = True  # normalise advantages over the batch (all ranks)
    lr: float = 5e-5  # actor learning rate
    critic_lr: float = 5e-5  # critic learning rate
    warmup_steps: int = 0  # linear warmup, in optimizer steps
    lr_schedule: str = "constant"  # constant | linear (decay to 0 at the last optimizer step)
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping per model
    # system
    dtype: str = "auto"  # compute dtype: bf16 (fp32 master weights) | fp32 | auto: bf16 where it is fast (see cpu_has_bf16)
    seed: int = 1  # seeds everything, per rank where it must differ
    log_every: int = 1  # metrics line every N steps
    sample_every: int = 4  # print one prompt/response every N steps; 0 disables
    save_every: int = 0  # training checkpoint + HF-format actor every N steps (and at the end); 0 = only at the end
    resume: str = ""  # a checkpoint folder, or "auto" for the newest complete one in out_dir/checkpoints
    max_bad_updates: int = 3  # stop after this many non-finite updates in a row (each one is skipped)
    keep_checkpoints: int = 2  # training checkpoints kept in out_dir/checkpoints (the newest ones)
    wandb: bool = False  # also log to Weights & Biases (wandb_project)
    wandb_project: str = "ppo"
    # derived in finalize()
    world_size: int = field(default=1, repr=False)
    rank: int = field(default=0, repr=False)

    def finalize(self, rank, world_size):
        self.rank, self.world_size = rank, world_size
        W = world_size
        assert self.rollout_batch_size % W == 0, f"rollout_batch_size {self.rollout_batch_size} must divide by {W} ranks"
        assert self.mini_batch_size % W == 0, f"mini_batch_size {self.mini_batch_size} must divide by {W} ranks"
        assert self.rollout_batch_size % self.mini_batch_size == 0, \
            f"rollout_batch_size {self.rollout_batch_size} must be a multiple of mini_batch_size {self.mini_batch_size}"
        self.micro_batch_size = min(self.micro_batch_size, self.mini_batch_size // W)  # at most one per minibatch
        assert (self.mini_batch_size // W) % self.micro_batch_size == 0, \
            f"per-rank minibatch {self.mini_batch_size // W} must be a multiple of micro_batch_size {self.micro_batch_size}"
        assert self.temperature > 0, "temperature must be > 0: PPO needs the logprobs of a sampling distribution"
        assert self.kl_estimator in ("k1", "k2", "k3"), f"kl_estimator must be k1, k2 or k3, not {self.kl_estimator!r}"
        assert self.lr_schedule in ("constant", "linear"), f"lr_schedule must be constant or linear, not {self.lr_schedule!r}"
        assert self.dtype in ("auto", "bf16", "fp32"), f"dtype must be auto, bf16 or fp32, not {self.dtype!r}"
        assert not (self.ptx_coef > 0 and not self.sft_data), "ptx_coef > 0 needs --sft_data"
        assert self.dual_clip == 0 or self.dual_clip > 1, "dual_clip must be > 1 (or 0 to disable)"
        return self

    @property
    def local_rollout(self):
        return self.rollout_batch_size // self.world_size

    @property
    def local_mini(self):
        return self.mini_batch_size // self.world_size

    @property
    def optimizer_steps(self):
        return self.total_steps * self.ppo_epochs * (self.rollout_batch_size // self.mini_batch_size)


# -----------------------------------------------------------------------------
# built-in reward functions: responses (decoded text) -> one score each

POSITIVE = set("""good great excellent wonderful amazing fantastic lovely beautiful delightful happy joy
joyful love loved loving enjoy enjoyed enjoyable pleasant perfect best brilliant awesome nice fun kind warm
glad grateful thankful cheerful bright fresh delicious tasty friendly helpful charming gorgeous superb
incredible outstanding marvelous magnificent splendid pleased proud calm peaceful relaxing cozy comfortable
favorite favourite sweet smile smiles smiling laugh laughter exciting excited inspiring hope hopeful success
successful win winning positive fine well better impressive remarkable stunning lively vibrant glorious
blessed thrilled adore adorable recommend memorable treasure gentle generous""".split())
NEGATIVE = set("""bad terrible awful horrible poor sad angry hate hated boring dull ugly worst worse
disappointing disappointed annoying annoyed unpleasant painful pain cold rude dirty broken wrong fail failed
failure problem problems difficult hard tired sick miserable lonely afraid scared fear worried worry stress
stressful upset unhappy mediocre bland noisy crowded expensive slow late lost mess messy gross nasty
disgusting dreadful gloomy grim cruel harsh bitter regret sorry negative tragic""".split())


def sentiment_reward(texts):
    """Lexicon sentiment: 10 * (positive words - negative words) / (words + 5), clipped to [-5, 5].
    A density, not a count, so padding a response with more words does not pay by itself."""
    scores = []
    for t in texts:
        words = re.findall(r"[a-z']+", t.lower())
        pos = sum(w in POSITIVE for w in words)
        neg = sum(w in NEGATIVE for w in words)
        scores.append(max(-5.0, min(5.0, 10.0 * (pos - neg) / (len(words) + 5))))
    return scores


REWARD_FNS = {"sentiment": sentiment_reward}


# -----------------------------------------------------------------------------
# distributed helpers (one code path for 1 process and for N)


def setup_distributed():
    """Starts a process group whether or not torchrun did: nccl on GPU, gloo on CPU."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group("nccl" if cuda else "gloo")
        else:  # plain `python ppo.py`: a group of one, on an in-memory store (no port to collide on)
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def cpu_has_bf16():
    """bf16 matmuls are fast on CPUs with AVX512-BF16 or AMX; elsewhere (AVX2) they are several
    times slower than float32, so the CPU default then stays float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_sum(x):
    """Sums a float64 tensor (or a list of floats) over ranks; returns the tensor."""
    t = torch.as_tensor(x, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = t.to(dev)
        dist.all_reduce(t)
    return t.cpu()


def shard(model, mesh, dtype):
    """FSDP2: each transformer block is one unit, the root holds the embeddings, norm and head."""
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def frozen_copy(model, device, dtype):
    """A plain (unsharded, no grad) copy in the compute dtype: the reference, the generation engine."""
    with torch.device("meta"):
        copy = Transformer(model.config, head=model.head)
    state = {k: v.detach().to(device=device, dtype=dtype, copy=True) for k, v in model.state_dict().items()}
    copy.load_state_dict(state, assign=True)  # copy=True: never share storage with the trained actor
    copy.hf_config = model.hf_config
    return copy.requires_grad_(False)


def check_same_tokenizer(tokenizer, policy_path, reward_path):
    other = load_tokenizer(reward_path)
    if other.get_vocab() != tokenizer.get_vocab() or other.eos_token_id != tokenizer.eos_token_id:
        raise ValueError(f"the policy {policy_path} and the reward model {reward_path} use different tokenizers: "
                         "the reward model would read other tokens than the policy wrote")


@torch.no_grad()
def copy_full_weights(src, dst):
    """Gathers the sharded actor's parameters into the plain generation copy (all ranks take part)."""
    dst_params = dict(dst.named_parameters())
    for name, p in src.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        dst_params[name].copy_(full)


def grad_norm_and_clip(model, max_norm):
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


# -----------------------------------------------------------------------------
# the forward passes PPO needs, on a batch dict (one micro-batch at a time)
#   tokens, attention_mask, position_ids (B, P+R); response_mask (B, R); P = prompt width


def response_labels(mb):
    """(B, P+R) labels: position t predicts token t+1; -100 outside the response."""
    P, tokens = mb["P"], mb["tokens"]
    labels = torch.full_like(tokens, -100)
    labels[:, P - 1 : -1] = torch.where(mb["response_mask"], tokens[:, P:], -100)
    return labels


def policy_forward(actor, mb, temperature, ref=None):
    """logp and entropy (B, R) of the actor; with `ref` also ref_logp and the exact kl to it.
    float32, 0 off the response. The reference is frozen: no gradient flows into it."""
    P = mb["P"]
    labels = response_labels(mb)
    kw, out = {}, {}
    if ref is not None:
        sel = labels != -100
        with torch.no_grad():
            ref_h = ref(mb["tokens"], mb["attention_mask"], mb["position_ids"], return_hidden=True)[sel]  # (N, H)
            ref_lp, _ = linear_logprob_entropy(ref_h, ref.lm_head_weight, labels[sel], temperature)
        out["ref_logp"] = torch.zeros(labels.shape, device=ref_lp.device).masked_scatter(sel, ref_lp)
        kw = dict(ref_hidden=ref_h, ref_weight=ref.lm_head_weight)
    out.update(actor(mb["tokens"], mb["attention_mask"], mb["position_ids"], labels=labels,
                     temperature=temperature, **kw))
    return {k: v[:, P - 1 : -1] for k, v in out.items()}


def value_forward(critic, mb):
    """values (B, R) float32: the critic's estimate at the state before each response token."""
    P = mb["P"]
    return critic(mb["tokens"], mb["attention_mask"], mb["position_ids"])[:, P - 1 : -1].float()


def micro_batches(batch, rows, size):
    """Slices of the batch dict over `rows` (a LongTensor of row indices), `size` rows at a time."""
    for i in range(0, len(rows), size):
        r = rows[i : i + size]
        yield {k: (v[r] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}


@torch.no_grad()
def score_batch(actor, ref, critic, reward_model, reward_fn, batch, cfg):
    """Step 2, in the same micro-batches and code path as training (so the first ratio is exactly 1):
    old_logp, entropy, ref_logp, kl (exact, over the vocabulary), values (B, R), score (B,)."""
    parts = []
    rows = torch.arange(batch["tokens"].size(0), device=batch["tokens"].device)
    for mb in micro_batches(batch, rows, cfg.micro_batch_size):
        pol = policy_forward(actor, mb, cfg.temperature, ref=ref)
        part = dict(old_logp=pol["logp"], entropy=pol["entropy"], ref_logp=pol["ref_logp"], kl_exact=pol["kl"],
                    values=value_forward(critic, mb))
        if reward_model is not None:
            v = reward_model(mb["tokens"], mb["attention_mask"], mb["position_ids"])
            part["score"] = reward_at_last_token(v, mb["attention_mask"]).float()
        parts.append(part)
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if reward_model is None:
        out["score"] = torch.tensor(reward_fn(batch["response_texts"]), dtype=torch.float32, device=rows.device)
    if not torch.isfinite(out["score"]).all():
        raise FloatingPointError(f"the reward gave non-finite scores: {out['score'].tolist()}")
    return out


def ppo_losses(actor, critic, mb, cfg, n_tokens, ref=None):
    """Step 5 on one micro-batch -> (actor_loss, critic_loss, stats).

    Per-token terms are summed over the micro-batch's response tokens and divided by n_tokens,
    the minibatch's response-token count over all ranks, then multiplied by the world size
    because FSDP averages gradients over ranks: summed over micro-batches and ranks this is the
    token mean over the minibatch. Rollout tensors are cleaned outside the mask first, so a NaN
    in a padded slot reaches neither the loss nor the gradient."""
    mask = mb["response_mask"]
    adv, ret, old_logp, old_values = (torch.where(mask, mb[k], 0.0) for k in ("adv", "ret", "old_logp", "old_values"))
    pol = policy_forward(actor, mb, cfg.temperature, ref=ref if cfg.kl_loss_coef > 0 else None)

    # clipped surrogate (Schulman et al. 2017), optional dual clip (Ye et al. 2020)
    logratio = torch.where(mask, pol["logp"] - old_logp, 0.0)
    ratio = logratio.exp()
    pg_losses = -adv * ratio
    pg_losses2 = -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)
    pg = torch.max(pg_losses, pg_losses2)
    if cfg.dual_clip > 0:
        pg = torch.where(adv < 0, torch.min(pg, -cfg.dual_clip * adv), pg)
    actor_tok = pg - cfg.entropy_coef * pol["entropy"]
    if cfg.kl_loss_coef > 0:
        actor_tok = actor_tok + cfg.kl_loss_coef * pol["kl"]

    # clipped value loss around the rollout's values
    vpred = value_forward(critic, mb)
    vf_losses = (vpred - ret).square()
    if cfg.loss_clip_val > 0:
        vclipped = old_values + (vpred - old_values).clamp(-cfg.loss_clip_val, cfg.loss_clip_val)
        vf_losses2 = (vclipped - ret).square()
        vf = 0.5 * torch.max(vf_losses, vf_losses2)
    else:
        vf_losses2 = vf_losses
        vf = 0.5 * vf_losses

    def tsum(x):  # select, don't multiply: NaN * 0 = NaN
        return torch.where(mask, x, 0.0).sum()

    scale = cfg.world_size / n_tokens
    stats = dict(policy_loss=tsum(pg), value_loss=tsum(vf), entropy=tsum(pol["entropy"]),
                 approxkl=tsum(0.5 * logratio.square()), clipfrac=tsum((pg_losses2 > pg_losses).float()),
                 vf_clipfrac=tsum((vf_losses2 > vf_losses).float()), ratio=tsum(ratio), ratio_sq=tsum(ratio.square()))
    stats = {k: v.detach().double().item() for k, v in stats.items()}
    return tsum(actor_tok) * scale, tsum(vf) * scale, stats


def ptx_loss(actor, sft, rows, device):
    """Supervised NLL (token mean, this rank) on prompt/response pairs: keeps the SFT skills."""
    pairs = [sft.pairs[i] for i in rows]
    tokens, attn, pos = (t.to(device) for t in left_pad([p + r for p, r in pairs], 0))
    labels = torch.full_like(tokens, -100)
    T = tokens.size(1)
    for b, (p, r) in enumerate(pairs):  # position t predicts token t+1: the response tokens
        labels[b, T - len(r) - 1 : T - 1] = tokens[b, T - len(r) :]
    out = actor(tokens, attn, pos, labels=labels)
    return -out["logp"].sum() / (labels != -100).sum()


def lr_lambda(cfg):
    total = cfg.optimizer_steps

    def f(i):
        warm = min(1.0, (i + 1) / cfg.warmup_steps) if cfg.warmup_steps > 0 else 1.0
        decay = 1.0 - i / total if cfg.lr_schedule == "linear" else 1.0
        return warm * max(decay, 0.0)

    return f


@torch.no_grad()
def save_hf(actor, tokenizer, folder):
    """HF-format actor (config + safetensors + tokenizer): every rank gathers, rank 0 writes atomically."""
    sd = get_model_state_dict(actor, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        with torch.device("meta"):
            plain = Transformer(actor.config, head=actor.head)
        plain.load_state_dict(sd, assign=True)
        plain.hf_config = actor.hf_config
        plain.save_pretrained(folder, tokenizer)
    dist.barrier()


# -----------------------------------------------------------------------------
# training checkpoints: everything needed to continue exactly where a run stopped
#   out_dir/checkpoints/step-000040/   .metadata + *.distcp  actor, critic and both optimizers (DCP, sharded)
#                                      trainer.pt            step, schedulers, KL controller, samplers, metrics
#                                      rng-rank{r}.pt        every RNG of rank r
#                                      config.json
# Written into step-N.tmp and renamed when every rank is done: a crash mid-write leaves the
# previous checkpoint as it was. DCP reshards, so a checkpoint loads on another number of ranks
# (ranks that did not exist then draw fresh sampling seeds).

MAY_CHANGE_ON_RESUME = {"total_steps", "save_every", "log_every", "sample_every", "wandb", "wandb_project",
                        "out_dir", "resume", "max_bad_updates", "keep_checkpoints", "world_size", "rank"}
CHECKPOINT_FILES = (".metadata", "trainer.pt", "config.json")


def rng_state(gens):
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                **{k: g.get_state() for k, g in gens.items()})


def set_rng_state(state, gens):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for k, g in gens.items():
        g.set_state(state[k])


def save_checkpoint(folder, modules, trainer, gens, cfg):
    """modules: {"actor": (model, optimizer), ...}; trainer: a picklable dict (rank 0's is kept)."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp, rank = folder + ".tmp", dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while writing
        os.makedirs(tmp)
    dist.barrier()
    state = {}
    for name, (model, opt) in modules.items():
        state[name], state[name + "_optim"] = get_state_dict(model, opt)
    dcp.save(state, checkpoint_id=tmp)
    torch.save(rng_state(gens), os.path.join(tmp, f"rng-rank{rank}.pt"))
    if rank == 0:
        torch.save(trainer, os.path.join(tmp, "trainer.pt"))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)
    dist.barrier()
    if rank == 0:
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.replace(tmp, folder)  # the commit point
        root = os.path.dirname(folder)
        old = sorted(n for n in os.listdir(root) if re.fullmatch(r"step-\d+", n))[: -cfg.keep_checkpoints]
        for n in old:
            shutil.rmtree(os.path.join(root, n))
    dist.barrier()


def find_checkpoint(cfg):
    """The folder to resume from, or None. "auto": the newest complete one in out_dir/checkpoints."""
    if cfg.resume != "auto":
        missing = [f for f in CHECKPOINT_FILES if not os.path.isfile(os.path.join(cfg.resume, f))]
        if not os.path.isdir(cfg.resume) or missing:
            raise FileNotFoundError(f"cannot resume from {cfg.resume}: "
                                    + ("no such folder" if not os.path.isdir(cfg.resume) else
                                       f"incomplete checkpoint, missing {missing}"))
        return cfg.resume
    root = os.path.join(cfg.out_dir, "checkpoints")
    names = sorted(n for n in os.listdir(root) if re.fullmatch(r"step-\d+", n)) if os.path.isdir(root) else []
    complete = [n for n in names if all(os.path.isfile(os.path.join(root, n, f)) for f in CHECKPOINT_FILES)]
    return os.path.join(root, complete[-1]) if complete else None


def load_checkpoint(folder, modules, gens, cfg):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    now = asdict(cfg)
    diff = {k: (saved.get(k), now[k]) for k in now if k not in MAY_CHANGE_ON_RESUME and saved.get(k) != now[k]}
    if diff:
        raise ValueError(f"checkpoint {folder} is from another config; differences (saved, now): {diff}")
    state = {}
    for name, (model, opt) in modules.items():
        state[name], state[name + "_optim"] = get_state_dict(model, opt)
    dcp.load(state, checkpoint_id=folder)
    for name, (model, opt) in modules.items():
        set_state_dict(model, opt, model_state_dict=state[name], optim_state_dict=state[name + "_optim"])
    trainer = torch.load(os.path.join(folder, "trainer.pt"), weights_only=False)
    rng_file = os.path.join(folder, f"rng-rank{dist.get_rank()}.pt")
    if os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False), gens)
    else:  # a rank the saving run did not have
        for i, g in enumerate(gens.values()):
            g.manual_seed(cfg.seed * 1000 + 7919 * trainer["step"] + 101 * dist.get_rank() + i)
    return trainer


# -----------------------------------------------------------------------------
# the main loop


def main(reward_fn=None, **overrides):
    """`python ppo.py --key=value ...`; reward_fn (texts -> scores) replaces the built-in one from Python."""
    cfg = Config(**overrides)
    rank, world, device = setup_distributed()
    cfg.finalize(rank, world)
    master = rank == 0
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # same on every rank: the critic's fresh head must agree before sharding
    if cfg.dtype == "auto":
        cfg.dtype = "bf16" if device.type == "cuda" or cpu_has_bf16() else "fp32"
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    mesh = init_device_mesh(device.type, (world,))
    os.makedirs(cfg.out_dir, exist_ok=True)
    print0(f"config: {json.dumps(asdict(cfg))}")

    # ---- models: actor (trained), reference (frozen), critic (trained), reward model (frozen)
    tokenizer = load_tokenizer(cfg.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # full weights are read on the CPU; fully_shard moves each rank's shards to the device
    actor = Transformer.from_pretrained(cfg.model, dtype=torch.float32, device="cpu")
    ctx = actor.config.max_position_embeddings
    if cfg.max_prompt_len + cfg.max_new_tokens > ctx:
        raise ValueError(f"max_prompt_len {cfg.max_prompt_len} + max_new_tokens {cfg.max_new_tokens} "
                         f"does not fit the context of {cfg.model} ({ctx} positions)")
    ref = frozen_copy(actor, device, dtype)
    gen = frozen_copy(actor, device, dtype)  # generation copy, refreshed from the actor every step
    reward_model = None
    if cfg.reward_model:
        check_same_tokenizer(tokenizer, cfg.model, cfg.reward_model)
        reward_model = Transformer.from_pretrained(cfg.reward_model, dtype=dtype, device=device).requires_grad_(False)
        if reward_model.config.vocab_size != actor.config.vocab_size:
            raise ValueError(f"policy {cfg.model} (vocab {actor.config.vocab_size}) and reward model "
                             f"{cfg.reward_model} (vocab {reward_model.config.vocab_size}) use different vocabularies")
        critic = Transformer.from_pretrained(cfg.reward_model, dtype=torch.float32, device="cpu", head="value")
        critic.score.bias = torch.nn.Parameter(torch.zeros(1))  # the RM's head has none; the critic may learn one
    else:
        reward_fn = reward_fn or REWARD_FNS[cfg.reward_fn]
        critic = actor.critic()
    shard(actor, mesh, dtype)
    shard(critic, mesh, dtype)
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, eps=1e-8)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=cfg.weight_decay, eps=1e-8)
    actor_sched = torch.optim.lr_scheduler.LambdaLR(actor_opt, lr_lambda(cfg))
    critic_sched = torch.optim.lr_scheduler.LambdaLR(critic_opt, lr_lambda(cfg))

    # ---- data
    prompts = load_prompts(cfg.prompts, tokenizer, cfg.max_prompt_len, cfg.prompt_key, cfg.messages_key)
    print0(f"prompts: {len(prompts)} from {cfg.prompts}, {prompts.n_dropped} dropped (longer than {cfg.max_prompt_len} tokens)")
    sampler = PromptSampler(len(prompts), cfg.rollout_batch_size, rank, world, cfg.seed)
    sft = load_sft(cfg.sft_data, tokenizer, cfg.max_prompt_len + cfg.max_new_tokens) if cfg.sft_data else None
    sft_sampler = PromptSampler(len(sft), cfg.micro_batch_size * world, rank, world, cfg.seed) if sft else None
    kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon) if cfg.target_kl > 0 else FixedKLController(cfg.kl_coef)
    gen_rng = torch.Generator(device).manual_seed(cfg.seed * 1000 + rank)  # sampling
    shuffle_rng = torch.Generator().manual_seed(cfg.seed * 1000 + 500 + rank)  # minibatch order

    # ---- resume: models, optimizers, schedulers, KL controller, samplers, RNGs, metrics so far
    modules = {"actor": (actor, actor_opt), "critic": (critic, critic_opt)}
    gens = {"gen_rng": gen_rng, "shuffle_rng": shuffle_rng}
    history, start = [], 1
    ckpt = find_checkpoint(cfg) if cfg.resume else None
    if ckpt:
        tr = load_checkpoint(ckpt, modules, gens, cfg)
        actor_sched.load_state_dict(tr["actor_sched"])
        critic_sched.load_state_dict(tr["critic_sched"])
        kl_ctl.load_state_dict(tr["kl_ctl"])
        sampler.load_state_dict(tr["sampler"])
        if sft_sampler is not None:
            sft_sampler.load_state_dict(tr["sft_sampler"])
        history, start = tr["metrics"], tr["step"] + 1
        print0(f"resumed from {ckpt} at step {tr['step']}")
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if master:  # the metrics file holds exactly the steps the models have seen
        with open(metrics_path + ".tmp", "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in history)
        os.replace(metrics_path + ".tmp", metrics_path)

    def trainer_state(step):
        return dict(step=step, actor_sched=actor_sched.state_dict(), critic_sched=critic_sched.state_dict(),
                    kl_ctl=kl_ctl.state_dict(), sampler=sampler.state_dict(),
                    sft_sampler=sft_sampler.state_dict() if sft_sampler else None, metrics=history)

    # SIGTERM / SIGINT (what a cluster sends before preemption): finish the step, checkpoint, exit
    signals = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: signals.append(signum))

    wandb_run = None
    if cfg.wandb and master:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("--wandb needs the wandb package: pip install wandb") from e
        wandb_run = wandb.init(project=cfg.wandb_project, config=asdict(cfg))
    from tqdm import tqdm

    bar = tqdm(total=cfg.total_steps, initial=start - 1, disable=not master, desc="ppo", dynamic_ncols=True,
               file=sys.stderr)
    bad_in_a_row, m = 0, None
    for step in range(start, cfg.total_steps + 1):
        t0 = time.time()
        # ---- 1. rollout: sample from the actor's full weights with a KV cache
        rows = sampler.next_batch()
        copy_full_weights(actor, gen)
        ro = generate(gen, [prompts.ids[i] for i in rows], cfg.max_new_tokens, temperature=cfg.temperature,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_id, generator=gen_rng)
        mask = ro.response_mask  # (B, R) bool
        texts = [tokenizer.decode(ro.tokens[b, ro.prompt_len :][mask[b]].tolist(), skip_special_tokens=True)
                 for b in range(mask.size(0))]
        batch = dict(tokens=ro.tokens, attention_mask=ro.attention_mask, position_ids=ro.position_ids,
                     response_mask=mask, P=ro.prompt_len, response_texts=texts)
        t1 = time.time()

        # ---- 2. score (no grad), in the training forward's micro-batches
        sc = score_batch(actor, ref, critic, reward_model, reward_fn, batch, cfg)

        # ---- 3. per-token reward: -beta * kl_t, plus the score at the last response token
        rewards, kl = shape_rewards(sc["score"], sc["old_logp"], sc["ref_logp"], mask, kl_ctl.value, cfg.kl_estimator,
                                    cfg.use_absolute_kl, cfg.score_clip or None, ro.ended, cfg.non_stop_penalty)

        # ---- 4. GAE, then advantages whitened over the whole batch (all ranks)
        adv, ret = compute_gae(rewards, sc["values"], mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            adv = masked_whiten(adv, mask)
        batch.update(old_logp=sc["old_logp"], old_values=sc["values"], adv=adv, ret=ret)
        t2 = time.time()

        # ---- 5. PPO epochs x minibatches x micro-batches
        mb_stats, n_skipped = [], 0
        for epoch in range(cfg.ppo_epochs):
            perm = torch.randperm(cfg.local_rollout, generator=shuffle_rng).to(device)
            for start in range(0, cfg.local_rollout, cfg.local_mini):
                mb_rows = perm[start : start + cfg.local_mini]
                n_tokens = all_sum(mask[mb_rows].sum().item()).item()  # the minibatch's tokens, all ranks
                sums = {}
                for mb in micro_batches(batch, mb_rows, cfg.micro_batch_size):
                    actor_loss, critic_loss, st = ppo_losses(actor, critic, mb, cfg, n_tokens, ref)
                    (actor_loss + critic_loss).backward()
                    sums = {k: sums.get(k, 0.0) + v for k, v in st.items()}
                if sft is not None and cfg.ptx_coef > 0:
                    ptx = ptx_loss(actor, sft, sft_sampler.next_batch(), device)
                    (cfg.ptx_coef * ptx).backward()
                    sums["ptx"] = ptx.item() * n_tokens / world  # a mean: undone below
                actor_norm = grad_norm_and_clip(actor, cfg.max_grad_norm)
                critic_norm = grad_norm_and_clip(critic, cfg.max_grad_norm)
                if math.isfinite(actor_norm) and math.isfinite(critic_norm):
                    actor_opt.step()
                    critic_opt.step()
                    bad_in_a_row = 0
                else:  # a non-finite loss or gradient: skip this update, keep the weights
                    n_skipped += 1
                    bad_in_a_row += 1
                    if bad_in_a_row >= cfg.max_bad_updates:
                        raise FloatingPointError(
                            f"step {step}: {bad_in_a_row} updates in a row with a non-finite gradient "
                            f"(actor norm {actor_norm}, critic norm {critic_norm}); stopping. The last "
                            f"checkpoint in {cfg.out_dir}/checkpoints is untouched: lower the learning rate and resume")
                actor_opt.zero_grad(set_to_none=True)
                critic_opt.zero_grad(set_to_none=True)
                actor_sched.step()
                critic_sched.step()
                mb_stats.append((n_tokens, sums, actor_norm, critic_norm))
        t3 = time.time()

        # ---- 6. adaptive KL controller, on the KL that went into the reward
        seq_kl = kl.sum(1).double()  # (B,) per response
        B_all = cfg.rollout_batch_size
        kl_mean = all_sum(seq_kl.sum().item()).item() / B_all
        beta = kl_ctl.value
        kl_ctl.update(kl_mean, B_all)

        # ---- log: every number averaged over all minibatches (and all ranks)
        def gmean(x):  # mean over this step's sequences, all ranks
            return all_sum(float(x.double().sum())).item() / B_all

        n_resp = all_sum(mask.sum().item()).item()
        keys = list(mb_stats[0][1])
        per_mb = all_sum([[s[k] for k in keys] for _, s, _, _ in mb_stats])  # (n_mb, n_keys), summed over ranks
        tok = torch.tensor([n for n, _, _, _ in mb_stats], dtype=torch.float64)[:, None]
        avg = dict(zip(keys, (per_mb / tok).mean(0).tolist()))
        seq_k = {k: gmean(torch.where(mask, kl_estimate(sc["old_logp"], sc["ref_logp"], k), 0.0).sum(1))
                 for k in ("k1", "k2", "k3")}
        var_ret = float(masked_var(ret, mask))
        m = {
            "step": step,
            "objective/scores": gmean(sc["score"]),
            "objective/kl": kl_mean,
            "objective/kl_k1": seq_k["k1"],
            "objective/kl_k2": seq_k["k2"],
            "objective/kl_k3": seq_k["k3"],
            "objective/kl_exact": gmean(torch.where(mask, sc["kl_exact"], 0.0).sum(1)),
            "objective/kl_coef": beta,
            "objective/entropy": all_sum(torch.where(mask, sc["entropy"], 0.0).sum().item()).item() / n_resp,
            "objective/non_score_reward": -beta * kl_mean,
            "objective/rlhf_reward": gmean(torch.where(mask, rewards, 0.0).sum(1)),
            "policy/approxkl_avg": avg["approxkl"],
            "policy/clipfrac_avg": avg["clipfrac"],
            "policy/entropy_avg": avg["entropy"],
            "loss/policy_avg": avg["policy_loss"],
            "loss/value_avg": avg["value_loss"],
            "val/clipfrac_avg": avg["vf_clipfrac"],
            "val/ratio": avg["ratio"],
            "val/ratio_var": avg["ratio_sq"] - avg["ratio"] ** 2,
            "val/explained_var": 1.0 - float(masked_var(ret - sc["values"], mask)) / max(var_ret, 1e-12),
            "val/response_length": n_resp / B_all,
            "val/stop_rate": gmean(ro.ended.float()),
            "val/sampler_logprob_diff": all_sum(torch.where(mask, (ro.logprobs - sc["old_logp"]).abs(), 0.0).sum().item()).item() / n_resp,
            "val/grad_norm_actor": sum(a for _, _, a, _ in mb_stats) / len(mb_stats),
            "val/grad_norm_critic": sum(c for _, _, _, c in mb_stats) / len(mb_stats),
            "val/skipped_updates": n_skipped,
            "lr": actor_sched.get_last_lr()[0],
            "critic_lr": critic_sched.get_last_lr()[0],
            "time/rollout": t1 - t0,
            "time/score": t2 - t1,
            "time/train": t3 - t2,
            "time/step": time.time() - t0,
        }
        if "ptx" in avg:
            m["loss/ptx_avg"] = avg["ptx"]
        m["time/tokens_per_sec"] = n_resp / m["time/step"]
        history.append(m)
        if master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(m) + "\n")
            if wandb_run is not None:
                wandb_run.log(m, step=step)
            if step % cfg.log_every == 0:
                bar.write(f"step {step:4d} | score {m['objective/scores']:+.3f} | kl {m['objective/kl']:+.3f} "
                          f"| entropy {m['objective/entropy']:.3f} | clipfrac {m['policy/clipfrac_avg']:.3f} "
                          f"| vloss {m['loss/value_avg']:.4f} | len {m['val/response_length']:.1f} "
                          f"| stop {m['val/stop_rate']:.2f} | {m['time/step']:.1f}s")
            if cfg.sample_every and step % cfg.sample_every == 0:
                bar.write(f"--- sample (score {sc['score'][0].item():+.3f})\n{prompts.texts[rows[0]]}{texts[0]}\n---")
            bar.update(1)

        # ---- checkpoint: every save_every steps, at the end, and when a signal asks to stop
        stop = all_sum(float(len(signals))).item() > 0  # every rank stops at the same step
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.total_steps or stop:
            save_checkpoint(os.path.join(cfg.out_dir, "checkpoints", f"step-{step:06d}"), modules,
                            trainer_state(step), gens, cfg)
            save_hf(actor, tokenizer, os.path.join(cfg.out_dir, "actor"))
        if stop:
            print0(f"stopped by signal {signals[0] if signals else '(on another rank)'} after step {step}; "
                   f"resume with --resume=auto --out_dir={cfg.out_dir}")
            break
    bar.close()
    if wandb_run is not None:
        wandb_run.finish()
    dist.destroy_process_group()
    return m


if __name__ == "__main__":
    import fire

    fire.Fire(main)

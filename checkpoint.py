"""
Sharded state in and out: the run's models loaded from HF checkpoints into FSDP2 shards (build_models), and its
training checkpoints (save, find, resume).

Loading. Every model is built on the meta device from its config alone, sharded (each transformer block one FSDP2
unit, the root another), and filled from one read of the checkpoint on rank 0, broadcast a tensor at a time: no
other rank holds the full weights in host memory (an 8B model in float32 is 32 GB; a copy per rank would be 256 GB
on an 8-GPU node). hf.py reads the files, model.py checks them against the architecture.

Training checkpoints:
    out_dir/checkpoints/step-000040/   .metadata + *.distcp  actor, critic and both optimizers (DCP, sharded)
                                       trainer.pt            step, schedulers, KL controller, samplers, metrics
                                       rng-rank{r}.pt        the global RNGs of rank r (python, numpy, torch, cuda)
                                       config.json           the Config the run was started with
    out_dir/actor/                     the actor in HF format and its checkpoint's dtype (hf.save_hf)
    out_dir/metrics.jsonl              one line per step; on resume, cut back to the checkpoint's steps (runtime.py)

Every write goes to a temporary folder that is renamed when every rank is done: a crash mid-write
leaves the previous checkpoint as it was, and `--resume=auto` takes the newest complete one.
torch.distributed.checkpoint reshards on load, so a checkpoint continues on another number of ranks.
ppo.py draws all of its own randomness (sampling noise, minibatch order) from keys of (seed, step,
global row), never from a generator's running state, so a resumed run repeats the uninterrupted one on
any number of ranks; the global RNGs are saved anyway, for forks that use them.
"""
import json
import os
import random
import re
import shutil
from dataclasses import asdict, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from hf import check_same_tokenizer
from model import Transformer

# Config fields that may differ between a checkpoint and the run resuming it: where and how often it
# logs and saves, how batches are cut into micro-batches (the loss is a token mean over the minibatch and
# sampling noise is keyed by row, so that split changes nothing but float rounding), and where memory goes
# (recomputed blocks, offloaded frozen models).
# total_steps may change too, except under the linear LR schedule, whose horizon it is (check_config).
MAY_CHANGE_ON_RESUME = {"total_steps", "save_every", "log_every", "sample_every", "wandb", "wandb_project", "out_dir",
                        "resume", "max_bad_updates", "keep_checkpoints", "micro_batch_size",
                        "inference_micro_batch_size", "rollout_micro_batch_size", "activation_checkpointing",
                        "offload_frozen", "dry_run", "gpu_memory_gb"}
# How a run behaved before a Config field existed, where that is not the field's default: a checkpoint without the
# field resumes at this value (and is refused, naming it, at another). Before --is_correction, no weight: "none".
BEFORE_FIELD = {"is_correction": "none"}
CHECKPOINT_FILES = (".metadata", "trainer.pt", "config.json")  # present in every complete checkpoint
STEP_DIR = re.compile(r"step-\d+")


# -----------------------------------------------------------------------------
# models under FSDP2: built on the meta device, sharded, read once


def shard(model, mesh, dtype, frozen=False, offload=False):
    """FSDP2: each transformer block is one unit, the root holds the embeddings, norm and head. A trained model
    keeps float32 master weights and computes in `dtype`; a frozen one (reference, reward model) is stored in
    `dtype` itself, without grads or optimizer, optionally on the CPU between forwards (offload). Either way
    a rank holds 1/W of the bytes, and a forward gathers one block at a time (resharded after it)."""
    if frozen:
        kw = dict(offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
        model.to(dtype).requires_grad_(False)
    else:
        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def load_sharded(path, mesh, run, head=None, frozen=False, bias=False):
    """A model built on the meta device, sharded, then filled from the one copy rank 0 reads (a float32 state for
    a trained model, the compute dtype for a frozen one): set_model_state_dict broadcasts it a tensor at a time
    and each rank keeps its shard, so no other rank ever holds the full weights. bias: give a value head a bias
    (zero), as a critic from a reward model needs (the reward model's head has none)."""
    model = Transformer.from_pretrained(path, head=head, device="meta")
    if bias and model.score.bias is None:
        model.score.bias = torch.nn.Parameter(torch.zeros(1, device="meta"))
    offload = frozen and run.offload_frozen
    shard(model, mesh, run.dtype, frozen, offload)
    model.to_empty(device="cpu" if offload else run.device)
    state = {}
    if run.rank == 0:
        state = Transformer.read_state(path, head=head, dtype=run.dtype if frozen else torch.float32)
        if bias:
            state.setdefault("score.bias", torch.zeros(1))
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def frozen_like(actor, mesh, run):
    """The reference: the actor's initial weights in the compute dtype, sharded like it (a local copy per rank)."""
    with torch.device("meta"):
        ref = Transformer(actor.config, head=actor.head)
    shard(ref, mesh, run.dtype, frozen=True, offload=run.offload_frozen)
    ref.to_empty(device="cpu" if run.offload_frozen else run.device)
    with torch.no_grad():
        for (name, p), (name_a, q) in zip(ref.named_parameters(), actor.named_parameters(), strict=True):
            assert name == name_a, (name, name_a)
            p.to_local().copy_(q.to_local())
    ref.hf_config = actor.hf_config
    return ref


def build_models(cfg, run, tokenizer, mesh):
    """The run's models: the actor, and the critic when the advantage estimator has one (run.critic), FSDP2 with
    fp32 master weights; the reference and the reward model (FSDP2, frozen, compute dtype); the generation copy
    (whole on every rank, compute dtype; refilled from the actor before each rollout). Built on the meta device and
    read once, by rank 0. The critic starts from the reward model (which may learn a bias), or from the policy's
    backbone with a fresh head drawn on rank 0 from the seeded global RNG."""
    actor = load_sharded(cfg.model, mesh, run, head="lm")
    ctx = actor.config.max_position_embeddings
    if cfg.max_prompt_len + cfg.max_new_tokens > ctx:
        raise ValueError(f"max_prompt_len {cfg.max_prompt_len} + max_new_tokens {cfg.max_new_tokens} "
                         f"does not fit the context of {cfg.model} ({ctx} positions)")
    with torch.device("meta"):
        gen = Transformer(actor.config).to(run.dtype)
    gen = gen.to_empty(device=run.device).requires_grad_(False)  # filled by copy_weights_from before each rollout
    m = dict(actor=actor, ref=frozen_like(actor, mesh, run), gen=gen, reward_model=None)
    if cfg.reward_model:
        check_same_tokenizer(tokenizer, cfg.model, cfg.reward_model)
        m["reward_model"] = load_sharded(cfg.reward_model, mesh, run, head="value", frozen=True)
        V, V_rm = actor.config.vocab_size, m["reward_model"].config.vocab_size
        if V_rm != V:
            raise ValueError(f"policy {cfg.model} (vocab {V}) and reward model {cfg.reward_model} (vocab {V_rm}) "
                             "use different vocabularies")
    if run.critic:
        m["critic"] = (load_sharded(cfg.reward_model, mesh, run, head="value", bias=True) if cfg.reward_model
                       else load_sharded(cfg.model, mesh, run, head="value"))
    for name in run.trained:
        m[name].activation_checkpointing = run.activation_checkpointing
    return m


# -----------------------------------------------------------------------------
# training checkpoints


def rng_state():
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(folder, modules, trainer, cfg):
    """modules: {"actor": (model, optimizer), ...}, sharded or not; trainer: a picklable dict (rank 0's
    is kept); cfg: the Config dataclass. Every rank calls it."""
    tmp, rank = folder + ".tmp", dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while writing
        os.makedirs(tmp)
    dist.barrier()
    state = {}
    for name, (model, opt) in modules.items():
        state[name], state[name + "_optim"] = get_state_dict(model, opt)
    dcp.save(state, checkpoint_id=tmp)
    torch.save(rng_state(), os.path.join(tmp, f"rng-rank{rank}.pt"))
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
        names = sorted(n for n in os.listdir(root) if STEP_DIR.fullmatch(n))
        for n in names[: max(len(names) - cfg.keep_checkpoints, 0)]:  # keep the newest keep_checkpoints
            shutil.rmtree(os.path.join(root, n))
    dist.barrier()


def find(cfg):
    """The folder to resume from, or None, checked against cfg (check_config). cfg.resume: "" (none), "auto"
    (the newest complete checkpoint in out_dir/checkpoints, None when there is none) or a checkpoint folder
    (an error if it is incomplete)."""
    resume = cfg.resume
    if not resume:
        return None
    if resume != "auto":
        missing = [f for f in CHECKPOINT_FILES if not os.path.isfile(os.path.join(resume, f))]
        if not os.path.isdir(resume) or missing:
            raise FileNotFoundError(f"cannot resume from {resume}: "
                                    + ("no such folder" if not os.path.isdir(resume) else
                                       f"incomplete checkpoint, missing {missing}"))
        check_config(resume, cfg)
        return resume
    root = os.path.join(cfg.out_dir, "checkpoints")
    names = sorted(n for n in os.listdir(root) if STEP_DIR.fullmatch(n)) if os.path.isdir(root) else []
    complete = [n for n in names if all(os.path.isfile(os.path.join(root, n, f)) for f in CHECKPOINT_FILES)]
    if not complete:
        return None
    check_config(os.path.join(root, complete[-1]), cfg)
    return os.path.join(root, complete[-1])


def check_config(folder, cfg):
    """Refuses a checkpoint written under settings that would change the run (MAY_CHANGE_ON_RESUME aside). A field
    the checkpoint's config lacks (added to Config since) must be at its default, the behaviour of the run that wrote
    it (or at the value BEFORE_FIELD gives). A field only the checkpoint has (removed since) is ignored."""
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    now = json.loads(json.dumps(asdict(cfg)))  # as saved: tuples become lists
    default = json.loads(json.dumps({f.name: BEFORE_FIELD.get(f.name, f.default) for f in fields(cfg)}))
    diff = {k: (saved[k], now[k]) for k in now if k in saved and k not in MAY_CHANGE_ON_RESUME and saved[k] != now[k]}
    if diff:
        raise ValueError(f"checkpoint {folder} is from another config; differences (saved, now): {diff}")
    newer = {k: (default[k], now[k]) for k in now if k not in saved and k not in MAY_CHANGE_ON_RESUME
             and now[k] != default[k]}
    if newer:
        raise ValueError(f"checkpoint {folder} was written before " + ", ".join(f"--{k}" for k in newer) + " existed, "
                         "so its run used the default (or checkpoint.BEFORE_FIELD's value); resuming with another "
                         f"value would change the run. (default, now): {newer}")
    if cfg.lr_schedule == "linear" and saved["total_steps"] != cfg.total_steps:
        raise ValueError(f"checkpoint {folder} was written by a run of total_steps={saved['total_steps']}, and the "
                         f"linear LR schedule decays to 0 at its last step; resuming with total_steps="
                         f"{cfg.total_steps} would move that horizon. Keep total_steps, or use lr_schedule=constant")


def load(folder, modules, cfg):
    """Loads models and optimizers in place (any number of ranks) from a folder find() returned; returns the
    trainer dict."""
    state = {}
    for name, (model, opt) in modules.items():
        state[name], state[name + "_optim"] = get_state_dict(model, opt)
    dcp.load(state, checkpoint_id=folder)
    for name, (model, opt) in modules.items():
        set_state_dict(model, opt, model_state_dict=state[name], optim_state_dict=state[name + "_optim"])
    trainer = torch.load(os.path.join(folder, "trainer.pt"), weights_only=False)
    rng_file = os.path.join(folder, f"rng-rank{dist.get_rank()}.pt")
    if os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:  # a rank the saving run did not have: seeded from what it does know
        seed = cfg.seed * 1_000_003 + trainer["step"] * 1009 + dist.get_rank()
        random.seed(seed), np.random.seed(seed % 2**32), torch.manual_seed(seed)
    return trainer

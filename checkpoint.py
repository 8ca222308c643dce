"""
Sharded state in and out: the run's models loaded from HF checkpoints into FSDP2 shards (build_models), their
optimizers (add_optimizers), and its training checkpoints (save_step, find, resume) and the HF-format actor (export).

Loading. Every model is built on the meta device from its config alone, sharded (each transformer block one FSDP2
unit, the root another), and filled from one read of the checkpoint on rank 0, broadcast a tensor at a time: no
other rank holds the full weights in host memory (an 8B model in float32 is 32 GB; a copy per rank would be 256 GB
on an 8-GPU node). hf.py reads the files, model.py checks them against the architecture. One rank on a CPU keeps
plain models where nothing is cast (float32, or a frozen model) or offloaded (place): FSDP2 would only make copies.

Training checkpoints:
    out_dir/checkpoints/step-000040/   .metadata + *.distcp  actor, critic and both optimizers (DCP, sharded; under
                                                         LoRA the adapters and the critic's head: trained_only)
                                       trainer.pt            step, schedulers, KL controller, samplers, metrics
                                       rng-rank{r}.pt        the global RNGs of rank r (python, numpy, torch, its GPU's)
                                       config.json           the Config the run was started with
    out_dir/actor/                     the actor in HF format and its checkpoint's dtype (hf.save_hf)
    out_dir/actor-lora/                under LoRA, the actor's adapters alone in PEFT's format (hf.write_peft_adapter)
    out_dir/metrics.jsonl              one line per step; on resume, cut back to the checkpoint's steps (runtime.py)

Every write goes to a temporary folder that is renamed when every rank is done: a crash mid-write
leaves the previous checkpoint as it was, and `--resume=auto` takes the newest complete one.
torch.distributed.checkpoint reshards on load, so a checkpoint continues on another number of ranks.
ppo.py draws all of its own randomness (sampling noise, minibatch order) from keys of (seed, step,
global row), never from a generator's running state, so a resumed run repeats the uninterrupted one on
any number of ranks; the global RNGs are saved anyway, for forks that use them.
"""
import atexit
import glob
import hashlib
import json
import math
import os
import random
import re
import shutil
import socket
import time
import uuid
from dataclasses import asdict, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from gae import uses_reference
from hf import finish_write, read_checkpoint, resolve, save_hf
from lora import AdaptersOff, adapter_state, add_adapters
from model import Transformer, decodes_transposed, store_transposed
from reward import is_file_spec
from runtime import UsageError, check_space, print0

# Config fields that may differ between a checkpoint and the run resuming it: where and how often it
# logs and saves, how batches are cut into micro-batches (the loss is a token mean over the minibatch and
# sampling noise is keyed by row, so that split changes nothing but float rounding), and where memory goes
# (recomputed blocks, offloaded frozen models); and the learning rates, which load() sets on the optimizers (the way
# on after non-finite updates).
# total_steps may change too, except under the linear LR schedule, whose horizon it is (check_config).
MAY_CHANGE_ON_RESUME = {"total_steps", "save_every", "log_every", "sample_every", "wandb", "wandb_project", "out_dir",
                        "resume", "max_bad_updates", "keep_checkpoints", "micro_batch_size", "lr", "critic_lr",
                        "inference_micro_batch_size", "rollout_micro_batch_size", "activation_checkpointing",
                        "offload_frozen", "offload_optimizer", "dry_run", "gpu_memory_gb"}
MAY_CHANGE_ON_RESUME |= {"overwrite"}
# Config fields naming a data file: a checkpoint's config.json keeps each file's sha256 (input_sha256), and resume
# compares what the file holds, not where it lies (a moved checkout still resumes with the default --prompts). So
# with --reward_fn=FILE.py:NAME: the same NAME, in a file of the same contents (input_files).
INPUT_FILES = ("prompts", "sft_data")
# Config fields naming a model, which resume reads again (the reference, the tokenizer, the critic's start, a LoRA
# base): config.json keeps a fingerprint of its files (model_sha256, model_fingerprint), and resume compares it, so a
# folder retrained or replaced under the same path is refused rather than silently changing the run.
MODEL_FIELDS = ("model", "reward_model")
SAMPLE_BYTES = 2**20  # of a model file over HASH_BELOW, the fingerprint reads this much at its start, middle and end
# Nor does what only watches the run (held-out evaluation reads the weights and moves no state) or spreads the reward
# calls over threads (the scores come back in order).
MAY_CHANGE_ON_RESUME |= {"eval_prompts", "eval_every", "eval_temperature", "eval_samples_per_prompt", "reward_workers",
                         "eval_top_p"}
# How a run behaved before a Config field existed, where that is not the field's default: a checkpoint without the
# field resumes at this value (and is refused, naming it, at another). Before --is_correction, no weight: "none".
BEFORE_FIELD = {"is_correction": "none"}
CHECKPOINT_FILES = (".metadata", "trainer.pt", "config.json")  # present in every complete checkpoint
STEP_DIR = re.compile(r"step-\d+")
MANIFEST = "manifest.json"  # written last, in the temporary folder before the rename that commits a checkpoint
HASH_BELOW = 64 * 2**20  # files under this size are checksummed in the manifest (all but the model shards)
LOCK = ".lock"  # out_dir/.lock: the PID and host of the run that owns the folder
TORN_LOCK_S = 10  # seconds after which a lock holding no PID and host is stale (_claim writes them at once)
# files each rank's shards are written to at once: the default run's 3.2 GB checkpoint took 4.7-5.9 s with one and
# 3.3-3.6 s with 2 or 4 on a 2-core CPU (the writes wait on the page cache and the final fsync, not on Python)
WRITE_THREADS = 2


# -----------------------------------------------------------------------------
# models under FSDP2: built on the meta device, sharded, read once


def shard(model, mesh, dtype, frozen=False, offload=False):
    """FSDP2: each transformer block is one unit, the root holds the embeddings, norm and head. A trained model
    keeps float32 master weights and computes in `dtype`; a frozen one (reference, reward model) is stored in
    `dtype` itself, without grads or optimizer. Under LoRA a trained model is both: its frozen base in `dtype`,
    its adapters (and a critic's head) in float32. offload: every shard lives on the CPU between uses (a frozen
    model's weights: --offload_frozen; a trained one's weights, grads and AdamW states, whose step then runs on
    the CPU: --offload_optimizer). Either way a rank holds 1/W of the bytes, and a forward gathers one block at a
    time (resharded after it)."""
    if frozen:
        model.to(dtype).requires_grad_(False)
    for p in model.parameters():  # LoRA's frozen base: stored in the compute dtype, as a frozen model is
        if not p.requires_grad:
            p.data = p.data.to(dtype)
    kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy())
    if not frozen:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def reshard(*models):
    """FSDP2 keeps a root's parameters gathered after its forward (the backward would need them at once): frees
    them on each model that has any (a plain model, or None, is passed over)."""
    for model in models:
        if hasattr(model, "reshard"):
            model.reshard()


def place(model, mesh, dtype, frozen=False, offload=False):
    """shard(), except where FSDP2 has nothing to do: one rank on a CPU, nothing offloaded, and no mixed
    precision (a frozen model, or compute in float32). There FSDP2 would still copy every unit's weights in for
    each forward (again for the backward) and every gradient out, a fifth of a default update's time on a 2-core
    CPU; the plain model computes the same numbers (test_place_plain_equals_fsdp) and checkpoints alike (DCP
    reshards a plain tensor as it does a sharded one)."""
    if mesh.size() == 1 and mesh.device_type == "cpu" and not offload and (frozen or dtype == torch.float32):
        return model.to(dtype).requires_grad_(False) if frozen else model
    return shard(model, mesh, dtype, frozen, offload)


def load_sharded(path, mesh, run, head=None, frozen=False, bias=False, seed=0, reward_head=False, checkpoint=None):
    """A model built on the meta device, sharded, then filled from the one copy rank 0 reads (a float32 state for
    a trained model, the compute dtype for a frozen one): set_model_state_dict broadcasts it a tensor at a time
    and each rank keeps its shard, so no other rank ever holds the full weights. bias: give a value head a bias
    (zero), as a critic from a reward model needs (the reward model's head has none). Under LoRA (run.lora) a
    trained model gets adapters, their A drawn on rank 0 from `seed`; reward_head: a critic that is also the
    reward model keeps the reward model's score layer, frozen, as `reward_head` (lora.AdaptersOff reads it).
    checkpoint: what hf.read_checkpoint(path) returned, when rank 0 has read it already (it is not changed)."""
    model = Transformer.from_pretrained(path, head=head, device="meta")
    if bias and model.score.bias is None:
        model.score.bias = torch.nn.Parameter(torch.zeros(1, device="meta"))
    if run.lora and not frozen:
        add_adapters(model, run.lora)
        if reward_head:
            model.reward_head = torch.nn.Linear(model.config.hidden_size, 1, bias=False, device="meta")
            model.reward_head.requires_grad_(False)
    offload = run.offload_frozen if frozen else run.offload_optimizer
    place(model, mesh, run.dtype, frozen, offload)
    model.to_empty(device="cpu" if offload else run.device)
    state = {}
    if run.rank == 0:
        state = Transformer.read_state(path, head=head, dtype=run.dtype if frozen else torch.float32,
                                       checkpoint=checkpoint)
        if bias:
            state.setdefault("score.bias", torch.zeros(1))
        if run.lora and not frozen:
            expected = model.state_dict()
            if reward_head:
                state["reward_head.weight"] = state["score.weight"]
            state.update(adapter_state({k: v.shape for k, v in expected.items()}, seed))
            state = {k: state[k].to(expected[k].dtype) for k in expected}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def local(t):
    """This rank's part of a parameter: a DTensor's shard, a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def frozen_like(actor, mesh, run):
    """The reference: the actor's initial weights in the compute dtype, sharded like it (a local copy per rank)."""
    with torch.device("meta"):
        ref = Transformer(actor.config, head=actor.head)
    place(ref, mesh, run.dtype, frozen=True, offload=run.offload_frozen)
    ref.to_empty(device="cpu" if run.offload_frozen else run.device)
    with torch.no_grad():
        for (name, p), (name_a, q) in zip(ref.named_parameters(), actor.named_parameters(), strict=True):
            assert name == name_a, (name, name_a)
            local(p).copy_(local(q))
    ref.hf_config = actor.hf_config
    return ref


def build_models(cfg, run, mesh):
    """The run's models: the actor, and the critic when the advantage estimator has one (run.critic), FSDP2 with
    fp32 master weights; the reference and the reward model (FSDP2, frozen, compute dtype); the generation copy
    (whole on every rank, compute dtype, in the layout its decode reads fastest: model.decodes_transposed; refilled
    from the actor before each rollout). Built on the meta device and read once, by rank 0. The critic starts from
    the reward model (which may learn a bias), or from the policy's backbone with a fresh head drawn on rank 0
    from the seeded global RNG. The inputs were checked before
    (ppo.load_inputs: files, context length, the reward model's tokenizer, vocabulary and score head).
    Under LoRA (--lora_rank) the actor and the critic train adapters on frozen bases (lora.py): the reference is
    the actor with its adapters off, and a critic that starts from the reward model is the reward model with its
    adapters off, so neither is a second copy. A critic from the policy is filled from the actor's read of the
    policy's files (a GGUF file takes seconds to dequantize)."""
    from_policy = run.critic and not cfg.reward_model
    policy = read_checkpoint(cfg.model) if run.rank == 0 and from_policy else None
    actor = load_sharded(cfg.model, mesh, run, head="lm", seed=cfg.seed, checkpoint=policy)
    with torch.device("meta"):
        gen = Transformer(actor.config).to(run.dtype)
    gen = gen.to_empty(device=run.device).requires_grad_(False)  # filled by copy_weights_from before each rollout
    if decodes_transposed(run.device, run.dtype):
        store_transposed(gen)  # the layout oneDNN's float32 decode reads fastest
    ref = (AdaptersOff(actor) if run.lora else frozen_like(actor, mesh, run)) if uses_reference(cfg) else None
    m = dict(actor=actor, ref=ref, gen=gen, reward_model=None)  # (no KL penalty or loss: no reference)
    shared = bool(run.lora and run.critic and cfg.reward_model)  # the critic's base is the reward model
    if cfg.reward_model and not shared:
        m["reward_model"] = load_sharded(cfg.reward_model, mesh, run, head="value", frozen=True)
    if run.critic:
        m["critic"] = (load_sharded(cfg.reward_model, mesh, run, head="value", bias=True, seed=cfg.seed + 1,
                                    reward_head=shared) if cfg.reward_model
                       else load_sharded(cfg.model, mesh, run, head="value", seed=cfg.seed + 1, checkpoint=policy))
    del policy
    if shared:
        m["reward_model"] = AdaptersOff(m["critic"], head=m["critic"].reward_head)
    for name in run.trained:
        m[name].activation_checkpointing = run.activation_checkpointing
    return m


def lr_lambda(cfg, steps=None):
    """The LR factor of a model's i-th optimizer step, for a model that trains in `steps` of the run's steps (default:
    all of them; the actor: those after --critic_warmup_steps)."""
    rows, steps = cfg.rollout_batch_size * cfg.samples_per_prompt, cfg.total_steps if steps is None else steps
    total = steps * cfg.ppo_epochs * (rows // cfg.mini_batch_size)  # optimizer steps

    def f(i):  # warmup x decay, each from the first optimizer step
        warm = min(1.0, (i + 1) / cfg.warmup_steps) if cfg.warmup_steps > 0 else 1.0
        t = min(i / total, 1.0) if total else 0.0  # the fraction of the schedule done (total_steps=0: no step)
        decay = {"linear": 1.0 - t, "cosine": 0.5 * (1.0 + math.cos(math.pi * t))}.get(cfg.lr_schedule, 1.0)
        return warm * max(decay, 0.0)

    return f


def add_optimizers(m, cfg, run):
    """AdamW and the LR schedule for each trained model (actor, and critic when there is one)."""
    for name, lr in (("actor", cfg.lr), ("critic", cfg.critic_lr))[: len(run.trained)]:
        params = [p for p in m[name].parameters() if p.requires_grad]  # LoRA: the adapters (and a critic's head)
        m[name + "_opt"] = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, eps=1e-8,
                                             fused=True)  # one kernel, no full-size temporaries (3x faster on a CPU)
        steps = max(cfg.total_steps - cfg.critic_warmup_steps, 0) if name == "actor" else cfg.total_steps  # its own
        m[name + "_sched"] = torch.optim.lr_scheduler.LambdaLR(m[name + "_opt"], lr_lambda(cfg, steps))
    return m


# -----------------------------------------------------------------------------
# the output folder: one run owns it


class FolderInUse(UsageError):
    """out_dir belongs to another run, or holds one that a new run would overwrite: a usage error."""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def step_names(root):
    """The step-N folders in root (none if it is not a folder), by N: as text, step-1000000 would come before
    step-999999 (six digits are only padding)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted((n for n in names if STEP_DIR.fullmatch(n)), key=lambda n: int(n.removeprefix("step-")))


def _holds_a_run(out_dir):
    """What in out_dir shows a run was started there ("" if nothing)."""
    found = []
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        with open(metrics, "rb") as f:  # lines, whatever bytes a crash or an editor left in them
            found.append(f"metrics.jsonl with {sum(1 for _ in f)} steps")
    root = os.path.join(out_dir, "checkpoints")
    steps = step_names(root)
    if steps:
        found.append(f"checkpoints {', '.join(steps)}")
    found += [f"an exported {d}/" for d in ("actor", "actor-lora") if os.path.isdir(os.path.join(out_dir, d))]
    return "; ".join(found)


def _set_aside_later_steps(out_dir, ckpt):
    """--resume=PATH to one of out_dir's checkpoints with later ones beside it (the run goes back, say to before
    a reward bug): the later checkpoints, the export (written with the latest), the sample rows after the step and
    a copy of metrics.jsonl move to out_dir/after-step-N.old-<time>, never deleted. Left in place, --resume=auto
    would take the newest again after the next interruption, and rotation would keep them over the new ones."""
    name = os.path.basename(os.path.realpath(ckpt))  # a link's target
    if not STEP_DIR.fullmatch(name):  # (a copy named otherwise: no step to compare with)
        return
    step, root = int(name.removeprefix("step-")), os.path.join(out_dir, "checkpoints")
    later = [n for n in step_names(root) if int(n.removeprefix("step-")) > step]
    if not later:
        return
    aside = os.path.join(out_dir, f"after-step-{step}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(os.path.join(aside, "checkpoints"))
    for n in later:
        os.replace(os.path.join(root, n), os.path.join(aside, "checkpoints", n))
    for name in ("actor", "actor-lora"):
        if os.path.isdir(os.path.join(out_dir, name)):
            os.replace(os.path.join(out_dir, name), os.path.join(aside, name))
    samples = os.path.join(out_dir, "samples")
    for n in sorted(os.listdir(samples)) if os.path.isdir(samples) else []:  # step-000012.jsonl: an evaluation's rows
        os.makedirs(os.path.join(aside, "samples"), exist_ok=True)
        if n == "train.jsonl":  # (runtime.Logger cuts both back to the step)
            shutil.copy2(os.path.join(samples, n), os.path.join(aside, "samples", n))
        elif re.fullmatch(r"step-\d+\.jsonl", n) and int(n[5:-6]) > step:  # (step's own: runtime.Logger keeps it)
            os.replace(os.path.join(samples, n), os.path.join(aside, "samples", n))
    if os.path.isfile(os.path.join(out_dir, "metrics.jsonl")):
        shutil.copy2(os.path.join(out_dir, "metrics.jsonl"), os.path.join(aside, "metrics.jsonl"))
    print(f"--resume={ckpt}: the later {', '.join(later)}, the export and their metrics moved to {aside}", flush=True)


def claim(out_dir, resume, overwrite, ckpt):
    """Every rank calls it before anything is written: rank 0 makes this run the owner of out_dir (_claim) and
    every rank returns the function that gives it back, or raises rank 0's FolderInUse (or UsageError: out_dir
    cannot be written). ckpt: the checkpoint this run resumes (find), or None."""
    release, why = (lambda: None), [None]
    if dist.get_rank() == 0:
        try:
            release = _claim(out_dir, resume, overwrite, ckpt)
        except UsageError as e:  # FolderInUse, or out_dir cannot be written
            why = [(type(e), str(e))]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(why, src=0)
    if why[0] is not None:
        raise why[0][0](why[0][1])
    return release


def _remove_stale(lock, judged, out_dir):
    """Removes the stale lock `judged` (its os.stat), unless another run taking it over at the same time got there
    first: the file is moved out of the way in one step (rename), and if it is not the one judged stale (that run's
    own lock, made since) it is put back and this run refused. Without it, two runs could both take over the
    same stale lock, the second deleting the first's new one and both writing into out_dir."""
    grab = f"{lock}.{socket.gethostname()}.{os.getpid()}"
    try:
        os.rename(lock, grab)
    except FileNotFoundError:  # the other run removed it: whichever creates the new lock first (O_EXCL) wins
        return
    now = os.stat(grab)
    if (now.st_ino, now.st_mtime_ns) != (judged.st_ino, judged.st_mtime_ns):
        try:
            os.link(grab, lock)
        except FileExistsError:
            pass
        os.remove(grab)
        raise FolderInUse(f"--out_dir={out_dir} was just taken by another run ({lock})")
    os.remove(grab)


def _claim(out_dir, resume, overwrite, ckpt):
    """Makes this run the owner of out_dir, and returns the function that gives it back. Raises FolderInUse when a
    live run holds out_dir/.lock (its PID and host named), or when out_dir holds an earlier run and this one neither
    continues it (ckpt, one of out_dir's own checkpoints) nor moves it aside (--overwrite: renamed to
    out_dir.old-<time>, never deleted). --resume=auto that found no checkpoint to continue (a run killed before its
    first one) moves the earlier run aside too. A lock whose PID is gone on this host is stale (a killed run): taken
    over. Then removes what interrupted writes left (checkpoints/*.tmp, the export's .tmp-* folders) and completes
    an export killed while it replaced the previous one (hf.finish_write)."""
    lock = os.path.join(out_dir, LOCK)
    try:
        judged = os.stat(lock)  # the file judged below: a lock made since (another run's) is another file
    except FileNotFoundError:
        judged = None
    if judged is not None:
        try:
            with open(lock) as f:
                holder = json.load(f)
        except (OSError, ValueError):
            holder = {}
        # a lock left empty: its run was killed between creating and writing it (or writes it this moment: wait)
        torn = not holder and time.time() - judged.st_mtime > TORN_LOCK_S
        # or a lock from this host whose PID is this process (an earlier main() here) or no longer running
        if torn or holder.get("host") == socket.gethostname() and (holder.get("pid") == os.getpid()
                                                                   or not _alive(holder.get("pid", -1))):
            whose = "left empty by a killed run" if torn else f"of PID {holder.get('pid')} (no longer running)"
            print(f"{out_dir}: taking over the stale lock {whose}", flush=True)
            _remove_stale(lock, judged, out_dir)
        else:
            raise FolderInUse(f"--out_dir={out_dir} is in use by another run: PID {holder.get('pid')} on host "
                              f"{holder.get('host')}, since {holder.get('since')} ({lock}); wait for it or stop it, "
                              "or use another --out_dir (a run on another host is not checked from here: if that "
                              "host went down with the run, delete the lock)")
    used = _holds_a_run(out_dir) if os.path.isdir(out_dir) else ""
    own = ckpt is not None and (os.path.realpath(os.path.dirname(os.path.normpath(ckpt)))
                                == os.path.realpath(os.path.join(out_dir, "checkpoints")))
    if used and not own:  # a new run, or one that resumes a checkpoint from elsewhere: not into another's folder
        if ckpt is not None and os.path.realpath(ckpt).startswith(os.path.realpath(out_dir) + os.sep):
            raise FolderInUse(f"--resume={resume} lies inside --out_dir={out_dir} (which holds a run: {used}) but is "
                              "not one of its checkpoints (out_dir/checkpoints/step-N): resume it into another "
                              "--out_dir")
        if not overwrite and resume != "auto":
            how = (f"--resume={resume} is not one of its checkpoints: resume into another --out_dir" if resume else
                   "continue it with --resume=auto, start this one in another --out_dir")
            raise FolderInUse(f"--out_dir={out_dir} holds an earlier run ({used}): {how}, or pass --overwrite to "
                              "move the old run aside")
        aside = f"{out_dir.rstrip(os.sep)}.old-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            os.replace(out_dir, aside)
        except OSError as e:
            raise UsageError(f"--out_dir={out_dir}: cannot move the earlier run aside: {e.strerror} ({aside})") \
                from None
        why = "--overwrite" if overwrite else "--resume=auto found no checkpoint to continue"
        print(f"{why}: the earlier run in {out_dir} moved to {aside}", flush=True)
    try:
        os.makedirs(out_dir, exist_ok=True)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            raise FolderInUse(f"--out_dir={out_dir} was just taken by another run ({lock})") from None
    except OSError as e:  # where load_inputs' os.access was wrong: root on NFS (root squash), /proc, ACLs
        raise UsageError(f"--out_dir={out_dir}: cannot write there: {e.strerror} ({e.filename})") from None
    me = dict(pid=os.getpid(), host=socket.gethostname(), since=time.strftime("%Y-%m-%d %H:%M:%S"))
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    leftovers = (glob.glob(os.path.join(out_dir, "checkpoints", "step-*.tmp"))
                 + glob.glob(os.path.join(out_dir, ".tmp-*")))
    for p in leftovers:  # an interrupted checkpoint or export: the complete ones are untouched
        shutil.rmtree(p, ignore_errors=True)
        print(f"removed {p}, left by an interrupted write", flush=True)
    for name in ("actor", "actor-lora"):  # an export killed while it replaced the previous one: the new one completed
        if finish_write(os.path.join(out_dir, name)):
            print(f"completed the interrupted replacement of {os.path.join(out_dir, name)}", flush=True)
    if own and resume != "auto":
        _set_aside_later_steps(out_dir, ckpt)

    def release():
        try:
            with open(lock) as f:
                if json.load(f).get("pid") == me["pid"]:
                    os.remove(lock)
        except (OSError, ValueError):
            pass

    atexit.register(release)  # also when the run fails before its loop (a model that does not load, say), whose
    return release  # `finally` calls it: a lock left behind is refused on another host (a requeued job)


# -----------------------------------------------------------------------------
# training checkpoints


def rng_state():
    """This rank's global RNGs; of CUDA's, its own device's generator alone (runtime.setup makes it the current
    device): a state per visible GPU would not restore where fewer are visible (set_rng_state_all's IndexError)."""
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if isinstance(cuda, (list, tuple)):  # written before: one state per visible GPU, the rank's own at its index
        cuda = cuda[torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.current_device() < len(
            cuda) else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)  # the current device's


def trained_only(cfg):
    """What a checkpoint holds of a model: under LoRA the adapters (and a critic's head) alone, since the frozen base
    is the HF checkpoint the run reads again on resume (16 GB an 8B model, not written every save_every steps)."""
    return StateDictOptions(ignore_frozen_params=bool(cfg.lora_rank), strict=not cfg.lora_rank)


def save(folder, modules, trainer, cfg):
    """modules: {"actor": (model, optimizer), ...}, sharded or not; trainer: a picklable dict (rank 0's is kept;
    trainer["run_id"] names the run); cfg: the Config dataclass. Every rank calls it. Written to folder.tmp, the
    manifest last, then renamed: a folder named step-N is always complete. Keeps the newest cfg.keep_checkpoints
    of this run that verify (rotate; another run's checkpoints are never deleted). Refuses to start when the disk
    cannot hold it. Prints where it is, its size and the seconds it took: a pause between two step lines."""
    tmp, rank, start = folder + ".tmp", dist.get_rank(), time.time()
    state = {}
    for name, (model, opt) in modules.items():
        state[name], state[name + "_optim"] = get_state_dict(model, opt, options=trained_only(cfg))
    check_space(os.path.dirname(folder), _local_bytes(state), "the training checkpoint")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while writing
        os.makedirs(tmp)
    dist.barrier()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, thread_count=WRITE_THREADS))
    torch.save(rng_state(), os.path.join(tmp, f"rng-rank{rank}.pt"))
    if rank == 0:
        torch.save(trainer, os.path.join(tmp, "trainer.pt"))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(dict(asdict(cfg), input_sha256=input_hashes(cfg), model_sha256=model_hashes(cfg),
                           python_reward_recorded=True), f, indent=1)
    dist.barrier()
    if rank == 0:
        size = write_manifest(tmp, trainer["run_id"], trainer["step"])
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.replace(tmp, folder)  # the commit point
        rotate(folder, trainer["run_id"], cfg.keep_checkpoints)
        size = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
        print0(f"checkpoint {folder}: {size} in {time.time() - start:.1f} s")  # (its time is outside time/step)
    dist.barrier()


def save_step(cfg, step, m, trained, stateful, **trainer):
    """save() of step `step` to out_dir/checkpoints/step-N: the `trained` models of m and their optimizers (m[name],
    m[name + "_opt"]), and in trainer.pt the state of each object of `stateful` (None for one the run does not have),
    the step and `trainer`'s entries (run_id, ...)."""
    models = {name: (m[name], m[name + "_opt"]) for name in trained}
    state = {k: (v.state_dict() if v is not None else None) for k, v in stateful.items()}
    save(os.path.join(cfg.out_dir, "checkpoints", f"step-{step:06d}"), models, dict(state, step=step, **trainer), cfg)


def export(actor, tokenizer, cfg, stop_ids, pad_id):
    """The actor in HF format to out_dir/actor (hf.save_hf), which records cfg.model as its base model."""
    save_hf(actor, tokenizer, os.path.join(cfg.out_dir, "actor"), stop_ids, pad_id, base_model=cfg.model)


def rotate(folder, run_id, keep):
    """After the checkpoint `folder` (step-N) is written: of run_id's checkpoints beside it up to step N, the newest
    `keep` that verify are kept, `folder` among them, and the older ones removed. Later ones (one that --resume=auto
    skipped as failing to verify, which the run replaces when it gets there) and another run's are left alone."""
    root, this = os.path.dirname(folder), os.path.basename(folder)
    names = step_names(root)
    ours = [n for n in names[: names.index(this) + 1] if _run_id(os.path.join(root, n)) == run_id]
    good = [n for n in ours if n == this or verify(os.path.join(root, n)) is None]
    for n in ours[: ours.index(good[-min(keep, len(good))])]:  # older than the oldest kept
        os.replace(os.path.join(root, n), os.path.join(root, n + ".tmp"))  # a removal cut short: claim ends it
        shutil.rmtree(os.path.join(root, n + ".tmp"))


def _local_bytes(state):
    """Bytes of this rank's share of a (nested) state dict's tensors."""
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if torch.is_tensor(state):
        t = local(state)
        return t.numel() * t.element_size()
    return 0


# -----------------------------------------------------------------------------
# manifests: a checkpoint proves itself


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder):
    return sorted(os.path.relpath(os.path.join(d, n), folder) for d, _, names in os.walk(folder) for n in names)


def write_manifest(folder, run_id, step):
    """folder/manifest.json: every file's size, and the sha256 of those under HASH_BELOW bytes; written last.
    Returns the bytes the files take."""
    files = {}
    for name in _files(folder):
        size = os.path.getsize(os.path.join(folder, name))
        digest = {"sha256": file_sha256(os.path.join(folder, name))} if size < HASH_BELOW else {}
        files[name] = {"size": size, **digest}
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(dict(run_id=run_id, step=step, files=files), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))
    return sum(f["size"] for f in files.values())


def verify(folder, legacy_ok=False):
    """None when the checkpoint in `folder` is what its manifest lists (sizes, checksums), else why not, naming
    the file. legacy_ok: a checkpoint without a manifest (written before checkpoints carried one) passes when its
    CHECKPOINT_FILES are there."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        missing = [f for f in CHECKPOINT_FILES if not os.path.isfile(os.path.join(folder, f))]
        if legacy_ok and not missing:
            return None
        if glob.glob(os.path.join(folder, "*.safetensors")) and {".metadata", "trainer.pt"} <= set(missing):
            return ("a model folder (the HF export, out_dir/actor?), not a training checkpoint: resume from "
                    "out_dir/checkpoints/step-N or with --resume=auto; an exported model is passed as --model")
        steps = [os.path.join(d, n) for d in (folder, os.path.join(folder, "checkpoints")) for n in step_names(d)]
        if steps:  # a run's out_dir, or its checkpoints folder
            return (f"not a checkpoint but a folder of them: pass one ({steps[-1]}, the newest), or --resume=auto "
                    "with that run's --out_dir")
        if legacy_ok:  # resumed by name (a checkpoint older than manifests would have passed): not one
            return (f"not a training checkpoint: no {MANIFEST}, and {missing[0]} is missing (a checkpoint is "
                    "out_dir/checkpoints/step-N)")
        return (f"no {MANIFEST} (the write was cut short, or the checkpoint predates manifests: resume it with "
                f"--resume={folder})" + (f", and {missing[0]} is missing" if missing else ""))
    try:
        with open(path) as f:
            listed = json.load(f)["files"]
        if not all(isinstance(w, dict) and isinstance(w.get("size"), int) for w in listed.values()):
            raise ValueError("an entry without its size")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({e!r})"
    for name, want in listed.items():
        p = os.path.join(folder, name)
        if not os.path.isfile(p):
            return f"{name} is missing"
        if os.path.getsize(p) != want["size"]:
            return f"{name} has {os.path.getsize(p)} bytes, its manifest says {want['size']}"
        if "sha256" in want and file_sha256(p) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _run_id(folder):
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError):
        return None


def find(cfg):
    """The folder to resume from, or None, checked against cfg (check_config). cfg.resume: "" (none), "auto"
    (the newest checkpoint in out_dir/checkpoints that verifies: each newer one that does not is named with the
    file that failed; None when there is none) or a checkpoint folder (an error naming the file if it does not
    verify). Runs on rank 0 before any model is read (reading checksums costs a read of the small files)."""
    resume = cfg.resume
    if not resume:
        return None
    if resume != "auto":
        if not os.path.isdir(resume):
            raise UsageError(f"cannot resume from {resume}: no such folder")
        if os.path.normpath(resume).endswith(".tmp"):  # (claim removes these, as what interrupted writes left)
            raise UsageError(f"cannot resume from {resume}: a checkpoint whose write was cut short (step-N.tmp); "
                             "resume from a complete step-N")
        problem = verify(resume, legacy_ok=True)
        if problem:
            raise UsageError(f"cannot resume from {resume}: {problem}")
        check_config(resume, cfg)
        return resume
    root = os.path.join(cfg.out_dir, "checkpoints")
    for n in reversed(step_names(root)):
        problem = verify(os.path.join(root, n))
        if problem is None:
            check_config(os.path.join(root, n), cfg)
            return os.path.join(root, n)
        print0(f"resume: skipping {os.path.join(root, n)}: {problem}")
    print0(f"--resume=auto: no checkpoint in {root}: starting fresh")
    return None


def check_config(folder, cfg):
    """Refuses a checkpoint written under settings that would change the run (MAY_CHANGE_ON_RESUME aside). A field
    the checkpoint's config lacks (added to Config since) must be at its default, the behaviour of the run that wrote
    it (or at the value BEFORE_FIELD gives). A field only the checkpoint has (removed since) is ignored."""
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    now = json.loads(json.dumps(asdict(cfg)))  # as saved: tuples become lists
    default = json.loads(json.dumps({f.name: BEFORE_FIELD.get(f.name, f.default) for f in fields(cfg)}))
    diff = {k: (saved[k], now[k]) for k in now if k in saved and k not in MAY_CHANGE_ON_RESUME
            and not same_setting(k, saved, now)}
    if diff:
        changed = [k for k in diff if saved[k] == now[k]]  # the same path, other contents
        python = "reward_fn" in diff and any(str(v).startswith("python:") for v in diff["reward_fn"])
        raise UsageError(f"checkpoint {folder} is from another config; differences (saved, now): {diff}"
                         + (f"; the files of {changed} have changed since (sha256)" if changed else "")
                         + ("; a reward function from Python is ppo.main(cfg, reward_fn=f)'s, recorded by its name"
                            if python else ""))
    newer = {k: (default[k], now[k]) for k in now if k not in saved and k not in MAY_CHANGE_ON_RESUME
             and now[k] != default[k]}
    if newer:
        raise UsageError(f"checkpoint {folder} was written before " + ", ".join(f"--{k}" for k in newer) + " existed, "
                         "so its run used the default (or checkpoint.BEFORE_FIELD's value); resuming with another "
                         f"value would change the run. (default, now): {newer}")
    if cfg.lora_dropout > 0 and saved.get("micro_batch_size", cfg.micro_batch_size) != cfg.micro_batch_size:
        print0(f"note: --lora_dropout with --micro_batch_size={cfg.micro_batch_size}, where {folder}'s run had "
               f"{saved['micro_batch_size']}: the dropout masks are drawn per micro-batch (lora.seed_dropout), so the "
               "resumed run draws others than the uninterrupted one would (the same in distribution)")
    if cfg.lr_schedule != "constant" and saved["total_steps"] != cfg.total_steps and cfg.total_steps:  # (0: evaluates)
        raise UsageError(f"checkpoint {folder} was written by a run of total_steps={saved['total_steps']}, and the "
                         f"{cfg.lr_schedule} LR schedule decays to 0 at its last step; resuming with total_steps="
                         f"{cfg.total_steps} would move that horizon. Keep total_steps, or use lr_schedule=constant")


def input_files(cfg):
    """{field: path} of the files the run reads its data from (INPUT_FILES) and its reward function's file."""
    files = {k: cfg[k] for k in INPUT_FILES if cfg.get(k)}
    spec = cfg.get("reward_fn", "")
    return files | ({"reward_fn": spec.rpartition(":")[0]} if is_file_spec(spec) else {})


def input_hashes(cfg):
    """{field: sha256} of each file of input_files, written beside the config it saves."""
    return {k: file_sha256(path) for k, path in input_files(asdict(cfg)).items() if os.path.isfile(path)}


def model_hashes(cfg):
    """{field: model_fingerprint} of the models the run reads (MODEL_FIELDS), written beside the config it saves."""
    return {k: model_fingerprint(getattr(cfg, k)) for k in MODEL_FIELDS if getattr(cfg, k)}


def model_fingerprint(name_or_path):
    """sha256 over a model's files (a GGUF file, or the files at the top of an HF folder but hidden ones), or None
    where there are none here (a Hub id: compared by its name): each file's name and size, the whole of those under
    HASH_BELOW (configs, tokenizer) and SAMPLE_BYTES at the start, middle and end of the larger ones (the weights:
    a retrained checkpoint differs there, and reading gigabytes at every save would not do)."""
    path = resolve(name_or_path)
    if os.path.isfile(path):
        folder, names = os.path.dirname(path), [os.path.basename(path)]
    elif os.path.isdir(path):
        folder = path
        names = sorted(n for n in os.listdir(path) if not n.startswith(".") and os.path.isfile(os.path.join(path, n)))
    else:
        return None
    h = hashlib.sha256()
    for name in names:
        p = os.path.join(folder, name)
        size = os.path.getsize(p)
        h.update(f"{name}\0{size}\0".encode())
        with open(p, "rb") as f:
            if size < HASH_BELOW:
                for block in iter(lambda: f.read(SAMPLE_BYTES), b""):
                    h.update(block)
            else:
                for at in (0, size // 2, size - SAMPLE_BYTES):
                    f.seek(at)
                    h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def same_setting(k, saved, now):
    """Whether field k of a checkpoint's config (saved) is the one of the run resuming it (now, both as JSON). A data
    file is the same when its contents are, wherever it lies; a checkpoint written before input_sha256 existed
    compares the paths, as the run that wrote it did (the config-evolution rule of check_config). One written
    before a reward function from Python was recorded (python_reward_recorded) takes the one passed now."""
    hashes, models = saved.get("input_sha256", {}), saved.get("model_sha256", {})
    if k in hashes:  # a data file, or a reward function's (FILE.py:NAME, the NAMEs the same)
        path = input_files(now).get(k)
        return (bool(path) and os.path.isfile(path) and file_sha256(path) == hashes[k]
                and (k != "reward_fn" or now[k].rpartition(":")[2] == saved[k].rpartition(":")[2]))
    if k in MODEL_FIELDS and models.get(k):  # (None: a Hub id, compared by name)
        return bool(now[k]) and model_fingerprint(now[k]) == models[k]
    if k == "reward_fn" and now[k].startswith("python:") and not saved.get("python_reward_recorded"):
        return True  # written before a function passed from Python was recorded: its config named the built-in one
    return saved[k] == now[k]


def load(folder, modules, cfg, stateful=None):
    """Loads models and optimizers in place (any number of ranks) from a folder find() returned, and each object of
    `stateful` ({key: object with load_state_dict, or None}: schedulers, samplers, ...) from the trainer dict,
    which it returns. The learning rates are cfg's (a resume may change --lr and --critic_lr, e.g. lower them after
    non-finite updates), at the schedule's position: the same floats as the saved ones when cfg's are the saved."""
    state = {}
    for name, (model, opt) in modules.items():
        state[name], state[name + "_optim"] = get_state_dict(model, opt, options=trained_only(cfg))
    dcp.load(state, checkpoint_id=folder)
    for name, (model, opt) in modules.items():
        set_state_dict(model, opt, model_state_dict=state[name], optim_state_dict=state[name + "_optim"],
                       options=trained_only(cfg))
    trainer = torch.load(os.path.join(folder, "trainer.pt"), weights_only=False)
    rng_file = os.path.join(folder, f"rng-rank{dist.get_rank()}.pt")
    if os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:  # a rank the saving run did not have: seeded from what it does know
        seed = cfg.seed * 1_000_003 + trainer["step"] * 1009 + dist.get_rank()
        random.seed(seed), np.random.seed(seed % 2**32), torch.manual_seed(seed)
    for k, obj in (stateful or {}).items():
        if obj is not None:
            obj.load_state_dict(trainer[k])
    for name, (_, opt) in modules.items():
        sched, lr = (stateful or {}).get(f"{name}_sched"), cfg.lr if name == "actor" else cfg.critic_lr
        if sched is not None:  # what LambdaLR computes: base lr x lambda(its step)
            sched.base_lrs = [lr] * len(opt.param_groups)
            for g, f in zip(opt.param_groups, sched.lr_lambdas):
                g["initial_lr"], g["lr"] = lr, lr * f(sched.last_epoch)
            sched._last_lr = [g["lr"] for g in opt.param_groups]
    return trainer


def resume(ckpt, m, trained, cfg, stateful):
    """The trainer dict a run starts from: the checkpoint ckpt's (find()), once load() has restored from it the
    `trained` models of m, their optimizers and `stateful`; with ckpt None, a new run's: step 0, no metrics, a new
    run_id (rotate deletes the checkpoints of its own run_id alone)."""
    trainer = dict(metrics=[], step=0, run_id=uuid.uuid4().hex)
    if ckpt:
        models = {name: (m[name], m[name + "_opt"]) for name in trained}
        trainer = dict(trainer, **load(ckpt, models, cfg, stateful))  # + schedulers, samplers, the KL controller
        print0(f"resumed from {ckpt} at step {trainer['step']}")
    return trainer

"""
Training checkpoints for ppo.py: save, find, resume, the HF-format export, the metrics log that resume
rewinds, and stopping on a signal.

    out_dir/checkpoints/step-000040/   .metadata + *.distcp  actor, critic and both optimizers (DCP, sharded)
                                       trainer.pt            step, schedulers, KL controller, samplers, metrics
                                       rng-rank{r}.pt        the global RNGs of rank r (python, numpy, torch, cuda)
                                       config.json           the Config the run was started with
    out_dir/actor/                     the actor in HF format (config, safetensors, tokenizer)
    out_dir/metrics.jsonl              one line per step; on resume, cut back to the checkpoint's steps

Every write goes to a temporary folder that is renamed when every rank is done: a crash mid-write
leaves the previous checkpoint as it was, and `--resume=auto` takes the newest complete one.
torch.distributed.checkpoint reshards on load, so a checkpoint continues on another number of ranks.
ppo.py draws all of its own randomness (sampling noise, minibatch order) from keys of (seed, step,
global row), never from a generator's running state, so a resumed run repeats the uninterrupted one on
any number of ranks; the global RNGs are saved anyway, for forks that use them.

Why a file of its own: ppo.py is where readers follow the algorithm; this is plumbing it calls.
"""
import json
import os
import random
import re
import shutil
import signal
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from model import Transformer

# Config fields that may differ between a checkpoint and the run resuming it: where and how often it
# logs and saves, how a minibatch is cut into micro-batches (the loss is a token mean over the
# minibatch, so that split changes nothing but float rounding), and whether blocks are recomputed.
# total_steps may change too, except under the linear LR schedule, whose horizon it is (check_config).
MAY_CHANGE_ON_RESUME = {"total_steps", "save_every", "log_every", "sample_every", "wandb", "wandb_project", "out_dir",
                        "resume", "max_bad_updates", "keep_checkpoints", "micro_batch_size",
                        "activation_checkpointing"}
CHECKPOINT_FILES = (".metadata", "trainer.pt", "config.json")  # present in every complete checkpoint
STEP_DIR = re.compile(r"step-\d+")


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
    """Refuses a checkpoint written under settings that would change the run (MAY_CHANGE_ON_RESUME aside)."""
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    now = json.loads(json.dumps(asdict(cfg)))  # as saved: tuples become lists
    diff = {k: (saved.get(k), now[k]) for k in now if k not in MAY_CHANGE_ON_RESUME and saved.get(k) != now[k]}
    if diff:
        raise ValueError(f"checkpoint {folder} is from another config; differences (saved, now): {diff}")
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


class Logger:
    """metrics.jsonl (rewritten to the steps the models have seen on resume), stdout, wandb if asked."""

    def __init__(self, cfg, history, master):
        self.cfg, self.history, self.master = cfg, history, master
        self.path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.wandb = None
        if master:
            with open(self.path + ".tmp", "w") as f:
                f.writelines(json.dumps(m) + "\n" for m in history)
            os.replace(self.path + ".tmp", self.path)
            if cfg.wandb:
                try:
                    import wandb
                except ImportError as e:
                    raise ImportError("--wandb needs the wandb package: pip install wandb") from e
                self.wandb = wandb.init(project=cfg.wandb_project, config=asdict(cfg), dir=cfg.out_dir)

    def log(self, m, sample=None):
        self.history.append(m)
        if not self.master:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(m) + "\n")
        if self.wandb is not None:
            self.wandb.log(m, step=m["step"])
        if m["step"] % self.cfg.log_every == 0:
            print(f"step {m['step']:4d} | score {m['objective/scores']:+.3f} | kl {m['objective/kl']:+.3f} "
                  f"| entropy {m['objective/entropy']:.3f} | clipfrac {m['policy/clipfrac_avg']:.3f} "
                  f"| vloss {m['loss/value_avg']:.4f} | len {m['val/response_length']:.1f} "
                  f"| stop {m['val/stop_rate']:.2f} | {m['time/step']:.1f}s", flush=True)
        if sample and self.cfg.sample_every and m["step"] % self.cfg.sample_every == 0:
            print(f"--- sample (score {sample[0]:+.3f})\n{sample[1]}{sample[2]}\n---", flush=True)

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()


class StopSignal:
    """SIGTERM / SIGINT (what a cluster sends before preemption) only set a flag: the step in flight
    finishes, then every rank checkpoints at the same step and exits."""

    def __init__(self):
        self.received = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.received.append(signum))

    def requested(self, all_sum):
        """True on every rank when any rank got a signal (all_sum: a sum over ranks, one collective)."""
        return all_sum([float(len(self.received))]).item() > 0

"""
The process a run lives in: the command line, the process group (one code path for 1 process and for N under
torchrun), printing on rank 0, sums over ranks, the phase timer, the metrics log and stopping on a signal. Plumbing that ppo.py
calls so that its main loop reads as the algorithm; nothing here knows about models.
"""
import inspect
import json
import os
import re
import signal
import time
from dataclasses import asdict, fields

import torch
import torch.distributed as dist


def setup_distributed():
    """Starts a process group whether or not torchrun did: nccl on GPU, gloo on CPU."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        if local_rank >= torch.cuda.device_count():  # else CUDA's "invalid device ordinal", naming nothing
            raise RuntimeError(f"LOCAL_RANK={local_rank}, but this node has {torch.cuda.device_count()} GPU(s): start "
                               "at most one process per GPU (torchrun --nproc_per_node), or hide the GPUs "
                               "(CUDA_VISIBLE_DEVICES=) to run every rank on the CPU")
        torch.cuda.set_device(local_rank)
    backend = "cuda:nccl,cpu:gloo" if cuda else "gloo"  # gloo for CPU tensors: metrics, offloaded shards
    if not dist.is_initialized():
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group(backend)
        else:  # plain `python ppo.py`: a group of one, on an in-memory store (no port to collide on)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_sum(x):
    """Sums a tensor (or nested list of floats) over ranks in float64; returns it on the CPU."""
    t = torch.as_tensor(x).double().cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)  # on the CPU: gloo
    return t


def phase_end(device, peaks, phase):
    """Ends a phase of the step and returns the host time. On CUDA it first waits for the queued kernels
    (they run asynchronously: a host clock alone would charge a phase's work to the next one), records
    the caching allocator's peak over the phase as peaks["mem/<phase>_peak_gib"] (what --dry_run's phase
    peaks predict; plan.py) and starts counting the next phase's."""
    if device.type == "cuda":  # this thread's stream: a rollout on its own stream (--async_rollout) goes on
        torch.cuda.current_stream(device).synchronize()
        if phase is not None:
            peaks[f"mem/{phase}_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return time.time()


# -----------------------------------------------------------------------------
# the command line: fire parses it into ppo.Config


def doc_from_comments(cls):
    """The fields' comments become the docstring's Args section: `python ppo.py --help` shows them."""
    comments = re.findall(r"^    (\w+): .*?  # (.*)$", inspect.getsource(cls), re.M)
    cls.__doc__ = "PPO for RLHF (see README.md).\n\nArgs:\n" + "".join(f"    {k}: {c}\n" for k, c in comments)
    return cls


def hold_to_types(cfg):
    """Each field of the dataclass cfg converted to its annotated type, or a ValueError naming the flag: fire reads
    "--lr=1" as an int and "--model=7" as one."""
    for f in fields(cfg):
        v, want = getattr(cfg, f.name), float if f.type == float | None else f.type
        if v is None and f.type == float | None:
            continue
        if want is tuple:
            v = tuple(v) if isinstance(v, (list, tuple)) else (v,)
            ok = all(isinstance(i, int) and not isinstance(i, bool) for i in v)
        elif want == tuple[float, float]:  # a band lo,hi: two numbers
            v = tuple(v) if isinstance(v, (list, tuple)) else (v,)
            ok = len(v) == 2 and all(isinstance(i, (int, float)) and not isinstance(i, bool) for i in v)
            v = tuple(float(i) for i in v) if ok else v
        elif want is str:
            v, ok = str(v), True
        else:  # bool, int, float: a bool is not a number here, an int is a float
            ok = isinstance(v, bool) if want is bool else isinstance(v, (int, want)) and not isinstance(v, bool)
            v = want(v) if ok else v
        if not ok:
            raise ValueError(f"--{f.name}={v!r}: expected {want.__name__}" + (" of ints" if want is tuple else
                                                                        " of two numbers" if want == tuple[float, float] else ""))
        setattr(cfg, f.name, v)


# -----------------------------------------------------------------------------
# the metrics log, stopping on a signal


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
            vloss = f"| vloss {m['loss/value_avg']:.4f} " if "loss/value_avg" in m else ""  # with a critic
            print(f"step {m['step']:4d} | score {m['objective/scores']:+.3f} | kl {m['objective/kl']:+.3f} "
                  f"| entropy {m['objective/entropy']:.3f} | clipfrac {m['policy/clipfrac_avg']:.3f} "
                  f"{vloss}| len {m['val/response_length']:.1f} "
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
        self.previous = {sig: signal.signal(sig, lambda signum, frame: self.received.append(signum))
                         for sig in (signal.SIGTERM, signal.SIGINT)}

    def close(self):
        """Puts back the handlers it replaced."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def requested(self, all_sum):
        """True on every rank when any rank got a signal (all_sum: a sum over ranks, one collective)."""
        return all_sum([float(len(self.received))]).item() > 0

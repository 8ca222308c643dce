"""
The process a run lives in: the command line, the process group (one code path for 1 process and for N under
torchrun), printing on rank 0, sums over ranks, the free disk, the phase timer, progress bars, the metrics and samples
log and stopping on a signal. Plumbing that ppo.py calls so that its main loop reads as the algorithm; nothing here
knows about models.
"""
import atexit
import contextlib
import datetime
import difflib
import inspect
import json
import math
import os
import re
import shutil
import shlex
import signal
import sys
import threading
import time
import traceback
import types
import typing
from dataclasses import asdict, fields

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm


PG_TIMEOUT_MIN = 30  # a collective waiting longer ends the job: ranks that wait on one rank's slow reward call,
# its checkpoint or export write. Said, not left to PyTorch, whose default is 10 minutes for "nccl" alone


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
    timeout = datetime.timedelta(minutes=PG_TIMEOUT_MIN)
    if not dist.is_initialized():
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group(backend, timeout=timeout)
        else:  # plain `python ppo.py`: a group of one, on an in-memory store (no port to collide on)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    global PEERS
    if "RANK" in os.environ and PEERS is None:  # torchrun: a rank that fails tells the others and torchrun's summary
        PEERS = PeerWatch(dist.get_rank(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size(), device


class PeerWatch:
    """A rank that fails leaves the others waiting for it in their next collective. NCCL sees no dead peer, so they
    wait until the process group's timeout (PG_TIMEOUT_MIN), and the SIGTERM torchrun sends them reaches no Python
    handler while the main thread waits in CUDA (one that runs would promise a checkpoint after a step that cannot
    end). torchrun kills the ranks on the failed one's node 30 s later (its --shutdown_timeout does not apply
    there); those on other nodes wait out the timeout. So a failing rank posts its error in torchrun's store (fail:
    from sys.excepthook, for an exception that ends the process whatever its script, and from run_command for a
    usage error). Another rank leaves at torchrun's SIGTERM where its handler runs (StopSignal asks posted()), and
    else a thread that polls the key makes it leave GRACE_S after the post, unless it is failing itself: it prints
    the failed rank's error, writes it where torchrun's summary reads it and exits with status 1. Nothing is posted
    when a run stops on a signal (every rank checkpoints) or ends; the store is torchrun's (its agent's), which
    outlives the ranks."""
    POLL_S, GRACE_S = 1.0, 3.0

    def __init__(self, rank, world):
        self.rank, self.failing = rank, False
        self.key = f"ppo/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # one key per torchrun attempt
        self.previous_hook, sys.excepthook = sys.excepthook, self._excepthook
        self.stopped, self.thread = threading.Event(), None
        if world > 1:
            self.thread = threading.Thread(target=self._watch, name="peer-watch", daemon=True)
            self.thread.start()
            atexit.register(self.stop)  # its store client gone before the interpreter's teardown, which it aborted

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=60)

    def _excepthook(self, kind, e, tb):  # an exception about to end the process
        self.fail(e, "".join(traceback.format_exception(kind, e, tb)).rstrip())
        self.previous_hook(kind, e, tb)

    def fail(self, e, summary):
        """This rank fails with e: summary (its traceback, or a usage error's line) goes where torchrun's summary of
        the failed ranks reads it, and e's first line to the other ranks."""
        torchrun_summary(summary)
        if self.thread is not None:
            self.post(e)

    @staticmethod
    def _store(seconds=30):
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=seconds))

    def post(self, e):
        """This rank fails with e: tells the others (the first failure's words stay) and stops watching them."""
        self.failing = True
        first = (str(e).splitlines() or [""])[0][:500]
        try:
            self._store().compare_set(self.key, "", f"rank {self.rank} failed: {type(e).__name__}: {first}")
        except Exception:  # noqa: BLE001 -- the store gone too: torchrun ends the ranks itself
            pass

    def _watch(self):
        try:
            store = self._store()
            while not store.check([self.key]):
                if self.stopped.wait(self.POLL_S):
                    return
            what = store.get(self.key).decode()
        except Exception:  # noqa: BLE001 -- a store that stops answering: torchrun itself is ending
            return
        del store
        if self.stopped.wait(self.GRACE_S) or self.failing:  # a rank failing at the same moment prints its own error
            return
        self.leave(what)

    def posted(self):
        """The failure another rank posted, or None (none, or this rank is failing itself): what a SIGTERM means."""
        if self.thread is None or self.failing:
            return None
        try:
            store = self._store(seconds=5)
            return store.get(self.key).decode() if store.check([self.key]) else None
        except Exception:  # noqa: BLE001 -- no store: a signal as any other
            return None

    def leave(self, what):
        line = (f"rank {self.rank}: stopping, since {what} (this rank would wait for it in its next collective); "
                "the last complete checkpoint is kept")
        os.write(2, (line + "\n").encode())
        torchrun_summary(line)
        os._exit(1)


PEERS = None  # setup_distributed's PeerWatch, under torchrun


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_sum(x):
    """Sums a tensor (or nested list of floats) over ranks in float64; returns a new tensor on the CPU, x untouched
    (a CPU float64 x was the tensor reduced in place). A list is read as float64: as_tensor's default float32 held
    check_space's bytes to 24 bits."""
    t = torch.as_tensor(x, dtype=torch.float64).detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)  # on the CPU: gloo
    return t


def grad_norm(model, max_norm):
    """Clips model's gradients in place to a total norm of max_norm; returns the norm before clipping, a 0-dim tensor
    (no host sync), whole on every rank (FSDP2's is a DTensor over the shards)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def bad_updates_in_a_row(count, update, step, cfg, critic):
    """The non-finite updates in a row after `update` (ppo.update's dict: skipped, norms), or a FloatingPointError
    that stops the run at cfg.max_bad_updates of them: each was skipped, and the last checkpoint is untouched."""
    count = count + 1 if update["skipped"] else 0
    if count >= cfg.max_bad_updates:
        raise FloatingPointError(f"step {step}: {count} updates in a row with a non-finite gradient (norms "
                                 f"{update['norms'].tolist()}); stopping. The last checkpoint in {cfg.out_dir}/"
                                 "checkpoints is untouched: resume with a lower --lr" + " (and --critic_lr)" * critic)
    return count


def check_space(folder, local_bytes, what):
    """Every rank calls it with the bytes its share of `what` will take in folder: raises OSError on every rank when
    the sum over ranks (plus 1% and 16 MiB for the small files) passes the free space rank 0 sees there."""
    os.makedirs(folder, exist_ok=True)
    free = shutil.disk_usage(folder).free if dist.get_rank() == 0 else 0
    need, free = all_sum([float(local_bytes) * 1.01 + 16 * 2**20, float(free)]).tolist()
    if need > free:
        size = (lambda b: f"{b / 2**30:.2f} GiB") if need >= 2**30 else (lambda b: f"{b / 2**20:.1f} MiB")
        raise OSError(f"not enough disk space for {what} in {folder}: it needs about {size(need)}, {size(free)} are "
                      "free; nothing was written, and what earlier steps saved is kept. Free some space (or move "
                      "--out_dir), then resume with --resume=auto")


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


def keep_freed_memory():
    """A CPU run's steps allocate and free the same large tensors again and again (FSDP2's gathered parameters and
    their gradients, the generation copy's refill, activations): gigabytes a step. glibc's malloc maps each block past
    its threshold (128 KiB, rising to 32 MiB) fresh from the kernel and unmaps it when freed, and the kernel zeroes
    every page again on first touch, so a step paid its own size in page faults (about a million, 3 s of system time,
    an fp32 step of the default run on 2 cores: python bench.py cpu_malloc). Called once the models are loaded: from
    then on large blocks come from the heap (M_MMAP_MAX 0) and freed memory stays in the process for the next step
    (M_TRIM_THRESHOLD 2 GiB), so after a few steps nothing faults. The price: the process keeps its heap until it
    exits, and a repeated block can take a few rounds to find its hole (torch asks for 64-byte aligned blocks, which
    do not fit the exact hole the last one left until holes merge), holding a few such blocks more meanwhile; the
    default run's peak resident memory did not change. glibc only (elsewhere nothing happens); returns whether it
    applied."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): its own allocator's policy
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def progress(desc):
    """A function that wraps an iterable (with its length as total, for a generator) in a tqdm bar labelled desc,
    cleared when done: the work inside a step. Only on rank 0 and when stdout is a terminal; elsewhere (a log file,
    a pipe) it hands the iterable back untouched, so the logs hold the step lines alone."""
    on = sys.stdout.isatty() and (not dist.is_initialized() or dist.get_rank() == 0)
    return lambda it, total=None: (tqdm(it, desc=desc, total=total, leave=False, file=sys.stdout, dynamic_ncols=True)
                                   if on else it)


# -----------------------------------------------------------------------------
# the command line: fire parses it into ppo.Config


class UsageError(ValueError):
    """A mistake in a flag or an input file, not in the code: ppo.py prints its message as one line
    ("error: ...", naming the flag or the file and what is expected) and exits with 2, as fire does for an
    unknown flag. PPO_DEBUG=1 shows the traceback instead."""


def need(ok, message):
    """A check of what the user gave: a UsageError (one line, exit 2 from the command line) unless ok."""
    if not ok:
        raise UsageError(message)



def doc_from_comments(cls):
    """The fields' comments become the docstring's Args section: `python ppo.py --help` shows them."""
    comments = re.findall(r"^    (\w+): .*?  # (.*)$", inspect.getsource(cls), re.M)
    cls.__doc__ = ("PPO for RLHF (see README.md). A bad flag or input file is named in one line, exit status 2 "
                   "(PPO_DEBUG=1: with its traceback).\n\nArgs:\n" + "".join(f"    {k}: {c}\n" for k, c in comments))
    return cls


def run_command(config_cls, main, argv=None, name=None):
    """fire parses argv (else sys.argv[1:]) into config_cls, then main(config) runs; returns main's result, or 2
    after printing a UsageError as one line ("error: ...") without a traceback: the user's mistake, not the
    code's, and a traceback would only hide the line. PPO_DEBUG=1 raises it instead. fire's own usage errors
    exit with 2 too."""
    import fire

    def cli(*args, **kwargs):  # a function, not the class: --help lists the flags alone, not each field again
        return config_cls(*args, **kwargs)

    def shown(p):  # fire's help writes a None default's type as Optional[<annotation>]: X, not X | None
        args = typing.get_args(p.annotation) if isinstance(p.annotation, types.UnionType) else ()
        if p.default is None and type(None) in args and len(args) == 2:
            return p.replace(annotation=next(a for a in args if a is not type(None)))
        return p

    sig = inspect.signature(config_cls)
    cli.__signature__ = sig.replace(parameters=[shown(p) for p in sig.parameters.values()])
    cli.__doc__ = config_cls.__doc__
    argv = sys.argv[1:] if argv is None else shlex.split(argv) if isinstance(argv, str) else list(argv)
    try:
        argv = check_flags(argv, {f.name: f.type in (bool, "bool") for f in fields(config_cls)}, name or "ppo.py")
        with no_short_flags_in_help(fire):
            cfg = fire.Fire(cli, command=argv, name=name, serialize=lambda cfg: None)
        return main(cfg)
    except UsageError as e:
        if os.environ.get("PPO_DEBUG", "0") not in ("", "0"):
            raise
        line = "error: " + str(e).replace("\n", " ")
        print(line, file=sys.stderr, flush=True)
        if PEERS is not None:  # under torchrun: the other ranks and torchrun's summary are told
            PEERS.fail(e, line)
        else:
            torchrun_summary(line)
        return 2


def run_function(fn, script, argv=None):
    """`python SCRIPT [ARGS] [--flags]` for a module's demo or self-check fn: fire calls fn with argv (else
    sys.argv[1:]) and prints what it returns, once check_flags has named a flag fn does not take or a word past its
    arguments (fire ran fn first, and then complained of what it had not used, offering the methods of fn's result).
    Returns the exit status: 2 after a UsageError's one line ("error: ...")."""
    import fire

    argv = sys.argv[1:] if argv is None else list(argv)
    params = inspect.signature(fn).parameters.values()
    try:
        argv = check_flags(argv, {p.name: isinstance(p.default, bool) for p in params}, script, positional=len(params))
        with no_short_flags_in_help(fire):
            fire.Fire(fn, command=argv, name=script)
    except UsageError as e:
        if os.environ.get("PPO_DEBUG", "0") not in ("", "0"):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


@contextlib.contextmanager
def no_short_flags_in_help(fire):
    """fire's help offers `-n, --non_stop_penalty` (a flag whose first letter no other flag has), a form that
    check_flags refuses: within this block it lists the --name form alone (fire 0.7's helper; another fire keeps its
    help as it is)."""
    helptext = getattr(fire, "helptext", None)
    short = getattr(helptext, "_GetShortFlags", None)
    if short is None:
        yield
        return
    helptext._GetShortFlags = lambda flags: []
    try:
        yield
    finally:
        helptext._GetShortFlags = short


def check_flags(argv, flags, script, positional=0):
    """argv, or ["--help"] where it asks for help beside flags (fire listed the made config's members). A UsageError
    for a word (before a lone "--", which fire's own flags follow) that is not one of `flags` ({name: is a bool})
    written --name=value, --name value, or --name / --noname for a bool: fire would take `-n` for the one flag that
    starts with n (--non_stop_penalty), a word without a flag for the next field in order (the model, then the
    reward model), --nomodel for --model=False, and an unknown --name for a member of the config once it is made
    (or, for a function, complain of it only after the function ran). positional: how many words without a flag
    may stand for the first arguments (a benchmark's FOLDER), in order."""
    if "-h" in argv or "--help" in argv:
        return ["--help"]
    ours = argv[: argv.index("--")] if "--" in argv else argv
    i = 0
    while i < len(ours):
        word, i = ours[i], i + 1
        key = word[2:].split("=", 1)[0].replace("-", "_") if word.startswith("--") else None
        if key is None and not word.startswith("-") and positional > 0:
            positional -= 1
            continue
        if key not in flags and not (key and "=" not in word and key.startswith("no") and flags.get(key[2:])):
            close = difflib.get_close_matches(key or word.lstrip("-"), list(flags), n=1, cutoff=0.75)
            hint = f"; did you mean --{close[0]}?" if close else f" (`python {script} --help` lists them)"
            raise UsageError(f"{word!r} is not a flag of {script}: each flag is written --name=value{hint}")
        if "=" not in word and i < len(ours) and not re.match(r"--|-[a-zA-Z]", ours[i]):
            i += 1  # its value, as fire reads it: the next word unless that is a flag
    return argv


def torchrun_summary(text):
    """Under torchrun: text (a traceback, an error's line) is what its summary of the failed ranks shows for this
    rank, in place of "To enable traceback see ...". The file torchrun names, in the form its readers take."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": text, "timestamp": str(int(time.time()))}, f)


def _not_finite(word):
    """True for a word that float() reads as nan or +-inf ("nan", "-Infinity"), which fire leaves a string."""
    try:
        return isinstance(word, str) and not math.isfinite(float(word))
    except ValueError:
        return False


def hold_to_types(cfg):
    """Each field of the dataclass cfg converted to its annotated type, or a UsageError naming the flag: fire reads
    "--lr=1" as an int and "--model=7" as one. The types: bool, int, float, str, X | None of these (a fork's field too:
    int | None was called as a type, a TypeError at every start), a tuple of ints, tuple[str, ...],
    tuple[float, float]."""
    for f in fields(cfg):
        v, want = getattr(cfg, f.name), f.type
        if typing.get_origin(want) in (typing.Union, types.UnionType) and type(None) in typing.get_args(want):
            if v is None:
                continue
            want = typing.Union[tuple(a for a in typing.get_args(want) if a is not type(None))]  # X of X | None
        if want not in (bool, int, float, str, tuple, tuple[str, ...], tuple[float, float]):
            raise TypeError(f"Config field {f.name}: type {f.type} is none that hold_to_types converts (bool, int, "
                            "float, str, X | None of these, tuple of ints, tuple[str, ...], tuple[float, float])")
        if want is tuple:
            v = tuple(v) if isinstance(v, (list, tuple)) else (v,)
            ok = all(isinstance(i, int) and not isinstance(i, bool) for i in v)
        elif want == tuple[str, ...]:  # names: a,b,c
            v = tuple(v) if isinstance(v, (list, tuple)) else tuple(str(v).split(","))
            ok = all(isinstance(i, str) for i in v)
        elif want == tuple[float, float]:  # a band lo,hi: two numbers
            v = tuple(v) if isinstance(v, (list, tuple)) else tuple(v.split(",")) if isinstance(v, str) else (v,)
            ok = len(v) == 2 and all(isinstance(i, (int, float)) and not isinstance(i, bool) for i in v)
            v = tuple(float(i) for i in v) if ok else v
        elif want is str:  # (a list of names: fire reads "a,b" as a tuple)
            v, ok = ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v), True
        else:  # bool, int, float: a bool is not a number here, an int is a float
            ok = isinstance(v, bool) if want is bool else isinstance(v, (int, want)) and not isinstance(v, bool)
            v = want(v) if ok else v
        if not ok:
            finite = any(map(_not_finite, v if isinstance(v, tuple) else (v,)))  # fire keeps "nan" a word
            what = {tuple: "tuple of ints", tuple[float, float]: f"tuple of two{' finite' * finite} numbers",
                    tuple[str, ...]: "tuple of names", float: "a finite float" if finite else "float"}
            raise UsageError(f"--{f.name}={v!r}: expected {what.get(want, want.__name__)}")
        setattr(cfg, f.name, v)


def check_wandb(project):
    """--wandb: the package, the project's name (wandb's rules) and credentials are there, checked before any model
    loads (wandb.init would stop the run after minutes of loading, or wait for a key at a prompt). Credentials:
    WANDB_API_KEY (or an identity token file), a netrc entry for the server (what `wandb login` writes), or
    WANDB_MODE=offline / disabled; the mode and the server as wandb reads them, from the variables or its settings
    files."""
    import importlib.util
    import netrc
    from urllib.parse import urlparse

    if importlib.util.find_spec("wandb") is None:
        raise UsageError("--wandb needs the wandb package: pip install wandb")
    bad = sorted(set(project) & set("/\\#?%:"))
    need(not bad and len(project) <= 128, f"--wandb_project={project!r}: wandb takes at most 128 characters, none of "
                                          f"/ \\ # ? % : ({'found ' + ' '.join(bad) if bad else 'too long'})")
    import configparser

    files = configparser.ConfigParser(interpolation=None)  # wandb's settings files (`wandb login --host`, `wandb
    try:  # offline`): the global one, then the workspace's
        files.read([os.path.join(os.path.expanduser(os.environ.get("WANDB_CONFIG_DIR", "~/.config/wandb")), "settings"),
                    os.path.join(os.environ.get("WANDB_DIR", "."), "wandb", "settings")])
    except configparser.Error:
        pass  # (one wandb cannot read either)
    setting = lambda k: os.environ.get(f"WANDB_{k.upper()}") or files.get("default", k, fallback="")  # noqa: E731
    if setting("mode").lower() in ("offline", "disabled", "dryrun") or \
            os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlparse(setting("base_url") or "https://api.wandb.ai").netloc  # netrc's machine: host[:port], as wandb
    path = os.path.expanduser(os.environ.get("NETRC", "~/.netrc"))
    try:
        if netrc.netrc(path).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass  # no netrc file, or one wandb could not read either
    raise UsageError(f"--wandb: no credentials for {host}: run `wandb login` (it writes {path}), set WANDB_API_KEY, "
                     "or set WANDB_MODE=offline to log locally (wandb sync uploads it later)")


# -----------------------------------------------------------------------------
# the metrics log, stopping on a signal


def reward_words(m, prefix):
    """The console's words for what a reward function returned beside the score: "| name mean " for each metric
    prefix + name of m (reward/correct, eval/reward/correct), or ""."""
    return "".join(f"| {k[len(prefix):]} {v:.3f} " for k, v in sorted(m.items()) if k.startswith(prefix))


class Logger:
    """metrics.jsonl (rewritten to the steps the models have seen on resume), stdout, wandb if asked; samples in
    out_dir/samples: train.jsonl (the sample printed every sample_every steps) and step-N.jsonl (an evaluation's
    rows), cut back to the resumed step as the metrics are. wandb_id: the wandb run the checkpoint logged to, which
    a resumed run continues, unless it goes back to an earlier step with --resume=PATH or resumes into another
    out_dir (a new run, named so). A line's non-finite numbers are written as null (JSON has no NaN); wandb failing
    mid-run leaves the run going."""

    def __init__(self, cfg, history, master, wandb_id=None):
        self.cfg, self.history, self.master = cfg, history, master
        self.path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.samples = os.path.join(cfg.out_dir, "samples")
        self.wandb = self.wandb_id = None
        last = max((m["step"] for m in history), default=-1)  # what a resumed run has already logged
        before = read_jsonl(self.path) if history else []  # the earlier run's lines, those after its checkpoint too
        if not any("eval/score" in m and m["step"] == last for m in history) and os.path.exists(
                os.path.join(self.samples, f"step-{last:06d}.jsonl")):  # the checkpoint's evaluation, written after it
            history += [m for m in before if m["step"] == last and "eval/score" in m][-1:]  # (every rank reads it)
        if not master:
            return
        with open(self.path + ".tmp", "w") as f:
            f.writelines(jsonl(m) for m in history)
        os.replace(self.path + ".tmp", self.path)
        if cfg.wandb:  # a new wandb run, unless this out_dir's own run continues (resumed into another: a fork)
            went_back = bool(history) and (not before or cfg.resume != "auto" and any(m["step"] > last for m in before))
            self.wandb_id = None if went_back else wandb_id
            self.wandb = self._start_wandb(self.wandb_id, last if went_back else None)
            self.wandb_id = self.wandb.id if self.wandb is not None else self.wandb_id
            # the newest evaluation the wandb run has: what metrics.jsonl had (wandb got every line), none if new
            self.wandb_evals = -1 if went_back else max((m["step"] for m in before if "eval/score" in m), default=-1)
            if self.wandb is not None:  # evaluations on an axis of their own, eval/step: one a resumed run does first
                self._guarded(lambda: (  # (it had failed, or a stop deferred it) is at a step below the wandb run's
                    self.wandb.define_metric("eval/step"), self.wandb.define_metric("eval/*", step_metric="eval/step")))
        evaluated = {m["step"] for m in history if "eval/score" in m}  # (a checkpoint precedes its evaluation)
        for name in os.listdir(self.samples) if os.path.isdir(self.samples) else []:
            n = re.fullmatch(r"step-(\d+)\.jsonl", name)
            if n and (int(n[1]) > last or int(n[1]) == last and last not in evaluated):
                os.remove(os.path.join(self.samples, name))
        train = os.path.join(self.samples, "train.jsonl")
        if os.path.exists(train):
            with open(train, errors="replace") as f:  # a line a kill -9 cut short (no newline: only the last can be)
                lines = [(line, _row(line)) for line in f]  # goes too; a whole line that does not parse is named
            for i, (line, row) in enumerate(lines, 1):  # (it stopped the resume with a JSONDecodeError, naming nothing)
                if row is None and line.endswith("\n"):
                    print(f"{train}:{i}: not a JSON object with an integer step: dropped", flush=True)
            kept = [line for line, row in lines if line.endswith("\n") and row is not None and row["step"] <= last]
            with open(train + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(train + ".tmp", train)

    def _start_wandb(self, wandb_id, went_back):
        """wandb.init: the run wandb_id continued, or a new one named after out_dir (+ the step it started from);
        offline (`wandb sync` uploads it later) when the server cannot be reached, without wandb if that fails too."""
        import wandb

        name = os.path.basename(os.path.abspath(self.cfg.out_dir))
        name += f"-from-step-{went_back}" if went_back is not None else ""
        kw = dict(project=self.cfg.wandb_project, config=asdict(self.cfg), dir=self.cfg.out_dir, name=name,
                  id=wandb_id, resume="allow" if wandb_id else None, allow_val_change=True)
        for mode in (None, "offline"):
            try:
                return wandb.init(mode=mode, **kw)
            except Exception as e:  # noqa: BLE001 -- the dashboard is not worth the run: say so and go on
                print(f"wandb.init{'' if mode is None else ' offline'} failed ({type(e).__name__}: {e})", flush=True)
        print("logging without wandb: metrics.jsonl and samples/ hold every line", flush=True)
        return None

    def _to_wandb(self, row, evaluation=False):
        """wandb.log(row()) at the row's step, unless wandb already has a later one (a resumed run repeats the
        steps logged after its checkpoint, with the same numbers); an evaluation that wandb does not have yet is
        logged at wandb's step if its own is behind (it is plotted against eval/step). wandb failing stops wandb,
        not the run."""
        def log():
            m = row()
            if evaluation and (m["step"] >= self.wandb.step or m["step"] > self.wandb_evals):
                self.wandb.log({**m, "eval/step": m["step"]}, step=max(m["step"], self.wandb.step))
                self.wandb_evals = max(self.wandb_evals, m["step"])
            elif not evaluation and m["step"] >= self.wandb.step:
                self.wandb.log(m, step=m["step"])

        self._guarded(log)

    def _guarded(self, fn):
        """fn(), a call to wandb: wandb failing stops wandb, not the run."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            print(f"wandb failed ({type(e).__name__}: {e}); logging on without it: metrics.jsonl holds every line",
                  flush=True)
            self.wandb = None

    def log(self, m, sample=None):
        self.history.append(m)
        if not self.master:
            return
        with open(self.path, "a") as f:
            f.write(jsonl(m))
        if self.wandb is not None:
            self._to_wandb(lambda: m)
        if m["step"] % self.cfg.log_every == 0:
            vloss = f"| vloss {m['loss/value_avg']:.4f} " if "loss/value_avg" in m else ""  # with a critic
            kl = f"| kl {m['objective/kl']:+.3f} " if "objective/kl" in m else ""  # with a reference
            print(f"step {m['step']:4d} | score {m['objective/scores']:+.3f} {reward_words(m, 'reward/')}{kl}"
                  f"| entropy {m['objective/entropy']:.3f} | clipfrac {m['policy/clipfrac_avg']:.3f} "
                  f"{vloss}| len {m['val/response_length']:.1f} "
                  f"| stop {m['val/stop_rate']:.2f} | {m['time/step']:.1f}s", flush=True)
        if sample and self.cfg.sample_every and m["step"] % self.cfg.sample_every == 0:
            print(f"--- sample (score {sample[0]:+.3f})\n{sample[1]}{sample[2]}\n---", flush=True)
            os.makedirs(self.samples, exist_ok=True)
            with open(os.path.join(self.samples, "train.jsonl"), "a") as f:
                f.write(json.dumps(dict(step=m["step"], prompt=sample[1], response=sample[2], score=sample[0])) + "\n")

    def log_eval(self, m, rows):
        """An evaluation: its metrics m, a line of their own in metrics.jsonl (at the step whose weights it
        evaluated), and its rows (one dict per prompt) in samples/step-N.jsonl and, with wandb, a wandb.Table."""
        self.history.append(m)
        if not self.master:
            return
        with open(self.path, "a") as f:
            f.write(jsonl(m))
        os.makedirs(self.samples, exist_ok=True)
        path = os.path.join(self.samples, f"step-{m['step']:06d}.jsonl")
        with open(path + ".tmp", "w") as f:
            f.writelines(jsonl(r) for r in rows)
        os.replace(path + ".tmp", path)
        if self.wandb is not None:
            import wandb

            self._to_wandb(lambda: {**m, "eval/samples": wandb.Table(columns=list(rows[0]),
                                                                     data=[list(r.values()) for r in rows])},
                           evaluation=True)
        n = getattr(self.cfg, "eval_samples_per_prompt", 1)
        sets = list(dict.fromkeys(r["set"] for r in rows)) if rows and "set" in rows[0] else []  # several files
        for name, part in [(None, rows)] + [(s, [r for r in rows if r["set"] == s]) for s in sets]:
            k, E = f"eval/{name}/" if name else "eval/", len(part) // n  # prompts, n responses each
            se = f"{m[k + 'score_std'] / E ** 0.5:.3f}" if E > 1 else "n/a"  # (one prompt: no spread)
            best = f"| best@{n} {m[k + 'score_best']:+.3f} " if k + "score_best" in m else ""
            best += f"| maj@{n} {m[k + 'score_maj']:+.3f} " if k + "score_maj" in m else ""
            print(f"eval {m['step']:4d} | {f'{name}: ' if name else ''}score {m[k + 'score']:+.3f} +- {se} {best}"
                  f"{reward_words(m, k + 'reward/')}" + (f"| kl {m[k + 'kl']:+.3f} " if k + "kl" in m else "")
                  + f"| len {m[k + 'response_length']:.1f} | "
                  f"stop {m[k + 'stop_rate']:.2f} | {E} prompts{f' x {n}' if n > 1 else ''}"
                  + ("" if name else f" | {m['time/eval']:.1f}s"), flush=True)

    def state(self):
        """What a checkpoint keeps of the log: the metrics so far and the wandb run a resumed run continues."""
        return dict(metrics=self.history, wandb_id=self.wandb_id)

    def close(self):
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:  # noqa: BLE001 -- the run is over and metrics.jsonl complete
                print(f"wandb.finish failed ({type(e).__name__}: {e})", flush=True)


def jsonl(m):
    """A metrics.jsonl line: non-finite numbers as null (json.dumps writes NaN, which JSON has not)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()}) + "\n"


def _row(line):
    """A jsonl line's object, or None unless it parses as an object with an integer step."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def read_jsonl(path):
    """The rows of a metrics.jsonl, the lines that parse: a kill can cut the last one short."""
    if not os.path.isfile(path):
        return []
    with open(path, errors="replace") as f:
        return [row for row in map(_row, f) if row is not None]


class StopSignal:
    """SIGTERM / SIGINT (what a cluster sends before preemption) only set a flag: the step in flight
    finishes, then every rank checkpoints at the same step and exits. A second signal stops the process at
    once (a step that hangs, in a reward function say): the last complete checkpoint stays as it was, and
    what the interrupted write left is removed at the next start. A signal within SAME_REQUEST_S of the first
    is the same request arriving twice: a scheduler's scancel signals torchrun and its workers, and torchrun
    passes it on; Ctrl-C in a terminal reaches the workers and torchrun, which sends them SIGTERM.
    Two signals at once can run the second's handler inside the first's (Python runs a handler between any two
    instructions of the main thread), so each arrival is put on a list in one step and the list's first entry
    decides: whatever instruction the second interrupts, one of the two is the request and the other its echo."""
    SAME_REQUEST_S = 2.0

    def __init__(self):
        self.received, self.arrivals = [], []
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        failed = PEERS.posted() if PEERS is not None else None
        if failed:  # torchrun passing on another rank's end: no step can finish without that rank
            PEERS.leave(failed)
        me = (time.monotonic(), signum)
        self.arrivals.append(me)
        first = self.arrivals[0]
        if first is not me and me[0] - first[0] < self.SAME_REQUEST_S:  # < 0 when it ran inside the first's handler
            return
        self.received.append(signum)
        if first is me:  # os.write: print() may be in the middle of a write this handler interrupted
            os.write(2, f"signal {signum}: stopping after the step in flight, with a checkpoint, once every rank "
                        f"ends it; send it again ({self.SAME_REQUEST_S:g} s or more later) to stop at once\n".encode())
        else:
            os.write(2, f"signal {signum} again: stopping now; the last complete checkpoint is kept\n".encode())
            os._exit(128 + signum)

    def close(self):
        """Puts back the handlers it replaced."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def requested(self, all_sum):
        """True on every rank when any rank got a signal (all_sum: a sum over ranks, one collective)."""
        return all_sum([float(len(self.received))]).item() > 0

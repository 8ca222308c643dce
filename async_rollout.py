"""
The rollout stage of the PPO loop: which weights draw a step's batch, and when, and which prompts make it
(--dynamic_sampling, Rollouts._take_dynamic: DAPO's rounds of prompts until the batch holds groups whose scores
differ). ppo.main calls Rollouts.take(step).

Synchronous (the default): step k's batch is drawn at the start of step k from the actor's weights theta_k, copied
into the generation copy (model.copy_weights_from: every rank gathers the sharded actor); the sampler is pi_old, up
to the numerics of the cached decode (gae.is_weights corrects for those).

One step ahead (--async_rollout; Noukhovitch et al. 2024, "Asynchronous RLHF", open-instruct's one-step-off schedule):
step k+1's batch is generated on a worker thread while step k scores and trains, from theta_k, the weights as they
were when step k's training began. The learner at theta_{k+1} then trains on data drawn by theta_k: val/policy_lag is
1 update, and the importance weights of --is_correction see that whole update in r = exp(old_logp - sampler_logp).

    main thread    | wait for batch k | theta_k -> gen | launch k+1 | score k, reward, advantages, train: theta_{k+1} |
    worker thread  ... batch k (from theta_{k-1}) |                 generate batch k+1 from theta_k ...

- Step 1 has no earlier step: its batch is generated and waited for (lag 0), then step 2's starts from the same weights.
- The generation copy is refilled only at the step boundary, in the main thread, while nothing generates: the gather is
  a collective, and the worker runs none (every rank must issue its collectives in one order). One copy is enough.
  A held-out evaluation (evaluate.py) refills it too: ppo.py waits for the batch being drawn first (Rollouts.wait),
  so an evaluation's time is not hidden behind generation, and a run trains the same with or without evaluations.
- The noise stays keyed by (seed, step, row) (rollout.py): an async run is deterministic on a machine and the same, to
  float rounding, on any number of ranks; step k's batch is exactly what a synchronous generation from theta_{k-1}
  draws with step k's keys.
- A training checkpoint holds the batch drawn for the next step (state_dict: waited for, every rank's rows gathered in
  global row order, so the run may resume on another number of ranks). The last step draws one too, so that a run
  continued past its total_steps repeats a longer uninterrupted one; it costs one rollout at the end of the run.
- CPU threads. torch.set_num_threads sets the calling thread's OpenMP team size and MKL's thread-local count
  (aten/src/ATen/ParallelOpenMP.cpp: omp_set_num_threads, mkl_set_num_threads_local), and the default that threads
  started later take. Each thread that runs an op opens its own OpenMP team, so while a rollout overlaps training
  the two teams share the cores. The worker runs CPU_WORKER_THREADS intra-op threads, the main thread keeps its own
  count: on 2 cores 1 + 2 threads, the steady choice (python bench.py async_rollout, README): 1 + 1 was slowest
  everywhere; 2 + 2 matched the synchronous step on a quiet machine but, under OpenMP's default spin-waiting
  with a neighbour running, took 15.4 s a step against 9.9 for 1 + 2. On 2 cores no split beat the synchronous
  step: generation takes its core-seconds from training. On CUDA the thread count does not matter.
- CUDA. The worker generates on its own stream, so the decode's kernels (CUDA graphs when compiled: recorded on the
  worker's thread, which runs every rollout, its first included, and the evaluations' generation: generate_beside)
  run beside the training kernels. The stream waits for
  the weight copy before it generates; the main thread's stream waits for the stream before it reads the batch, whose
  tensors are marked as used there (record_stream) so that the caching allocator does not hand them back to the
  worker's stream early. Phases end on the current stream only (runtime.phase_end), not on the whole device.

Where the scale-out design attaches (dedicated generation ranks, more than one GPU): _launch and take's weight refill
are the two seams. A generation rank would replace the worker thread (take waits on its batch instead of a future),
and the refill would become a broadcast of theta_k over NCCL from the training ranks to the generation ranks, issued
at the same step boundary by every rank of both groups; the keyed noise and the checkpointed pending batch stay as
they are.
"""
import gc
import importlib
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import torch
import torch.distributed as dist

from data import left_pad
from rollout import Rollout, StopStrings, row_seeds
from runtime import need, progress

CPU_WORKER_THREADS = 1  # intra-op threads of the generation thread on a CPU (see the module docstring)


def check_rollout_flags(cfg, device):
    """A UsageError (ppo.derive, before anything loads) for what these rollouts cannot do with cfg on device."""
    need(not (cfg.async_rollout and cfg.lora_dropout > 0 and device.type == "cuda"), "--lora_dropout with "
         "--async_rollout on a GPU: the worker's CUDA graphs and compiles claim and rewind the CUDA generator dropout "
         "draws from")
    need(all(s for s in getattr(cfg, "stop_strings", ())), f"--stop_strings must be non-empty strings, not "
         f"{getattr(cfg, 'stop_strings', ())!r}")
    if cfg.dynamic_sampling:
        why = "compares the scores of a prompt's samples, from the reward function, as it draws a step's batch"
        need(cfg.samples_per_prompt >= 2, f"--dynamic_sampling {why}: it needs --samples_per_prompt >= 2")
        need(not cfg.reward_model, f"--dynamic_sampling {why}: a --reward_model scores the batch later, once drawn")
        need(not cfg.async_rollout, f"--dynamic_sampling {why}: --async_rollout draws the batch on a worker thread, "
             "which runs no collective (the rounds gather every rank's verdicts); use one of the two")
        rows = cfg.dynamic_sampling * cfg.rollout_batch_size * cfg.samples_per_prompt
        need(rows < 1_000_033, f"--dynamic_sampling={cfg.dynamic_sampling}: its rounds would draw {rows:,} rows a "
             "step, past the 1,000,033 rows whose noise keys a step (rollout.row_seeds); fewer rounds")


def rollout_rows(ro, rows):
    """A Rollout (B rows) -> B plain records on the CPU, for a checkpoint: the row's prompt index (rows[b]), its
    prompt and response token ids, the response's sampler logprobs (float32), whether it ended, its seed."""
    P = ro.prompt_len
    return [dict(index=rows[b], prompt=ro.tokens[b, :P][ro.prompt_mask[b]].tolist(),
                 response=ro.tokens[b, P:][ro.response_mask[b]].tolist(),
                 logprobs=ro.logprobs[b][ro.response_mask[b]].cpu(), ended=bool(ro.ended[b]), seed=int(ro.seeds[b]))
            for b in range(ro.tokens.size(0))]


def rollout_from_rows(records, pad_id, device):
    """The inverse of rollout_rows: (prompt indices, Rollout) with the tensors generate returns for these rows
    (prompts left-padded to the widest, responses padded with pad_id to the longest, logprob 0 off the mask)."""
    idx, prompt_mask, _ = left_pad([r["prompt"] for r in records], pad_id)
    B, R = len(records), max(len(r["response"]) for r in records)
    tokens = torch.full((B, R), pad_id, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.bool)
    logprobs = torch.zeros(B, R, dtype=torch.float32)
    for b, r in enumerate(records):
        n = len(r["response"])
        tokens[b, :n] = torch.tensor(r["response"], dtype=torch.long)
        response_mask[b, :n], logprobs[b, :n] = True, r["logprobs"]
    ro = Rollout(tokens=torch.cat([idx, tokens], 1).to(device), prompt_len=idx.size(1),
                 prompt_mask=prompt_mask.bool().to(device), response_mask=response_mask.to(device),
                 logprobs=logprobs.to(device), ended=torch.tensor([r["ended"] for r in records], device=device),
                 seeds=torch.tensor([r["seed"] for r in records], dtype=torch.long, device=device))
    return [r["index"] for r in records], ro


def own_graph_trees():
    """On the worker thread: its own empty state of inductor's cudagraph trees. They keep their managers in a
    threading.local filled only on the thread that imported the module (and autograd's threads, through a
    thread-local stash): on any other thread the first graph asserts (cudagraph_trees.get_obj). With its own, the
    worker records the decode's graphs into one manager and one memory pool, which the rollouts and evaluations
    share (generate_beside)."""
    from collections import defaultdict
    from threading import Lock

    from torch._inductor import cudagraph_trees as trees

    if not hasattr(trees.local, "tree_manager_containers"):  # (a worker that imported the module has them)
        trees.local.tree_manager_containers, trees.local.tree_manager_locks = {}, defaultdict(Lock)


class Rollouts:
    """Each step's (prompt indices, Rollout) for this rank: drawn now, or one step ahead (module docstring).
    m: the run's models (m["gen"] generates, m["actor"] fills it); generate: rollout.generate, passed in so that a
    caller may swap it (bench.py does)."""

    def __init__(self, m, prompts, sampler, cfg, run, stop_ids, pad_id, generate, reward=None, tokenizer=None):
        self.m, self.prompts, self.sampler, self.cfg, self.run = m, prompts, sampler, cfg, run
        self.stop_ids, self.pad_id, self.generate = stop_ids, pad_id, generate
        self.reward, self.tokenizer = reward, tokenizer  # (--dynamic_sampling scores the batches it draws)
        self.stop = StopStrings.of(getattr(cfg, "stop_strings", ()), tokenizer)
        self.next, self.pool, self.stream, self.metrics, self.scored = None, None, None, {}, None

    def _start(self):
        """The worker thread (and its CUDA stream), at the first job: a run that fails before it starts none."""
        if self.pool is None:
            threads = torch.get_num_threads()
            # Dynamo refuses to run a compiled function while torch.fx traces (eval_frame's nested-trace check), but
            # the flag it reads (torch.fx._symbolic_trace._is_fx_tracing_flag) is one for the whole process: on an
            # H100 the main thread compiling step 1's training made the worker's compiled decode step raise, and the
            # worker compiling a decode size it had not met would make training raise. Nothing here traces compiled
            # code with torch.fx, so the check is off while the worker exists, on both threads (since torch 2.13 a
            # set config value holds for the thread that set it); compiles themselves take one lock (convert_frame).
            self.forced = torch._dynamo.config.force_compile_during_fx_trace
            torch._dynamo.config.force_compile_during_fx_trace = True
            if self.run.device.type == "cuda":
                importlib.import_module("torch._inductor.cudagraph_trees")  # its thread-local state: the main's
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout", initializer=self._init_worker)
            self.pool.submit(lambda: None).result()  # the worker exists and has set its threads
            torch.set_num_threads(threads)  # also the default of threads started later (autograd's, gloo's): the main's
            if self.run.device.type == "cuda":
                self.stream = torch.cuda.Stream(self.run.device)

    def _init_worker(self):
        torch._dynamo.config.force_compile_during_fx_trace = True  # (see _start)
        if self.run.device.type == "cuda":
            torch.cuda.set_device(self.run.device)  # the current device is per thread
            own_graph_trees()
        else:
            torch.set_num_threads(min(CPU_WORKER_THREADS, torch.get_num_threads()))

    def _draw(self, step, round=0):
        """This rank's rows of `step`: prompt indices (a prompt's samples side by side) and their noise seeds. Round j
        of --dynamic_sampling keys its rows as global rows j x (global rows a step) + g, the first round as a step."""
        rows = [i for i in self.sampler.next_batch() for _ in range(self.cfg.samples_per_prompt)]
        L, r = self.run.local_rows, self.run.rank
        first = round * L * self.run.world
        return rows, row_seeds(self.cfg.seed, step, range(first + r * L, first + (r + 1) * L))

    def _generate(self, rows, seeds, step):
        cfg, run = self.cfg, self.run
        return self.generate(self.m["gen"], [self.prompts.ids[i] for i in rows], cfg.max_new_tokens,
                             temperature=cfg.temperature, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                             seeds=seeds.to(run.device), micro_batch_size=run.rollout_micro, stop=self.stop,
                             max_prompt_len=cfg.max_prompt_len, progress=progress(f"step {step} rollout"))

    def _work(self, job, fn):
        """On the worker thread: job["ro"] = fn(), a Rollout, generated on the worker's own stream on CUDA."""
        job["start"] = time.time()
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            job["ro"] = fn()
            if self.stream is not None:
                self.stream.synchronize()  # only this thread waits: the end time is when the GPU finished
        job["end"] = time.time()

    def _submit(self, job, fn):
        self._start()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.run.device))  # the weights just copied into gen
        job["fn"], job["future"] = fn, self.pool.submit(self._work, job, fn)
        return job

    def _launch(self, step, lag):
        rows, seeds = self._draw(step)
        return self._submit(dict(rows=rows, seeds=seeds, lag=lag, step=step), lambda: self._generate(rows, seeds, step))

    def _wait(self, job):
        """Waits for job's batch. One that failed on the worker (out of memory beside training, say) is generated
        again there once, now that nothing trains: from the same copy of the weights (refilled only after this) and
        with the same keys, so the same batch; a second failure is raised, with the step it was for."""
        if "future" in job:
            job["waited"] = time.time()  # from here on the main thread waits for it
            what, failed = f"step {job['step']}'s batch" if "step" in job else "an evaluation's generation", None
            try:
                job.pop("future").result()  # re-raises what the worker raised
            except Exception as e:  # noqa: BLE001 -- any failure: retried once, then raised as it was
                failed = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.clear_frames(e.__traceback__)  # the failed attempt's KV cache, held by its frames, freed
            if failed is not None:
                gc.collect()
                print(f"rank {self.run.rank}: --async_rollout: {what} failed on the worker ({failed}); generating "
                      "it again", flush=True)
                try:
                    self.pool.submit(self._work, job, job["fn"]).result()
                except Exception as again:
                    again.add_note(f"--async_rollout: {what}, generated on the worker thread (twice)")
                    raise
            if self.stream is not None:
                cur = torch.cuda.current_stream(self.run.device)
                cur.wait_stream(self.stream)
                ro = job["ro"]
                for t in (ro.tokens, ro.prompt_mask, ro.response_mask, ro.logprobs, ro.ended, ro.seeds):
                    t.record_stream(cur)
        return job

    def take(self, step):
        """-> (rows, Rollout): this rank's prompt indices, one per row, and the batch of `step`. Synchronous: drawn
        now from the actor's weights. Async: drawn during the previous step; the generation copy is then refilled
        from the actor and the next step's batch launched. Sets self.metrics (async, --dynamic_sampling)."""
        gen, actor = self.m["gen"], self.m["actor"]
        if not self.cfg.async_rollout:
            if self.cfg.dynamic_sampling:
                return self._take_dynamic(step)
            rows, seeds = self._draw(step)
            gen.copy_weights_from(actor)  # gathers the sharded actor
            return rows, self._generate(rows, seeds, step)
        if self.next is None:  # the first step: nothing was drawn ahead
            gen.copy_weights_from(actor)
            job = self._wait(self._launch(step, lag=0))
        else:
            job = self._wait(self.next)
            gen.copy_weights_from(actor)  # the step boundary: nothing generates now
        self.next = self._launch(step + 1, lag=1)
        hidden = max(0.0, min(job["end"], job["waited"]) - job["start"]) if "start" in job else 0.0
        self.metrics = {"val/policy_lag": job["lag"], "time/rollout_overlap": hidden}
        return job["rows"], job["ro"]

    def _take_dynamic(self, step):
        """--dynamic_sampling=K (DAPO's dynamic sampling): draws prompt batches, generates and scores them with the
        reward function, until rollout_batch_size of the groups drawn have scores that differ (a group of equal
        scores has no group advantage: it trains on nothing but the KL), or K batches were drawn. The step's batch
        is the first rollout_batch_size such groups in the order drawn (round, then global row); after K rounds the
        groups of equal scores complete it, in that order too (val/dynamic_filled). Every rank draws each round's
        share as a plain step does (round j's keys: _draw) and all ranks decide alike on the gathered verdicts, so
        the batch is the same on any number of ranks; its rows move to the ranks that train on them (global row
        order, as a plain step's). When the first round's groups all differ, the batch is that round's, as is.
        Sets self.scored: (the reward function's scores of this rank's rows, the failed calls of all its rounds)."""
        cfg, run, n, groups_a_step = self.cfg, self.run, self.cfg.samples_per_prompt, self.cfg.rollout_batch_size
        mine, differ, equal, errors = {}, [], [], 0  # this rank's groups' rows; global groups (round, g) by verdict
        self.m["gen"].copy_weights_from(self.m["actor"])
        for j in range(cfg.dynamic_sampling):
            rows, seeds = self._draw(step, j)
            ro = self._generate(rows, seeds, step)
            scores, failed = self.reward([self.prompts.records[i] for i in rows], ro.texts(self.tokenizer))
            errors += failed
            records = rollout_rows(ro, rows)
            for rec, score, extras, pred in zip(records, scores, self.reward.extras, self.reward.preds):
                rec.update(score=score, extras=extras, pred=pred)
            groups = [records[q : q + n] for q in range(0, len(records), n)]
            mine.update({(j, run.rank * run.local_rollout + q): group for q, group in enumerate(groups)})
            verdicts = [None] * run.world  # every rank's: do a group's scores differ?
            dist.all_gather_object(verdicts, [max(r["score"] for r in g) > min(r["score"] for r in g) for g in groups])
            for g, varies in enumerate(v for part in verdicts for v in part):
                (differ if varies else equal).append((j, g))
            if j == 0:
                as_drawn = rows, ro
            if len(differ) >= groups_a_step:
                break
        chosen = (differ + equal)[:groups_a_step]
        self.metrics = {"val/dynamic_rounds": j + 1, "val/dynamic_varied": len(differ) / ((j + 1) * groups_a_step),
                        "val/dynamic_filled": max(0, groups_a_step - len(differ))}
        share = chosen[run.rank * run.local_rollout : (run.rank + 1) * run.local_rollout]
        if chosen == [(0, g) for g in range(groups_a_step)]:  # the first round's groups all differ: its batch, as drawn
            (rows, ro), records = as_drawn, [r for g in share for r in mine[g]]
        else:
            everyone = [None] * run.world  # the chosen groups each rank drew, to the ranks that train on them
            dist.all_gather_object(everyone, {g: mine[g] for g in chosen if g in mine})
            drawn = {g: group for part in everyone for g, group in part.items()}
            records = [r for g in share for r in drawn[g]]
            rows, ro = rollout_from_rows(records, self.pad_id, run.device)
        self.reward.extras, self.reward.preds = [r["extras"] for r in records], [r["pred"] for r in records]
        self.scored = [r["score"] for r in records], errors
        return rows, ro

    def generate_beside(self, *args, **kwargs):
        """self.generate(*args, **kwargs) where the rollouts are generated: on CUDA with --async_rollout, on the
        worker's thread and stream, else here. An evaluation (evaluate.py) generates through it, after wait(), so that
        its compiled decode replays the rollouts' CUDA graphs: inductor's cudagraph trees keep a manager and a memory
        pool per thread (cudagraph_trees.get_container), and a second thread would record every graph again into a
        second pool, beside the one --dry_run plans. On a CPU it stays on the main thread, which has the cores."""
        if self.cfg.async_rollout and self.run.device.type == "cuda":
            self._start()  # (an evaluation before the first step: the worker that will run every rollout)
        if self.stream is None:
            return self.generate(*args, **kwargs)
        return self._wait(self._submit({}, lambda: self.generate(*args, **kwargs)))["ro"]

    def wait(self):
        """Waits for the batch being drawn ahead, if one is: the generation copy is then free for another use (an
        evaluation refills it and generates from it). The batch stays pending for the next take."""
        if self.next is not None:
            self._wait(self.next)

    def state_dict(self):
        """The batch drawn for the next step, every rank's rows in global row order; waits for it. A collective:
        every rank calls it. None when nothing is pending (rollouts drawn at each step)."""
        if self.next is None:
            return None
        job = self._wait(self.next)
        everyone = [None] * self.run.world
        dist.all_gather_object(everyone, rollout_rows(job["ro"], job["rows"]))
        return dict(rows=[r for part in everyone for r in part], lag=job["lag"])

    def load_state_dict(self, state):
        if state is None:  # (a checkpoint of rollouts drawn at each step)
            return
        L, r = self.run.local_rows, self.run.rank
        rows, ro = rollout_from_rows(state["rows"][r * L : (r + 1) * L], self.pad_id, self.run.device)
        self.next = dict(rows=rows, ro=ro, lag=state["lag"])

    def close(self):
        """Ends the worker. Nothing generates after a run's last step (its checkpoint waited for the batch drawn
        ahead); while an exception propagates, a batch still generating is not waited for, so that the error shows
        at once, not after a rollout (the worker ends when that generation does, its batch dropped)."""
        if self.pool is not None:
            self.pool.shutdown(wait=sys.exc_info()[0] is None, cancel_futures=True)
            torch._dynamo.config.force_compile_during_fx_trace = self.forced

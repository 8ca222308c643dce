"""
One readable decoder-only transformer that loads the checkpoints PPO users train.

Families: Llama 2/3/3.1 (incl. Llama-3 RoPE scaling), Mistral, Qwen2/2.5 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm) and SmolLM/SmolLM2 (tied embeddings). All of them are the same
block with a few switches:

    x = x + o_proj(attn(rope(q_norm(q_proj(rmsnorm(x)))), rope(k_norm(k_proj(...))), v_proj(...)))
    x = x + down_proj(silu(gate_proj(rmsnorm(x))) * up_proj(rmsnorm(x)))

Parameter names are the checkpoints' own (`model.layers.0.self_attn.q_proj.weight`, ...), so
loading is a straight copy of the state dict (hf.py reads the files: safetensors folders, Hub ids,
GGUF files through transformers). transformers is used for configs, tokenizers and reading GGUF files,
and as the reference in the tests, never as the model. No dropout anywhere.

Heads: `head="lm"` gives logits (B, T, V); `head="value"` gives one float32 scalar per token (B, T)
from a `score` linear layer, as in `*ForSequenceClassification` checkpoints, computed in float32
whatever the model's dtype. A reward model reads that scalar where transformers reads it, at the last
token that is not the pad id (`reward_at_last_token`); a critic uses every position.

Left-padded batches: pass `attention_mask` (B, S) with 1 for real tokens and
`position_ids = cumsum(mask) - 1`. Generation (rollout.py) preallocates a KV cache with
`setup_kv_cache` and calls the model with `cache_pos`, the cache slots of the new tokens.

Padding-free: when the queries include padding (T > 1), embeddings, norms, projections, MLPs and heads run on
the real tokens only, packed as (N, H) (N rounded up to a multiple of 16 with padding slots, `RealTokens`).
Attention ("sdpa") runs each row's real tokens on their own (`attend_rows`), so a row's outputs are the same
bits whatever rows share its batch (PPO's first ratio of exactly 1); "flex" scatters them into the (B, T)
layout and back. A decode step (T = 1), a prefill into the cache and the "reference" impl run the padded layout.

Attention: one masking rule (`may_attend`) over cache slots: query slot i reads key slot j iff
j <= i and slot j holds a real token, or j == i (a padding query then reads its own slot: a finite
output that nothing uses, not the NaN of an all-masked row). `Transformer.attn_impl` picks the kernel:
  "flex"       CUDA default (head_dim >= 16, as Triton needs). Compiled FlexAttention with a BlockMask
               built once per forward and shared by every layer. Each query head reads its key/value
               head directly (GQA), and 128 x 128 tiles with no allowed pair (padding, the future,
               unfilled cache slots) are skipped. Lengths are rounded up to multiples of 128 (zero-
               padded, dropped after) so that few shapes compile; a decode step (T = 1) reads the
               whole cache, one shape per cache. Prefill, decode and training never run the math
               kernel (a GPU test reads the profile and the compiled graphs).
               A decode step folds the g = nh / nkv query heads that share a key/value head into g
               query rows of that head, (B, nh, 1, hs) -> (B, nkv, g, hs), all with the step's one
               mask row. Why: inductor's flex decoding kernel, which reads each key/value head's
               cache once for all its query heads (split along the cache), takes GQA only at a
               power-of-two g; SmolLM2 (9 / 3) and Qwen2.5-1.5B (12 / 2) would get the general
               kernel instead, a 128-row tile per query head with one real row, reading the cache
               g times. Folded, flex sees as many query heads as key/value heads, and the decoding
               kernel runs at any g, still skipping unfilled cache tiles. (SDPA over the filled
               prefix is no way out: the rows are left-padded and the compiled step reads the whole
               cache, so it needs a mask, and on CUDA a mask with GQA means the math kernel.)
  "sdpa"       CPU default. Padding-free (scoring, training), one causal SDPA call per row over its
               real tokens, no mask; a prefill or a decode step, SDPA with the boolean (B, 1, T, S)
               mask. On a CPU both dispatch to its fused flash-attention kernel, forward and backward,
               reading the key/value heads without repeating them (profiled:
               aten::_scaled_dot_product_flash_attention_for_cpu). On CUDA the masked call falls back
               to the math kernel (flash takes no custom mask, and GQA runs on flash and math only).
  "reference"  The same call on SDPA's math kernel: key/value heads repeated to every query head,
               full (B, nh, T, S) score matrices. The slow twin the tests compare against.
Why not flex on the CPU: torch 2.13 has no flex backward on CPU, so training could not use it, and
each compile takes ~10 s on 2 cores (~5 s per further shape), minutes over the tests' many shapes;
the CPU flash kernel compiles nothing. It computes every tile (no skipping with a custom mask); on
2 cores in float32, at SmolLM2's and Llama-3-8B's heads and T = 256..1024, its forward is 2-4x faster
than the math kernel's, its backward 1.1-1.5x and a decode step 10-15x.

    python model.py --path=smollm2     # loads the embedded model and prints a short greedy answer
    python bench.py attention [--device=cuda]         # attention, fused against the math kernel
"""
import contextlib
import functools
import math
import platform
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from hf import MAX_SHARD_SIZE, read_checkpoint, read_config, write_pretrained
from lora import full_parameters
from runtime import UsageError

SUPPORTED = {  # model_type -> what differs from Llama
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}
# the config's bias switches each family's transformers class reads; Mistral's and Qwen2's biases are fixed (a
# config.json's attention_bias or mlp_bias is ignored there, so it must not ask for biases the checkpoint lacks)
BIAS_FLAGS = {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",)}


# -----------------------------------------------------------------------------
# config


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3", "factor": ...} or {}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q, k, v (not o)
    attention_bias: bool = False  # Llama's flag: bias on q, k, v and o
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    sliding_window: int | None = None
    checkpoint_dtype: torch.dtype | None = None  # the weights' dtype as config.json records it, the HF export's

    @classmethod
    def from_hf(cls, hf):
        """Reads a transformers config (v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters`)."""
        mt = hf.model_type
        if mt not in SUPPORTED:
            raise UsageError(f"unsupported architecture {mt!r} ({getattr(hf, 'architectures', None)}); "
                             f"supported: {sorted(SUPPORTED)}")
        if getattr(hf, "hidden_act", "silu") not in ("silu", "swish"):  # (transformers' ACT2FN: the same function)
            raise UsageError(f"unsupported hidden_act {hf.hidden_act!r}: only silu (swish)")
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise UsageError(f"unsupported rope_type {rope_type!r}: default, linear and llama3 are implemented")
        rope = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
        window = getattr(hf, "sliding_window", None)
        if mt in ("qwen2", "qwen3") and not getattr(hf, "use_sliding_window", False):
            window = None
        if "sliding_attention" not in (getattr(hf, "layer_types", None) or ["sliding_attention"]):
            window = None  # no layer slides (Qwen's max_window_layers >= the layers): full attention everywhere
        n_heads = hf.num_attention_heads
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // n_heads,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=window,
            checkpoint_dtype=recorded_dtype(hf),  # read now: transformers' from_config(hf, dtype=) overwrites it
            **{f: bool(getattr(hf, f, False)) for f in BIAS_FLAGS.get(mt, ())},
            **SUPPORTED[mt],
        )


def recorded_dtype(hf):
    """The dtype a transformers config records for its checkpoint's weights, or None (a config read from GGUF
    metadata records none). transformers 5 keeps it in `dtype` and reads a 4.x config.json's `torch_dtype`
    into it."""
    d = getattr(hf, "dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d.removeprefix("torch."), None)
    return d if isinstance(d, torch.dtype) and d.is_floating_point else None


# -----------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in float32, scale in the input dtype (the checkpoints were trained this way)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg, device=None):
    """Inverse frequencies (head_dim/2,) in float32, with linear or Llama-3 scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    rs = cfg.rope_scaling
    if rs.get("rope_type") == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif rs.get("rope_type") == "llama3":
        # Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp in between
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x, cos, sin):
    # x (..., nh, hs); cos, sin (..., 1, hs); rotate the two halves of each head
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# -- attention: one masking rule, three kernels that apply it (see the module docstring) --------

ATTN_IMPLS = ("flex", "sdpa", "reference")
FLEX_BLOCK = 128  # flex attention's tile: its lengths are bucketed to multiples of it


def may_attend(q_slot, k_slot, k_real):
    """The masking rule, over cache slots: causal, real keys only, and a query always sees its own slot,
    so a padding query gets a finite (ignored) output instead of NaN from an all-masked row.
    Elementwise: on broadcast tensors (attention_mask_4d) as on flex attention's scalar indices."""
    return ((k_slot <= q_slot) & k_real) | (k_slot == q_slot)


def attention_mask_4d(attention_mask, q_slots):
    """(B, S) key mask (1 = real token) and (T,) query slots -> (B, 1, T, S) bool: may attend."""
    k_slots = torch.arange(attention_mask.size(1), device=attention_mask.device)
    allowed = may_attend(q_slots[None, :, None], k_slots[None, None, :], attention_mask[:, None, :].bool())
    return allowed[:, None]  # (B, 1, T, S)


def attention_block_mask(attention_mask, q_slots, Q, S):
    """The same rule as a flex attention BlockMask over Q >= T query rows and S key slots, S >= the mask's
    width (the extra rows and slots are padding: padding slots are no real keys, padding queries take
    slot 0 and so see key 0 only). Tiles of FLEX_BLOCK x FLEX_BLOCK with no allowed pair are skipped.
    A decode step (T = 1) has Q = nh / nkv rows, all of them its one query: attend folds the query heads
    that share a key/value head into query rows."""
    B, T, W = attention_mask.size(0), q_slots.numel(), attention_mask.size(1)
    # padded only where needed: inductor's CPU flex kernel rejects mask tensors computed in the same graph
    # (the compiled decode step passes the whole cache's mask and one slot, so it needs no padding)
    keys = attention_mask if W == S else F.pad(attention_mask, (0, S - W))  # (B, S), 1 = real token
    q_slots = q_slots if T == Q or T == 1 else F.pad(q_slots, (0, Q - T))  # (Q,), or (1,) for a decode step

    def mask_mod(b, h, q, kv):  # query row q sits in cache slot q_slots[q]
        return may_attend(q_slots[q], kv, keys[b, kv] != 0)

    def decode_mask_mod(b, h, q, kv):  # every row is the one query (attend folds query heads into rows)
        return may_attend(q_slots[0], kv, keys[b, kv] != 0)

    # two functions, not a test of T inside one: compiled flex attention guards on the values a mask_mod reads
    return create_block_mask(decode_mask_mod if T == 1 else mask_mod, B, None, Q, S, device=attention_mask.device,
                             BLOCK_SIZE=FLEX_BLOCK)


def default_attn_impl(device, head_dim):
    """flex on CUDA (its Triton kernels need head_dim >= 16, so tiny test models use sdpa), sdpa elsewhere."""
    return "flex" if device.type == "cuda" and head_dim >= 16 else "sdpa"


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once per process (called uncompiled it runs an unfused reference that
    builds the full score matrix). Default automatic dynamic shapes: after the first recompile, dims
    that changed become symbolic, so a run with many length buckets compiles a few times, rather than
    piling up recompiles until torch's recompile limit makes it fall back to that unfused reference."""
    return torch.compile(flex_attention)


def attend(q, k, v, mask, impl):
    """softmax(q k^T / sqrt(hs), masked) v with grouped-query heads (head h reads key head h // (nh/nkv)).
    q (B, nh, T, hs), k, v (B, nkv, S, hs) -> (B, nh, T, hs).
    impl "flex": mask is attention_block_mask's, over lengths (Q, S') >= (T, S): q, k, v are zero-padded
      to them (a copy, only when they differ) and the padded rows dropped from the output. A decode step
      (T = 1, Q = nh / nkv) folds the g = nh / nkv query heads of each key/value head into g query rows:
      q (B, nh, 1, hs) -> (B, nkv, g, hs), a view. Every row then reads its own head's keys, with no GQA,
      so inductor picks its flex decoding kernel for any ratio g (it takes GQA only for a power of two),
      which reads each key/value head's cache once for all g rows, in tiles split along the cache.
    impl "sdpa" / "reference": mask is attention_mask_4d's (B, 1, T, S'), S' <= S: only the first S'
      slots are read; "reference" forces SDPA's math kernel (the slow twin). mask None ("sdpa"): causal over
      T = S slots that all hold real tokens (attend_rows' rows, and a batch without padding). An "sdpa" decode
      step with GQA folds the query heads into rows as flex does: PyTorch's CPU kernel, which takes a block of
      query rows per head, ran SmolLM2's step 1.2-1.6x faster so in float32 and 4.7-5.9x in bf16 (16 rows,
      61-173 slots)."""
    gqa = q.size(1) != k.size(1)
    if impl == "flex":
        (B, nh, T, hs), nkv, (Q, S) = q.shape, k.size(1), mask.seq_lengths
        if S > k.size(2):
            k, v = F.pad(k, (0, 0, 0, S - k.size(2))), F.pad(v, (0, 0, 0, S - v.size(2)))
        # inside a compiled region (the compiled decode step) the plain function is traced and fused there
        flex = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
        if T == 1:  # decode: query head h = kv * g + r becomes row r of key/value head kv
            y = flex(q.view(B, nkv, nh // nkv, hs), k, v, block_mask=mask)  # (B, nkv, g, hs)
            return y.reshape(B, nh, 1, hs)
        if Q > T:
            q = F.pad(q, (0, 0, 0, Q - T))
        return flex(q, k, v, block_mask=mask, enable_gqa=gqa)[:, :, :T]
    if mask is None:  # "sdpa" only: attend_rows' rows, a batch without padding
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    S = mask.size(-1)
    k, v = k[:, :, :S], v[:, :, :S]
    if impl == "sdpa":
        if gqa and q.size(2) == 1:  # decode: (B, nh, 1, hs) -> (B, nkv, g, hs), one mask row for all g
            (B, nh, _, hs), nkv = q.shape, k.size(1)
            y = F.scaled_dot_product_attention(q.reshape(B, nkv, nh // nkv, hs), k, v, attn_mask=mask)
            return y.reshape(q.shape)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert impl == "reference", f"attn_impl must be one of {ATTN_IMPLS}, got {impl!r}"
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


ROW_MULTIPLE = 16  # bf16 GEMMs on a CPU run up to 25% slower at odd row counts (M = 451 against 448 or 464)


class RealTokens:
    """Where the N real tokens of a (B, T) batch sit, for the padding-free layout: embeddings, norms,
    projections and MLPs run on the (N, H) real tokens only. Attention, the one place that needs rows, either
    runs each row's real tokens on their own ("sdpa": `attend_rows`) or scatters them into a zero
    (B, T) layout and gathers its output back ("flex": a copy of N x (q + k + v + out) values per layer)."""

    def __init__(self, real):  # real (B, T) bool: the real tokens
        self.B, self.T = real.shape
        flat = real.flatten()
        extra = -int(flat.sum()) % ROW_MULTIPLE  # computed as well: the first padding slots, as padded rows would be
        if extra:
            flat = flat.clone()
            flat[(~flat).nonzero()[:extra, 0]] = True
        self.rows = flat.nonzero().squeeze(1)  # (N,) flat indices into (B * T); N a multiple of ROW_MULTIPLE or B T
        self.real = real

    @functools.cached_property
    def row_tokens(self):
        """For attend_rows: where each row's real tokens sit among the N, in row order: a slice where they are
        consecutive (PPO's left-padded prompts and right-padded responses), else their indices."""
        at = self.real.flatten()[self.rows].nonzero().squeeze(1)  # (n,) the real tokens among the N, row by row
        _, counts = torch.unique_consecutive(self.rows[at] // self.T, return_counts=True)
        starts = counts.cumsum(0) - counts
        first, last = at[starts].tolist(), at[starts + counts - 1].tolist()
        return [slice(a, b + 1) if b - a + 1 == n else at[s : s + n]
                for a, b, n, s in zip(first, last, counts.tolist(), starts.tolist())]

    @functools.cached_property
    def runs(self):
        """The N rows cut in order into ("row", slice) and ("gap", count of padding slots computed to round N up),
        when every row's real tokens are consecutive; else empty."""
        if not all(isinstance(t, slice) for t in self.row_tokens):
            return []
        runs, n = [], 0
        for t in self.row_tokens:
            runs += [("gap", t.start - n)] * (t.start > n) + [("row", t)]
            n = t.stop
        return runs + [("gap", len(self.rows) - n)] * (len(self.rows) > n)

    def gather(self, x):  # (B, T, ...) -> (N, ...)
        return x.flatten(0, 1).index_select(0, self.rows)

    def scatter(self, x):  # (N, ...) -> (B, T, ...), zero at padding
        out = x.new_zeros(self.B * self.T, *x.shape[1:])  # index_put_'s backward keeps the rows only (index_copy_'s
        return out.index_put_((self.rows,), x).unflatten(0, (self.B, self.T))  # would keep a copy of x as well)


def attend_rows(q, k, v, real):
    """Padding-free attention, one row at a time: q (N, nh, hs), k, v (N, nkv, hs) of real.rows -> (N, nh, hs).
    A row's real tokens attend causally among themselves (the masking rule, whatever padding surrounds them);
    the padding slots computed to round N up get 0. So a row's output is the same bits whatever rows share its
    batch and however wide their padding: nothing of it moves with the other rows, as it does in the (B, T)
    layout, where the row's keys start after the batch's left padding and the kernel's blocks and vector lanes
    fall on them differently (measured on the default run in bf16, where training regroups scoring's rows:
    the first minibatch's approxkl summed 0.05 over its 192 tokens that way, 0 this way)."""
    def one_row(qb, kb, vb):  # (L, heads, hs) each
        y = attend(qb.transpose(0, 1)[None], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None], None, "sdpa")
        return y[0].transpose(0, 1)  # (L, nh, hs)

    if q.size(0) == 0:  # a batch of padding alone: no token to attend
        return q.new_zeros(q.shape)
    if real.runs:  # every row's real tokens consecutive: split into the runs (one cat in the backward), in order
        sizes = [at.stop - at.start if kind == "row" else at for kind, at in real.runs]
        parts = zip(*(t.split(sizes) for t in (q, k, v)))
        return torch.cat([one_row(*p) if kind == "row" else q.new_zeros(p[0].shape)
                          for (kind, _), p in zip(real.runs, parts)])
    idx = [torch.arange(t.start, t.stop, device=q.device) if isinstance(t, slice) else t for t in real.row_tokens]
    y = torch.cat([one_row(*(x.index_select(0, i) for x in (q, k, v))) for i in idx])
    return q.new_zeros(q.shape).index_put((torch.cat(idx),), y)


class KVCache(nn.Module):
    """Preallocated keys and values for one layer, written at explicit cache slots (gpt-fast)."""

    def __init__(self, B, n_kv, S, hs, dtype, device):
        super().__init__()
        self.register_buffer("k", torch.zeros(B, n_kv, S, hs, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(B, n_kv, S, hs, dtype=dtype, device=device), persistent=False)

    def update(self, slots, k, v):
        # slots (T,), k, v (B, n_kv, T, hs) -> the whole cache (B, n_kv, S, hs)
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        return self.k, self.v


# -----------------------------------------------------------------------------
# linear layers: a CPU's float32 products (and a generation's bf16 ones) may run on oneDNN's kernels

CPU_MATMUL = "auto"  # a CPU's float32 products: "mkl" (F.linear), "onednn", "auto" (cpu_matmul)
_generating = threading.local()  # .onednn: this thread is generating, with oneDNN's bf16 products (decode_products)


@torch.compiler.assume_constant_result  # traced code reads the kernel, as eager code would, not the CPU's files
def cpu_matmul():
    """The kernel of a CPU's float32 products (CPU_MATMUL; "auto": oneDNN on x86 CPUs not made by Intel, F.linear
    elsewhere). PyTorch's x86 build runs a float32 F.linear on MKL, which picks its code by the CPU's vendor: on
    other vendors' CPUs its GEMV, a decode step's product at small batch, takes a generic path on one thread, and
    its GEMMs run AVX2 code even where the CPU has AVX-512. oneDNN's kernels dispatch on the instruction set alone:
    on an AMD Zen 5 a 1.5-2.6x faster float32 generation at batch 1-16, and for scoring's and training's products
    1.0-1.2x (AVX2 code) to 1.9-2.4x (AVX-512) forward and for the input's gradient. On Intel CPUs MKL's float32
    GEMV is the faster. `python bench.py generation` and `python bench.py train_products` time both kernels."""
    if CPU_MATMUL not in ("auto", "mkl", "onednn"):
        raise ValueError(f"model.CPU_MATMUL must be 'auto', 'mkl' or 'onednn', got {CPU_MATMUL!r}")
    if CPU_MATMUL != "auto":
        return CPU_MATMUL
    onednn = cpu_vendor() not in (None, "GenuineIntel") and torch.backends.mkldnn.is_available()
    return "onednn" if onednn else "mkl"


@contextlib.contextmanager
def decode_products(device, compiled=False):
    """Within it, this thread's bf16 products of `linear` (and Linear layers) run on oneDNN where cpu_matmul()
    picks it, on a CPU and not under torch.compile (called directly, they gave F.linear's bf16 results bitwise,
    faster). rollout.generate runs in it; training and scoring, whose bf16 F.linear is oneDNN's already, never do."""
    before = getattr(_generating, "onednn", False)
    _generating.onednn = torch.device(device).type == "cpu" and not compiled and cpu_matmul() == "onednn"
    try:
        yield
    finally:
        _generating.onednn = before


@functools.cache
def onednn_dtypes():
    """The dtypes oneDNN's products take on this CPU: bf16 needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def onednn_linear(x, weight, bias=None):
    """x @ weight.T + bias on oneDNN's kernels (no autograd of its own)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """F.linear with the forward and the input's gradient on oneDNN; the weight's and the bias's gradients as
    F.linear's backward computes them (oneDNN was no faster there). A row's output rounds the same whatever rows
    share the product (tested), so scoring and training, which group rows differently, agree bit for bit."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        # what each gradient needs, as F.linear saves it: x for the weight's, the weight for x's (a frozen base
        # layer under LoRA keeps no copy of its input)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.size(-1))  # (rows, out)
        dx = onednn_linear(gy, weight.T) if ctx.needs_input_grad[0] else None  # gy @ weight
        dw = g2.T.mm(x.reshape(-1, x.size(-1))) if ctx.needs_input_grad[1] else None
        db = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


@torch.library.custom_op("ppo::onednn_linear", mutates_args=())
def onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """onednn_linear as an operator that compiled code calls as it is (inductor's own lowering of oneDNN's linear
    takes only the weights it has packed when freezing a model)."""
    return onednn_linear(x, weight, bias)


@onednn_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.size(0))


def linear(x, weight, bias=None):
    """F.linear, or oneDNN's product where cpu_matmul() picks it: in float32 on plain CPU tensors (OneDNNLinear when
    gradients flow), and in bf16 inside decode_products (no gradients there). Compiled on a CPU without gradients
    (rollout.generate(compile=True)): a one-row product with an (out, in) row-major weight is a multiply and a sum,
    which inductor fuses into one vectorized reduction per product that streams the weight once, near the memory's
    read rate (SmolLM2's 30 blocks' products at 33 GB/s where oneDNN's one-row products read them at 19 and a plain
    sum at 26, a 2-core AMD Zen 3); products of more rows call oneDNN's kernel where cpu_matmul() picks it
    (onednn_linear_op), else F.linear's."""
    if torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == weight.dtype:
        if not torch.is_grad_enabled() and x.numel() == x.size(-1) and weight.stride(-1) == 1:
            y = (weight * x.reshape(1, -1)).sum(-1)  # (out,): row i of the weight times x
            return (y if bias is None else y + bias).reshape(*x.shape[:-1], -1)
        if not torch.is_grad_enabled() and x.dtype == torch.float32 and cpu_matmul() == "onednn":
            return onednn_linear_op(x, weight, bias)
    plain = (x.dtype == weight.dtype and weight.device.type == "cpu" and type(weight) in (torch.Tensor, nn.Parameter)
             and x.device.type == "cpu" and not torch.compiler.is_compiling())
    if plain and x.dtype == torch.float32 and cpu_matmul() == "onednn":
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return OneDNNLinear.apply(x, weight, bias)
        return onednn_linear(x, weight, bias)
    if (plain and getattr(_generating, "onednn", False) and x.dtype in onednn_dtypes()
            and not torch.is_grad_enabled()):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear through `linear`: a plain nn.Linear everywhere but in a CPU generation with oneDNN picked."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


def decodes_transposed(device, dtype):
    """Whether a model that only generates (the rollout's copy) keeps its blocks' weights transposed in memory
    (store_transposed): on a CPU whose float32 products run on oneDNN (cpu_matmul()). oneDNN's float32
    product of a few rows reads an (in, out) weight faster than an (out, in) one (`python bench.py decode_layout`,
    SmolLM2's shapes, an AMD Zen 5 with AVX-512 code and held to AVX2 code): 1.1-1.8x for every block weight at
    2-16 rows; at one row 1.3-2.1x for q_proj, o_proj and down_proj, about 1.0x for k_proj and v_proj, 0.85-0.96x
    for gate_proj and up_proj. SmolLM2's generation: 1.10-1.12x at batch 1, 1.07-1.29x at 2-16 (`python bench.py
    generation`). Not in bf16, where (out, in) reads faster (0.4-1.1x), nor for the LM head (0.6-1.2x at one row)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and cpu_matmul() == "onednn"


@torch.no_grad()
def store_transposed(model, transposed=True):
    """Re-stores the Linear weights of model's blocks for decoding, the same shapes and values. The projections
    that read the same input share one tensor: q_proj, k_proj and v_proj one (their biases one vector), gate_proj
    and up_proj another, and their parameters are views of it. The module's `fused` holds the whole, so that a
    decode runs 4 products a block instead of 7, each larger (one row, SmolLM2's shapes, oneDNN, a 2-core AMD Zen 3
    with AVX2: a block's products in 681 against 857 us). transposed: every weight the transpose of an (in, out)
    contiguous tensor, the layout oneDNN's eager products of a few rows read fastest (decodes_transposed); False:
    (out, in) rows, as a compiled CPU decode's one-row products read them (`linear`). copy_ writes through the
    views, so copy_weights_from keeps the layout. At 2 rows and more oneDNN's products are bit for bit those of the
    (out, in) layout; one row takes a GEMV kernel there, whose sums round differently (within 1e-6 of the output's
    largest entry). For a model that does not train."""
    for block in model.model.layers:
        for mod, names in ((block.self_attn, ("q_proj", "k_proj", "v_proj")), (block.mlp, ("gate_proj", "up_proj"))):
            layers = [getattr(mod, n) for n in names]
            if transposed:  # (in, the outs together), contiguous, seen as its transpose
                weight = torch.cat([lin.weight.T for lin in layers], dim=1).T
            else:  # (the outs together, in), contiguous
                weight = torch.cat([lin.weight for lin in layers])
            bias = torch.cat([lin.bias for lin in layers]) if layers[0].bias is not None else None
            lo = 0
            for lin in layers:
                hi = lo + lin.out_features
                lin.weight = nn.Parameter(weight[lo:hi], requires_grad=lin.weight.requires_grad)
                if bias is not None:
                    lin.bias = nn.Parameter(bias[lo:hi], requires_grad=lin.bias.requires_grad)
                lo = hi
            mod.fused = (weight, bias)  # (the outs together, in): one product for all of them
        for lin in (block.self_attn.o_proj, block.mlp.down_proj) if transposed else ():
            lin.weight = nn.Parameter(lin.weight.T.contiguous().T, requires_grad=lin.weight.requires_grad)
    return model


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh, self.nkv, self.hs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_bias = cfg.qkv_bias or cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.nh * self.hs, bias=qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, self.nkv * self.hs, bias=qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, self.nkv * self.hs, bias=qkv_bias)
        self.o_proj = Linear(self.nh * self.hs, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hs, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hs, cfg.rms_norm_eps)
        self.kv_cache = None
        self.fused = None  # (weight, bias) of q_proj, k_proj and v_proj together (store_transposed)

    def forward(self, x, cos, sin, mask, cache_slots=None, impl="sdpa", real=None):
        # x (B, T, H), or (N, H): the real tokens only, `real` (RealTokens) says where they sit in (B, T)
        if self.fused is not None:  # the rollout's copy (store_transposed): one product for q, k and v
            qkv = linear(x, *self.fused).unflatten(-1, (self.nh + 2 * self.nkv, self.hs))
            q, k, v = qkv.split((self.nh, self.nkv, self.nkv), -2)
        else:
            q = self.q_proj(x).unflatten(-1, (self.nh, self.hs))  # (..., nh, hs)
            k = self.k_proj(x).unflatten(-1, (self.nkv, self.hs))
            v = self.v_proj(x).unflatten(-1, (self.nkv, self.hs))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused is None or hasattr(self, "q_norm"):
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # q's and k's heads side by side in qkv: one rotation for both
            q, k = apply_rope(qkv[..., : self.nh + self.nkv, :], cos, sin).split((self.nh, self.nkv), -2)
        if real is not None and impl == "sdpa" and cache_slots is None:  # each row's real tokens on their own
            return self.o_proj(attend_rows(q, k, v, real).flatten(1))
        if real is not None:  # attention alone sees the (B, T) layout, padding slots zero (and masked)
            q, k, v = real.scatter(q), real.scatter(k), real.scatter(v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh or nkv, T, hs)
        if cache_slots is not None:
            k, v = self.kv_cache.update(cache_slots, k, v)  # (B, nkv, S, hs)
        y = attend(q, k, v, mask, impl).transpose(1, 2).flatten(2)  # (B, T, nh * hs)
        return self.o_proj(y if real is None else real.gather(y))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.fused = None  # (weight, bias) of gate_proj and up_proj together (store_transposed)

    def forward(self, x):
        if self.fused is not None:  # the rollout's copy: one product for both
            gate, up = linear(x, *self.fused).chunk(2, -1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # gate's product freed before up's


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache_slots=None, impl="sdpa", real=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_slots, impl, real)
        return x + self.mlp(self.post_attention_layernorm(x))


# -----------------------------------------------------------------------------
# the model


class Transformer(nn.Module):
    padding_free = True  # run the real tokens only (RealTokens); False: the padded layout (an instance or the class)

    def __init__(self, cfg: ModelConfig, head="lm", value_bias=True):
        super().__init__()
        assert head in ("lm", "value"), f"head must be 'lm' or 'value', got {head!r}"
        self.config, self.head = cfg, head
        self.model = nn.Module()  # keeps the checkpoints' `model.` prefix
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if head == "value":
            self.score = nn.Linear(cfg.hidden_size, 1, bias=value_bias)
        elif not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.hf_config = None  # the transformers config it was loaded from, written back on save
        self.activation_checkpointing = False  # recompute each block in the backward (memory for compute)
        self.attn_impl = None  # "flex", "sdpa" or "reference" (ATTN_IMPLS); None: default_attn_impl

    @property
    def lm_head_weight(self):
        """(V, H) output projection: the fused logprob kernels take it together with the hidden states."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def setup_kv_cache(self, B, S, dtype=None, device=None):
        """Allocates every layer's cache once for B rows of S slots (prompt width + new tokens)."""
        p = self.model.embed_tokens.weight
        for blk in self.model.layers:
            a = blk.self_attn
            a.kv_cache = KVCache(B, a.nkv, S, a.hs, dtype or p.dtype, device or p.device)

    def clear_kv_cache(self):
        for blk in self.model.layers:
            blk.self_attn.kv_cache = None

    def forward(self, idx, attention_mask=None, position_ids=None, cache_pos=None, return_hidden=False,
                labels=None, temperature=1.0, ref_hidden=None, ref_weight=None):
        """idx (B, T) token ids.
        attention_mask: (B, T) without a cache, (B, S) over all cache slots with one (or over the first
            S' slots holding every query: attention then reads only those); 1 = real token.
        position_ids: (B, T) RoPE positions; default cumsum(mask) - 1 (left padding) or 0..T-1.
        cache_pos: (T,) cache slots of these tokens (needs `setup_kv_cache`).
        Returns logits (B, T, V) [head="lm"], values (B, T) [head="value"], or with
        return_hidden the final normed hidden states (B, T, H). Padding positions (the mask's zeros
        among the queries) are not computed: their hidden states are 0, their outputs the heads' of 0,
        except the few (< ROW_MULTIPLE) computed to round the row count up, which hold finite values
        that nothing reads (the "reference" impl computes them all, as its layout is padded).
        labels (B, T): the token each position predicts, -100 where ignored. Instead of logits it
        returns `logp` and `entropy` (B, T) of softmax(logits / temperature), float32, 0 where
        ignored, from the fused kernels (no (B, T, V) logits), and with ref_hidden (N, H) (the
        reference model's hidden states at the N scored positions, row-major order) and
        ref_weight (V, H) also the reference's `ref_logp` (no gradient) and the exact per-token `kl` to
        it (under no_grad the four from one pass over both heads). Computing these inside
        forward keeps FSDP's gathered LM head in scope for the backward."""
        B, T = idx.shape
        if attention_mask is None:
            S = T if cache_pos is None else self.model.layers[0].self_attn.kv_cache.k.size(2)
            attention_mask = torch.ones(B, S, dtype=torch.long, device=idx.device)
        if position_ids is None:
            if cache_pos is not None:
                raise ValueError("decoding with a KV cache needs explicit position_ids")
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        q_slots = cache_pos if cache_pos is not None else torch.arange(T, device=idx.device)
        w = self.config.sliding_window
        if w is not None and (q_slots.max().item() + 1 if cache_pos is None else attention_mask.size(1)) > w:
            raise ValueError(f"sequence longer than the sliding window ({w}) is not supported")
        # the mask is built once per forward and shared by every layer
        impl = self.attn_impl or default_attn_impl(idx.device, self.config.head_dim)
        if impl == "flex":  # lengths bucketed so that few shapes compile; decode (T = 1) reads the whole cache
            L = T if T == 1 else math.ceil(T / FLEX_BLOCK) * FLEX_BLOCK
            S = L if cache_pos is None else self.model.layers[0].self_attn.kv_cache.k.size(2)
            # one token: a row for each query head of a key/value head (attend folds them)
            Q = self.config.num_attention_heads // self.config.num_key_value_heads if T == 1 else L
            mask = attention_block_mask(attention_mask, q_slots, Q, S)
        else:
            mask = attention_mask_4d(attention_mask, q_slots)  # (B, 1, T, S')

        # padding-free: with padding among the queries, everything but attention runs on the real tokens only
        # (the reference keeps the padded layout); a decode step (T = 1, compiled) is always dense
        real = None
        if T > 1 and self.padding_free and impl != "reference":
            is_real = attention_mask.index_select(1, q_slots) != 0  # (B, T)
            if labels is not None and (labels.ne(-100) & ~is_real).any():
                raise ValueError("labels at padding positions: a scored position must be a real token")
            if not is_real.all():
                real = RealTokens(is_real)
                idx, position_ids = real.gather(idx), real.gather(position_ids)  # (N,)
            elif impl == "sdpa" and cache_pos is None:  # every slot real: plain causal, as attend_rows runs a row
                mask = None

        inv_freq = rope_inv_freq(self.config, idx.device)
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, hs/2) or (N, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)  # (..., 1, hs): the same for every head
        x = self.model.embed_tokens(idx)  # (B, T, H) or (N, H)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        recompute = self.activation_checkpointing and cache_pos is None and torch.is_grad_enabled()
        for blk in self.model.layers:
            if recompute:  # keep each block's input only; the backward recomputes its activations
                x = torch.utils.checkpoint.checkpoint(blk, x, cos, sin, mask, impl=impl, real=real,
                                                      use_reentrant=False)
            else:
                x = blk(x, cos, sin, mask, cache_pos, impl, real)
        x = self.model.norm(x)
        if real is not None:
            x = real.scatter(x)  # (B, T, H), zero at padding
        if return_hidden:
            return x
        if labels is not None:
            return self._fused_head(x, labels, temperature, ref_hidden, ref_weight)
        if self.head == "value":  # (B, T); not a view of the (B, T, 1) product, which FSDP hooks dislike
            # float32 whatever the model's dtype: values and scores rounded to bf16 would carry 3 significant
            # digits into GAE and into the reward (upcasting (B, T, H) and one (H,) row is cheap)
            v = x.float() @ self.score.weight[0].float()
            return v if self.score.bias is None else v + self.score.bias.float()
        return F.linear(x, self.lm_head_weight)  # (B, T, V)

    def _fused_head(self, x, labels, temperature, ref_hidden, ref_weight):
        from kernels import linear_logprob_entropy, linear_logprob_entropy_kl

        sel = labels != -100  # (B, T)
        h, y, w = x[sel], labels[sel], self.lm_head_weight  # (N, H), (N,), (V, H)
        if ref_hidden is None:
            out = dict(zip(("logp", "entropy"), linear_logprob_entropy(h, w, y, temperature)))
        else:  # scoring, and training with the KL loss: both models' logits once for all four (the reference frozen)
            out = dict(zip(("logp", "entropy", "ref_logp", "kl"),
                           linear_logprob_entropy_kl(h, w, y, ref_hidden, ref_weight, temperature)))
        return {k: x.new_zeros(sel.shape, dtype=torch.float32).masked_scatter(sel, v) for k, v in out.items()}

    # -- loading and saving ----------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_path, dtype=torch.float32, device="cpu", head=None):
        """Loads a Hub id, a local HF folder (safetensors, sharded or not) or a `.gguf` file.
        head: None reads it from the checkpoint (`*ForSequenceClassification` -> "value").
        device="meta": built from the config alone (config.json, or the GGUF metadata), no weights read,
        hf_config set: FSDP2 shards it, then `read_state`'s tensors are loaded into it."""
        if torch.device(device).type == "meta":
            return cls._from_hf_config(read_config(name_or_path), name_or_path, head).to(dtype)
        hf, state = read_checkpoint(name_or_path)
        model = cls._from_hf_config(hf, name_or_path, head)
        model.load_state_dict(model._checked_state(state, name_or_path, dtype), assign=True)
        return model.to(device=device)

    @classmethod
    def read_state(cls, name_or_path, head=None, dtype=torch.float32, checkpoint=None):
        """The full state dict from_pretrained loads, CPU tensors in `dtype`, after the same checks (keys,
        shapes, one label) and head conversions (a critic from a policy draws its fresh value head here, from
        the global RNG). Loaded into `from_pretrained(..., device="meta")`, it gives from_pretrained's model.
        checkpoint: read_checkpoint(name_or_path), already read (neither it nor its tensors are changed; the
        returned tensors may be its own, where no cast was needed)."""
        hf, state = checkpoint or read_checkpoint(name_or_path)
        return cls._from_hf_config(hf, name_or_path, head)._checked_state(state, name_or_path, dtype)

    @classmethod
    def _from_hf_config(cls, hf, name_or_path, head):
        """The model of a transformers config, on the meta device, hf_config set; the checks a config allows."""
        arch = (getattr(hf, "architectures", None) or ["?ForCausalLM"])[0]
        is_cls = arch.endswith("ForSequenceClassification")
        head = head or ("value" if is_cls else "lm")
        if head == "lm" and is_cls:  # before its labels: a classifier of any label count is no policy
            raise UsageError(f"{name_or_path} is a {arch}: it has no LM head to generate with")
        if is_cls and getattr(hf, "num_labels", 1) != 1:
            raise UsageError(f"{name_or_path}: reward model must have one label, has {hf.num_labels}")
        cfg = ModelConfig.from_hf(hf)
        with torch.device("meta"):  # no memory, no RNG draws
            model = cls(cfg, head=head, value_bias=not is_cls)  # a reward model's score layer has no bias
        model.hf_config = hf
        return model

    def _checked_state(self, state, name_or_path, dtype):
        """The checkpoint's tensors for exactly this model's keys and shapes, CPU, in dtype."""
        self.check_shapes({k: tuple(v.shape) for k, v in state.items()}, None, name_or_path)
        if self._critic_from_policy():
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
            state.update(new_value_head(self.config.hidden_size))
        if self.config.tie_word_embeddings and "lm_head.weight" in state:  # some tied checkpoints store a copy too
            emb = state.get("model.embed_tokens.weight")
            if emb is None or not torch.equal(state["lm_head.weight"], emb):  # transformers would use it, untied
                raise UsageError(f"{name_or_path}: its config ties the LM head to the embeddings "
                                 "(tie_word_embeddings), but its lm_head.weight differs from "
                                 "model.embed_tokens.weight, which transformers then loads untied: set "
                                 "\"tie_word_embeddings\": false in its config.json to train the two as stored")
        return {k: state[k].to(device="cpu", dtype=dtype) for k in self.state_dict()}

    def _critic_from_policy(self):  # a value head on a causal LM's checkpoint: its lm_head is dropped, a head drawn
        return self.head == "value" and not self._arch().endswith("ForSequenceClassification")

    def _arch(self):
        return (getattr(self.hf_config, "architectures", None) or ["?ForCausalLM"])[0]

    def check_shapes(self, shapes, file_of, name_or_path):
        """Refuses a checkpoint whose tensors ({name: shape}; file_of: {name: file} or None) miss one of this model's
        (built on the meta device) or give one another shape: from the safetensors headers (hf.check_model's) before
        any tensor is read, and again on the tensors read (_checked_state)."""
        if self._critic_from_policy():
            shapes = {k: v for k, v in shapes.items() if k != "lm_head.weight"}
            shapes.update({k: tuple(v.shape) for k, v in self.state_dict().items() if k.startswith("score.")})
        expected = self.state_dict()
        missing = sorted(set(expected) - set(shapes))
        extra = sorted(k for k in set(shapes) - set(expected) if "rotary_emb" not in k)
        if self.config.tie_word_embeddings:
            extra = [k for k in extra if k != "lm_head.weight"]
        if missing or extra:
            raise UsageError(f"{name_or_path}: checkpoint does not match {self._arch()}: "
                             f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                             f"unexpected {extra[:8]}{'...' if len(extra) > 8 else ''}")
        expected = {k: tuple(v.shape) for k, v in expected.items()}
        if self.config.tie_word_embeddings and "lm_head.weight" in shapes:  # a tied checkpoint's stored copy
            expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
        for k, v in expected.items():
            if tuple(shapes[k]) != v:
                where = f"{file_of[k]}: " if file_of else f"{name_or_path}: "
                raise UsageError(f"{where}shape mismatch for {k}: checkpoint {tuple(shapes[k])}, config expects {v}")

    @torch.no_grad()
    def copy_weights_from(self, src):
        """Copies src's parameters (an FSDP-sharded model: gathered, every rank takes part) into this plain model,
        with src's LoRA adapters merged into its weights (lora.full_parameters). Each of this model's parameters
        must get one (a fork's new parameter on one side only is named, not left stale or dropped)."""
        params = dict(self.named_parameters())
        left = set(params)
        for name, p in full_parameters(src):
            if name not in params:
                raise KeyError(f"copy_weights_from: the source's {name} has no parameter of that name here")
            params[name].copy_(p)
            left.discard(name)
            del p  # before the next is gathered: one full parameter live at a time (plan.weight_sync)
        if left:
            raise KeyError(f"copy_weights_from: {sorted(left)} of this model are not in the source: not refilled")

    def save_pretrained(self, folder, tokenizer=None, dtype=None, max_shard_size=None):
        """Writes config.json, the safetensors weights (in the checkpoint's dtype unless `dtype` is given) and
        the tokenizer, so that transformers' AutoModelForCausalLM / AutoModelForSequenceClassification loads
        them back; atomic (hf.write_pretrained; max_shard_size None: transformers' default)."""
        write_pretrained(self, folder, tokenizer, dtype=dtype, max_shard_size=max_shard_size or MAX_SHARD_SIZE)


def new_value_head(H):
    """Scalar head for a critic without a reward model: weight ~ N(0, 1/sqrt(H+1)), bias 0
    (Stiennon et al. 2020, appendix)."""
    return {"score.weight": torch.randn(1, H) / math.sqrt(H + 1), "score.bias": torch.zeros(1)}


def reward_at_last_token(values, tokens, pad_token_id):
    """values (B, T) from a value head, tokens (B, T) long -> (B,) the value where transformers'
    *ForSequenceClassification reads its score (modeling_layers.GenericForSequenceClassification): at each
    row's last token that is not pad_token_id, or at column 0 when every token of the row is pad_token_id.
    That is position-based on the ids, not on the attention mask: when pad == eos (SmolLM2, many Llama-3
    reward models) a trailing EOS, and any padding after it, is skipped and the score is read at the
    token before the EOS; when pad != eos it is read at the EOS. A row that never ended is read at its last
    token. pad_token_id None: the last column, and only for one row (transformers raises for more)."""
    if values.shape != tokens.shape:
        raise ValueError(f"reward_at_last_token: values {tuple(values.shape)} and tokens {tuple(tokens.shape)} differ")
    B, T = tokens.shape
    if pad_token_id is None:
        if B != 1:
            raise ValueError("reward_at_last_token: the reward model has no pad_token_id, so (as in transformers) "
                             "the last token of a batch of more than one row cannot be found; set its "
                             "config.pad_token_id")
        return values[:, -1]
    col = torch.arange(T, device=tokens.device)  # (T,)
    last = (col * (tokens != pad_token_id)).argmax(-1)  # (B,): the largest non-pad column, 0 if none
    return values.gather(1, last[:, None]).squeeze(1)


# -----------------------------------------------------------------------------
# the compute dtype


@functools.cache
def cpu_vendor():
    """An x86 CPU's vendor string (/proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD, ...); None elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), None)
    except OSError:
        return None


def cpu_has_bf16():
    """bf16 matmuls are fast on CPUs with AVX512-BF16 or AMX; elsewhere (AVX2) they are several
    times slower than float32, so the CPU default then stays float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


if __name__ == "__main__":
    from runtime import run_function

    def main(path="smollm2", prompt="What is the capital of France?", new_tokens=24):
        """Greedy demo: a short answer from a checkpoint, with the plain loop (rollout.py is the fast path)."""
        from hf import load_tokenizer

        tok = load_tokenizer(path)
        model = Transformer.from_pretrained(path).eval()
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_dict=False)  # token ids (transformers 5 returns a BatchEncoding else)
        ids = torch.tensor([list(ids)])
        with torch.no_grad():
            for _ in range(new_tokens):  # plain loop without a cache; rollout.py is the fast path
                ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
        print(tok.decode(ids[0]))

    raise SystemExit(run_function(main, "model.py"))

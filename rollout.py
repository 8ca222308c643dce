"""
Batched sampling with a KV cache: the rollout stage of PPO, on model.py's Transformer.

    generate(model, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, ...) -> Rollout

Prompts of different lengths are left-padded to a common width P, so every row's last prompt token
sits in column P-1 and the batch appends in step. Positions count real tokens only:
position_ids = max(cumsum(mask) - 1, 0). One KV cache of S = P + max_new_tokens slots is allocated
for the whole batch (gpt-fast style: preallocated buffers written at explicit slots), then
  prefill: one forward over the P prompt columns fills slots 0..P-1 and gives the first logits;
  decode:  one forward per new token, of shape (B, 1), writing slot P + t.
Both are small separate functions. Eager decoding attends to the filled slots 0..P+t only; the
compiled decode step (torch.compile, on CUDA with mode="reduce-overhead", i.e. CUDA graphs) always
gets the whole cache, with S rounded up to a multiple of 64, so its shapes never change and batches
with other prompt widths reuse the same graph. It recompiles for each new (B, S) and keeps its cache
on the model between calls (fixed buffer addresses for the graphs); model.clear_kv_cache() frees it.
Decoding runs in the model's dtype (load it in bf16 on a GPU); sampling always in float32.

Sampling, per step:
    z = logits / temperature                     logp = log_softmax(z)
    z' = z with tokens outside top-k / top-p at -inf,   p' = softmax(z')
    token = argmax(p' / q),  q ~ Exponential(1)  (the exponential-race form of the Gumbel-max trick)
argmax(p'/q) is distributed as Categorical(p'): for independent q_i ~ Exp(1), q_i / p'_i ~ Exp(p'_i)
and the smallest of them is i with probability p'_i. Unlike torch.multinomial it needs no host-device
sync. temperature == 0 is greedy: token = argmax(logits).
The logits are float32 whatever the model's dtype, computed as the training path computes them
(kernels/): bf16 hidden states and LM head, float32 accumulation and output (on CUDA a bf16 GEMM
with a float32 result; on a CPU float32 operands, which hold the bf16 values exactly). A bf16 result
would round every logit by up to 2^-9 of its size, and the tokens would come from another
distribution than the one the training forward credits them with.

Sampling noise is counter-based, not drawn from a generator's stream: q for row b, decode step t
(the t-th new token) and token v is a pure function of (seeds[b], t, v),
    key     = mix(fold(seeds[b]) ^ mix(t))             (B,) one 32-bit key per row and step
    bits    = mix(mix(v) ^ key) >> 8                   (B, V) 24 uniform bits per token
    q       = -log(u),  u = (bits + 1/2) / 2^24 in (0, 1)
with mix = lowbias32 (C. Wellons' hash-prospector: a bijection of 32-bit integers with near-ideal
avalanche), evaluated with int64 torch ops that never overflow (every product stays below 2^63), and
fold(s) = mix(s_hi ^ mix(s_lo)) for the 64-bit seed, one-to-one on seeds below 2^32 (two (row, step)
pairs share a noise vector only when their 32-bit keys collide, probability 2^-32). Why: a row's
noise depends only on its seed, not on the other rows of the batch, its position in it, the number
of ranks or of rollout micro-batches, so PPO under torchrun draws the same noise for a global row on
any number of GPUs; no generator state to carry, save or resume; no host sync (the step count is a
host int, or a device tensor). The tokens are then exactly as batch-invariant as the logits: GEMM
kernels chosen by batch shape change a row's logits by float rounding; in float32 that flips a token
only at a near-tie (SmolLM2, 16 rows vs 2 or 4 micro-batches: all rows identical), in bf16 a row's
hidden states move by ~1.5% and about a quarter of the rows part ways somewhere in 24 tokens.
`seeds` is one non-negative int per prompt; when it is None, generate draws the seeds from
`generator` (same generator seed -> same tokens).

Recorded logprobs (a choice, stated because libraries differ): logp[token] under the tempered but
*untruncated* distribution log_softmax(logits / temperature) (untempered at temperature 0). That is
exactly what the training forward recomputes, so PPO's first ratio is 1. With top_k / top_p the token
was drawn from the truncated, renormalised p', whose logprob, logp[token] - log(sum of the kept
tokens' probabilities), is not what is returned.

Finished rows: once a row has sampled an EOS id, its later tokens are pad_token_id, masked out of the
cache and of response_mask, with logprob 0; its sampled values are ignored. The loop stops when every
row has finished (checked every step on CPU; every CUDA_CHECK_EVERY steps on CUDA, so the host does
not wait for the GPU at each token) or after max_new_tokens.

generate_reference is the slow twin: the same sampling and the same noise (same seeds), with a full
forward without cache at every step. The tests compare the two token for token.

Benchmark (greedy, 128 new tokens, no EOS stop; ours vs transformers' generate on the same weights):
    python rollout.py                  # CPU: SmolLM2-135M-Instruct, float32 at batch 1/8/32, bfloat16 at 1
    python rollout.py --device=cuda    # GPU, bf16: SmolLM2 at batch 1-64, and random weights with
                                       # Llama-3-8B's shapes at batch 64 against the memory-bandwidth roof
On a CPU shared with other jobs, --threads=1 (or OMP_WAIT_POLICY=PASSIVE) keeps OpenMP threads from
waiting on a core that a neighbour holds, which otherwise slows every step several times over.
"""
import functools
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.utils import gemm_operand, mm_f32

CUDA_CHECK_EVERY = 16  # decode steps between "has every row finished?" checks on CUDA (one sync each)
CACHE_MULTIPLE = 64  # compiled decoding rounds the cache width up to this, so prompt widths share graphs
MASK32 = 0xFFFFFFFF  # the noise hash works on 32-bit values held in int64


# -----------------------------------------------------------------------------
# the result


@dataclass
class Rollout:
    tokens: torch.Tensor  # (B, P+R) long: left-padded prompts, then responses; pad_token_id after EOS
    prompt_len: int  # P
    prompt_mask: torch.Tensor  # (B, P) bool: real prompt tokens
    response_mask: torch.Tensor  # (B, R) bool: real response tokens, EOS included, anything after it not
    logprobs: torch.Tensor  # (B, R) float32: log_softmax(logits / temperature) at the sampled token, 0 if masked
    ended: torch.Tensor  # (B,) bool: the row sampled an EOS id
    seeds: torch.Tensor = None  # (B,) long: the rows' sampling seeds (generate(seeds=...) repeats the rollout)

    @property
    def responses(self):
        return self.tokens[:, self.prompt_len:]  # (B, R)

    @property
    def response_lengths(self):
        return self.response_mask.sum(-1)  # (B,) long

    @property
    def attention_mask(self):
        return torch.cat([self.prompt_mask, self.response_mask], dim=1).long()  # (B, P+R)

    @property
    def position_ids(self):
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P+R), as during sampling


# -----------------------------------------------------------------------------
# small helpers


def pad_prompts(prompts, pad_id, vocab_size, device):
    """Token id lists -> idx (B, P) long and mask (B, P) bool, padded on the left."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token id lists")
    rows = []
    for i, p in enumerate(prompts):
        p = torch.as_tensor(p, dtype=torch.long).flatten()
        if p.numel() == 0:
            raise ValueError(f"prompts[{i}] is empty")
        if p.min() < 0 or p.max() >= vocab_size:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}): "
                             f"min {p.min().item()}, max {p.max().item()}")
        rows.append(p)
    B, P = len(rows), max(len(r) for r in rows)
    idx = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.bool)
    for i, r in enumerate(rows):
        idx[i, P - len(r):] = r
        mask[i, P - len(r):] = True
    return idx.to(device), mask.to(device)


def _check_args(model, max_new_tokens, temperature, top_k, top_p, eos_token_id, pad_token_id, generator):
    """Validates the sampling arguments; returns (eos ids as a list, pad id, device)."""
    if getattr(model, "head", "lm") != "lm":
        raise ValueError(f"generate needs a model with an LM head, this one has head={model.head!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    V = model.config.vocab_size
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if any(not isinstance(e, int) or not 0 <= e < V for e in eos):
        raise ValueError(f"eos_token_id must be None, an int or a list of ints in [0, {V}), got {eos_token_id!r}")
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    if not isinstance(pad, int) or not 0 <= pad < V:
        raise ValueError(f"pad_token_id must be an int in [0, {V}), got {pad_token_id!r}")
    device = model.lm_head_weight.device
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device} but the model is on {device}: "
                         f"use torch.Generator(device={device.type!r})")
    return eos, pad, device


def _row_seeds(seeds, B, generator, device):
    """-> (B,) long on `device`: the given seeds (a list of B non-negative ints or a (B,) integer tensor), or
    B seeds drawn from the generator."""
    if seeds is None:
        return draw_seeds(B, generator, device)
    if isinstance(seeds, torch.Tensor):
        if seeds.shape != (B,) or seeds.is_floating_point() or seeds.is_complex() or seeds.dtype == torch.bool:
            raise ValueError(f"seeds must be a ({B},) integer tensor, one per prompt, got {seeds.dtype} "
                             f"of shape {tuple(seeds.shape)}")
        seeds = seeds.to(device=device, dtype=torch.long)
        if (seeds < 0).any():  # one host sync per call, not per token
            raise ValueError(f"seeds must be non-negative, got {seeds.tolist()}")
        return seeds
    seeds = list(seeds)
    if len(seeds) != B or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**63 for s in seeds):
        raise ValueError(f"seeds must be {B} ints in [0, 2^63), one per prompt, got {seeds!r}")
    return torch.tensor(seeds, dtype=torch.long, device=device)


# -----------------------------------------------------------------------------
# sampling


def filter_logits(z, top_k=0, top_p=1.0):
    """z (B, V) float32 tempered logits -> the same with tokens outside top-k / nucleus top-p at -inf.
    top-k keeps every token tied with the k-th largest; top-p then keeps the smallest set of the
    most likely tokens (after top-k, renormalised) whose mass reaches top_p, and always the first."""
    if 0 < top_k < z.size(-1):
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]  # (B, 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        zs, order = torch.sort(z, dim=-1, descending=True)  # (B, V)
        ps = zs.softmax(-1)
        drop_sorted = ps.cumsum(-1) - ps >= top_p  # mass of the more likely tokens already reaches top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def _mul32(x, m):
    """x * m mod 2^32, in place on an int64 tensor (or on an int) x in [0, 2^32), for a constant m in
    [0, 2^32), without any product reaching 2^63: m < 2^31 multiplies directly; a larger m is split as
    m_hi 2^16 + m_lo, and only the low 16 bits of x m_hi survive the shift mod 2^32 (both products < 2^48)."""
    if m < 1 << 31:
        x *= m
    else:
        hi = x * (m >> 16)
        hi &= 0xFFFF
        hi <<= 16
        x *= m & 0xFFFF
        x += hi
    x &= MASK32
    return x


def mix32(x):
    """lowbias32 (C. Wellons, github.com/skeeto/hash-prospector): a bijection of [0, 2^32) in which each input
    bit flips each output bit with probability close to 1/2. x: int64 tensor with values in [0, 2^32), or a
    Python int (the step's key is then computed on the host: nothing to copy to the device). Augmented
    assignments work in place on the new tensor from the first line (a third of the time of fresh tensors
    on a CPU), and on ints as well."""
    x = x ^ (x >> 16)  # a new tensor: the caller's is never modified
    x = _mul32(x, 0x7FEB352D)
    x ^= x >> 15
    x = _mul32(x, 0x846CA68B)
    x ^= x >> 16
    return x


def noise_bits(seeds, step, V):
    """seeds (B,) int64, step an int or a 0-dim / (1,) long tensor -> (B, V) int64 in [0, 2^24): 24 uniform
    bits for every (row, token), a pure function of (seeds[b], step, v) (see the module docstring)."""
    s = mix32(((seeds >> 32) & MASK32) ^ mix32(seeds & MASK32))  # (B,) fold 64 -> 32 bits
    key = mix32(s ^ mix32(step & MASK32))  # (B,)
    v = mix32(torch.arange(V, device=seeds.device))  # (V,): adjacent ids differ in many bits before the last mix
    return mix32(v[None, :] ^ key[:, None]) >> 8  # (B, V): the high bits, the best mixed


def exponential_noise(seeds, step, V):
    """-> q (B, V) float32, Exp(1) noise q = -log(u) with u = (k + 1/2) / 2^24 for the 24 hashed bits k:
    u is in (0, 1), never 0 or 1. float32 cannot hold those midpoints above 1/2 (its spacing there is 2^-24),
    so q is computed from u's distance to 0 or to 1, whichever is smaller, which is exact:
    a = min(u, 1 - u) = (min(k, 2^24 - 1 - k) + 1/2) / 2^24, q = -log(a) below 1/2, -log1p(-a) above."""
    k = noise_bits(seeds, step, V)  # (B, V)
    a = torch.minimum(k, 0xFFFFFF - k).float().add_(0.5).mul_(2.0**-24)  # (B, V) in (0, 1/2), exact
    return torch.where(k >= 1 << 23, a.neg().log1p_().neg_(), a.log().neg_())


def draw_seeds(B, generator=None, device="cpu"):
    """(B,) int64 seeds in [0, 2^63 - 1), drawn on the generator's device (the default one's if None)."""
    dev = generator.device if generator is not None else torch.device(device)
    return torch.randint(0, 2**63 - 1, (B,), generator=generator, device=dev).to(device)


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None, seeds=None, step=0):
    """logits (B, V) -> token (B,) long, logp (B,) float32 of that token under
    log_softmax(logits / temperature) (see the module docstring). temperature 0 = greedy.
    seeds (B,) long on the logits' device and step (int or 0-dim / (1,) long tensor) key the noise;
    seeds None draws them from `generator` (B fresh seeds per call)."""
    logits = logits.float()
    if temperature == 0:
        token = logits.argmax(-1)
        logp = F.log_softmax(logits, dim=-1)
    else:
        z = logits / temperature
        logp = F.log_softmax(z, dim=-1)  # (B, V): what the training forward recomputes
        probs = (filter_logits(z, top_k, top_p) if (top_k or top_p < 1) else z).softmax(-1)
        if seeds is None:
            seeds = draw_seeds(z.size(0), generator, z.device)
        q = exponential_noise(seeds, step, z.size(-1))  # (B, V), > 0: a dropped token gives 0 / q = 0
        token = (probs / q).argmax(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


# -----------------------------------------------------------------------------
# prefill and decode


def head_weight(model):
    """The LM head's (V, H) weight as the sampler's GEMM takes it, prepared once per generate() call: on CUDA
    as it is (a half GEMM with a float32 result), elsewhere upcast to float32 (kernels.utils.gemm_operand,
    as in the training path), once per call rather than once per token (SmolLM2's is 28M values)."""
    return gemm_operand(model.lm_head_weight)


def last_logits(model, hidden, weight=None):
    """hidden (B, T, H) -> float32 logits (B, V) of the last column: only that row of the LM head is needed.
    weight: head_weight(model), passed in by the decode loop (None: prepared here). The product is the
    training path's: half operands, float32 accumulation and result, so no logit is rounded to bf16."""
    W = head_weight(model) if weight is None else weight  # (V, H)
    h = hidden[:, -1]  # (B, H)
    if h.device.type == "cuda":
        return mm_f32(h, W.T)
    h = h.to(W.dtype)  # float32 operands: bf16 values, and their products, are exact in float32
    return (W @ h.T).T.contiguous()  # MKL runs the tall (V, H) @ (H, B) faster than (B, H) @ (H, V) at small B


def prefill(model, idx, mask, pos):
    """idx, pos (B, P), mask (B, P) over the first P cache slots -> hidden states (B, P, H); fills slots 0..P-1."""
    P = idx.size(1)
    slots = torch.arange(P, device=idx.device)
    return model(idx, attention_mask=mask, position_ids=pos, cache_pos=slots, return_hidden=True)


def decode_one(model, tok, mask, pos, slot):
    """tok, pos (B, 1), mask (B, S'), slot (1,) -> hidden states (B, 1, H); writes the token's keys/values at
    `slot` and attends to the first S' cache slots. Compiled, it gets the whole cache (S' = S) every step, so
    that its shapes never change; eager, only the slots filled so far. The LM head runs outside, in
    last_logits (float32 output, kernels.utils.mm_f32: a probe and a cache that are not for tracing)."""
    return model(tok, attention_mask=mask, position_ids=pos, cache_pos=slot, return_hidden=True)


@functools.cache
def compiled_decode_one(device_type):
    """decode_one compiled once per process and device type (CUDA: CUDA graphs via reduce-overhead)."""
    mode = "reduce-overhead" if device_type == "cuda" else None
    return torch.compile(decode_one, mode=mode, fullgraph=True, dynamic=False)


def _kv_cache(model, B, S, dtype, device, static):
    """Allocates the per-layer caches, or reuses the current ones when they already fit exactly
    (a compiled decode step keeps the same buffers, so CUDA graphs are not re-recorded)."""
    c = model.model.layers[0].self_attn.kv_cache
    if c is None or c.k.shape[0] != B or c.k.shape[2] != S or c.k.dtype != dtype or c.k.device != device:
        model.setup_kv_cache(B, S, dtype=dtype, device=device)
    if static:  # fixed addresses: CUDA graphs may write the cache in place
        for blk in model.model.layers:
            torch._dynamo.mark_static_address(blk.self_attn.kv_cache.k)
            torch._dynamo.mark_static_address(blk.self_attn.kv_cache.v)


def _rollout(idx, prompt_mask, tokens, response_mask, logprobs, ended, seeds):
    """Cuts the responses to R = the longest one; steps past it (CUDA checks every few) only padded."""
    R = int(response_mask.sum(-1).max())  # >= 1: every row samples its first token
    return Rollout(tokens=torch.cat([idx, tokens[:, :R]], dim=1), prompt_len=idx.size(1), prompt_mask=prompt_mask,
                   response_mask=response_mask[:, :R].clone(), logprobs=logprobs[:, :R].clone(), ended=ended,
                   seeds=seeds)


# -----------------------------------------------------------------------------
# generation


@torch.no_grad()
def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
             pad_token_id=None, generator=None, compile=None, seeds=None):
    """Samples up to max_new_tokens tokens after each prompt (a list of token id lists).
    temperature 0 = greedy; top_k 0 and top_p 1 = off. eos_token_id: None (never stop early), an int or
    a list of ints. pad_token_id: defaults to the first EOS id, else 0. seeds: one non-negative int per
    prompt (a list or a (B,) integer tensor) that keys its sampling noise; None draws them from generator,
    a torch.Generator on the model's device type (None: the default one). compile: compile the decode
    step (default: on for CUDA, off elsewhere);
    a compiled decode keeps its KV cache on the model between calls (model.clear_kv_cache() frees it).
    Runs under no_grad, not inference_mode, so the returned tensors can be used in training."""
    eos, pad, device = _check_args(model, max_new_tokens, temperature, top_k, top_p, eos_token_id, pad_token_id,
                                   generator)
    cuda = device.type == "cuda"
    compile = cuda if compile is None else compile
    check_every = CUDA_CHECK_EVERY if cuda else 1
    idx, prompt_mask = pad_prompts(prompts, pad, model.config.vocab_size, device)  # (B, P)
    B, P = idx.shape
    seeds = _row_seeds(seeds, B, generator, device)  # (B,)
    W = head_weight(model)  # (V, H), float32 on a CPU: converted once, not at every token
    S = P + max_new_tokens
    if compile:
        S = math.ceil(S / CACHE_MULTIPLE) * CACHE_MULTIPLE
    _kv_cache(model, B, S, model.lm_head_weight.dtype, device, static=compile and cuda)
    step = compiled_decode_one(device.type) if compile else decode_one
    eos_ids = torch.tensor(eos, dtype=torch.long, device=device)

    mask = torch.zeros(B, S, dtype=torch.long, device=device)  # (B, S): cache slots holding real tokens
    mask[:, :P] = prompt_mask
    pos = (mask[:, :P].cumsum(-1) - 1).clamp(min=0)  # (B, P)
    out_tokens = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    out_mask = torch.zeros(B, max_new_tokens, dtype=torch.bool, device=device)
    out_logp = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)  # (B,): no EOS sampled yet
    try:
        logits = last_logits(model, prefill(model, idx, mask[:, :P], pos), W)  # (B, V) float32
        pos = pos[:, -1:] + 1  # (B, 1): position of the next token of every row
        slot = torch.tensor([P], dtype=torch.long, device=device)  # (1,): its cache slot, a tensor for fixed shapes
        for t in range(max_new_tokens):
            tok, logp = sample(logits, temperature, top_k, top_p, seeds=seeds, step=t)  # (B,), (B,)
            tok = torch.where(alive, tok, pad)
            out_tokens[:, t] = tok
            out_logp[:, t] = torch.where(alive, logp, 0.0)
            out_mask[:, t] = alive
            mask[:, P + t] = alive  # a token sampled after EOS is padding: no later query sees it
            if eos:
                alive &= ~(tok[:, None] == eos_ids).any(-1)
            if t == max_new_tokens - 1 or ((t + 1) % check_every == 0 and not alive.any()):
                break
            if compile and cuda:
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's hidden states are consumed
            width = S if compile else P + t + 1  # eager: attend to the filled slots only
            logits = last_logits(model, step(model, tok[:, None], mask[:, :width], pos, slot), W)  # (B, V)
            pos += 1
            slot += 1
    finally:
        if not compile:
            model.clear_kv_cache()
    return _rollout(idx, prompt_mask, out_tokens, out_mask, out_logp, ~alive if eos else torch.zeros_like(alive),
                    seeds)


@torch.no_grad()
def generate_reference(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
                       pad_token_id=None, generator=None, seeds=None):
    """The slow twin of `generate`: same arguments (no compile), same sampling and the same noise (the same
    seeds, or the same ones drawn from the generator), but every step runs the full forward over the whole
    sequence without a cache."""
    eos, pad, device = _check_args(model, max_new_tokens, temperature, top_k, top_p, eos_token_id, pad_token_id,
                                   generator)
    idx, prompt_mask = pad_prompts(prompts, pad, model.config.vocab_size, device)
    seeds = _row_seeds(seeds, idx.size(0), generator, device)  # (B,)
    W = head_weight(model)  # (V, H)
    seq, mask = idx, prompt_mask.long()  # (B, P + t)
    toks, masks, logps = [], [], []
    alive = torch.ones(idx.size(0), dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        h = model(seq, attention_mask=mask, position_ids=pos, return_hidden=True)  # (B, P + t, H)
        tok, logp = sample(last_logits(model, h, W), temperature, top_k, top_p, seeds=seeds, step=t)
        tok = torch.where(alive, tok, pad)
        toks.append(tok)
        logps.append(torch.where(alive, logp, 0.0))
        masks.append(alive.clone())
        seq = torch.cat([seq, tok[:, None]], dim=1)
        mask = torch.cat([mask, alive[:, None].long()], dim=1)
        if eos:
            alive = alive & ~torch.isin(tok, torch.tensor(eos, device=device))
        if not alive.any():
            break
    ended = ~alive if eos else torch.zeros_like(alive)
    return _rollout(idx, prompt_mask, torch.stack(toks, 1), torch.stack(masks, 1), torch.stack(logps, 1), ended,
                    seeds)


# -----------------------------------------------------------------------------
# benchmark: python rollout.py [--device=cuda]


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
    generate(model, prompts, min(new_tokens, max(3, S - CACHE_MULTIPLE + 1 - P)), temperature=0, compile=True)


def _compare(model, hf, prompts, batches, new_tokens, rounds, compile, pad_id, label):
    """One table row per batch size: tokens/s of transformers' generate and of ours (eager, compiled)."""
    device = model.lm_head_weight.device
    print(f"\n{label}: greedy, {new_tokens} new tokens, no EOS stop; tokens/s = batch * new tokens / wall time "
          f"(prefill included), best of {rounds} rounds (transformers and ours interleaved, then ours+compile)")
    print(f"{'batch':>5} {'prompt P':>8} {'transformers':>12} {'ours':>8} {'ours+compile':>12} {'speedup':>7} "
          f"{'agree':>6}")
    for B in batches:
        batch = [prompts[i % len(prompts)] for i in range(B)]
        P = max(len(p) for p in batch)
        runs = {"transformers": lambda: _hf_generate(hf, batch, new_tokens, pad_id),
                "ours": lambda: generate(model, batch, new_tokens, temperature=0, compile=False).tokens}
        best, outs = {k: float("inf") for k in runs}, {}
        for _ in range(rounds):
            for k, fn in runs.items():
                dt, outs[k] = _timed(fn, device)
                best[k] = min(best[k], dt)
        if compile:  # after the eager runs, which free the cache a compiled step keeps
            _warm_compiled(model, batch, new_tokens)
            fn = lambda: generate(model, batch, new_tokens, temperature=0, compile=True).tokens
            best["ours+compile"] = min(_timed(fn, device)[0] for _ in range(rounds))
            model.clear_kv_cache()
        tps = {k: B * new_tokens / v for k, v in best.items()}
        differ = (outs["ours"] != outs["transformers"])[:, P:]  # (B, new_tokens)
        same = torch.where(differ.any(-1), differ.float().argmax(-1), new_tokens).float().mean().item() / new_tokens
        comp = f"{tps['ours+compile']:12.1f}" if compile else f"{'-':>12}"
        speedup = max(v for k, v in tps.items() if k != "transformers") / tps["transformers"]
        print(f"{B:5d} {P:8d} {tps['transformers']:12.1f} {tps['ours']:8.1f} {comp} {speedup:6.2f}x {same:6.0%}",
              flush=True)


def _bench_smollm2(device, runs, new_tokens, rounds, compile):
    """runs: [(dtype, batch sizes)]."""
    import os

    from data import load_prompts
    from model import Transformer, load_tokenizer

    tok = load_tokenizer("smollm2")
    model = Transformer.from_pretrained("smollm2", device=device).eval()
    prompts = load_prompts(os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl"), tok, 64).ids
    for dtype, batches in runs:
        model.to(dtype)
        hf = _hf_twin(model)  # built in this dtype: hf.to(dtype) would also round its RoPE inv_freq buffer
        _compare(model, hf, prompts, batches, new_tokens, rounds, compile, tok.eos_token_id,
                 f"SmolLM2-135M-Instruct, {str(dtype).replace('torch.', '')}, {_device_name(device)}")
    del model, hf


def _copy_bandwidth(device, nbytes=2 << 30):
    """Bytes read + written per second by a large device-to-device copy: the practical roof."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    dt = min(_timed(lambda: y.copy_(x), device)[0] for _ in range(5))
    return 2 * nbytes / dt


LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 rope_theta=500000.0, tie_word_embeddings=False)


def _device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"


def _bench_roof(device, shapes, batch, prompt_len, new_tokens, rounds, compile=True, name="Llama-3-8B"):
    """Random weights with a real model's shapes (a transformers LlamaConfig's fields) in bf16: decode
    tokens/s against the memory-bandwidth roof (every weight and the filled part of the KV cache read
    once per step), and transformers' generate at the same batch. Decode time = time(new_tokens) -
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
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(prompt_len // 2, prompt_len + 1, (batch,), generator=g).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]

    bw = _copy_bandwidth(device, min(2 << 30, 4 * sum(p.numel() * p.element_size() for p in model.parameters())))
    w_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_slot = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # bytes: bf16 K and V
    kv_bytes = batch * (sum(lens) / batch + new_tokens / 2) * kv_per_slot  # average filled slots over the decode
    roof_tps = batch / ((w_bytes + kv_bytes) / bw)

    engines = {"ours": lambda n: generate(model, prompts, n, temperature=0, compile=False)}
    if compile:
        engines["ours+compile"] = lambda n: generate(model, prompts, n, temperature=0, compile=True)
    engines["transformers"] = lambda n: _hf_generate(hf, prompts, n, 0)
    res = {}
    for key, fn in engines.items():
        fn(1)
        t_one = min(_timed(lambda: fn(1), device)[0] for _ in range(rounds))  # prefill + first token, no decode
        if key == "ours+compile":  # compile and record at the full cache width, which the timed runs reuse
            _warm_compiled(model, prompts, new_tokens)
        t_full = min(_timed(lambda: fn(new_tokens), device)[0] for _ in range(rounds))
        res[key] = batch * (new_tokens - 1) / (t_full - t_one), batch * new_tokens / t_full
    model.clear_kv_cache()
    print(f"\n{name} shapes, random weights, bf16, {_device_name(device)}: batch {batch}, prompts "
          f"{min(lens)}-{max(lens)} tokens, {new_tokens} new tokens (greedy, no EOS stop)")
    print(f"read per decode step: weights {w_bytes / 1e9:.2f} GB + KV cache {kv_bytes / 1e9:.2f} GB (filled part, "
          f"average); copy bandwidth {bw / 1e9:,.0f} GB/s -> roof {roof_tps:,.0f} tokens/s")
    print(f"{'engine':>14} {'decode tok/s':>12} {'% of roof':>9} {'end-to-end tok/s':>16}")
    for key, (dec, e2e) in res.items():
        print(f"{key:>14} {dec:12,.0f} {dec / roof_tps:9.0%} {e2e:16,.0f}", flush=True)


if __name__ == "__main__":
    import fire

    def main(device="cpu", new_tokens=128, rounds=2, compile=True, bf16=True, threads=None, batches=(1, 8, 32)):
        """CPU: SmolLM2-135M-Instruct in float32 (and bfloat16) at each batch size, ours vs transformers.
        CUDA: the same in bf16, then a random Llama-3-8B at batch 64 against the bandwidth roof."""
        dev = torch.device(device)
        batches = (batches,) if isinstance(batches, int) else tuple(batches)
        if threads:
            torch.set_num_threads(threads)
        if dev.type == "cuda":
            _bench_smollm2(dev, [(torch.bfloat16, (1, 8, 32, 64))], new_tokens, rounds, compile)
            _bench_roof(dev, LLAMA3_8B, 64, 128, new_tokens, rounds, compile)
        else:
            runs = [(torch.float32, batches)] + ([(torch.bfloat16, (1,))] if bf16 else [])
            _bench_smollm2(dev, runs, new_tokens, rounds, compile)

    fire.Fire(main)

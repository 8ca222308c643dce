"""
Batched sampling with a KV cache: the rollout stage of PPO, on model.py's Transformer.

    generate(model, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, ...) -> Rollout

Prompts of different lengths are left-padded to a common width P, so every row's last prompt token
sits in column P-1 and the batch appends in step. Positions count real tokens only:
position_ids = max(cumsum(mask) - 1, 0). The KV cache is gpt-fast's: preallocated buffers written at
explicit slots. Per micro-batch of rows (see below):
  prefill: one forward over the micro-batch's P prompt columns fills slots 0..P-1 and gives the first logits;
  decode:  one forward per new token, of shape (rows, 1), writing slot P + t.
Both are small separate functions. Eager decoding attends to the filled slots 0..P+t only; the
compiled decode step (torch.compile, on CUDA with mode="reduce-overhead", i.e. CUDA graphs) always
gets the whole cache, so that its shapes never change. It compiles once per (rows, S) and keeps its
cache on the model between calls (fixed buffer addresses for the graphs); model.clear_kv_cache() frees it.
On a CPU compile=True pays at one row: the step and the LM head (compiled_last_logits) compile to C++ loops
(inductor) in which each one-row product is a reduction streaming its weight (model.linear; the blocks'
weights fused in (out, in) rows, model.store_transposed(transposed=False)), about 1.8x the eager decode of a
135M model on a 2-core AVX2 CPU; from 2 rows on, the products are oneDNN's either way and compiled decoding
runs 0.9-1.2x the eager one. Each size compiles in about 40 s there: a CPU's default, and PPO's rollouts (many
rows, compacted through many sizes), stay eager.

Micro-batches and one fixed cache. generate(micro_batch_size=m) runs the prompts m rows at a time, through
ONE cache of m rows x S slots, allocated once per call (eager; freed at its end) or kept from the last call
when it has that shape (compiled). S = max_prompt_len + max_new_tokens, rounded up to a multiple of
CACHE_MULTIPLE (compiled, or when max_prompt_len is given); max_prompt_len None takes the widest prompt
of the call. With max_prompt_len set, as in PPO, S is the same at every step, and so are the compiled
graphs. Each micro-batch prefills at its own prompt width (its rows' padding only); the Rollout puts all
rows back together at P = the widest prompt of the call, R = the longest response. A row's tokens depend
on its prompt and seed only (the sampling noise below), not on the micro-batching, up to the float
rounding of a GEMM at another batch size.

Stop strings (StopStrings): at each check the live rows' last tokens are decoded; a row whose text now holds one
ends with the token completing it, as at an EOS, and what it sampled since is padding.

Finished rows leave the decode batch (compaction). The batch runs on views of the cache buffers'
leading rows; when rows have sampled an EOS, the live ones are copied to the front (index_select of every
layer's K and V, and of tok, positions, masks, seeds) and the views shrink, so no memory is allocated and
the buffers keep their addresses. A compaction copies about as much as one decode step reads, so:
  eager (CPU, or compile=False): checked every step; compacts once at most COMPACT_BELOW (3/4) of the
    rows are live, to exactly the live rows. A last micro-batch of fewer rows simply runs fewer rows.
  compiled (CUDA graphs): the decode batch takes only the sizes m, m/2, m/4, m/8 (ROW_BUCKETS, rounded
    up), one graph each, recorded once and replayed across micro-batches and calls; it shrinks to the
    smallest size that holds the live rows, at the steps where the host checks for finished rows (every
    CUDA_CHECK_EVERY steps on CUDA, every step on a CPU), padded with finished rows. A last, smaller
    micro-batch starts at the smallest size that holds it, filled with copies of its first row that
    count as finished from the start (their outputs are dropped). This path runs under inductor on a CPU
    in the tests, and with its CUDA graphs (a view of the leading rows marked as a static address, one
    graph per size) in the CUDA tests.
compact=False keeps every row to the end, as transformers' generate does.
Decoding runs in the model's dtype (load it in bf16 on a GPU); sampling always in float32.

Sampling, per step:
    z = logits / temperature                     logp = log_softmax(z)
    z' = z with tokens outside top-k / top-p at -inf,   p' = softmax(z')
    token = argmax(p' / q),  q ~ Exponential(1)  (the exponential-race form of the Gumbel-max trick)
argmax(p'/q) is distributed as Categorical(p'): for independent q_i ~ Exp(1), q_i / p'_i ~ Exp(p'_i)
and the smallest of them is i with probability p'_i. Unlike torch.multinomial it needs no host-device
sync. temperature == 0 is greedy: token = argmax(logits).
Without top-k / top-p (PPO's case) a step's sampling is `race`: eager, some 115 ops over (rows, V), most
of them the noise hash's int64 passes (2.25 GB read and written at 32 rows of 151,936 tokens, about
0.8 ms at an H100's copy bandwidth, against a decode step's 3 GB of weights). On a CPU, `race_pruned`
draws the same tokens with the noise of only the tokens that can win. Compiled decoding on CUDA
runs it compiled too (compiled_race: a few fused kernels); the hash's integer ops are exact in any order,
so the noise is the same bits, and only the softmaxes' sums may round otherwise (a token can then differ at
a near-tie, as with any change of kernel).
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
cache and of response_mask, with logprob 0; its sampled values are ignored (and, compacted, it is no
longer decoded). A micro-batch's loop stops when all its rows have finished (checked every step on CPU;
every CUDA_CHECK_EVERY steps on CUDA, so the host does not wait for the GPU at each token) or after
max_new_tokens.

generate_reference is the slow twin: the same sampling and the same noise (same seeds), with a full
forward without cache at every step. The tests compare the two token for token.

Benchmark (greedy, 128 new tokens, no EOS stop; ours vs transformers' generate on the same weights):
    python bench.py generation                 # CPU: SmolLM2-135M-Instruct, float32 at batch 1 to 32, bf16 at 1
    python bench.py generation --device=cuda   # GPU, bf16: SmolLM2's shapes at batch 1 to 64
    python bench.py generation --device=cuda --cases=roof   # random weights with Llama-3-8B's shapes at batch
                                               # 1, 8 and 64 against the memory-bandwidth roof
then rows that stop at EOS (short answers and open-ended prompts), compaction off vs on, in one batch of
32 and in micro-batches of 8 (--cases=ragged runs only that one).
On a CPU shared with other jobs, --threads=1 (or OMP_WAIT_POLICY=PASSIVE) keeps OpenMP threads from
waiting on a core that a neighbour holds, which otherwise slows every step several times over.
"""
import functools
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from data import left_pad
from kernels.utils import gemm_operand, mm_f32
from model import decode_products, linear

CUDA_CHECK_EVERY = 16  # decode steps between "has every row finished?" checks on CUDA (one sync each)
CACHE_MULTIPLE = 64  # compiled decoding rounds the cache width up to this, so prompt widths share graphs
COMPACT_BELOW = 0.75  # eager decoding drops finished rows once at most this fraction of its rows is live
ROW_BUCKETS = 4  # compiled decoding runs micro_batch_size / 2^i rows, i < ROW_BUCKETS: one graph for each size
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

    def texts(self, tokenizer, rows=None):
        """The responses of the first `rows` rows (all: None) as text, special tokens (the EOS) skipped."""
        return [tokenizer.decode(self.responses[b][self.response_mask[b]].tolist(), skip_special_tokens=True)
                for b in range(self.tokens.size(0) if rows is None else rows)]


# -----------------------------------------------------------------------------
# small helpers


def pad_prompts(prompts, pad_id, vocab_size, device):
    """Token id lists -> idx (B, P) long and mask (B, P) bool, padded on the left (data.left_pad), after
    checking that every prompt is a non-empty list of ids in [0, vocab_size)."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token id lists")
    rows = []
    for i, p in enumerate(prompts):
        p = torch.as_tensor(p).flatten()
        if p.numel() == 0:
            raise ValueError(f"prompts[{i}] is empty")
        if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:  # (3.7 would be read as 3)
            raise ValueError(f"prompts[{i}] holds {p.dtype} values, not integer token ids")
        p = p.long()
        if p.min() < 0 or p.max() >= vocab_size:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}): "
                             f"min {p.min().item()}, max {p.max().item()}")
        rows.append(p.tolist())
    idx, mask, _ = left_pad(rows, pad_id)
    return idx.to(device), mask.bool().to(device)


def row_seeds(seed, step, rows):
    """(B,) int64 sampling seeds of global rollout rows `rows` at `step` (hashed into the sampling noise below):
    distinct for every (step, row), the same on any rank that holds the row."""
    return torch.tensor([((seed * 1_000_003 + step) * 1_000_033 + g) % 2**62 for g in rows], dtype=torch.long)


def eval_seeds(seed, rows):
    """(B,) int64 sampling seeds of held-out evaluation rows `rows` (evaluate.py): in [2^62, 2^63), where no
    row_seeds falls, so evaluation never draws a training row's noise; the same at every evaluation of a run."""
    return row_seeds(seed, 0, rows) + 2**62


MIN_TEMPERATURE = 1e-6  # below it logits / temperature can overflow to inf (1e-40: every token id 0, logprobs NaN)


def is_int(x):
    """An integer (numpy's too), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_args(model, max_new_tokens, temperature, top_k, top_p, eos_token_id, pad_token_id, generator):
    """Validates the sampling arguments; returns (eos ids as a list, pad id, device)."""
    if getattr(model, "head", "lm") != "lm":
        raise ValueError(f"generate needs a model with an LM head, this one has head={model.head!r}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {temperature!r}")
    if not is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    V = model.config.vocab_size
    try:
        eos = [] if eos_token_id is None else [eos_token_id] if is_int(eos_token_id) else list(eos_token_id)
    except TypeError:  # not iterable
        eos = [None]
    if any(not is_int(e) or not 0 <= e < V for e in eos):
        raise ValueError(f"eos_token_id must be None, an int or a list of ints in [0, {V}), got {eos_token_id!r}")
    eos = [int(e) for e in eos]
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    if not is_int(pad) or not 0 <= pad < V:
        raise ValueError(f"pad_token_id must be an int in [0, {V}), got {pad_token_id!r}")
    pad, device = int(pad), model.lm_head_weight.device
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


def _check_sizes(B, P, micro_batch_size, max_prompt_len, prompt_mask):
    """Validates the micro-batch size and the prompt cap against the padded prompts (B, P); -> the micro-batch
    size (B when None)."""
    if micro_batch_size is not None and (not is_int(micro_batch_size) or micro_batch_size < 1):
        raise ValueError(f"micro_batch_size must be None or an int >= 1, got {micro_batch_size!r}")
    if max_prompt_len is not None:
        if not is_int(max_prompt_len) or max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be None or an int >= 1, got {max_prompt_len!r}")
        if P > max_prompt_len:
            i = int(prompt_mask.sum(-1).argmax())
            raise ValueError(f"prompts[{i}] has {P} tokens, more than max_prompt_len={max_prompt_len}")
    return B if micro_batch_size is None else micro_batch_size


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
    v = mix32(torch.arange(V, device=seeds.device))  # (V,): adjacent ids differ in many bits before the last mix
    return mix32(v[None, :] ^ row_keys(seeds, step)[:, None]) >> 8  # (B, V): the high bits, the best mixed


def row_keys(seeds, step):
    """seeds (B,) int64, step -> (B,) int64: each row's 32-bit key for this step."""
    s = mix32(((seeds >> 32) & MASK32) ^ mix32(seeds & MASK32))  # (B,) fold 64 -> 32 bits
    return mix32(s ^ mix32(step & MASK32))  # (B,)


def noise_bits_at(seeds, step, rows, cols):
    """noise_bits(seeds, step, V)[rows, cols] for index vectors rows, cols (n,), without the (B, V) rest."""
    return mix32(mix32(cols) ^ row_keys(seeds, step)[rows]) >> 8  # (n,)


def exponential_noise(seeds, step, V):
    """-> q (B, V) float32, Exp(1) noise q = -log(u) with u = (k + 1/2) / 2^24 for the 24 hashed bits k:
    u is in (0, 1), never 0 or 1. float32 cannot hold those midpoints above 1/2 (its spacing there is 2^-24),
    so q is computed from u's distance to 0 or to 1, whichever is smaller, which is exact:
    a = min(u, 1 - u) = (min(k, 2^24 - 1 - k) + 1/2) / 2^24, q = -log(a) below 1/2, -log1p(-a) above."""
    return noise_from_bits(noise_bits(seeds, step, V))


def noise_from_bits(k):
    """exponential_noise of 24-bit values k (any shape): -log((k + 1/2) / 2^24), float32."""
    a = torch.minimum(k, 0xFFFFFF - k).float().add_(0.5).mul_(2.0**-24)  # in (0, 1/2), exact
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
        return token, F.log_softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
    if seeds is None:
        seeds = draw_seeds(logits.size(0), generator, logits.device)
    if not top_k and top_p == 1:  # a CPU: race_pruned; compiled CUDA decoding calls compiled_race itself
        return (race_pruned if logits.device.type == "cpu" else race)(logits, temperature, seeds, step)
    z = logits / temperature
    probs = filter_logits(z, top_k, top_p).softmax(-1)
    q = exponential_noise(seeds, step, z.size(-1))  # (B, V), > 0: a dropped token gives 0 / q = 0
    token = (probs / q).argmax(-1)
    return token, F.log_softmax(z, dim=-1).gather(-1, token[:, None]).squeeze(-1)


def race(logits, temperature, seeds, step):
    """sample without top-k / top-p: logits (B, V) float32, temperature > 0, seeds (B,) long, step an int or a
    (1,) long tensor -> token (B,), logp (B,) float32. One function of tensors, so that compiled_race can
    fuse it."""
    z = logits / temperature
    logp = F.log_softmax(z, dim=-1)  # (B, V): what the training forward recomputes
    q = exponential_noise(seeds, step, z.size(-1))  # (B, V) > 0
    token = (z.softmax(-1) / q).argmax(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


NOISE_FLOOR = 2.0**-26  # below every noise value (the smallest, at bits 2^24 - 1, is -log1p(-2^-25) ~ 2^-25)


def race_pruned(logits, temperature, seeds, step):
    """race's tokens and logprobs, bit for bit, drawing the noise only for the tokens that can win (a CPU's
    eager decode: race's noise hash is some 25 passes over (B, V), most of its time). Each row's most probable
    token gives a score s = p / q that the row's winner reaches; every q >= NOISE_FLOOR, so a token scores
    fl(p / q) <= p / NOISE_FLOOR, and one with p < s NOISE_FLOOR cannot win (rounding is monotone; scaling by a
    power of two is exact, and s >= 1 / (17.4 V) is far from underflow). The kept tokens' scores are race's (the
    same softmax, noise bits and
    division); the winner is the first column at the row's best, as argmax takes it. SmolLM2's decode keeps
    about 3% of the tokens at temperature 0.7 and a quarter at 1: 2.0-2.5x and 1.0-1.4x as fast as race at 16
    and 32 rows (a 2-core AMD Zen 3). Where more than 3/8 would be kept (flat rows, random weights: 10-20%
    slower than race), or a row has no finite probability (NaN or infinite logits), the call draws every
    token's noise, as race does."""
    z = logits / temperature
    logp = F.log_softmax(z, dim=-1)  # (B, V)
    p = z.softmax(-1)  # (B, V): race's probabilities
    B, V = p.shape
    rows = torch.arange(B, device=p.device)
    top = p.argmax(-1)  # (B,)
    s = p[rows, top] / noise_from_bits(noise_bits_at(seeds, step, rows, top))  # (B,) a score the winner reaches
    keep = p >= (s * NOISE_FLOOR)[:, None]  # (B, V): the tokens that can reach s
    token = None
    if 8 * int(keep.sum()) <= 3 * keep.numel():  # pruning gains up to about 40% kept
        r, c = keep.nonzero(as_tuple=True)  # (n,) each
        score = p[r, c] / noise_from_bits(noise_bits_at(seeds, step, r, c))  # (n,)
        best = score.new_full((B,), -1.0).scatter_reduce_(0, r, score, "amax")  # (B,)
        hit = score == best[r]
        token = torch.full((B,), V, device=p.device).scatter_reduce_(0, r[hit], c[hit], "amin")  # (B,) first best
    if token is None or bool((token == V).any()):  # flat rows, or a row without candidates (NaN)
        token = (p / exponential_noise(seeds, step, V)).argmax(-1)  # race's
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


COMPILED_RACE_DEVICES = ("cuda",)  # where compiled decoding also compiles race (a CPU would compile it per shape
# in about 15 s, for a few ms a step: compile=True there is a benchmark's choice, not the rollout's)


@functools.cache
def compiled_race(device_type):
    """race compiled once per process and device type (fixed shapes: one graph per decode batch size), step a
    (1,) device tensor so that the steps share it. The noise is integer arithmetic, the same bits fused or
    not; the softmaxes may sum in another order (inductor's C++ on a CPU: the same tokens, logprobs 4e-6
    apart at 151,936 tokens, and by the logits' own rounding at logits of 1e4)."""
    return torch.compile(race, fullgraph=True, dynamic=False)


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
    # float32 operands: bf16 values, and their products, are exact in float32. (B, H) @ (H, V), as transformers
    # computes it: MKL (torch 2.13, AVX-512) ran it 1.0x (B = 1) to 2.8x (B = 2, 3) faster than (V, H) @ (H, B)
    return linear(h.to(W.dtype), W)  # = h @ W.T, on oneDNN where model.cpu_matmul() picks it


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


@functools.cache
def compiled_last_logits(device_type):
    """last_logits compiled once per process and device type, for a CPU's compiled decode: at one row its product
    is one reduction that streams the head's weight (model.linear). CUDA's head stays eager (mm_f32's probe)."""
    return torch.compile(last_logits, fullgraph=True, dynamic=False)


def _kv_cache(model, B, S, dtype, device, static):
    """-> the layers' caches, allocated for B rows of S slots, or the current ones when they already have that
    shape (a compiled decode step keeps the same buffers, so CUDA graphs are not re-recorded). Each cache keeps
    its full buffers in `.full` (name -> (B, ...) tensor, rows first); the decode batch runs on views of their
    leading rows (_use_rows), so a smaller or compacted batch allocates nothing."""
    key = (B, S, dtype, device)
    caches = [blk.self_attn.kv_cache for blk in model.model.layers]
    if any(getattr(c, "rollout_key", None) != key for c in caches):
        model.setup_kv_cache(B, S, dtype=dtype, device=device)
        caches = [blk.self_attn.kv_cache for blk in model.model.layers]
        for c in caches:
            c.full, c.rollout_key = dict(c.named_buffers(recurse=False)), key
    if static:  # fixed addresses: CUDA graphs may write the cache in place
        for c in caches:
            for buf in c.full.values():
                torch._dynamo.mark_static_address(buf)
    return caches


def _use_rows(caches, n, static):
    """Points every cache at the first n rows of its full buffers (views: same addresses, no copy)."""
    for c in caches:
        for name, buf in c.full.items():
            view = buf if n == buf.size(0) else buf[:n]
            if static:  # a view starts at its buffer's address: a CUDA graph recorded for n rows replays
                torch._dynamo.mark_static_address(view)
            setattr(c, name, view)


def _compact_cache(caches, keep, static):
    """keep (n,) long, ascending: the decode rows that stay. Moves them to the first n rows of the buffers."""
    for c in caches:
        for name, buf in c.full.items():
            buf[:keep.numel()].copy_(getattr(c, name).index_select(0, keep))  # through a copy: rows overlap
    _use_rows(caches, keep.numel(), static)


def _row_sizes(m, compact):
    """The decode batch sizes compiled decoding runs at, for m cache rows: m, m/2, m/4, ... (ROW_BUCKETS of
    them, rounded up), one compiled graph each; only m without compaction."""
    return sorted({math.ceil(m / 2**i) for i in range(ROW_BUCKETS if compact else 1)})


def _decode_rows(n, m, compiled, compact):
    """Rows to decode n live rows with, out of m cache rows: n eagerly; the smallest fixed size >= n compiled."""
    return n if not compiled else min(s for s in _row_sizes(m, compact) if s >= n)


def _compacted_rows(n_alive, n, m, compiled):
    """Decode rows after dropping finished rows from a batch of n (n: not worth a copy yet). Eager: the live
    rows, once at most COMPACT_BELOW of the batch is live (a compaction copies about what one step reads);
    compiled: the next smaller fixed size that holds them."""
    if compiled:
        return min(n, _decode_rows(n_alive, m, True, True))
    return n_alive if n_alive <= COMPACT_BELOW * n else n


def _rollout(idx, prompt_mask, tokens, response_mask, logprobs, ended, seeds):
    """Cuts the responses to R = the longest one; steps past it (CUDA checks every few) only padded."""
    R = int(response_mask.sum(-1).max())  # >= 1: every row samples its first token
    return Rollout(tokens=torch.cat([idx, tokens[:, :R]], dim=1), prompt_len=idx.size(1), prompt_mask=prompt_mask,
                   response_mask=response_mask[:, :R].clone(), logprobs=logprobs[:, :R].clone(), ended=ended,
                   seeds=seeds)


class StopStrings:
    """Stop strings (vLLM's `stop`, --stop_strings): a response ends with the token that completes one of `strings`
    in its text, which stays in the response, as an EOS does; `ended` is then True. generate asks at every check of
    the decode loop (each step on a CPU, every CUDA_CHECK_EVERY on CUDA), for the rows still going, about their last
    tokens: the `new` ones since the last check and `window` before them, enough to hold a stop string (every token
    is at least a byte, and a few more for a character cut at the window's start). The tokens a row sampled after
    its stop are dropped: a stop depends on the tokens before it alone, so this is the rollout that stopping at once
    would give, with the same keyed noise. decode: a tokenizer's batch_decode (a list of id lists -> their texts)."""

    def __init__(self, strings, decode):
        self.strings, self.decode = tuple(strings), decode
        self.window = max(len(s.encode()) for s in self.strings) + 4

    @classmethod
    def of(cls, strings, tokenizer):
        """The run's (--stop_strings, decoded as the rewards read the responses), or None without any."""
        return cls(strings, functools.partial(tokenizer.batch_decode, skip_special_tokens=True)) if strings else None

    def __call__(self, windows, new):
        """-> for each row's window (its last `new` + up to `window` tokens), the index in it of the token that
        completes a stop string first, among the new ones, or None."""
        hit = lambda text: any(s in text for s in self.strings)  # noqa: E731
        out = []
        for ids, text in zip(windows, self.decode(windows)):
            first = max(0, len(ids) - new)
            out.append(next((j for j in range(first, len(ids)) if hit(self.decode([ids[: j + 1]])[0])), None)
                       if hit(text) else None)
        return out


def _stop_rows(stop, tokens, resp_mask, logps, mask, alive, row, P, t, new, pad):
    """StopStrings on the live decode rows after step t (new: steps since the last check): a row whose text now holds
    a stop string ends at the token completing it; what it sampled after that is padding (alive, in place)."""
    live = alive.nonzero().squeeze(1).tolist()
    if not live:
        return
    lo = max(0, t + 1 - new - stop.window)
    rows = row[live].tolist()
    for i, r, j in zip(live, rows, stop(tokens[rows, lo : t + 1].tolist(), new)):
        if j is not None:
            end = lo + j + 1  # the first column after the stop
            tokens[r, end : t + 1], resp_mask[r, end : t + 1], logps[r, end : t + 1] = pad, False, 0.0
            mask[i, P + end : P + t + 1], alive[i] = 0, False


# -----------------------------------------------------------------------------
# generation


def _sample_micro_batch(model, step, caches, idx, prompt_mask, seeds, out, sampling, eos_ids, pad, W, compiled,
                        compact, check_every, static, stop=None):
    """Samples one micro-batch's responses. idx, prompt_mask (n, P) left-padded, seeds (n,); out: the call's
    (tokens, response_mask, logprobs), each (n, N), written in place. Returns alive (n,): no EOS sampled.
    The decode batch holds `row.numel()` rows: the micro-batch's, then (compiled) finished filler rows up to a
    fixed size; dropping finished rows (compaction) indexes the cache, tok, pos, mask, alive, row and seeds."""
    (n, P), N = idx.shape, out[0].size(1)
    m, S = caches[0].rollout_key[:2]  # cache rows and slots
    device = idx.device
    b = _decode_rows(n, m, compiled, compact)
    if b > n:  # a fixed compiled size: filler rows (copies of row 0) that have finished before they start
        idx, prompt_mask, seeds = (torch.cat([x, x[:1].expand(b - n, *x.shape[1:])]) for x in (idx, prompt_mask, seeds))
    _use_rows(caches, b, static)
    row = torch.arange(b, device=device)  # (b,): each decode row's row in the micro-batch (>= n: filler)
    alive = row < n  # (b,): no EOS sampled yet
    tokens = torch.full((b, N), pad, dtype=torch.long, device=device)
    resp_mask = torch.zeros(b, N, dtype=torch.bool, device=device)
    logps = torch.zeros(b, N, dtype=torch.float32, device=device)
    mask = torch.zeros(b, S, dtype=torch.long, device=device)  # (b, S): cache slots holding real tokens
    mask[:, :P] = prompt_mask
    pos = (mask[:, :P].cumsum(-1) - 1).clamp(min=0)  # (b, P)
    logits = last_logits(model, prefill(model, idx, mask[:, :P], pos), W)  # (b, V) float32
    pos = pos[:, -1:] + 1  # (b, 1): position of the next token of every row
    slot = torch.tensor([P], dtype=torch.long, device=device)  # (1,): its cache slot, a tensor for fixed shapes
    temperature, top_k, top_p = sampling
    fused = compiled and device.type in COMPILED_RACE_DEVICES and temperature > 0 and not top_k and top_p == 1
    step_t = torch.zeros(1, dtype=torch.long, device=device)  # (1,): t, for compiled_race
    head = compiled_last_logits(device.type) if compiled and device.type == "cpu" else last_logits
    for t in range(N):
        if fused:
            tok, logp = compiled_race(device.type)(logits, temperature, seeds, step_t)  # (b,), (b,)
            step_t += 1
        else:
            tok, logp = sample(logits, *sampling, seeds=seeds, step=t)
        tok = torch.where(alive, tok, pad)
        tokens[row, t] = tok
        logps[row, t] = torch.where(alive, logp, 0.0)
        resp_mask[row, t] = alive
        mask[:, P + t] = alive  # a token sampled after EOS is padding: no later query sees it
        if eos_ids.numel():
            alive &= ~(tok[:, None] == eos_ids).any(-1)
        if stop is not None and (t == N - 1 or (t + 1) % check_every == 0):  # at each check, and the last step
            _stop_rows(stop, tokens, resp_mask, logps, mask, alive, row, P, t, t % check_every + 1, pad)
        if t == N - 1:
            break
        if (t + 1) % check_every == 0:
            n_alive = int(alive.sum())  # the host waits for the device here, once per check
            if n_alive == 0:
                break
            k = _compacted_rows(n_alive, row.numel(), m, compiled) if compact else row.numel()
            if k < row.numel():  # drop finished rows: the live ones in order, then finished ones up to k
                keep = torch.argsort((~alive).int(), stable=True)[:k].sort().values  # (k,) ascending
                _compact_cache(caches, keep, static)
                tok, pos, mask, alive, row, seeds = (x[keep] for x in (tok, pos, mask, alive, row, seeds))
        if compiled and device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's hidden states are consumed
        width = S if compiled else P + t + 1  # eager: attend to the filled slots only
        logits = head(model, step(model, tok[:, None], mask[:, :width], pos, slot), W)  # (k, V)
        pos += 1
        slot += 1
    for o, x in zip(out, (tokens, resp_mask, logps)):
        o.copy_(x[:n])
    done = torch.ones(b, dtype=torch.bool, device=device)
    done[row] = ~alive
    return ~done[:n]


@torch.no_grad()
def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
             pad_token_id=None, generator=None, compile=None, seeds=None, micro_batch_size=None, max_prompt_len=None,
             compact=True, progress=None, stop=None):
    """Samples up to max_new_tokens tokens after each prompt (a list of token id lists).
    temperature 0 = greedy; top_k 0 and top_p 1 = off. eos_token_id: None (never stop early), an int or
    a list of ints. pad_token_id: defaults to the first EOS id, else 0. seeds: one non-negative int per
    prompt (a list or a (B,) integer tensor) that keys its sampling noise; None draws them from generator,
    a torch.Generator on the model's device type (None: the default one). compile: compile the decode
    step (default: on for CUDA, off elsewhere);
    a compiled decode keeps its KV cache on the model between calls (model.clear_kv_cache() frees it); on a
    CPU it pays at one row (module docstring).
    micro_batch_size: rows generated at once (None: all); the one KV cache has that many rows (eager: at
    most len(prompts)). max_prompt_len: fixes the cache width at max_prompt_len + max_new_tokens (rounded up
    to CACHE_MULTIPLE) whatever this call's prompts, so that calls share the cache and the compiled step; a
    longer prompt is a ValueError. None: the widest prompt of this call. compact: drop finished rows from
    the decode batch (module docstring); the results are the same either way, up to float rounding.
    progress: wraps the loop over micro-batches (runtime.progress: a progress bar); None: the plain loop.
    stop: a StopStrings, which ends a row at a stop string as at an EOS; None: none.
    Runs under no_grad, not inference_mode, so the returned tensors can be used in training."""
    eos, pad, device = _check_args(model, max_new_tokens, temperature, top_k, top_p, eos_token_id, pad_token_id,
                                   generator)
    cuda = device.type == "cuda"
    compile = cuda if compile is None else compile
    idx, prompt_mask = pad_prompts(prompts, pad, model.config.vocab_size, device)  # (B, P) over all prompts
    B, P = idx.shape
    m = _check_sizes(B, P, micro_batch_size, max_prompt_len, prompt_mask)
    seeds = _row_seeds(seeds, B, generator, device)  # (B,)
    W = head_weight(model)  # (V, H), float32 on a CPU: converted once, not at every token
    S = need = (P if max_prompt_len is None else max_prompt_len) + max_new_tokens
    if compile or max_prompt_len is not None:
        S = math.ceil(S / CACHE_MULTIPLE) * CACHE_MULTIPLE
    w = model.config.sliding_window
    if w is not None and need <= w < S:  # a cache as wide as the window, not past it: full attention (model.py)
        S = w
    static = compile and cuda
    # one cache for all micro-batches; compiled: micro_batch_size rows even for fewer prompts (one shape)
    caches = _kv_cache(model, m if compile else min(m, B), S, model.lm_head_weight.dtype, device, static)
    step = compiled_decode_one(device.type) if compile else decode_one
    eos_ids = torch.tensor(eos, dtype=torch.long, device=device)
    lengths = prompt_mask.sum(-1).tolist()  # (B,) real prompt tokens

    out = (torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device),  # tokens
           torch.zeros(B, max_new_tokens, dtype=torch.bool, device=device),  # response_mask
           torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device))  # logprobs
    alive = torch.zeros(B, dtype=torch.bool, device=device)  # (B,): never sampled an EOS
    try:
        with decode_products(device, compiled=compile):  # a CPU's products on F.linear or oneDNN (model.py)
            for lo in (progress or iter)(range(0, B, m)):
                hi = min(lo + m, B)
                Pm = max(lengths[lo:hi])  # this micro-batch's prompt width: its prefill skips the others' padding
                alive[lo:hi] = _sample_micro_batch(
                    model, step, caches, idx[lo:hi, P - Pm:], prompt_mask[lo:hi, P - Pm:], seeds[lo:hi],
                    [o[lo:hi] for o in out], (temperature, top_k, top_p), eos_ids, pad, W, compile, compact,
                    CUDA_CHECK_EVERY if cuda else 1, static, stop)
    finally:
        if compile:
            _use_rows(caches, m, static)  # the whole buffers again, for the next call
        else:
            model.clear_kv_cache()
    return _rollout(idx, prompt_mask, *out, ~alive if eos or stop else torch.zeros_like(alive), seeds)


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

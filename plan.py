"""
The memory plan of a PPO run, per GPU, before launch: `python ppo.py --dry_run=N ...` prints it for N GPUs of
--gpu_memory_gb GiB each, and exits (with status 1 when it does not fit).

It reads only the actor's and the reward model's config.json (a local folder; a Hub id, of which config.json
alone is downloaded; a .gguf file's metadata), never weights, and needs no GPU. Shapes come from
model.ModelConfig; bytes follow ppo.py's design on CUDA, per rank of W ranks, compute dtype bf16 (or --dtype):

    actor, critic    FSDP2, one unit per block plus the root (embeddings, final norm, head); fp32 master weights
                     sharded on dim 0, which FSDP2 pads to a multiple of W (a rank holds ceil(rows / W) rows of
                     every parameter); AdamW's exp_avg and exp_avg_sq alike; fp32 sharded grads in training only.
                     LoRA (--lora_rank): the base frozen in the compute dtype, no grads; the adapters (A (r, in),
                     B (out, r) per target projection) and a critic's head are what is fp32 and trained.
                     --offload_optimizer: all of it in pinned CPU memory (0 on the GPU; each unit's shard is copied
                     in and cast for its all-gather; the report adds the bytes that cross per step, and the host
                     memory of a node of min(8, W) ranks)
    reference,       FSDP2 in the compute dtype, no grads, resharded after each forward; with --offload_frozen
    reward model     their shards live on the CPU (0 bytes on the GPU at rest). LoRA: the actor with its adapters
                     off, and the critic with its adapters off where the critic starts from the reward model
    generation copy  the whole actor in the compute dtype on every rank
    KV cache         rollout_micro x S x layers x (k, v) x kv heads x head_dim, S = max_prompt_len +
                     max_new_tokens rounded up to 64; kept between rollouts (CUDA graphs hold its addresses)
    decode graphs    the memory pool of the compiled decode step's CUDA graphs, kept between rollouts
                     (decode_graph_bytes)

A phase's peak is that persistent state plus what is live at the phase's worst moment:
    rollout    the weight sync to the generation copy (weight_sync: one full parameter at a time; LoRA: a target's
               merge, lora.merge's float32 temporaries), or the prefill of one rollout micro-batch (no grad, one
               layer at a time), or its float32 sampling tensors
    scoring    one inference micro-batch forward (no grad) of the actor (after the reference's, whose LM head
               and hidden states the fused KL kernel reads), of the critic, or of the reward model
    training   fp32 sharded grads, the saved activations of actor and critic (both losses go through one
               backward, the critic's first), a block recomputed with its gradients, the fused head's
               backward, FSDP's gathered units; at the end of the backward the roots' gradients and their
               reduce-scatter
    --async_rollout: the next batch generates on its own stream during scoring and training, so the larger of
               its prefill and its sampling tensors is live beside both phases (the weight sync stays in the
               rollout phase, where nothing generates)
Every prompt counts max_prompt_len tokens and every response max_new_tokens (the worst micro-batch).
FSDP2 does not reshard a root after its forward (the backward needs it at once), so the actor's and the
critic's roots count as gathered from their first scoring forward until a training backward ends, and the
reference's and the reward model's through the scoring phase (ppo.py reshards them at its end and after training).

Counted: what the CUDA caching allocator hands out (cuBLAS's workspaces too), so a phase's peak compares with
torch.cuda.max_memory_allocated() over that phase. In the reserve instead: the CUDA context, NCCL's buffers
(RESERVE_GIB), and what the allocator holds without handing out (FRAGMENTATION of the peak).
The run fits when peak x (1 + FRAGMENTATION) + RESERVE_GIB <= --gpu_memory_gb.
Not counted, each under 0.1 GiB at the sizes of the README or live only while nothing larger is: the rollout's
tensors (tokens, masks, per-token values), rope tables, attention block masks (built from a dense boolean grid
before the first block), the fused kernels' per-row statistics, AdamW's step counters, the optional ptx (SFT)
micro-batch (the actor alone, smaller than a PPO micro-batch), flex attention's padding of a length to a multiple
of 128. Saved activations are counted tensor by tensor from model.py (block_saved_bytes); the no-grad working sets
and the gradients in flight are estimates of the largest set of tensors live at once in eager execution.

    python ppo.py --dry_run=8 --model=meta-llama/Llama-3.1-8B-Instruct --reward_model=path/to/rm \
        --rollout_batch_size=512 --max_prompt_len=1024 --max_new_tokens=1024 --mini_batch_size=64
"""
import contextlib
import dataclasses
import math
import os
import traceback

import torch

from data import check_reward_head
from gae import uses_reference
from kernels.utils import DEFAULT_CONFIG, cdiv, vocab_chunk, vocab_splits
from hf import read_config
from model import ModelConfig
from runtime import UsageError, need
from rollout import CACHE_MULTIPLE

GiB, DTYPES = 2**30, {2: "bf16", 4: "fp32"}  # DTYPES: the names of the compute dtypes by element size
# Outside the caching allocator, so missing from max_memory_allocated: what the driver keeps of the card (an
# "80 GB" H100 shows CUDA 79.2 GiB), the CUDA context and loaded kernels (~0.5-1 GiB), NCCL's buffers (~0.5 GiB).
RESERVE_GIB = 3.0
CUBLAS_WORKSPACE = 32 * 2**20  # torch's on Hopper, from the caching allocator: one per GEMM-running thread, kept
# Freed blocks of one size that a request of another cannot use (micro-batches are cropped to their rows' real
# lengths, so shapes vary from step to step); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lowers it.
FRAGMENTATION = 0.10
GPU_SMS = 132  # H100 SXM; the Triton forwards split the vocabulary by it (kernels.utils.vocab_splits)
# rollout.sample on (rows, V), per row and vocabulary entry: float32 logits, tempered logits, log-softmax and
# softmax (16 bytes), and while the noise is hashed its int64 bits, their int64 temporaries and its float32 forms
SAMPLING_BYTES = 41


# -----------------------------------------------------------------------------
# parameters


def param_shapes(c, head="lm", value_bias=True, lora=None, reward_head=False):
    """-> (root, block): {name: shape} of the root's parameters and of one block's (names inside
    model.layers.i), as model.Transformer(c, head, value_bias) has them; lora (a lora.LoRAConfig): with the
    adapters lora.add_adapters gives each target projection W (out, in): lora_A (r, in) and lora_B (out, r);
    reward_head: with the frozen (1, H) score layer a critic that is also the reward model keeps."""
    H, I = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    block = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        block[f"self_attn.{name}.weight"] = (rows, H)
        if c.qkv_bias or c.attention_bias:
            block[f"self_attn.{name}.bias"] = (rows,)
    block["self_attn.o_proj.weight"] = (H, q)
    if c.attention_bias:
        block["self_attn.o_proj.bias"] = (H,)
    if c.qk_norm:
        block["self_attn.q_norm.weight"] = block["self_attn.k_norm.weight"] = (c.head_dim,)
    for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        block[f"mlp.{name}.weight"] = shape
        if c.mlp_bias:
            block[f"mlp.{name}.bias"] = shape[:1]
    root = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
    if head == "value":
        root["score.weight"] = (1, H)
        if value_bias:
            root["score.bias"] = (1,)
    elif not c.tie_word_embeddings:
        root["lm_head.weight"] = (c.vocab_size, H)
    if reward_head:
        root["reward_head.weight"] = (1, H)
    for name, (rows, cols) in [(k, s) for k, s in block.items() if lora and k.split(".")[1] in lora.targets
                               and k.endswith("weight")]:
        base = name.removesuffix(".weight")
        block[f"{base}.lora_A.weight"], block[f"{base}.lora_B.weight"] = (lora.rank, cols), (rows, lora.rank)
    return root, block


def numel(shapes):
    return sum(math.prod(s) for s in shapes.values())


def shard_numel(shapes, W):
    """Elements one rank stores: FSDP2 cuts dim 0 into W chunks of ceil(rows / W) rows and pads every rank's
    chunk to that size (the last ranks' chunks may be partly or wholly padding)."""
    return sum(cdiv(s[0], W) * math.prod(s[1:]) for s in shapes.values())


class Model:
    """One model's shapes: its ModelConfig, root and block parameters, and where they were read. Under LoRA
    (lora: a lora.LoRAConfig) the adapters and a value head train, the rest is the frozen base."""

    def __init__(self, c, head="lm", value_bias=True, source="", lora=None, reward_head=False):
        self.c, self.head, self.source, self.L, self.lora = c, head, source, c.num_hidden_layers, lora
        self.root, self.block = param_shapes(c, head, value_bias, lora, reward_head)

    def trains(self, name):  # lora.add_adapters: the adapters and a critic's head (not the frozen reward_head)
        return not self.lora or ".lora_" in name or name.startswith("score.")

    def part(self, shapes, which):
        """which: None (every parameter), "trained" or "frozen"."""
        return {k: s for k, s in shapes.items() if which is None or self.trains(k) == (which == "trained")}

    def numel(self, which=None):
        return numel(self.part(self.root, which)) + self.L * numel(self.part(self.block, which))

    def base_numel(self):
        """Elements of the model without its adapters (and reward_head): the generation copy's."""
        keep = lambda d: {k: v for k, v in d.items() if ".lora_" not in k and not k.startswith("reward_head")}
        return numel(keep(self.root)) + self.L * numel(keep(self.block))

    def shard(self, W, which=None):
        """Elements one rank stores of the whole model (or of its trained or frozen part)."""
        return shard_numel(self.part(self.root, which), W) + self.L * shard_numel(self.part(self.block, which), W)

    def stored(self, shapes, W, cb):
        """Bytes one rank stores of `shapes`: trained parameters in float32, a LoRA base in the compute dtype."""
        return 4 * shard_numel(self.part(shapes, "trained"), W) + cb * shard_numel(self.part(shapes, "frozen"), W)

    def gathered(self, shapes, W):
        """Elements of a unit once gathered: W padded chunks."""
        return W * shard_numel(shapes, W)


def read_model(name_or_path, flag="--model"):
    """-> (ModelConfig, whether it is a *ForSequenceClassification), from config.json or GGUF metadata alone. A
    config this code cannot plan is a UsageError that names the flag and the model, as the run's own checks do."""
    try:
        hf = read_config(name_or_path)
        arch = (getattr(hf, "architectures", None) or ["?ForCausalLM"])[0]
        is_cls = arch.endswith("ForSequenceClassification")
        need(not is_cls or getattr(hf, "num_labels", 1) == 1, f"reward model must have one label, has "
             f"{getattr(hf, 'num_labels', 1)}")
        return ModelConfig.from_hf(hf), is_cls
    except UsageError as e:
        if str(e).startswith("--"):  # named already
            raise
        raise UsageError(f"{flag}: {name_or_path}: {e}" if name_or_path not in str(e) else f"{flag}: {e}") from None


# -----------------------------------------------------------------------------
# activations and working sets, in bytes per token (cb: bytes of the compute dtype)


def _dims(c):
    return (c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim, c.num_attention_heads, c.num_key_value_heads)


def block_saved_bytes(c, cb=2, padding_free=True, lora=None, mask_bytes=1):
    """What one model.Block forward saves for its backward, per token, each tensor once, parameters excluded
    (they are FSDP's); q = heads x head_dim, kv = kv heads x head_dim:
      each RMSNorm   its float32 input (pow and mul save it), rsqrt (one float), the normed value in the
                     compute dtype (the weight's mul saves it), its output (the next projections save it)
                                                                              2 x (4H + 4 + 2 cb H)
      q/k_norm       (Qwen3) the same over q and k, rsqrt per head            (4 + cb)(q + kv) + 4 (nh + nkv)
      rope           nothing: x cos and x sin save only cos and sin, shared by every block
      attention      the fused kernel's q, k, v, output and float32 logsumexp per head; o_proj saves
                     the same output (its layout follows q's (B, T, heads, head_dim), so the
                     reshape to (B, T, heads x head_dim) is a view)           cb (2q + 2kv) + 4 nh
                     padding-free (model.RealTokens, the default): o_proj saves the output gathered
                     back to the real tokens, a copy (counted at no padding, the widest case)   + cb q
      MLP            gate's output (silu saves it), silu's and up's outputs (their product saves both),
                     the product (down_proj saves it)                         4 cb I
    The residual stream itself is saved by none of them (the tests count this with saved-tensor hooks).
    Under LoRA (lora: a lora.LoRAConfig) the norms' weights and the base projections are frozen, and autograd
    saves only what a gradient it computes reads: the input gradients still need every activation above
    except what only a weight's gradient reads. So per token
      each RMSNorm   no normed value (only the frozen weight's gradient would read it), and its output only
                     where an adapter's A saves it (q/k/v, or gate/up, targets)      4H + 4 (+ cb H)
      q/k_norm       no normed values                                         4 (q + kv) + 4 (nh + nkv)
      o_proj         the real-tokens copy only if o_proj has an adapter       (+ cb q)
      MLP            the product only if down_proj has one                    3 cb I (+ cb I)
      each target    its adapter's (tokens, r) intermediate x A^T (B's input)   + cb r
      --lora_dropout each target's dropped input (A's input), its mask (mask_bytes: bool on CUDA), none of the
                     shared inputs above (norm outputs, o_proj's copy, the product)      + (cb + mask_bytes) in
    (the first block saves a little less: its input, the frozen embedding's output, needs no gradient)."""
    H, I, q, kv, nh, nkv = _dims(c)
    if lora is None:
        norms = 2 * (4 * H + 4 + 2 * cb * H)
        qk = (4 + cb) * (q + kv) + 4 * (nh + nkv) if c.qk_norm else 0
        return norms + qk + cb * (2 * q + 2 * kv) + 4 * nh + 4 * cb * I + (cb * q if padding_free else 0)
    t, keep = set(lora.targets), lora.dropout == 0  # (dropout: A saves its own dropped input, not the shared one)
    norms = 2 * (4 * H + 4) + keep * cb * H * (bool(t & {"q_proj", "k_proj", "v_proj"}) + bool(t & {"gate_proj",
                                                                                                  "up_proj"}))
    qk = 4 * (q + kv) + 4 * (nh + nkv) if c.qk_norm else 0
    o_in = cb * q if padding_free and "o_proj" in t and keep else 0
    mlp = cb * I * (3 + ("down_proj" in t and keep))
    dropped = 0 if keep else (cb + mask_bytes) * sum(dict(o_proj=q, down_proj=I).get(k, H) for k in t)
    return norms + qk + cb * (2 * q + 2 * kv) + 4 * nh + o_in + mlp + cb * lora.rank * len(t) + dropped


def block_grad_bytes(c, cb=2):
    """Gradients live at once in one block's backward (an estimate): the residual's gradient in and out, and
    three of the MLP's (B, T, I) gradients (the product's, then silu's and up's beside it)."""
    H, I, q, kv, _, _ = _dims(c)
    return cb * (2 * H + 3 * max(I, q + kv))


def block_forward_bytes(c, cb=2):
    """Live at once in one block's no-grad forward (eager, padding-free), per token: the block's input (its caller
    holds it) and the largest of (a test counts each moment's allocations)
      q's rope         the normed input, k and v, q, x cos, the rotated half, its product with sin; k's rope
                       instead: q and q roped beside k, v and k's three (larger where 3 kv > 2 q)
      q_norm (Qwen3)   the normed input, q, k, v, over q a float32 copy, its square or normed value, rsqrt
      attention out    the normed input, q, k, v scattered to rows, the output, its gather to the real tokens, o_proj's
      MLP              x + attention, its norm, silu(gate), up and their product (or where H > 2 I, once down_proj
                       has run, its output beside the product)
      2nd RMSNorm      x + attention, a float32 copy, its square or normed value, rsqrt (the 1st, final: less)"""
    H, I, q, kv, nh, _ = _dims(c)
    rope, qk = cb * (2 * H + 2 * kv + 2 * q + max(2 * q, 3 * kv)), cb * (2 * H + q + 2 * kv) + 8 * q + 4 * nh
    attention, mlp = cb * (3 * H + 3 * q + 2 * kv), cb * (3 * H + max(3 * I, H + I))
    return max(rope, c.qk_norm * qk, attention, mlp, 8 * H + 2 * cb * H + 4)


def kv_cache_bytes(c, rows, S, cb=2):
    """model.Transformer.setup_kv_cache(rows, S): a k and a v buffer (rows, kv heads, S, head_dim) per layer."""
    return c.num_hidden_layers * 2 * rows * c.num_key_value_heads * S * c.head_dim * cb


def decode_graph_bytes(c, rows, S, cb=2):
    """The memory pool of the compiled decode step's CUDA graphs (rollout.compiled_decode_one: torch.compile
    mode="reduce-overhead", i.e. inductor's cudagraph trees), in bytes, for a cache of `rows` rows and S slots.
    One graph is recorded per decode batch size (rows, rows/2, ... : rollout.ROW_BUCKETS), all of them into
    one private pool per GPU (cudagraph_trees.CUDAGraphTreeManager), and the allocator keeps that pool for
    as long as the graphs may replay, i.e. until the process ends: through scoring and training too. Freeing
    it after each rollout (cudagraph_trees.reset_cudagraph_trees) would have every rollout warm up and record
    every graph again, to give back this line's few MiB. Every decode step starts a new generation
    (cudagraph_mark_step_begin), so no graph's outputs are live while another runs and the pool holds what
    the largest graph, `rows` rows, needs at its worst moment. Per row:
      inputs          the graph's own copies of what is not a static address: the token and its position
                      (int64) and the mask over the S cache slots (int64)           8 (2 + S)  (+ 8: the slot)
      attention mask  may-attend over the S slots, as booleans and in the compute dtype    S (1 + cb)
      rope            positions x inv_freq and their concatenation (float32), cos and sin
                                                                                   4 (hs/2 + hs) + 2 cb hs
      one block       its no-grad working set at one token (block_forward_bytes); the hidden state out
                      replaces it at the end
    The weights and the KV cache are static inputs (parameters, addresses marked static): no copies.
    An estimate from the eager step's allocations (a test counts them): the graph is inductor's code, which
    fuses elementwise ops and reuses buffers. The pool is cut from whole allocator segments (2 MiB for
    blocks under 1 MiB), which the fragmentation allowance covers."""
    hs = c.head_dim
    per_row = 8 * (2 + S) + S * (1 + cb) + 4 * (hs // 2 + hs) + 2 * cb * hs + block_forward_bytes(c, cb)
    return rows * per_row + 8 + 4 * (hs // 2)  # the slot (int64), inv_freq (float32)


def head_bytes(N, H, V, cb=2, kl=False):
    """The fused LM-head ops (kernels/, Triton path) on N response tokens -> (saved, forward scratch, backward
    scratch) in bytes. Saved: the hidden states (N, H) and per row the label (int64), max, log-sum and entropy
    (the caller's x[mask] saves its boolean (B, T) mask besides). Forward: the vocab-split statistics (4, splits,
    N) float32. Backward, at its largest moment: dz (N, vocab chunk) in the compute dtype, dh in float32 (the GEMM
    adds into it: utils.addmm_f32), a (chunk, H) operand (the chunk's dW product; before it W - c, for a head with a
    shared column: utils.shared_row); dW (V, H) is the LM head's gradient and counted as the root's. kl: the one
    pass over both heads (linear_logprob_entropy_kl: scoring, training with the KL loss), which also saves the
    reference's hidden states, its max and log-sum and the KL, keeps 8 planes of statistics, and has the same
    backward (one dz for all three losses; a frozen head, with LoRA, has no dW and the same scratch)."""
    if N == 0:
        return 0, 0, 0
    splits = vocab_splits(DEFAULT_CONFIG, torch.device("cuda"), N, V, sms=GPU_SMS)[0]
    saved = N * (cb * H + 20) + (N * (cb * H + 12) if kl else 0)  # the KL's reference hidden states and stats
    fwd = (8 if kl else 4) * splits * N * 4
    vc = vocab_chunk(DEFAULT_CONFIG, N, V, DEFAULT_CONFIG.gpu_chunk_elems, DEFAULT_CONFIG.block_v)
    return saved, fwd, N * vc * cb + N * H * 4 + vc * H * cb


def weight_sync(actor, W, cb, off):
    """The weight sync's largest moment, (label, bytes): model.copy_weights_from copies lora.full_parameters' full
    tensors into the generation copy one at a time (copy_ casts in place). Each is gathered in its stored dtype
    (fp32; a LoRA base in the compute dtype) by DTensor.full_tensor: on one rank the shard itself, no copy; else
    the all-gather's output (W chunks of ceil(rows / W) rows) and, where W does not divide the rows, the shard
    padded to a chunk. --offload_optimizer: the shard is first copied to the GPU as long as it is (a worst rank's: a
    chunk, or a partial one, rows mod chunk, beside its padded chunk). A LoRA target then merges beside its gathered
    weight, A and B (fp32), three float32 (out, in) at once (W.float() and B @ A, scale x it, W.float() + that)."""
    b, copied = (cb if actor.lora else 4), " + its shard copied from the CPU" if off else ""
    full = lambda s, b: b * (W * cdiv(s[0], W) if W > 1 else off * s[0]) * math.prod(s[1:])  # W padded chunks
    extra = lambda s, c: c * (off or s[0] % W > 0) + off * (s[0] % c) if W > 1 else 0  # rows, beside: pad, copy
    gather = lambda s: full(s, b) + b * extra(s, cdiv(s[0], W)) * math.prod(s[1:])
    shapes, dtype = {k: s for k, s in {**actor.root, **actor.block}.items() if ".lora_" not in k}, DTYPES[b]
    s = max(shapes.values(), key=gather)
    how = (f"gathered in {dtype} (all-gather output{' + padded chunk' if s[0] % W else ''}{copied})" if W > 1 else
           f"in {dtype}: on one rank its shard" + (", copied from the CPU" if off else ", read in place"))
    lines = [(f"the largest actor parameter {how}", gather(s))]
    for out, cols in [s for k, s in shapes.items() if k.removesuffix("weight") + "lora_A.weight" in actor.block]:
        lines.append((f"merging the largest target ({out} x {cols}): its {dtype} weight, A, B + 3 fp32 copies", full(
            (out, cols), b) + full((actor.lora.rank, cols), 4) + full((out, actor.lora.rank), 4) + 12 * out * cols))
    return max(lines, key=lambda t: t[1])


# -----------------------------------------------------------------------------
# the plan


class Plan:
    """Lines of (label, bytes): the persistent state, and per phase the terms live throughout it and its
    moments, of which the largest is the phase's peak."""

    def __init__(self):
        self.persistent, self.phases = [], []  # phases: (title, always, [(moment, terms)])

    def peak(self, phase):
        _, always, moments = phase
        return (sum(b for _, b in self.persistent) + sum(b for _, b in always)
                + max(sum(b for _, b in terms) for _, terms in moments))


def build(cfg, run):
    """-> (Plan, facts: a dict of the sizes the text quotes) for a ppo.Config and its derived sizes on run.world
    GPUs (ppo.derive with a CUDA device: the run's checks and per-rank sizes, as on a GPU)."""
    W, lora, off = run.world, run.lora, run.offload_optimizer
    cb = torch.tensor([], dtype=run.dtype).element_size()
    (c, policy_is_cls), T = read_model(cfg.model), cfg.max_prompt_len + cfg.max_new_tokens
    need(not policy_is_cls, f"--model: {cfg.model} is a sequence classifier: the policy needs an LM head")
    need(T <= c.max_position_embeddings, f"--max_prompt_len + --max_new_tokens = {T} does not fit the context of "
         f"{cfg.model} ({c.max_position_embeddings} positions)")
    # LoRA: the reference is the actor with its adapters off (checkpoint.build_models), no model of its own; a run
    # without a KL penalty or loss has none at all (gae.uses_reference)
    kl_ref = uses_reference(cfg)
    actor = Model(c, "lm", source=cfg.model, lora=lora)
    ref = Model(c, "lm", source=cfg.model) if kl_ref and not lora else None
    if cfg.reward_model:
        rc, rm_is_cls = read_model(cfg.reward_model, "--reward_model")  # load_inputs' checks of the two configs
        need(rc.vocab_size >= c.vocab_size, f"--reward_model: {cfg.reward_model} has {rc.vocab_size} token embeddings, "
             f"fewer than the {c.vocab_size} of the policy {cfg.model}, which may sample any of them")
        need(T <= rc.max_position_embeddings, f"--max_prompt_len + --max_new_tokens = {T} does not fit the context of "
             f"--reward_model {cfg.reward_model} ({rc.max_position_embeddings} positions)")
        rm = Model(rc, "value", value_bias=not rm_is_cls, source=cfg.reward_model)
    else:
        rm, rc = None, c
    # LoRA with a critic from the reward model: the reward model is the critic with its adapters off, read by
    # the critic's frozen reward_head; no reward model of its own
    shared = bool(lora and run.critic and rm)
    # the critic, when the advantage estimator has one: from the reward model, or the policy with a fresh head
    critic = Model(rc, "value", value_bias=True, source=cfg.reward_model or cfg.model, lora=lora,
                   reward_head=shared) if run.critic else None
    trained = [m for m in (actor, critic) if m is not None]
    names = "actor and critic" if critic else "actor"
    for m in filter(None, (actor, critic, rm)):
        need(m.c.sliding_window is None or T <= m.c.sliding_window, f"{m.source}: {T} tokens exceed its sliding "
             f"window ({m.c.sliding_window})")

    S = cdiv(T, CACHE_MULTIPLE) * CACHE_MULTIPLE
    rows_r, rows_i, rows_t = run.rollout_micro, run.infer_micro, run.local_micro
    R, V, H = cfg.max_new_tokens, c.vocab_size, c.hidden_size
    frozen_cb = 0 if run.offload_frozen else cb
    dtype = DTYPES[cb]
    # --offload_optimizer: a trained model's every shard (a LoRA base too), grad and AdamW state is on the CPU
    on_gpu, cpu = (0, " (on the CPU)") if off else (1, "")
    p = Plan()
    for name, m in (("actor", actor), ("critic", critic)):
        if m is None:
            continue
        if not lora:
            p.persistent += [(f"{name} weights, fp32 shard{cpu}", on_gpu * 4 * m.shard(W)),
                             (f"{name} AdamW exp_avg + exp_avg_sq, fp32 shard{cpu}", on_gpu * 8 * m.shard(W))]
            continue
        what = "adapters" + (" + value head" if m.head == "value" else "")
        p.persistent += [(f"{name} frozen base, {dtype} shard{cpu}", on_gpu * cb * m.shard(W, "frozen")),
                         (f"{name} {what}, fp32 shard{cpu}", on_gpu * 4 * m.shard(W, "trained")),
                         (f"{name} {what} AdamW exp_avg + exp_avg_sq, fp32 shard{cpu}",
                          on_gpu * 8 * m.shard(W, "trained"))]
    if ref is not None:
        where = " (on the CPU: --offload_frozen)" if run.offload_frozen else ""
        p.persistent.append((f"reference weights, {dtype} shard{where}", frozen_cb * ref.shard(W)))
    if rm is not None and not shared:
        p.persistent.append((f"reward model weights, {dtype} shard" + (" (on the CPU)" if run.offload_frozen else ""),
                             frozen_cb * rm.shard(W)))
    p.persistent += [
        (f"generation copy: the whole actor in {dtype}" + (", adapters merged" if lora else ""),
         cb * actor.base_numel()),
        (f"KV cache: {rows_r} rows x {S} slots x {c.num_hidden_layers} layers x (k, v) x {c.num_key_value_heads} "
         f"kv heads x {c.head_dim}", kv_cache_bytes(c, rows_r, S, cb)),
        (f"decode step's CUDA graphs: one pool, the {rows_r}-row graph's inputs and working set",
         decode_graph_bytes(c, rows_r, S, cb)),
        ("cuBLAS workspaces: this thread's, autograd's backward's" + (", the async generation's" if
         cfg.async_rollout else ""), (3 if cfg.async_rollout else 2) * CUBLAS_WORKSPACE)]

    # ---- rollout: the weight sync, then per micro-batch a prefill and float32 sampling; decoding holds less
    P = cfg.max_prompt_len
    per_prompt = f" x {cfg.samples_per_prompt} samples" if cfg.samples_per_prompt > 1 else ""
    prefill = (f"prefill of {rows_r} x {P} tokens, one layer at a time, no grad",
               rows_r * P * block_forward_bytes(c, cb))
    sampling = (f"sampling: float32 logits, softmax and hashed noise, {rows_r} x {V}", SAMPLING_BYTES * rows_r * V)
    sync = [weight_sync(actor, W, cb, off)]
    p.phases.append((f"rollout: {run.local_rollout} prompts{per_prompt} per GPU, {rows_r} at a time", [], [
        ("weight sync" + (", LoRA merged" if lora else ""), sync),
        ("prefill", [prefill]),
        ("sampling", [sampling]),
    ]))
    label, b = max(prefill, sampling, key=lambda t: t[1])
    beside = [(f"--async_rollout, the next batch beside it: {label}", b)] if cfg.async_rollout else []

    # ---- scoring: per inference micro-batch, reference, actor (fused logprob + KL), critic, reward model
    gathered_root = lambda m: cb * m.gathered(m.root, W)
    units_fwd = lambda m: 2 * cb * m.gathered(m.block, W)  # the unit being computed and the next one, prefetched

    def h2d(m):  # --offload_optimizer, 2 units: a shard copied to the GPU as stored, and cast to the compute dtype
        return 2 * (m.stored(m.block, W, cb) + cb * shard_numel(m.part(m.block, "trained"), W)) if off else 0

    def fetched(who, m):  # the offloaded units' copies, as a line where there are any
        return [(f"{who} blocks' shards copied from the CPU and cast (--offload_optimizer)", h2d(m))] if off else []

    N_i, N_t = rows_i * R, rows_t * R
    frozen = [(f"{who} root, gathered from its first forward until the phase ends", gathered_root(m))
              for who, m in (("reference", ref), ("reward model", None if shared else rm)) if m is not None]
    _, fwd_i, _ = head_bytes(N_i, H, V, cb, kl=kl_ref)
    work_i = rows_i * T
    ref_h = [(f"reference hidden states, {N_i} response tokens" + (" (the actor, adapters off)" if lora else ""),
              N_i * cb * H)] if kl_ref else []
    scoring = [
        ("actor forward", [
            *ref_h,
            ("actor blocks gathered: one computing, one prefetched", units_fwd(actor)), *fetched("actor", actor),
            (f"actor block working set, {rows_i} x {T} tokens", work_i * block_forward_bytes(c, cb)),
            ("fused logprob/entropy" + " + KL" * kl_ref + " forward scratch", fwd_i)])]
    if critic is not None:
        scoring.append(("critic forward", [
            ("critic blocks gathered", units_fwd(critic)), *fetched("critic", critic),
            (f"critic block working set, {rows_i} x {T} tokens", work_i * block_forward_bytes(critic.c, cb))]))
    if shared:  # its root is the critic's, gathered already
        scoring.append(("reward model forward: the critic, adapters off", [
            ("critic blocks gathered", units_fwd(critic)), *fetched("critic", critic),
            (f"critic block working set, {rows_i} x {T} tokens", work_i * block_forward_bytes(critic.c, cb))]))
    elif rm is not None:
        scoring.append(("reward model forward", [
            ("reward model blocks gathered", units_fwd(rm)),
            (f"reward model block working set, {rows_i} x {T} tokens", work_i * block_forward_bytes(rm.c, cb))]))
    p.phases.append((f"scoring: {run.local_rows} sequences per GPU, {rows_i} at a time, no grad",
                     [(f"{names} root{'s' if critic else ''}, gathered (FSDP2 keeps a root after its forward)",
                       sum(gathered_root(m) for m in trained))] + frozen + beside, scoring))

    # ---- training: one micro-batch's forward of actor and critic, then one backward for both losses
    kl = cfg.kl_loss_coef > 0
    saved_h, _, bwd_h = head_bytes(N_t, H, V, cb, kl=kl)
    tok = rows_t * T

    def saved(m):  # block inputs (checkpointing) or every block's activations, and the final norm's (LoRA: no normed)
        per_block = cb * m.c.hidden_size if run.activation_checkpointing else block_saved_bytes(m.c, cb, lora=lora)
        return tok * (m.L * per_block + 4 * m.c.hidden_size + 4 + (0 if lora else cb * m.c.hidden_size))

    def block_bwd(m):  # one block recomputed (checkpointing) and its gradients (the input's, frozen weights too)
        recompute = block_saved_bytes(m.c, cb, lora=lora) if run.activation_checkpointing else 0
        return tok * (recompute + block_grad_bytes(m.c, cb))

    def units_bwd(m):  # 2 blocks gathered, 1 block's grads in bf16 and its fp32 reduce-scatter input (LoRA: adapters')
        return 2 * cb * m.gathered(m.block, W) + (cb + 4) * m.gathered(m.part(m.block, "trained"), W)

    # the roots' gradients in the compute dtype, gathered: LoRA's frozen root has none but a critic's head
    root_grads = lambda m: cb * m.gathered(m.part(m.root, "trained"), W)
    actor_saved = saved(actor) + saved_h + tok  # + the head's (B, T) boolean mask of response tokens
    lm_grad = 0 if lora else cb * V * H  # the fused head's dW: the LM head's (or the tied embedding's) gradient
    dw, tied = [("LM head gradient dW", lm_grad)] if lm_grad else [], lm_grad if c.tie_word_embeddings else 0
    ac, what = "recomputed" if run.activation_checkpointing else "without checkpointing", "adapter " if lora else ""
    always = [(f"{names} {what}grads, fp32 shard{cpu}", on_gpu * 4 * sum(m.shard(W, "trained") for m in trained)),
              (f"{names} root{'s' if critic else ''}, gathered", sum(gathered_root(m) for m in trained))]
    if kl and ref is not None:  # LoRA: the actor's own LM head, in its gathered root
        always.append(("reference LM head, gathered for the KL loss", gathered_root(ref)))
    always += beside
    moments, held = [], []  # held: what the critic's backward (it runs first) leaves for the actor's
    if critic is not None:
        critic_saved = saved(critic) + tok * 4 * critic.c.hidden_size  # + the value head's float32 input
        held = [(f"critic root gradients ({'value head' if lora else 'embedding'})", root_grads(critic))]
        moments.append(("backward through the critic's blocks", [
            ("actor activations saved", actor_saved), ("critic activations saved", critic_saved),
            (f"a critic block {ac}, with its gradients", block_bwd(critic)),
            ("critic blocks in flight: 2 gathered, 1 block's grads + reduce-scatter", units_bwd(critic)),
            *fetched("critic", critic)]))
    moments += [
        ("backward through the actor's head", [
            ("actor activations saved", actor_saved), *held, *dw,
            (f"fused head backward scratch, {N_t} tokens" + (" (with the KL loss: one dz for the three)" if kl
                                                             else ""), bwd_h)]),
        ("backward through the actor's blocks", [
            ("actor activations saved", actor_saved), *held, *dw,
            (f"an actor block {ac}, with its gradients", block_bwd(actor)),
            ("actor blocks in flight: 2 gathered, 1 block's grads + reduce-scatter", units_bwd(actor)),
            *fetched("actor", actor)]),
        ("end of the backward", [
            (f"root gradients of {names}" + (" (+ the tied head's, added)" if tied else ""),
             sum(root_grads(m) for m in trained) + tied),
            ("the larger root's fp32 reduce-scatter input", 4 * max(m.gathered(m.part(m.root, "trained"), W)
                                                                   for m in trained))]),
    ]
    p.phases.append((f"training: micro-batch of {rows_t} x {T} tokens ({N_t} response tokens), activation "
                     f"checkpointing {'on' if run.activation_checkpointing else 'off'}", always, moments))
    facts = dict(W=W, cb=cb, T=T, S=S, actor=actor, critic=critic, rm=rm, ref=ref, shared=shared, run=run,
                 math_attention=rows_t * c.num_attention_heads * T * T * 4)
    if off:  # per step and rank, what crosses PCIe, and the pinned host memory that holds the offloaded state
        n_s, n_t = cdiv(run.local_rows, rows_i), cfg.ppo_epochs * cdiv(run.local_rows, rows_t)
        blocks = lambda m: m.L * m.stored(m.block, W, cb)  # every block's shard, as stored
        twice = 2 if lora and kl_ref else 1  # LoRA: the reference's forward gathers the actor's blocks, the reward
        # model's (shared) the critic's; a root is gathered once per phase or micro-batch and kept through it
        facts["h2d"] = (n_s * (twice * blocks(actor) + (2 if shared else 1) * (blocks(critic) if critic else 0))
                        + (1 + n_t) * sum(m.stored(m.root, W, cb) for m in trained)
                        + n_t * sum(2 * blocks(m) for m in trained) + (n_t * blocks(actor) if lora and kl else 0)
                        + blocks(actor) + actor.stored(actor.root, W, cb))  # the weight sync: the shards as stored
        facts["d2h"] = n_t * 4 * sum(m.shard(W, "trained") for m in trained)  # each backward's fp32 grad shards
        facts["n_s"], facts["n_t"] = n_s, n_t
        facts["pinned"] = sum(m.stored(m.root, W, cb) + blocks(m) + 12 * m.shard(W, "trained") for m in trained)
    return p, facts


def dry_run(cfg, run):
    """python ppo.py --dry_run=N: the reward model's score head checked, the plan printed; -> dict(fits=...)."""
    check_reward_head(cfg)
    text, fits = report(cfg, run)
    print(text)
    return dict(fits=fits)


def preflight(cfg, run, memory_bytes=None, local_ranks=None):
    """The line a run prints before any model loads: its plan's peak against the memory at hand, so that a run that
    cannot fit says so in its first seconds, not after loading. On CUDA memory_bytes is the GPU's (as torch.cuda
    reports it); on a CPU it is what this machine has available (available_host_bytes), shared by its local_ranks
    ranks (torchrun's LOCAL_WORLD_SIZE), where a run past it is killed by the kernel without a word. The plan is a
    worst case (every prompt and response at its limit): a run it does not fit may go on for a while on shorter
    ones, and runs out of memory at the first batch that comes near it."""
    cuda = run.device.type == "cuda"
    if memory_bytes is None:
        memory_bytes = torch.cuda.get_device_properties(run.device).total_memory if cuda else available_host_bytes()
    n = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if memory_bytes is None:
        return "memory plan: not computed (this machine's available memory is unknown); the run goes on"
    gb = gib_down(memory_bytes / (1 if cuda else n))
    try:
        text, fits = report(dataclasses.replace(cfg, gpu_memory_gb=gb), run)
    except Exception as e:  # noqa: BLE001 -- advice, not worth the run (load_inputs has checked what the user gave)
        return f"memory plan: not computed ({type(e).__name__}: {e}); the run goes on"
    peak = text.rsplit("\n", 1)[-1]  # "peak 61.3 GiB per GPU of 79.1: fits"
    flags = f"--dry_run={run.world} --gpu_memory_gb={gb:g}"
    if not cuda:  # on a CPU: per rank, of the memory available to this machine's ranks; the plan of this CPU's run
        peak = peak.replace(" per GPU of ", " per rank of ") + (f" ({n} ranks on this machine)" if n > 1 else "")
        flags += (f" --dtype={'bf16' if run.dtype == torch.bfloat16 else 'fp32'} "
                  f"--activation_checkpointing={'on' if run.activation_checkpointing else 'off'}")
    if fits:
        how = f"--dry_run={run.world}" if cuda else f"`python ppo.py {flags}` with this run's flags"
        return f"memory plan: {peak} (the worst case; {how} prints the plan)"
    return (f"warning: memory plan: {peak}, in the worst case (every prompt and response at its limit): the first "
            f"batch near it will run out of memory{'' if cuda else ' (the kernel kills the process)'}. `python "
            f"ppo.py {flags}` with this run's flags prints the plan and which flags shrink its largest lines")


def gib_down(n_bytes):
    """Bytes in GiB, rounded down to 0.1 (a GPU of 81559 MiB: 79.6), never up past what is there."""
    return math.floor(n_bytes / GiB * 10) / 10


def available_host_bytes(root="/"):
    """Memory this process may still take on this machine: /proc/meminfo's MemAvailable, or less under a container's
    cgroup limit (v2 memory.max, v1 memory.limit_in_bytes) less its usage but for its inactive file cache; None where
    none of them can be read (not Linux). root: where /proc and /sys are (a test's folder)."""
    found = []
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for folder, limit, usage, cache in (("sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
                                        ("sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                                         "total_inactive_file")):
        folder = os.path.join(root, folder)
        try:
            with open(os.path.join(folder, limit)) as f, open(os.path.join(folder, usage)) as g:
                cap, used = f.read().strip(), int(g.read())
            if cap != "max":
                with open(os.path.join(folder, "memory.stat")) as f:
                    stat = dict(line.split() for line in f if line.strip())
                found.append(int(cap) - used + int(stat.get(cache, 0)))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


# What main() was calling when a CUDA allocation failed, the plan's phase for it, and the flags that shrink that phase
# which a resumed run may change (checkpoint.MAY_CHANGE_ON_RESUME): the advice an out-of-memory error gets
CALLEES = {"build_models": ("loading", None), "add_optimizers": ("loading", None), "resume": ("loading", None),
           "take": ("rollout", 0), "score_batch": ("scoring", 1), "update": ("training", 2),
           "evaluate": ("evaluation", None), "save_step": ("checkpoint", None), "export": ("export", None)}
SHRINKS = {"rollout": "rollout_micro_batch_size", "evaluation": "rollout_micro_batch_size",
           "scoring": "inference_micro_batch_size", "training": "micro_batch_size"}  # + checkpointing for training


@contextlib.contextmanager
def out_of_memory_noted(cfg, run, step=0):
    """A CUDA out-of-memory error raised inside leaves with out_of_memory's note."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        e.add_note(out_of_memory(cfg, run, step, e))
        raise


def out_of_memory(cfg, run, step, error, gpu_bytes=None):
    """The note a CUDA out-of-memory error gets in main(), beside torch's own message: the step and phase it ran out
    in (from the traceback: what main() was calling), that phase's worst case in the plan against the GPU (loading
    the models: the plan's persistent memory), and how to go on (from the last checkpoint) with flags that shrink it."""
    frames = [f.name for f in traceback.extract_tb(error.__traceback__)]
    callee = frames[frames.index("main") + 1] if "main" in frames[:-1] else None
    phase, index = CALLEES.get(callee, ("", None))
    where = {"": f"in step {step}", "evaluation": f"in the evaluation after step {step}",
             "loading": "while loading the models"}.get(phase, f"in step {step}'s {phase}")
    if gpu_bytes is None:
        cuda = run.device.type == "cuda"
        gpu_bytes = torch.cuda.get_device_properties(run.device).total_memory if cuda else cfg.gpu_memory_gb * GiB
    gb = gib_down(gpu_bytes)
    text = f"rank {run.rank} ran out of GPU memory {where}."
    if index is not None or phase == "loading":
        try:
            p, _ = build(cfg, run)
            persistent = sum(b for _, b in p.persistent)
            what, size = (f"worst case for {phase}", p.peak(p.phases[index])) if index is not None else (
                "persistent memory (the models' shards, gradients and optimizer states)", persistent)
            text += (f" The plan's {what} is {size / GiB:.1f} GiB on this {gb:g} GiB GPU (`python ppo.py "
                     f"--dry_run={run.world} --gpu_memory_gb={gb:g}` with this run's flags prints it line by line).")
        except Exception as e:  # noqa: BLE001 -- advice: the error itself is what the user must see
            text += f" (The plan was not computed: {type(e).__name__}: {e}.)"
    flags = [f"--{f}={getattr(cfg, f) // 2} (now {getattr(cfg, f)})" for f in [SHRINKS.get(phase)]
             if f and getattr(cfg, f) > 1]
    flags += ["--activation_checkpointing=on"] * (phase == "training" and not run.activation_checkpointing)
    flags += [f"--{f}" for f in ("offload_frozen", "offload_optimizer") if not getattr(cfg, f)]  # every phase
    if phase == "loading":  # nothing ran yet; a resumed run may change these flags and the number of GPUs
        text += " To load with less memory per GPU: more GPUs (FSDP2 shards the models over them)" + (
            ", or any of " * bool(flags)) + ", ".join(flags)
    elif flags:
        text += (f" To go on from the last checkpoint in {cfg.out_dir}/checkpoints (if any) with less memory: "
                 f"--resume=auto --out_dir={cfg.out_dir} with any of " + ", ".join(flags) + " (each changes "
                 "nothing but float rounding and speed)")
    return text


def report(cfg, run):
    """-> (text, fits): the per-GPU plan for run.world GPUs of cfg.gpu_memory_gb GiB. Its last line reads
    `peak 61.3 GiB per GPU of 80: fits` (or `: does not fit`); fits means peak + reserve <= gpu_memory_gb."""
    p, f = build(cfg, run)
    run, W, dtype = f["run"], f["W"], DTYPES[f["cb"]]

    def row(label, b, indent=2):
        return f"{' ' * indent}{label:<{86 - indent}}{b / GiB:8.2f}"

    def describe(role, m):  # the base model's sizes, and under LoRA what trains
        blk, root = (numel({k: s for k, s in d.items() if ".lora_" not in k and k != "reward_head.weight"})
                     for d in (m.block, m.root))
        lora = (f"\n{'':15}LoRA rank {m.lora.rank} on {','.join(m.lora.targets)}: {m.numel('trained') / 1e6:.1f}M "
                f"trained" if m.lora else "")
        return (f"  {role:<13}{m.c.model_type} {(m.L * blk + root) / 1e9:.2f}B ({m.L} x {blk / 1e6:.1f}M + root "
                f"{root / 1e6:.1f}M), {'value' if m.head == 'value' else 'LM'} head: {m.source}{lora}")

    lines = [f"memory plan per GPU: {W} GPU{'s' if W > 1 else ''} of {cfg.gpu_memory_gb:g} GiB, {dtype} compute, "
             f"FSDP2 over {W} rank{'s' if W > 1 else ''}, sizes in GiB (2^30 bytes)",
             describe("actor", f["actor"])] + ([describe("critic", f["critic"])] if f["critic"] else [])
    if f["rm"] is not None:
        lines.append(describe("reward model", f["rm"]) + (" (the critic, adapters off)" if f["shared"] else ""))
    n = f" x {cfg.samples_per_prompt} samples" if cfg.samples_per_prompt > 1 else ""
    lines.append(f"  per GPU      rollout {run.local_rollout} prompts{n}, {run.rollout_micro} at a time; scoring "
                 f"{run.infer_micro} and training {run.local_micro} rows at a time,")
    lines.append(f"{'':15}rows of {f['T']} tokens ({cfg.max_prompt_len} prompt + {cfg.max_new_tokens} response)")
    persistent = sum(b for _, b in p.persistent)
    lines += ["persistent (in every phase)", *(row(label, b) for label, b in p.persistent), row("total", persistent)]
    peaks = []
    for title, always, moments in p.phases:
        lines.append(title)
        lines += [row(label, b) for label, b in always]
        for name, terms in moments:
            lines.append(f"  {name}:")
            lines += [row(label, b, indent=4) for label, b in terms]
        worst = max(moments, key=lambda m: sum(b for _, b in m[1]))[0]
        peaks.append(p.peak((title, always, moments)))
        lines.append(row(f"peak: persistent + {'the above + ' if always else ''}{worst}", peaks[-1]))
    peak = max(peaks)
    reserve = RESERVE_GIB * GiB + FRAGMENTATION * peak
    fits = (peak + reserve) / GiB <= cfg.gpu_memory_gb
    lines.append(f"for comparison: attention without the fused kernel (SDPA's math path) would add "
                 f"{f['math_attention'] / GiB:.2f} GiB per layer\n  in training, float32 scores (rows x heads x T x T);"
                 f" the fused kernel keeps one float32 logsumexp per token and head")
    if run.offload_optimizer:
        rpn = min(8, W)  # ranks per node: 8 GPUs a node, or all W
        lines.append(f"--offload_optimizer, per step and GPU: {f['h2d'] / GiB:.2f} GiB host->device (the trained "
                     f"models' shards at every gather, {f['n_s']} scoring and {f['n_t']} training micro-batches,\n  "
                     f"and the actor's for the weight sync), {f['d2h'] / GiB:.2f} GiB device->host (fp32 "
                     f"gradient shards after each backward);\n  pinned host memory {rpn * f['pinned'] / GiB:.1f} GiB "
                     f"per node ({rpn} rank{'s' if rpn > 1 else ''} x {f['pinned'] / GiB:.2f} GiB: "
                     f"{'actor and critic' if f['critic'] else 'actor'} shards, grads, AdamW states)")
    lines.append(f"reserve {reserve / GiB:.1f} GiB: {RESERVE_GIB:g} GiB outside PyTorch's allocator (driver, CUDA "
                 f"context, NCCL)\n  + {FRAGMENTATION:.0%} of the peak for fragmentation: "
                 f"{cfg.gpu_memory_gb - reserve / GiB:.1f} GiB usable")
    lines.append(f"peak {peak / GiB:.1f} GiB per GPU of {cfg.gpu_memory_gb:g}: {'fits' if fits else 'does not fit'}")
    return "\n".join(lines), fits

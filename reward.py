"""
Reward functions: (prompt record, response text) -> one float score, for runs without a reward model.

The record is the prompt's whole JSONL object, so a reward that checks a reference answer reads
record["answer"]. ppo.py takes a built-in one by name (--reward_fn, a key of REWARD_FNS), one from a Python file
(--reward_fn=FILE.py:NAME, load_reward_fn), or any callable from Python: main(cfg, reward_fn=f), recorded in the run's
config as python:module.name (python_name), so that a resume must pass it again. A reward model, when given
(--reward_model), replaces the function. ppo.py calls each through RewardCaller, which refuses anything but one
number (or a dict of numbers holding the score, the others logged as reward/<name>), naming the function and what it
returned.

RewardCaller calls the function on a batch: in series, or in a pool of threads for a function that waits (a
verifier in a subprocess, a judge behind HTTP), with a timeout per call; a call that raised, timed out or returned
NaN, inf or a number beyond float32 is scored with a fixed value and counted (ppo.py: --reward_workers,
--reward_timeout, --reward_on_error, val/reward_errors). A function with the attribute batched = True (a judge
model in the process, a service that takes lists) is called on lists instead, fn(records, responses) -> a list of
as many scores, once a batch or once a part of it per worker.

    python reward.py "What a lovely, sunny day!"       # the built-in sentiment score of a text
    python reward.py "84" --reward_fn=my_rewards.py:verify --record='{"answer": "84"}'  # a file's, on a record
"""
import copy
import difflib
import functools
import importlib.util
import inspect
import json
import numbers
import os
import re
import sys
import threading
import time
import traceback
import weakref

import torch

from runtime import UsageError, need, run_function


POSITIVE = set("""good great excellent wonderful amazing fantastic lovely beautiful delightful happy joy
joyful love loved loving enjoy enjoyed enjoyable pleasant perfect best brilliant awesome nice fun kind warm
glad grateful thankful cheerful bright fresh delicious tasty friendly helpful charming gorgeous superb
incredible outstanding marvelous magnificent splendid pleased proud calm peaceful relaxing cozy comfortable
favorite favourite sweet smile smiles smiling laugh laughter exciting excited inspiring hope hopeful success
successful win winning positive fine well better impressive remarkable stunning lively vibrant glorious
blessed thrilled adore adorable recommend memorable treasure gentle generous""".split())
NEGATIVE = set("""bad terrible awful horrible poor sad angry hate hated boring dull ugly worst worse
disappointing disappointed annoying annoyed unpleasant painful pain cold rude dirty broken wrong fail failed
failure problem problems difficult hard tired sick miserable lonely afraid scared fear worried worry stress
stressful upset unhappy mediocre bland noisy crowded expensive slow late lost mess messy gross nasty
disgusting dreadful gloomy grim cruel harsh bitter regret sorry negative tragic""".split())


def sentiment_reward(record, response):
    """Lexicon sentiment: 10 * (positive words - negative words) / (words + 5), clipped to [-5, 5].
    A density, not a count, so padding a response with more words does not pay by itself. A word: letters a-z
    (case ignored) with inner apostrophes, typographic too ("don't", "it\u2019s"); a quote's are no part of it."""
    words = re.findall(r"[a-z]+(?:['\u2019][a-z]+)*", response.lower())
    pos = sum(w in POSITIVE for w in words)
    neg = sum(w in NEGATIVE for w in words)
    return max(-5.0, min(5.0, 10.0 * (pos - neg) / (len(words) + 5)))


BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?")  # 72, -1,234.5, .5, 3/4


def last_boxed(text):
    """The inside of the last closed \\boxed{...} of text (its braces matched), or None."""
    for start in reversed([m.end() for m in BOXED.finditer(text)]):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def canonical_answer(answer):
    """An answer's comparable form: a number as "%.10g" (a thousands comma, $, a trailing % or period, a/b and
    \\frac{a}{b} understood), anything else as its text without spaces, $ and LaTeX's spacing and sizing commands."""
    s = str(answer)
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\!", ""),
                     ("\\,", ""), ("\\;", ""), ("\\ ", ""), ("$", ""), ("\\%", "%")):
        s = s.replace(old, new)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", re.sub(r"\s+", "", s)).rstrip(".")
    t = s.removesuffix("%")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", t):
        t = t.replace(",", "")
    m = re.fullmatch(r"(-?)\\frac\{(\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}", t) or re.fullmatch(
        r"(-?)(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)", t)
    try:
        x = (-1) ** len(m[1]) * float(m[2]) / float(m[3]) if m else float(t)
    except (ValueError, ZeroDivisionError):
        return s
    return f"{x:.10g}" if abs(x) != float("inf") else s


ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def response_answer(response):
    """The answer a response gives: read from inside its last closed <answer>...</answer> when it has one (the R1
    template's tags: that text's box, "####" or last number, else all of it), else its last \\boxed{...}, else the
    first line after its last "####" (GSM8K's form), else its last number; None when it gives none."""
    if (tagged := ANSWER_TAG.findall(response)) and (inside := response_answer(tagged[-1]) or tagged[-1].strip()):
        return inside  # (an empty pair: read as if it were not there)
    if (boxed := last_boxed(response)) is not None:
        return boxed
    if "####" in response:
        return response.rsplit("####", 1)[1].strip().split("\n")[0] or None
    numbers = NUMBER.findall(response)
    return numbers[-1] if numbers else None


def math_reward(record, response):
    """1.0 when the response's answer (response_answer) equals record["answer"], else 0.0; "pred" is the answer read
    (maj@n votes on it) and "answered" whether there was one. The reference: record["answer"], a number or a string,
    its last \\boxed{...} or what follows its "####" when it has one (GSM8K's answers end "#### 72"). Equal: as
    canonical_answer forms, numbers within 1e-6 of the reference's size (at least 1)."""
    ref = record.get("answer")
    if isinstance(ref, bool) or not isinstance(ref, (str, int, float)) or not str(ref).strip():
        raise ValueError(f"math_reward: the record's \"answer\" must be a number or a non-empty string, not "
                         f"{ref!r:.60}")
    ref = str(ref)
    ref = last_boxed(ref) if last_boxed(ref) is not None else ref.rsplit("####", 1)[-1].strip()
    pred = response_answer(response)
    if pred is None:
        return {"score": 0.0, "pred": None, "answered": 0.0}
    want, got = canonical_answer(ref), canonical_answer(pred)
    try:
        ok = abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
    except ValueError:
        ok = got == want
    return {"score": float(ok), "pred": got, "answered": 1.0}


math_reward.fields = ("answer",)  # read from every prompt record: a prompt file without it is refused at the start
REWARD_FNS = {"sentiment": sentiment_reward, "math": math_reward}
FLOAT32_MAX = 3.4028234663852886e38  # the scores become float32 tensors: a larger score is a failed call


def real_number(value):
    """Whether a reward function's return value is one real number: an int, float or bool, or a numpy or torch
    scalar (a 0-dim array or tensor) of an integer, float or bool dtype; not a string, a complex number or a list.
    A bool is a 0/1 score (a verifier's `return answer == record["answer"]`), numpy's and torch's as Python's; an
    array or tensor of one element is refused as a list of one is: one call scores one response, not a batch."""
    if isinstance(value, numbers.Real):
        return True
    dtype = getattr(value, "dtype", None)
    if getattr(value, "ndim", None) != 0 or dtype is None:
        return False
    kind = getattr(dtype, "kind", None)  # numpy's: b, i, u, f are real; a torch dtype has none, but is_complex
    return kind in ("b", "i", "u", "f") if kind is not None else getattr(dtype, "is_complex", None) is False


def _brief(record):
    """A prompt record for a message, each field's value cut to 60 characters (a long prompt would hide the rest)."""
    if not isinstance(record, dict):
        return f"{record!r:.200}"
    return "{" + ", ".join(f"{k!r}: {v!r:.60}" for k, v in record.items()) + "}"


def python_name(fn):
    """How a run records a reward function passed from Python (ppo.main(cfg, reward_fn=fn)) in its config:
    "python:module.qualname", which a resume must give again; a functools.partial by its function's (with
    "(partial)"), a callable object by its class's. A name only: two lambdas of a module, or two partials of one
    function, are not told apart."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    return f"python:{getattr(inner, '__module__', None) or '?'}.{name}" + ("(partial)" if inner is not fn else "")


def recorded_name(fn, cfg):
    """--reward_fn as a run's config records it: the flag, or for a function passed from Python (ppo.main(cfg,
    reward_fn=fn)) its python_name, once fn is checked to take (record, response). A UsageError for a flag that
    names a function from Python with none passed (a resume's flag), for a function beside a reward model without
    --reward_fn_coef, and for --reward_fn_coef with no function named (the default, sentiment, is the demo's)."""
    flag, default = cfg.reward_fn, type(cfg).reward_fn
    need(not (cfg.reward_model and cfg.reward_fn_coef and fn is None and flag == default), "--reward_fn_coef adds a "
         f"reward function's score to --reward_model's: name it with --reward_fn (the default, {default}, scores the "
         f"embedded demo; --reward_fn=reward.py:{REWARD_FNS[default].__name__} adds it)")
    if fn is None:
        need(not flag.startswith("python:"), f"--reward_fn={flag} is a function passed from Python: pass it again, "
             "ppo.main(cfg, reward_fn=...)")
        return flag
    need(not cfg.reward_model or cfg.reward_fn_coef, "main(cfg, reward_fn=...) and --reward_model both give the "
         "reward: set --reward_fn_coef to add the function's score to the model's")
    check_signature(fn, f"main(cfg, reward_fn=f): {python_name(fn)[7:]}")
    return python_name(fn)


def combined_scores(model_scores, scores, coef, extras, device):
    """(B,) float32 scores from a reward function's (B floats): those alone, or with a reward model's (model_scores,
    (B,)) the model's plus coef x the function's (--reward_fn_coef: Tulu 3's verifiable reward beside its reward
    model), each response's two parts then added to its extras (RewardCaller.extras) as model_score and
    function_score, which ppo.py logs as reward/model_score and reward/function_score."""
    fn = torch.tensor(scores, dtype=torch.float32, device=device)
    if model_scores is None:
        return fn
    for e, model, function in zip(extras, model_scores.tolist(), scores):
        e.update(model_score=model, function_score=function)
    return model_scores.float() + coef * fn


def check_reward_flag(cfg):
    """A UsageError (ppo.derive) unless --reward_fn names a built-in, a FILE.py:NAME or a function passed from Python
    ("python:...", as a run's config records one), or a reward model scores alone."""
    named = cfg.reward_fn in REWARD_FNS or cfg.reward_fn.startswith("python:") or is_file_spec(cfg.reward_fn)
    need(cfg.reward_model or named, f"--reward_fn must be one of {list(REWARD_FNS)} or FILE.py:NAME, a function of "
         f"a Python file (or give --reward_model), not {cfg.reward_fn!r}")


def is_file_spec(spec):
    """Whether --reward_fn has the form FILE.py:NAME, a function of a Python file (load_reward_fn)."""
    path, _, name = spec.rpartition(":")
    return path.endswith(".py") and name.isidentifier()


def check_signature(fn, what):
    """A UsageError unless fn can be called as fn(record, response) and returns its score (not a coroutine)."""
    need(callable(fn), f"{what} is {type(fn).__name__} {fn!r:.60}, not a function")
    need(not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(getattr(fn, "__call__", None)),
         f"{what} is async (async def): a reward function returns its score; wrap the coroutine in a def that "
         "returns asyncio.run(...) of it (--reward_workers runs calls side by side)")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: its first call says
        return
    try:
        signature.bind({}, "")
    except TypeError as e:
        raise UsageError(f"{what} takes {signature}, not (record, response): {e}") from None


def record_fields(fn):
    """The prompt-record fields a reward function says it reads (its attribute `fields`: a name or a tuple of names;
    math_reward's is ("answer",)), which data.load_inputs requires of every prompt before any model loads."""
    fields = getattr(fn, "fields", ())
    fields = (fields,) if isinstance(fields, str) else fields
    need(isinstance(fields, (tuple, list)) and all(isinstance(k, str) for k in fields),
         f"reward function {getattr(fn, '__name__', fn)!r:.60}: its `fields` must be a tuple of field names, not "
         f"{fields!r:.60}")
    return tuple(fields)


def load_reward_fn(spec):
    """The function NAME of the Python file FILE, from --reward_fn=FILE.py:NAME, checked to take (record, response).
    The file runs as a module (in every rank's process), with its folder first on sys.path as for a script, so that
    it may import its neighbours. A UsageError names what is wrong: no such file, an error while the file runs (with
    its line), no NAME in it (with the functions it has), a NAME that is no function of two arguments."""
    path, _, name = spec.rpartition(":")
    need(is_file_spec(spec), f"--reward_fn={spec}: expected FILE.py:NAME, the function NAME of a Python file, or a "
         f"built-in one of {list(REWARD_FNS)}")
    need(os.path.isfile(path), f"--reward_fn={spec}: {path} is " + ("a folder" if os.path.isdir(path) else
         f"not found (from {os.getcwd()})" if not os.path.exists(path) else "not a regular file"))
    abspath = os.path.abspath(path)
    folder = os.path.dirname(abspath)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = "reward_file_" + re.sub(r"\W", "_", os.path.basename(path)[:-3])
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(module_name, path))
    sys.modules[module_name] = module  # (a dataclass of the file looks its module up there)
    try:
        module.__spec__.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 -- whatever the file does while it runs (a sys.exit too) is named
        del sys.modules[module_name]
        if isinstance(e, KeyboardInterrupt):
            raise
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == abspath]
        where = f" (line {lines[-1]})" if lines and not isinstance(e, SyntaxError) else ""  # (a SyntaxError names it)
        raise UsageError(f"--reward_fn={spec}: running {path}{where} raised {type(e).__name__}: {e} "
                         "(PPO_DEBUG=1 shows the traceback)") from e
    if not hasattr(module, name):
        defined = [k for k, v in vars(module).items() if callable(v) and getattr(v, "__module__", None) == module_name]
        close = difflib.get_close_matches(name, defined, n=1, cutoff=0.6)
        raise UsageError(f"--reward_fn={spec}: {path} defines no {name!r}" + (f"; did you mean {close[0]!r}?" if close
                         else f"; its functions: {', '.join(defined) or 'none'}"))
    fn = getattr(module, name)
    check_signature(fn, f"--reward_fn={spec}")
    return fn


def reward_function(spec):
    """What --reward_fn names: a built-in function, or a file's (load_reward_fn)."""
    if spec in REWARD_FNS:
        return REWARD_FNS[spec]
    return load_reward_fn(spec)


# -----------------------------------------------------------------------------
# calling a reward function on a batch: in series or in threads, a timeout per call, failed calls scored


class RewardCaller:
    """Scores a batch of responses with fn(record, response) -> float: (scores, one float per response in the
    order given, errors: how many calls were scored on_error).

    workers == 1 and no timeout: the calls run one after the other in the calling thread. Otherwise `workers`
    threads take the calls in turn; a call still running `timeout` seconds (> 0) after it started is given up.
    Python cannot stop a thread, so a given-up call runs on in its (daemon) thread, its result dropped, and a fresh
    thread takes its place in the pool. The scores come back in the order of the responses whatever order the calls
    end in: for a function of its arguments alone, the workers change the time and nothing else.
    A call that raised (any exception: a verifier's sys.exit, asyncio's CancelledError), timed out or returned NaN,
    inf or a number beyond float32 (the scores' dtype) is scored on_error and counted; with on_error None it stops
    the run, naming the function, the response and the error. A call that returns something other than one real
    number (a string, a complex number, a list) is a TypeError whatever on_error says: that is a bug of the function,
    not a flaky verifier. Each call gets a copy of its record, so what a function does to it stays in that call.
    A function may return a dict instead: the score under "score", and more numbers of the response under names of
    its own (accuracy, a format check), kept per response in `extras` after each batch ({} for a number or a failed
    call), which ppo.py logs as means, reward/<name> (metrics.reward_means). One name is not a metric: "pred", the
    answer the function read in the response (a string, verl's name for it), kept in `preds` (None where not given),
    which an evaluation with several responses a prompt takes a majority vote of.
    A function whose attribute `batched` is True is called as fn(records, responses) on lists and returns a list (or
    an array: anything with tolist()) of one score or dict per response: once on the whole batch, or with workers > 1
    on that many contiguous parts of it, one a thread, the timeout applying to each call. A call that failed fails
    each of its responses (each scored on_error and counted); a list of another length is a TypeError."""

    SLOW_S = 60.0  # without a timeout, a call running this long is reported (once)

    def __init__(self, fn, workers=1, timeout=0.0, on_error=None):
        if not callable(fn):
            raise TypeError(f"the reward function must be callable as fn(record, response), got {fn!r:.80}")
        if not (isinstance(workers, numbers.Integral) and not isinstance(workers, bool) and workers >= 1):
            raise ValueError(f"reward_workers must be an int >= 1, not {workers!r}")
        if not timeout >= 0:
            raise ValueError(f"reward_timeout must be >= 0 seconds (0: none), not {timeout!r}")
        if not (on_error is None or real_number(on_error) and -FLOAT32_MAX <= on_error <= FLOAT32_MAX):
            raise ValueError(f"reward_on_error must be None or a score finite in float32, not {on_error!r:.40}")
        self.fn, self.workers, self.timeout, self.on_error = fn, int(workers), float(timeout), on_error
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        self.batched = getattr(fn, "batched", False) is True
        self.reported = set()  # the kinds of failure already printed (each kind once a run)
        self.running, self.watcher = {}, None  # the calls in flight: key -> (start, response); their watcher
        self.extras, self.preds = [], []  # the last batch's: {name: float} and the "pred" entry (or None) per response

    def __call__(self, records, responses):
        records, responses = list(records), list(responses)
        if len(records) != len(responses):
            raise ValueError(f"{len(records)} prompt records for {len(responses)} responses")
        # each call its own copy of its record: a function that pops or edits a field would otherwise change it for
        # the other samples of its prompt (in other threads too) and for every later pass over the prompts
        calls = list(zip(map(copy.deepcopy, records), responses))
        if not self.timeout and self.watcher is None:  # started here, not by the workers: two could each start one
            self.watcher = threading.Thread(target=RewardCaller._watch, args=(weakref.ref(self),),
                                            name=f"reward-watch-{self.name}", daemon=True)
            self.watcher.start()
        where = [f"response {i} ({t!r:.80}) to the prompt record {_brief(r)}"  # the record: a field missing, say
                 for i, (r, t) in enumerate(zip(records, responses))]
        if self.batched:  # contiguous parts, one call each: [a, b) of the batch
            k = min(self.workers, len(calls))
            bounds = [(j * len(calls) // k, (j + 1) * len(calls) // k) for j in range(k)]
            calls = [([r for r, _ in calls[a:b]], [t for _, t in calls[a:b]]) for a, b in bounds]
        results = [self._call(*c) for c in calls] if self.workers == 1 and not self.timeout else self._threads(calls)
        if self.batched:
            results, parts = [], results
            for (a, b), (ok, value) in zip(bounds, parts):
                value = value.tolist() if ok and hasattr(value, "tolist") else value  # a numpy array, a tensor
                if ok and not (isinstance(value, (list, tuple)) and len(value) == b - a):
                    raise TypeError(f"batched reward function {self.name} returned {value!r:.80} for {b - a} responses "
                                    f"(the first {responses[a]!r:.80}); it must return a list of {b - a} scores")
                results += [(True, v) for v in value] if ok else [(False, value)] * (b - a)
                if not ok:
                    where[a:b] = [f"the batch of responses {a} to {b - 1} (the first {responses[a]!r:.80} to the "
                                  f"prompt record {_brief(records[a])})"] * (b - a)
        scores, errors, self.extras, self.preds = [], 0, [], []
        for i, (ok, value) in enumerate(results):
            extras, pred = {}, None
            if ok and isinstance(value, dict):  # {"score": x, "name": y, ...}: each name logged as reward/name
                value, extras, pred = self._entries(value, i, responses[i])
            if ok and real_number(value):  # NaN, inf, or beyond float32: a failed call, named, or scored on_error
                try:
                    bad = not abs(float(value)) <= FLOAT32_MAX
                except OverflowError:  # an int too large for a float
                    bad = True
                if bad:
                    ok, value = False, FloatingPointError(f"returned {value!r:.40}, not a finite float32")
            failed = f"reward function {self.name} failed on {where[i]}: {value!r}"
            if not ok and self.on_error is None:
                raise RuntimeError(f"{failed}; --reward_on_error=X scores such responses X instead") from value
            self.extras.append(extras if ok else {})
            self.preds.append(pred if ok else None)
            if not ok:
                scores.append(float(self.on_error))
                errors += 1
                if type(value) not in self.reported:  # a function that fails on every call is not silent
                    self.reported.add(type(value))
                    print(f"{failed}; scored --reward_on_error={self.on_error:g} (further {type(value).__name__}s are "
                          "counted in val/reward_errors only)", flush=True)
            elif real_number(value):
                scores.append(float(value))
            else:
                raise TypeError(f"reward function {self.name} returned {value!r:.80} ({type(value).__name__}) for "
                                f"response {i} ({responses[i]!r:.80}); it must return a float")
        return scores, errors

    def _entries(self, returned, i, response):
        """(score, {name: float}, pred) of a dict a call returned: its "score", its other entries, each a number
        finite in float32 (what one response tells of itself: a verifier's accuracy, a format check, a length), and
        its "pred" (the answer read in the response: a string; None if absent or None).
        Anything else is a TypeError: the function's bug, as a return value that is no number."""
        where = f"reward function {self.name} returned {returned!r:.120} for response {i} ({response!r:.80})"
        if "score" not in returned:
            raise TypeError(f"{where}: a dict it returns must hold the score under \"score\"")
        if not real_number(returned["score"]):
            raise TypeError(f"{where}: its \"score\" must be a float")
        pred = returned.get("pred")
        if not (pred is None or isinstance(pred, str)):
            raise TypeError(f"{where}: its \"pred\" (the answer read in the response) must be a string (or None: "
                            f"none read), not {pred!r:.40} ({type(pred).__name__})")
        extras = {k: v for k, v in returned.items() if k not in ("score", "pred")}
        for k, v in extras.items():
            if not isinstance(k, str) or not k or "/" in k:
                raise TypeError(f"{where}: {k!r} is no name for a metric (a string without '/')")
            if not (real_number(v) and abs(float(v)) <= FLOAT32_MAX):
                raise TypeError(f"{where}: its {k!r} must be a number finite in float32, not {v!r:.40} (leave the "
                                "name out of the dict for a response it does not apply to)")
        return returned["score"], {k: float(v) for k, v in extras.items()}, pred

    def _call(self, record, response):
        """(True, what fn returned) or (False, the exception it raised). Without a timeout, a call still running
        after SLOW_S seconds is reported once (_watch)."""
        key = object()
        self.running[key] = (time.monotonic(), response)  # (batched: a list of them)
        try:
            return True, self.fn(record, response)
        except BaseException as e:  # noqa: BLE001 -- any failure of the user's function is scored or re-raised,
            # SystemExit and CancelledError too (in a worker thread they ended it, and the batch waited forever)
            if isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                raise  # Ctrl-C: the user's, not the function's failure
            return False, e
        finally:
            del self.running[key]

    @staticmethod
    def _watch(caller):
        """A daemon thread: names a call that runs past SLOW_S with no timeout to end it. On several ranks the
        others wait for this one in their next collective, until the process group's timeout (30 minutes) ends
        the job and names one of them. It holds its RewardCaller by a weak reference, and ends with it (else the
        function, and whatever it holds, lived as long as the process: a thread for each caller)."""
        reported = set()
        while (rc := caller()) is not None:
            now, rank = time.monotonic(), os.environ.get("RANK")
            slow = sorted(((t0, response, key) for key, (t0, response) in list(rc.running.items())
                           if now - t0 >= rc.SLOW_S and key not in reported), key=lambda c: c[0])
            if slow:  # one line for those found at once (a pool of workers)
                t0, response, _ = slow[0]
                what = (f"a response ({response!r:.80})" if isinstance(response, str) else
                        f"{len(response)} responses (the first {response[0]!r:.60})")
                more = f" (and {len(slow) - 1} more calls past {rc.SLOW_S:g} s)" if len(slow) > 1 else ""
                print(f"{f'rank {rank}: ' if rank else ''}reward function {rc.name} has run {now - t0:.0f} s on "
                      f"{what}{more} and is waited for; --reward_timeout gives up such calls", flush=True)
                reported |= {key for _, _, key in slow}
            reported &= set(rc.running)  # the calls that ended
            wait, rc = rc.SLOW_S / 4, None  # no reference while it sleeps
            time.sleep(wait)

    def _threads(self, calls):
        """The calls' results in the pool of threads, each (True, value) or (False, exception)."""
        n = len(calls)
        results, started, given_up = [None] * n, [None] * n, set()
        todo = iter(range(n))
        cond = threading.Condition()  # guards all of the above; notified when a call starts or ends

        def worker():
            while True:
                with cond:
                    i = next(todo, None)
                    if i is None:
                        return
                    started[i] = time.monotonic()
                    cond.notify()  # the waiting loop learns of the new deadline
                result = self._call(*calls[i])
                with cond:
                    if i in given_up:  # replaced by another thread while it ran: leave
                        return
                    results[i] = result
                    cond.notify()

        def start():
            threading.Thread(target=worker, name=f"reward-{self.name}", daemon=True).start()

        with cond:
            for _ in range(min(self.workers, n)):
                start()
            while any(r is None for r in results):
                wait, now = None, time.monotonic()
                for i in range(n):
                    if self.timeout and results[i] is None and started[i] is not None:
                        left = started[i] + self.timeout - now
                        if left <= 0:
                            results[i] = (False, TimeoutError(f"no result after {self.timeout:g} s"))
                            given_up.add(i)
                            start()
                        else:
                            wait = left if wait is None else min(wait, left)
                if any(r is None for r in results):
                    cond.wait(wait if wait is None else min(wait, threading.TIMEOUT_MAX))  # else OverflowError
        return results


def score_one(text: str, reward_fn: str = "sentiment", record: str | dict = "{}"):
    """The score reward_fn (a built-in name, or FILE.py:NAME) gives the response text to a prompt record (a JSON
    object, as a line of the prompts file holds), with what else the function returned (a dict)."""
    fn = reward_function(reward_fn)
    try:
        record = json.loads(record) if isinstance(record, str) else record
    except json.JSONDecodeError as e:
        raise UsageError(f"--record={record!r:.60} is not JSON: {e}") from None
    need(isinstance(record, dict), f"--record must be a JSON object, not {record!r:.60}")
    missing = [k for k in record_fields(fn) if k not in record]
    need(not missing, f"--record has no {missing[0]!r} field, which --reward_fn={reward_fn} reads" if missing else "")
    caller = RewardCaller(fn)
    (score,), _ = caller([record], [str(text)])  # (fire reads "42" as an int)
    more = {**caller.extras[0], **({"pred": caller.preds[0]} if caller.preds[0] is not None else {})}
    return {"score": score, **more} if more else score


if __name__ == "__main__":
    raise SystemExit(run_function(score_one, "reward.py"))

"""
Reward functions: (prompt record, response text) -> one float score, for runs without a reward model.

The record is the prompt's whole JSONL object, so a reward that checks a reference answer reads
record["answer"]. ppo.py takes a built-in one by name (--reward_fn, a key of REWARD_FNS) or any callable from
Python: main(cfg, reward_fn=f). A reward model, when given (--reward_model), replaces the function. ppo.py calls
each through call_reward, which refuses anything but one number, naming the function and what it returned.

    python reward.py "What a lovely, sunny day!"       # the built-in sentiment score of a text
"""
import numbers
import re

from runtime import UsageError

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
    A density, not a count, so padding a response with more words does not pay by itself."""
    words = re.findall(r"[a-z']+", response.lower())
    pos = sum(w in POSITIVE for w in words)
    neg = sum(w in NEGATIVE for w in words)
    return max(-5.0, min(5.0, 10.0 * (pos - neg) / (len(words) + 5)))


REWARD_FNS = {"sentiment": sentiment_reward}


def call_reward(fn, record, response):
    """fn(record, response) as a float. One number is expected (a Python or NumPy number, a bool, a 0-dim tensor or
    array): anything else, e.g. None, a string or one score per token, is a UsageError naming fn and what it
    returned, instead of a TypeError from float() that names neither."""
    out = fn(record, response)
    x = out.item() if getattr(out, "ndim", None) == 0 and hasattr(out, "item") else out  # numpy / torch 0-dim
    if isinstance(x, numbers.Real):
        return float(x)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', None) or repr(fn)}"
    shape = (f", shape {tuple(out.shape)}" if hasattr(out, "shape") else
             f" of {len(out)}" if isinstance(out, (list, tuple)) else "")
    raise UsageError(f"reward function {name} returned {out!r:.80} ({type(out).__name__}{shape}) for the response "
                     f"{response!r:.40}: expected one number per (record, response)")


if __name__ == "__main__":
    import fire

    fire.Fire(lambda text: sentiment_reward({}, text))

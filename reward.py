"""
Reward functions: (prompt record, response text) -> one float score, for runs without a reward model.

The record is the prompt's whole JSONL object, so a reward that checks a reference answer reads
record["answer"]. ppo.py takes a built-in one by name (--reward_fn, a key of REWARD_FNS) or any callable from
Python: main(cfg, reward_fn=f). A reward model, when given (--reward_model), replaces the function.

    python reward.py "What a lovely, sunny day!"       # the built-in sentiment score of a text
"""
import re

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


if __name__ == "__main__":
    import fire

    fire.Fire(lambda text: sentiment_reward({}, text))

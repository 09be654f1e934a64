"""Measuring what steering does: the log-probability a model gives to a set of words."""
import torch


def word_logprob(lm, prompts, words):
    """Mean over prompts and words of log p(word's first token | prompt), from one uncached pass
    per prompt. Words are encoded without BOS; give them with their leading space (" happy").

    Example:
        >>> word_logprob(lm.steer(vec, 2.0), ["I feel"], [" happy", " glad"])
        -6.12
    """
    if not prompts or not words:
        raise ValueError("word_logprob needs at least one prompt and one word")
    firsts = first_ids(lm, words)
    total = 0.0
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([lm.tokenizer.encode(prompt)], device=lm.device)
            logp = torch.log_softmax(lm(ids)[0, -1].float(), -1)
            total += float(logp[firsts].mean())
    return total / len(prompts)


def first_ids(lm, words):
    """The first token id of each word (as the model's tokenizer splits it, without BOS)."""
    ids = []
    for word in words:
        encoded = lm.tokenizer.encode(word, add_bos=False)
        if not encoded:
            raise ValueError(f"word {word!r} encodes to no tokens")
        ids.append(encoded[0])
    return ids

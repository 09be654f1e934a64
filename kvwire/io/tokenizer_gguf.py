"""`tokenizers` backends for the vocabularies GGUF files carry, built the way transformers' GGUF
tokenizer builds them (transformers/integrations/gguf/gguf_tokenizer_mapping.py), which kvwire's
tests take as the arbiter: SentencePiece-style BPE (`tokenizer.ggml.model` 'llama') and byte-level
BPE ('gpt2') with the split regex its `tokenizer.ggml.pre` names.

Where llama.cpp (src/llama-vocab.cpp) tokenizes differently, transformers wins; each such
disagreement is written next to the entry it concerns.
"""
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

CONTROL, USER_DEFINED = 3, 4  # GGUF token types
_GPT2_DEFAULT = "<|endoftext|>"

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = None  # ByteLevel's own split: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+

# tokenizer.ggml.pre -> split regex. transformers keys this on `pre` alone (the architecture only
# picks a tokenizer class, which keeps the GGUF backend), and gives every name it does not list the
# GPT-2 split. kvwire takes that fallback only for the names below and refuses other names.
# Disagreements with llama.cpp, which transformers (and so kvwire) does not follow:
# - llama3 group and tekken: llama.cpp sets ignore_merges (a word that is itself a token is not
#   merged, as Llama 3's tokenizer.json says) and adds BOS when the file has no add_bos_token.
# - smollm: llama.cpp splits every digit apart first (as SmolLM's tokenizer.json does) where
#   transformers keeps GPT-2's digit runs. SmolLM2's own merges never join digits, so on its file
#   the ids agree; on a vocabulary with digit merges "12345" is one token here, five there.
# - default (and a file with no `pre`): llama.cpp splits off punctuation runs and digit runs (cut
#   into threes) before the GPT-2 split, so "I'm" is I ' m there; transformers: the GPT-2 split.
# - qwen2 group: the same regex in both (llama.cpp spells (?i:...) out); neither applies the NFC
#   normalizer of Qwen's tokenizer.json.
PRE_TOKENIZER_SPLITS = {
    "gpt-2": _GPT2, "default": _GPT2, "smollm": _GPT2,
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2),
    "qwen35": _QWEN35, "tekken": _TEKKEN,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O),
}


def _byte_alphabet():
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    table = {b: chr(b) for b in kept}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


_BYTE_CHAR = _byte_alphabet()
_ALPHABET = frozenset(_BYTE_CHAR.values())


def byte_spelled(token):
    """A GGUF byte-level token as the vocabulary spells it: most are already in the byte alphabet;
    others (added tokens written as plain text, like ' <x>') get their UTF-8 bytes respelled.

    Example:
        >>> byte_spelled("\u0120the"), byte_spelled(" <x>")
        ('\u0120the', '\u0120<x>')
    """
    return token if set(token) <= _ALPHABET else "".join(_BYTE_CHAR[b] for b in token.encode("utf-8"))


def byte_level_bpe(tokens, merges, pre):
    """GPT-2-style byte-level BPE with the split `pre` names (a key of PRE_TOKENIZER_SPLITS).

    Example:
        >>> byte_level_bpe(["\u0120", "t", "\u0120t"], ["\u0120 t"], "smollm").encode(" t").ids
        [2]
    """
    vocab = {byte_spelled(t): i for i, t in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], dropout=None,
                       continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    backend = Backend(model)
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_bpe(tokens):
    """SentencePiece-style BPE with byte fallback and no prefix space (Gemma).

    GGUF stores runs of spaces as real spaces, while the model sees them as '\u2581'; and it lists
    no merges, so they are derived from the vocabulary: every split of a token into two tokens,
    ranked by the merged token's position in the file (Gemma's file order is its merge order).

    Example:
        >>> sentencepiece_bpe(["<unk>", "a", "b", "ab"]).encode("ab").ids
        [3]
    """
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = []
    for rank, token in enumerate(vocab):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((vocab[token], -len(left), -len(right), left, right))
    merges.sort()
    model = models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], unk_token="<unk>",
                       fuse_unk=True, byte_fallback=True)
    backend = Backend(model)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def add_special_tokens(backend, tokens, types, named, byte_level):
    """Mark the tokens transformers treats as added tokens, in its order: all are matched whole.

    Control tokens become special tokens, user-defined ones plain added tokens (as in llama.cpp);
    in a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp
    mislabel and stays text, and '<|endoftext|>' is special whatever its type. Then the tokens the
    file names as bos/eos/unk/pad (`named`: ids) become special too, whatever their type.
    Returns the `named` tokens the vocabulary does not spell as written (transformers would give
    them new ids past the vocabulary), for the caller to refuse.

    Example:
        >>> tokens = ["<|endoftext|>", "a", "<s> x"]
        >>> add_special_tokens(byte_level_bpe(tokens, [], "gpt-2"), tokens, [3, 1, 1], [0, 2], byte_level=True)
        ['<s> x']
    """
    if byte_level and backend.token_to_id(_GPT2_DEFAULT) is not None:
        # transformers builds byte-level vocabularies through GPT2Tokenizer, whose default special
        # token this is: special whatever its type. (A vocabulary without it, like Llama 3's, gets it
        # as a new id past the vocabulary there; kvwire leaves such text as text.)
        backend.add_special_tokens([AddedToken(_GPT2_DEFAULT, normalized=False, special=True)])
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k == CONTROL and (not byte_level or set(t) <= _ALPHABET)]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                        if k == USER_DEFINED and t in vocab])
    spelled = [i for i in named if not byte_level or byte_spelled(tokens[i]) == tokens[i]]
    backend.add_special_tokens([AddedToken(tokens[i], rstrip=False, lstrip=False, normalized=False, special=True)
                                for i in spelled])
    return [tokens[i] for i in named if i not in spelled]

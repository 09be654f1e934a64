"""Tokenizers built in the tests (no downloads): byte-level BPE and character-level."""
import string

from tokenizers import ByteLevelBPETokenizer, Tokenizer, decoders, models, pre_tokenizers, Regex

from kvwire.io.tokenizer import Tokenizer as KvTokenizer

CORPUS = ["the cat sat on the mat", "caf\u00e9 cr\u00e8me br\u00fbl\u00e9e", "\u6771\u4eac \U0001F600 emoji",
          "the theory of the thing"] * 20


def byte_level(vocab_size=300):
    """GPT-2-style byte-level BPE: multi-byte characters span several tokens. EOS id 0."""
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False)
    return KvTokenizer(Tokenizer.from_str(tok._tokenizer.to_str()), bos_token_id=None, eos_token_ids=[0])


def char_level():
    """One token per character: <pad> <eos> <bos> then printable ASCII (98 ids, fits vocab 100)."""
    chars = string.printable[:95]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return KvTokenizer(backend, bos_token_id=2, eos_token_ids=[1], add_bos=True)

"""Tokenizers built with Hugging Face's `tokenizers` library: from tokenizer.json or GGUF metadata."""
import json
import os
import tempfile
from pathlib import Path

from tokenizers import Tokenizer as Backend

from .chat_template import (ChatTemplate, template_end_of_turn_ids, template_from_gguf, template_from_hf_folder,
                            token_strings)
from .content_text import ContentText
from .gguf_header import Strings
from .tokenizer_gguf import PRE_TOKENIZER_SPLITS, add_special_tokens, byte_level_bpe, sentencepiece_bpe

# deriving sentencepiece merges costs the sum of squared token lengths: Gemma 3's 262k tokens sum
# to 1.1e7 (~2 s); a hostile vocabulary of long tokens must not take hours
_MERGE_WORK = 5e7
CHAT_FILE = "kvwire_chat.json"  # what `save` writes beside the tokenizer: template, token strings
# beside a tokenizer.json `save` wrote in its fastest form (`write_backend`); its absence (a folder
# saved by kvwire before it) makes `load` rewrite the file once
FAST_FORM_MARK = "kvwire_tokenizer_fast_form"


class Tokenizer:
    """Text <-> token ids, plus the ids generation needs (BOS, EOS) and the model's chat template.

    Args:
        backend: a `tokenizers.Tokenizer`. bos_token_id / eos_token_ids: special ids.
        add_bos: whether `encode` starts every text with BOS (Gemma: yes, GPT-2: no).
        chat_template: a `ChatTemplate`, its jinja source (str), or None.
        special_tokens: token strings the template sees ({"eos_token": "<|im_end|>", "pad_token": ...});
            bos_token / eos_token default to the text of bos_token_id / eos_token_ids[0].
        eot_token_id: an extra id ending an assistant turn (GGUF `tokenizer.ggml.eot_token_id`).

    Example:
        >>> tok = Tokenizer.from_file("tokenizer.json", bos_token_id=2, eos_token_ids=[1], add_bos=True)
        >>> tok.decode(tok.encode("Hello"))
        'Hello'
    """

    def __init__(self, backend, bos_token_id=None, eos_token_ids=(), add_bos=False, chat_template=None,
                 special_tokens=None, eot_token_id=None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = bool(add_bos) and bos_token_id is not None
        if isinstance(chat_template, str):
            chat_template = ChatTemplate(chat_template, "the chat_template argument")
        if chat_template is not None and not isinstance(chat_template, ChatTemplate):
            raise TypeError(f"chat_template must be a ChatTemplate, a str or None; got {type(chat_template).__name__}")
        self.chat_template = chat_template
        self._token_strings = dict(special_tokens or {})
        self.eot_token_id = eot_token_id
        self._content_text = None

    @property
    def special_tokens(self):
        """Special token strings a chat template sees (bos_token, eos_token, and others when known)."""
        named = {"bos_token": self.bos_token_id, "eos_token": (self.eos_token_ids or (None,))[0]}
        derived = {k: self.backend.id_to_token(i) for k, i in named.items() if i is not None}
        return {k: v for k, v in {**derived, **self._token_strings}.items() if v is not None}

    @property
    def end_of_turn_ids(self):
        """Ids that end an assistant turn: EOS, the GGUF eot id, and the well-known end-of-turn tokens
        (`<|im_end|>`, `<end_of_turn>`, `<|eot_id|>`, ...) in the vocabulary that the template writes."""
        eot = () if self.eot_token_id is None else (self.eot_token_id,)
        from_template = template_end_of_turn_ids(self.backend, self.chat_template)
        return tuple(dict.fromkeys(self.eos_token_ids + eot + from_template))

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **variables):
        """Render `messages` with the model's chat template, exactly as transformers'
        `apply_chat_template` does (but add_generation_prompt defaults to True: the prompt ends where
        the assistant's reply starts).

        Args:
            messages: a non-empty list of {"role": str, "content": str or a list of parts}.
            tokenize: return token ids instead of text; BOS is not added again (the template writes it).
                Special-token strings inside a message's content are tokenised as text (a user who
                types `<|im_end|>` gets the characters, not the control token); the template's own
                markup becomes control tokens. transformers parses both: this is where kvwire departs
                from it (the text form, `tokenize=False`, cannot carry the difference).
            variables: passed to the template (`tools`, `documents`, custom flags); they override the
                special token strings.

        Example:
            >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}])
            '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n'
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template (no GGUF tokenizer.chat_template, no chat_template.jinja "
                             "or tokenizer_config.json chat_template); encode a plain prompt instead, or set "
                             "tokenizer.chat_template = kvwire.io.chat_template.ChatTemplate(source)")
        variables = {**self.special_tokens, **variables}
        if not tokenize:
            return self.chat_template.render(messages, add_generation_prompt, **variables)
        if self._content_text is None or self._content_text.backend is not self.backend:
            self._content_text = ContentText(self.backend)
        messages, hidden = self._content_text.hide(messages, self.chat_template.source, variables)
        return self._content_text.encode(self.chat_template.render(messages, add_generation_prompt, **variables), hidden)

    @property
    def vocab_size(self):
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text, add_bos=None):
        """text -> list of token ids (BOS first when `add_bos`)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        # encode_batch releases the GIL (encode holds it): a long text on a server's worker thread
        # does not stop its event loop
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.add_bos if add_bos is None else add_bos
        return [self.bos_token_id] + ids if bos else ids

    def decode(self, ids, skip_special_tokens=True):
        """token ids -> text (special tokens dropped by default)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, folder):
        folder = Path(folder)
        write_backend(self.backend, folder / "tokenizer.json")
        (folder / FAST_FORM_MARK).write_text("1")
        meta = {"bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids), "add_bos": self.add_bos}
        (folder / "kvwire_tokenizer.json").write_text(json.dumps(meta))
        # a file of its own, so kvwire versions from before chat templates still read the folder
        chat = {"chat_template": None if self.chat_template is None else self.chat_template.source,
                "special_tokens": self._token_strings, "eot_token_id": self.eot_token_id}
        (folder / CHAT_FILE).write_text(json.dumps(chat))

    @classmethod
    def load(cls, folder):
        """Load what `save` wrote (a folder saved before chat templates has no CHAT_FILE: no template)."""
        folder = Path(folder)
        meta = json.loads((folder / "kvwire_tokenizer.json").read_text())
        chat_path = folder / CHAT_FILE
        chat = json.loads(chat_path.read_text()) if chat_path.is_file() else {}
        source = chat.pop("chat_template", None)
        template = None if source is None else ChatTemplate(source, f"{chat_path}: chat_template")
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        if not (folder / FAST_FORM_MARK).is_file():
            try:  # once: later loads parse the shorter form
                write_backend(backend, folder / "tokenizer.json")
                (folder / FAST_FORM_MARK).write_text("1")
            except OSError:  # a read-only or full folder: the file still loads as it is (the
                pass  # temporary file comes first, so a read-only folder costs no serialising)
        return cls(backend, chat_template=template, **meta, **chat)

    @classmethod
    def from_file(cls, path, **kwargs):
        return cls(Backend.from_file(str(path)), **kwargs)


def write_backend(backend, path):
    """Write a `tokenizers.Tokenizer` as JSON in the form it parses fastest, the same tokenizer:
    BPE merges as "left right" strings, which every `tokenizers` version reads, where that form
    holds them (no part with a space, none starting with "#version", a line that form skips), else
    as pairs (what `backend.save` writes); the vocabulary in key order, not id order (the ids are the
    values either way), because the parse first inserts every key into a sorted map, and sorted
    keys go in faster. Gemma 3's tokenizer (262,144 tokens, 514,906 merges): `Tokenizer.from_file`
    0.96 -> 0.75 s with string merges, then 0.91 -> 0.76 s sorted (medians of 6, interleaved, two
    phases of this machine). Written to a temporary file of its own beside `path` (made first, so a
    read-only folder fails before the work), synced, then moved over `path`: a process loading it
    meanwhile reads the old file or the new one whole, and a crash leaves one of them.
    """
    path = Path(path)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(_fast_form(json.loads(backend.to_str())), ensure_ascii=False))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(partial, path.stat().st_mode & 0o777 if path.exists() else 0o644)  # mkstemp's is 0600
        os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)


def _fast_form(data):
    """A tokenizer's JSON (parsed) with merges and vocabulary as `write_backend` writes them."""
    model = data.get("model") or {}
    merges = model.get("merges")
    if merges and all(isinstance(m, list) and " " not in m[0] and " " not in m[1] and not m[0].startswith("#version")
                      for m in merges):
        model["merges"] = [f"{left} {right}" for left, right in merges]
    if isinstance(model.get("vocab"), dict):  # code point order is the UTF-8 byte order Rust sorts by
        model["vocab"] = dict(sorted(model["vocab"].items()))
    return data


def eos_list(value):
    """An eos_token_id config value (int, list or None) as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def tokenizer_from_hf_folder(folder, config):
    """The tokenizer of a Hugging Face checkpoint folder (tokenizer.json), or None if it has none."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        return None
    settings_path = folder / "tokenizer_config.json"
    settings = read_json(settings_path) if settings_path.is_file() else {}
    if not isinstance(settings, dict):
        raise ValueError(f"{settings_path}: expected a JSON object, got {type(settings).__name__}")
    add_bos = settings.get("add_bos_token") or False
    if type(add_bos) is not bool:
        raise ValueError(f"{settings_path}: add_bos_token = {add_bos!r}; expected true or false")
    try:  # the tokenizers library raises plain Exceptions on a bad file
        backend = Backend.from_file(str(folder / "tokenizer.json"))
    except Exception as e:
        raise ValueError(f"{folder / 'tokenizer.json'} is not a readable tokenizer: {e}") from e
    return Tokenizer(backend, bos_token_id=config.bos_token_id, eos_token_ids=eos_list(config.eos_token_id),
                     add_bos=add_bos, chat_template=template_from_hf_folder(folder, settings, settings_path),
                     special_tokens=token_strings(settings, settings_path))


def read_json(path):
    """A JSON file's contents; a ValueError naming the file if it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON file: {e}") from e


def tokenizer_from_gguf(gguf):
    """Build the tokenizer a GGUF file describes (`tokenizer.ggml.*` metadata), every field checked
    first: errors name the file and the key."""
    path = gguf.path

    def field(key, default=None):  # long string arrays are read lazily (`Strings`): all are needed here
        value = gguf.field(key, default)
        return list(value) if isinstance(value, Strings) else value
    kind = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path} has no tokenizer metadata (tokenizer.ggml.tokens)")
    _check_list(path, "tokenizer.ggml.tokens", tokens, str, "strings")
    if not tokens:
        raise ValueError(f"{path}: tokenizer.ggml.tokens is empty")
    types = field("tokenizer.ggml.token_type")
    if types is None:
        types = [1] * len(tokens)
    _check_list(path, "tokenizer.ggml.token_type", types, int, "integers", len(tokens))
    bos, eos = (_token_id(path, field, f"tokenizer.ggml.{k}_token_id", len(tokens)) for k in ("bos", "eos"))
    # llama.cpp adds BOS to sentencepiece vocabularies unless told not to (and to byte-level ones whose
    # pre is in the llama3 group or tekken, where transformers, followed here, adds none)
    default_bos = kind == "llama"
    add_bos = field("tokenizer.ggml.add_bos_token", default_bos)
    if type(add_bos) is not bool:
        raise ValueError(f"{path}: tokenizer.ggml.add_bos_token = {add_bos!r}; expected true or false")
    if add_bos and bos is None and field("tokenizer.ggml.add_bos_token") is not None:
        raise ValueError(f"{path}: tokenizer.ggml.add_bos_token is true but there is no tokenizer.ggml.bos_token_id")
    if kind not in ("llama", "gpt2"):
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (expected 'llama' or 'gpt2')")
    add_eos = field("tokenizer.ggml.add_eos_token", False)
    if add_eos is not False:  # transformers would append EOS; kvwire's Tokenizer (and export sidecar) cannot
        raise ValueError(f"{path}: tokenizer.ggml.add_eos_token = {add_eos!r}; kvwire never appends EOS to "
                         f"encoded text, so it expects false or no such key")
    pre = _pre_tokenizer(path, field) if kind == "gpt2" else None
    merges = field("tokenizer.ggml.merges") if kind == "gpt2" else []
    if merges is None:  # llama.cpp refuses a BPE vocabulary without them too
        raise ValueError(f"{path}: a gpt2 tokenizer needs tokenizer.ggml.merges, which the file lacks")
    _check_list(path, "tokenizer.ggml.merges", merges, str, "strings")
    bad = [m for m in merges if " " not in m]
    if bad:
        raise ValueError(f"{path}: tokenizer.ggml.merges has {bad[0]!r}; expected 'left right' pairs")
    work = sum(len(t) ** 2 for t in tokens) if kind == "llama" else 0
    if work > _MERGE_WORK:
        raise ValueError(f"{path}: tokenizer.ggml.tokens are too long to derive merges from (the sum of their "
                         f"squared lengths is {work}; kvwire allows {_MERGE_WORK:.0e}, Gemma 3 needs 1.1e7)")
    named = [_token_id(path, field, f"tokenizer.ggml.{k}_token_id", len(tokens)) for k in ("unknown", "padding")]
    strings = {k: tokens[i] for k, i in zip(("unk_token", "pad_token"), named) if i is not None}
    eot = _token_id(path, field, "tokenizer.ggml.eot_token_id", len(tokens))
    template = template_from_gguf(path, field)
    named = list(dict.fromkeys(i for i in [bos, eos, *named] if i is not None))
    try:  # the tokenizers library raises plain Exceptions on inconsistent vocabularies
        backend = sentencepiece_bpe(tokens) if kind == "llama" else byte_level_bpe(tokens, merges, pre)
        unspelled = add_special_tokens(backend, tokens, types, named, byte_level=kind == "gpt2")
    except Exception as e:
        raise ValueError(f"{path}: the tokenizer metadata does not make a tokenizer: {e}") from e
    if unspelled:  # the model could not embed the new id past the vocabulary transformers would give it
        raise ValueError(f"{path}: special token {unspelled[0]!r} (a bos/eos/unknown/padding token id) is not "
                         f"spelled in the byte-level alphabet, so transformers would give it an id past the "
                         f"vocabulary; expected byte-alphabet characters only")
    extra_eos = [i for i, t in enumerate(tokens) if t == "<end_of_turn>"]  # Gemma's chat turn end
    return Tokenizer(backend, bos, [e for e in [eos, *extra_eos] if e is not None], add_bos, chat_template=template,
                     special_tokens=strings, eot_token_id=eot)


def _pre_tokenizer(path, field):
    """The checked `tokenizer.ggml.pre` of a gpt2 vocabulary; a file without one (or with '') reads
    as 'default', as in llama.cpp (which warns) and transformers."""
    pre = field("tokenizer.ggml.pre")
    if pre is None or pre == "":
        return "default"
    if type(pre) is not str or pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"{path}: tokenizer.ggml.pre = {pre!r} is not a pre-tokenizer kvwire knows; "
                         f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}")
    return pre


def _check_list(path, key, values, kind, what, length=None):
    if not isinstance(values, list) or not all(type(v) is kind for v in values):
        got = type(values).__name__ if not isinstance(values, list) else \
            f"a list holding {sorted({type(v).__name__ for v in values})}"
        raise ValueError(f"{path}: {key} must be a list of {what}; got {got}")
    if length is not None and len(values) != length:
        raise ValueError(f"{path}: {key} has {len(values)} entries; expected one per token ({length})")


def _token_id(path, field, key, n_tokens):
    value = field(key)
    if value is not None and not (type(value) is int and 0 <= value < n_tokens):
        raise ValueError(f"{path}: {key} = {value!r} is not a token id (expected an integer in [0, {n_tokens}))")
    return value

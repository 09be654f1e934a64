"""What a control vector records of the model it was trained on, and the check before it is used.

A fingerprint names the model's shape, not its weights: the same model quantised, or loaded from
a GGUF instead of a Hugging Face folder, has the same fingerprint; its base and instruct versions
usually do too (same architecture, sizes and tokenizer).
"""
import hashlib

from ..graph import numbered_blocks

FIELDS = ("architecture", "hidden_size", "num_layers", "vocab_size", "tokenizer")
# families that llama.cpp's converter writes under another architecture: a Mistral loaded from a
# GGUF is a "llama" model, so the Hugging Face checkpoint must say the same
LLAMA_CPP_NAMES = {"mistral": "llama"}
# what the tokenizer digest encodes: ordinary text (letters, digits, punctuation, accents, spaces,
# a newline) that every loader of one tokenizer splits alike
PROBE = "The quick brown fox jumps over 13 lazy dogs.\nCaf\u00e9, na\u00efve d\u00e9j\u00e0 vu: {x: 42}  [ok]?"


def fingerprint(lm):
    """{field: value} of `lm`: the fields of `FIELDS` it can tell.

    - architecture: the model family as llama.cpp names its GGUF architecture ("gemma3", "llama",
      "gpt2"; Mistral is "llama"); for the generic path, its Hugging Face `model_type`;
    - hidden_size: the width of the residual stream (D);
    - num_layers: the number of decoder blocks of the checkpoint (an edited model keeps it);
    - vocab_size: the rows of the output head;
    - tokenizer: a digest of the token ids of a fixed text (no key without a tokenizer).

    Example:
        >>> fingerprint(kw.load("gemma3-270m"))
        {'architecture': 'gemma3', 'hidden_size': 640, 'num_layers': 18, 'vocab_size': 262144,
         'tokenizer': '35e5f08b87048985'}
    """
    out = {"architecture": _architecture(lm), "hidden_size": int(lm.head.weight.shape[1]),
           "num_layers": _num_layers(lm), "vocab_size": int(lm.vocab_size)}
    if lm.tokenizer is not None:
        ids = lm.tokenizer.encode(PROBE, add_bos=False)
        out["tokenizer"] = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]
    return {k: v for k, v in out.items() if v is not None}


def mismatches(recorded, lm):
    """["field: vector V, model M", ...] for each field both `recorded` and `lm`'s fingerprint have
    that differs (an empty list when they agree or nothing was recorded)."""
    if not recorded:
        return []
    have = fingerprint(lm)
    return [f"{k}: vector {recorded[k]!r}, model {have[k]!r}" for k in FIELDS
            if k in recorded and k in have and recorded[k] != have[k]]


def check_fingerprint(recorded, lm, allow_mismatch=False, what="control vector"):
    """ValueError naming every field of `recorded` that `lm` does not match, unless allow_mismatch."""
    wrong = mismatches(recorded, lm)
    if wrong and not allow_mismatch:
        raise ValueError(f"this {what} was trained on another model ({'; '.join(wrong)}); pass "
                         f"allow_mismatch=True to use it anyway (its width must still fit)")


def _architecture(lm):
    from ..models.registry import FAMILIES, by_hf_model_type

    name = getattr(lm, "family", None)
    if name == "generic" or name is None:
        model_type = getattr(lm.config, "model_type", None)
        if name is None and model_type is None:  # a CausalLM built by hand: its config's class, if one family has it
            matches = [f.name for f in FAMILIES.values() if isinstance(lm.config, f.config_cls)]
            return matches[0] if len(matches) == 1 else None
        try:
            name = by_hf_model_type(model_type).name  # a family kvwire also has natively: the same name
        except ValueError:
            name = model_type
    return LLAMA_CPP_NAMES.get(name, name)


def _num_layers(lm):
    for key in ("num_hidden_layers", "n_layer"):
        value = getattr(lm.config, key, None)
        if isinstance(value, int):
            return value
    blocks = numbered_blocks(lm.backbone)
    return max(blocks) + 1 if blocks else None

"""Write tiny GGUF files of llama, mistral, qwen2, qwen3, phi3 and gemma2 as llama.cpp's converter does.

`write_gguf(path, hf)` follows convert_hf_to_gguf.py: its metadata keys per architecture, its tensor
names, its transforms (llama's Q/K row permutation, Gemma's norm offset folded in) and its extra
tensors (llama3 rope_freqs, phi3 longrope factors). A family is one row of FAMILIES; what differs
between two families is that row, not a second writer.

    stored = write_gguf(tmp_path / "m.gguf", tiny_hf("qwen3", vocab_size=300), quant=GGMLQuantizationType.Q8_0)
    hf.load_state_dict(stored, strict=False)  # the weights the file really holds, after rounding
"""
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter, LlamaFileType

from .gguf_files import CONTROL, NORMAL, _finish, _store, sentencepiece_vocab

UNUSED = 5  # llama.cpp's token type for the ids a tokenizer leaves empty ("[PAD{i}]")

# HF module below model.layers.N -> llama.cpp's tensor name (gguf-py's TensorNameMap); a family
# overrides only the names it spells differently
BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # phi3: q, k and v rows stacked, kept fused
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate rows then up rows, kept fused (llama.cpp's swiglu splits it)
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _rope(c):
    return c.rope_parameters.get("full_attention", c.rope_parameters)


def _head_dim(c):
    return c.to_dict().get("head_dim") or c.hidden_size // c.num_attention_heads


def _phi3_rotary(c):
    """Phi-3's rotary width in dimensions, as the converter counts it (from hidden_size, not head_dim)."""
    return int(_rope(c).get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads


def _base_keys(c):
    """TextModel.set_gguf_parameters: what the converter writes for any decoder, in its order."""
    keys = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads}
    keys |= _rope_scaling_keys(c)
    keys |= {"rope.freq_base": float(_rope(c)["rope_theta"]), "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps)}
    if c.to_dict().get("head_dim") is not None:  # only where the config states it
        keys |= {"attention.key_length": c.head_dim, "attention.value_length": c.head_dim}
    return keys


def _rope_scaling_keys(c):
    rope = _rope(c)
    kind = rope.get("rope_type", "default")
    if kind in ("default", "llama3"):  # llama3's scaling travels as the rope_freqs tensor
        return {}
    if kind == "linear":
        return {"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])}
    if kind == "yarn":
        keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                "rope.scaling.original_context_length": rope["original_max_position_embeddings"]}
        optional = {"extrapolation_factor": "yarn_ext_factor", "attention_factor": "yarn_attn_factor",
                    "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}
        return keys | {f"rope.scaling.{k}": float(rope[hf]) for hf, k in optional.items() if rope.get(hf) is not None}
    raise ValueError(f"rope_type {kind!r} has no llama.cpp layout here; expected default, linear, yarn or llama3")


def _llama_keys(c):
    return _base_keys(c) | {"vocab_size": c.vocab_size, "rope.dimension_count": _head_dim(c)}


def _phi3_keys(c):
    """Phi3MiniModel writes its own list: the rotary width in dimensions, no rope.scaling.type."""
    rope = _rope(c)
    keys = {"context_length": c.max_position_embeddings,
            "rope.scaling.original_context_length": c.original_max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "block_count": c.num_hidden_layers, "attention.head_count": c.num_attention_heads,
            "attention.head_count_kv": c.num_key_value_heads, "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
            "rope.dimension_count": _phi3_rotary(c), "rope.freq_base": float(rope["rope_theta"]),
            "attention.sliding_window": c.sliding_window or 0}  # 0: no window (how llama.cpp tells Phi-4 apart)
    if rope.get("long_factor"):
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        keys["rope.scaling.attn_factor"] = (math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings))
                                            if scale > 1.0 else 1.0)
    return keys


def _gemma2_keys(c):
    """Gemma2Model writes no rope.freq_base (llama.cpp assumes 10000) and the two soft-caps."""
    return {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps), "attention.key_length": c.head_dim,
            "attention.value_length": c.head_dim, "attn_logit_softcapping": float(c.attn_logit_softcapping),
            "final_logit_softcapping": float(c.final_logit_softcapping), "attention.sliding_window": c.sliding_window}


# --- the real transforms, each with its inverse for the values handed back -------------------

def permute(w, n_head):
    """llama.cpp's LlamaModel.permute: HF rotates dims (i, i + d/2) of a head, ggml's rope (2i, 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w, n_head):
    """The inverse of `permute` (what transformers' LlamaTensorProcessor applies on load)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qk_heads(key, c):
    """The head count llama.cpp permutes a tensor by: n_head for Q, n_head_kv for K, None for the rest."""
    heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
    return heads.get(key.rsplit(".", 2)[-2])


def _llama_to_file(key, a, c):
    return a if _qk_heads(key, c) is None else permute(a, _qk_heads(key, c))


def _llama_from_file(key, a, c):
    return a if _qk_heads(key, c) is None else unpermute(a, _qk_heads(key, c))


def _gemma_to_file(key, a, c):
    return a + 1.0 if key.endswith("norm.weight") else a  # Gemma's RMSNorm scales by (1 + w)


def _gemma_from_file(key, a, c):
    return a - 1.0 if key.endswith("norm.weight") else a


def _same(key, a, c):
    return a


# --- extra tensors the converter generates from the config -----------------------------------

def _llama3_rope_freqs(c):
    """LlamaModel.generate_extra_tensors: llama3 scaling as one divisor per rotary frequency."""
    rope = _rope(c)
    if rope.get("rope_type") != "llama3":
        return {}
    dim = _head_dim(c)
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    # llama.cpp reads the top-level field (default 8192); every real Llama 3 states the same value here
    old = rope["original_max_position_embeddings"]
    divisors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": np.array(divisors, dtype=np.float32)}


def _phi3_rope_factors(c):
    rope, rotary = _rope(c), _phi3_rotary(c)
    if not rope.get("long_factor"):
        return {}
    if not len(rope["long_factor"]) == len(rope["short_factor"]) == rotary // 2:
        raise ValueError(f"longrope needs {rotary // 2} long and short factors, got {len(rope['long_factor'])} "
                         f"and {len(rope['short_factor'])}")
    return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}


def _no_extra(c):
    return {}


# --- what llama.cpp cannot represent: refuse rather than write a file that means something else ---

def _check_no_window(c):
    window = c.sliding_window if c.model_type == "mistral" else None
    if "sliding_attention" in (getattr(c, "layer_types", None) or ()):
        window = c.sliding_window
    if window is not None and window < c.max_position_embeddings:
        raise ValueError(f"{c.model_type} has sliding_window={window}, but llama.cpp's "
                         f"{FAMILIES[c.model_type].arch} architecture has no window: build it with sliding_window=None")


def _check_phi3(c):
    if c.to_dict().get("head_dim") not in (None, c.hidden_size // c.num_attention_heads):
        raise ValueError(f"phi3 head_dim={c.head_dim}, but llama.cpp's phi3 takes hidden_size / heads = "
                         f"{c.hidden_size // c.num_attention_heads}")
    kind = _rope(c).get("rope_type", "default")
    if kind not in ("default", "longrope"):
        raise ValueError(f"phi3 rope_type {kind!r} has no llama.cpp layout here; expected default or longrope")


def _check_gemma2(c):
    theta = _rope(c)["rope_theta"]
    if theta != 10000.0:
        raise ValueError(f"gemma2 rope_theta={theta}, but llama.cpp's gemma2 files carry none and assume 10000")
    if c.query_pre_attn_scalar != c.head_dim:
        raise ValueError(f"gemma2 query_pre_attn_scalar={c.query_pre_attn_scalar}, but llama.cpp scales queries "
                         f"by head_dim={c.head_dim}")
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(c.num_hidden_layers)]
    if list(c.layer_types) != alternating:
        raise ValueError(f"gemma2 layer_types={c.layer_types}, but llama.cpp's gemma2 slides on even layers only")
    if c.attn_logit_softcapping is None or c.final_logit_softcapping is None:
        raise ValueError("gemma2 without soft-caps cannot be written: llama.cpp's converter requires both")


@dataclass(frozen=True)
class Family:
    """One architecture as llama.cpp's converter writes it."""
    arch: str                                # general.architecture
    tokenizer: str                           # "gpt2" (byte-level BPE) or "llama" (sentencepiece)
    pre: str                                 # tokenizer.ggml.pre
    add_bos: bool
    keys: Callable                           # config -> {key below "<arch>.": value}
    names: dict = field(default_factory=dict)  # exceptions to BLOCK_NAMES
    to_file: Callable = _same                # (HF key, array, config) -> the array llama.cpp stores
    from_file: Callable = _same              # its inverse
    extra: Callable = _no_extra              # config -> {tensor name: array}, written first
    check: Callable = _check_no_window       # config -> None, raises what llama.cpp cannot say


_LLAMA = dict(keys=_llama_keys, to_file=_llama_to_file, from_file=_llama_from_file, extra=_llama3_rope_freqs)
FAMILIES = {
    "llama": Family("llama", "gpt2", "llama-bpe", True, **_LLAMA),         # Llama 3's tokenizer
    "mistral": Family("llama", "llama", "default", True, **_LLAMA),        # Mistral 7B's sentencepiece
    "qwen2": Family("qwen2", "gpt2", "qwen2", False, _base_keys),
    "qwen3": Family("qwen3", "gpt2", "qwen2", False, _base_keys),
    "phi3": Family("phi3", "llama", "default", False, _phi3_keys, extra=_phi3_rope_factors, check=_check_phi3),
    "gemma2": Family("gemma2", "llama", "default", True, _gemma2_keys, check=_check_gemma2,
                     names={"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                            "post_feedforward_layernorm": "post_ffw_norm"},
                     to_file=_gemma_to_file, from_file=_gemma_from_file),
}


def write_gguf(path, hf, arch=None, quant=GGMLQuantizationType.F32):
    """Write HF tiny model `hf` as llama.cpp's convert_hf_to_gguf.py would, quantising 2-D weights to `quant`.

    Args:
        path: the .gguf file to write.
        hf: a transformers causal LM of a FAMILIES model_type (mistral is written as arch "llama").
        arch: the architecture expected for it (a check; None takes the family's).
        quant: a ggml type that gguf.quants can quantise (F32, F16, BF16, Q8_0, Q4_0, ...); 1-D
            tensors stay F32, as in llama.cpp.

    Returns the HF state dict (HF names and layout) holding the values the file stores, after
    rounding; tied lm_head weights are left out, as the file has no `output` then.
        stored = write_gguf(p, tiny_hf("llama", vocab_size=300)); hf.load_state_dict(stored, strict=False)
    """
    c = hf.config
    if c.model_type not in FAMILIES:
        raise ValueError(f"no GGUF layout for model_type {c.model_type!r}; expected one of {sorted(FAMILIES)}")
    family = FAMILIES[c.model_type]
    if arch is not None and arch != family.arch:
        raise ValueError(f"{c.model_type} is written as GGUF architecture {family.arch!r}, not {arch!r}")
    family.check(c)
    w = GGUFWriter(str(path), family.arch)
    w.add_name(f"Tiny {c.model_type.title()}")  # the converter names a file after its model folder or card
    for key, value in family.keys(c).items():
        _add(w, f"{family.arch}.{key}", value)
    w.add_file_type(LlamaFileType.ALL_F32 if quant is GGMLQuantizationType.F32 else LlamaFileType[f"MOSTLY_{quant.name}"])
    w.add_quantization_version(GGML_QUANT_VERSION)
    _add_vocab(w, c, family)
    for name, array in family.extra(c).items():
        w.add_tensor(name, array)
    stored = {}
    for key, value in hf.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output tensor, and its loader reuses token_embd
        kept = _store(w, _tensor_name(key, family), family.to_file(key, value.numpy(), c), quant)
        stored[key] = torch.from_numpy(np.ascontiguousarray(family.from_file(key, kept, c)))
    _finish(w)
    return stored


def _tensor_name(key, family):
    module, kind = key.rsplit(".", 1)
    if module in TOP_NAMES:
        return f"{TOP_NAMES[module]}.{kind}"
    _, _, i, rest = module.split(".", 3)  # model.layers.N.<module>
    name = family.names.get(rest, BLOCK_NAMES.get(rest))
    if name is None:
        raise ValueError(f"no llama.cpp tensor name for {key!r} in architecture {family.arch!r}")
    return f"blk.{i}.{name}.{kind}"


def _add(w, key, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"metadata {key}={value!r}: expected an int, float or str")
    {int: w.add_uint32, float: w.add_float32, str: w.add_string}[type(value)](key, value)


# --- tokenizers: what _set_vocab_gpt2 and _set_vocab_sentencepiece write ----------------------

MERGES = ["\u0120 t", "h e", "\u0120t he", "i n", "e r"]


def byte_level_vocab(c):
    """A GPT-2-style vocabulary: specials at the config's ids, the 256 byte symbols, five merges,
    then llama.cpp's "[PAD{i}]" for the ids left empty."""
    from tokenizers.pre_tokenizers import ByteLevel

    specials = {c.pad_token_id: "<|pad|>", c.eos_token_id: "<|endoftext|>", c.bos_token_id: "<|begin_of_text|>"}
    pieces = iter(sorted(ByteLevel.alphabet()) + ["\u0120t", "he", "\u0120the", "in", "er"])
    need = 256 + len(MERGES) + len(specials)
    if c.vocab_size < need:
        raise ValueError(f"vocab_size {c.vocab_size} is too small for a byte-level vocabulary of {need}: "
                         f"build the model with vocab_size={need} or more")
    tokens, types = [], []
    for i in range(c.vocab_size):
        token = specials.get(i) or next(pieces, None)
        tokens.append(token or f"[PAD{i}]")
        types.append(CONTROL if i in specials else NORMAL if token else UNUSED)
    return tokens, types


def _add_vocab(w, c, family):
    if family.tokenizer == "gpt2":
        tokens, types = byte_level_vocab(c)
        scores = None
    else:
        if (c.pad_token_id, c.eos_token_id, c.bos_token_id) != (0, 1, 2):
            raise ValueError(f"the sentencepiece vocabulary has pad, eos, bos = 0, 1, 2; the config says "
                             f"{c.pad_token_id}, {c.eos_token_id}, {c.bos_token_id}")
        if c.vocab_size < 260:
            raise ValueError(f"vocab_size {c.vocab_size} is too small for a sentencepiece vocabulary with 256 "
                             f"byte tokens: build the model with vocab_size=260 or more")
        tokens, types = sentencepiece_vocab(c.vocab_size)
        scores = [-float(i) if t == NORMAL else 0.0 for i, t in enumerate(types)]  # BPE rank, best first
    w.add_tokenizer_model(family.tokenizer)
    w.add_tokenizer_pre(family.pre)
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_token_types(types)
    if family.tokenizer == "gpt2":
        w.add_token_merges(MERGES)
    if family.arch == "gemma2":
        w.add_add_space_prefix(False)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    if family.tokenizer == "llama":
        w.add_unk_token_id(tokens.index("<unk>"))
    w.add_pad_token_id(c.pad_token_id)
    w.add_add_bos_token(family.add_bos)
    w.add_add_eos_token(False)

"""Strategies and memoised builders for the property tests (tests/test_properties*.py).

A drawn model is a hashable spec: (family, config fields, edits). Building it takes a few ms, but
the same spec recurs often (the space is kept modest), so `model(spec)` builds each one once per
process and keeps it, with its traced cached graph (`lm.cached`) and the caches `generate` keeps
between calls (later cases then run on stale caches, which the masks must hide).
"""
import contextlib
import functools
import zlib

import torch
from hypothesis import settings
from hypothesis import strategies as st
from torch import nn

import kvwire as kw
from kvwire.generate import CausalLM
from kvwire.graph import numbered_blocks
from kvwire.graph.trace import layer_calls, trace
from kvwire.layers.base import Block, Layer
from kvwire.models import FAMILIES

MAX_POSITIONS = 128
EOS = 1  # every family's tiny config ends rows at id 1 unless told to ignore it
DECODER_FAMILIES = ("gemma", "gemma2", "granite", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3")
WINDOWS = [2, 3, 5]  # rings of 1, 2 and 4 slots
# static rope scaling only (v4 form: rope_scaling items, kept hashable): dynamic and longrope switch
# their factors with the sequence length, so a forward over T tokens and a decode step at T differ
# by design (tests/test_families.py and tests/test_rope.py pin them against transformers)
ROPE_SCALINGS = [None, (("factor", 4.0), ("rope_type", "linear")),
                 (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                  ("original_max_position_embeddings", 16), ("rope_type", "llama3")),
                 (("factor", 4.0), ("original_max_position_embeddings", 32), ("rope_type", "yarn"))]


def examples(weight):
    """This test's share of the profile's cases: weight x max_examples (conftest: "ci" 150, "local" 1,500)."""
    return max(1, round(weight * settings.default.max_examples))


@st.composite
def configs(draw):
    """(family, frozen config fields) of any family: 1-3 layers, width 16 or 32, vocabulary twice
    the width, MQA/GQA/MHA (not GPT-2). Gemma 3 with a random sliding/full pattern, a window of 2,
    3 or 5 and linear rope scaling of the full layers or none; the shared decoder's families with
    the variations of each (`decoder_fields`)."""
    family = draw(st.sampled_from(["gpt2", "gemma3", *DECODER_FAMILIES]))
    layers, width = draw(st.integers(1, 3)), draw(st.sampled_from([16, 32]))
    if family == "gpt2":
        fields = dict(vocab_size=2 * width, n_embd=width, n_layer=layers, n_head=draw(st.sampled_from([2, 4])),
                      n_positions=MAX_POSITIONS, bos_token_id=0, eos_token_id=EOS)
        return family, tuple(sorted(fields.items()))
    heads, kv_heads, head_dim = draw(st.sampled_from([(2, 1, 8), (4, 2, 4), (2, 2, 8)]))  # MQA, GQA, MHA
    fields = dict(vocab_size=2 * width, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=MAX_POSITIONS, bos_token_id=2, eos_token_id=EOS, pad_token_id=0)
    if family == "gemma3":
        sliding = draw(st.lists(st.booleans(), min_size=layers, max_size=layers))
        fields.update(sliding_window=draw(st.sampled_from(WINDOWS)), query_pre_attn_scalar=head_dim,
                      layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
                      rope_scaling=draw(st.sampled_from(ROPE_SCALINGS[:2])))
    else:
        fields.update(draw(decoder_fields(family, layers, head_dim)))
    return family, tuple(sorted(fields.items()))


@st.composite
def decoder_fields(draw, family, layers, head_dim):
    """A shared-decoder family's own Hugging Face config fields (read by its config_from_hf): a
    static rope scaling or none and tied or untied heads for all; windows where the family has
    them (Mistral and Phi-3 on every layer or none, Qwen from max_window_layers on, Gemma 2 on a
    random pattern); biases (Llama, Qwen 3); partial rotary (Phi-3); soft-caps (Gemma 2);
    multipliers (Granite)."""
    # Phi-3 reads "yarn" as longrope (transformers does)
    rope = draw(st.sampled_from(ROPE_SCALINGS[:3] if family == "phi3" else ROPE_SCALINGS))
    fields = dict(rope_scaling=rope, tie_word_embeddings=draw(st.booleans()))
    window = st.sampled_from(WINDOWS)
    if family == "llama":
        fields.update(attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()))
    elif family in ("mistral", "phi3"):
        fields.update(sliding_window=draw(st.none() | window))
        if family == "phi3":
            fields.update(partial_rotary_factor=draw(st.sampled_from([1.0, 0.5])))
    elif family in ("qwen2", "qwen3"):
        fields.update(use_sliding_window=draw(st.booleans()), sliding_window=draw(window),
                      max_window_layers=draw(st.integers(0, layers)))
        if family == "qwen3":
            fields.update(attention_bias=draw(st.booleans()))
    elif family == "gemma2":
        sliding = draw(st.lists(st.booleans(), min_size=layers, max_size=layers))
        fields.update(sliding_window=draw(window), query_pre_attn_scalar=head_dim,
                      layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
                      attn_logit_softcapping=draw(st.sampled_from([None, 5.0])),
                      final_logit_softcapping=draw(st.sampled_from([None, 3.0])))
    elif family == "granite":
        fields.update(embedding_multiplier=draw(st.sampled_from([1.0, 1.7])),
                      attention_multiplier=draw(st.sampled_from([head_dim**-0.5, 0.2])),
                      residual_multiplier=draw(st.sampled_from([1.0, 0.6])),
                      logits_scaling=draw(st.sampled_from([1.0, 2.5])))
    return fields


# An edit: (kind, target index, new module kind, seed). Targets are indices into the current layer
# calls (inserted modules included), taken modulo their number when the edit is applied.
NEW = ("add", "scale", "linear", "positions", "plain positions", "block")


@st.composite
def edits(draw, kinds=("after", "before", "replace", "skip"), max_edits=2):
    out = []
    for _ in range(draw(st.integers(0, max_edits))):
        kind = draw(st.sampled_from(kinds))
        new = None if kind == "skip" else draw(st.sampled_from(NEW))
        out.append((kind, draw(st.integers(0, 7)), new, draw(st.integers(0, 1))))
    return tuple(out)


@st.composite
def specs(draw, **edit_options):
    return (*draw(configs()), draw(edits(**edit_options)))


@functools.lru_cache(maxsize=None)
def base_model(family, fields):
    """A tiny kvwire CausalLM built from a kvwire config (no transformers: faster), float32: each
    family's HF fields through its mapping."""
    fam = FAMILIES[family]
    fields = {k: dict(v) if k == "rope_scaling" and v else v for k, v in fields}  # a dict, kept hashable in the spec
    config = fam.config_from_hf(fields)
    torch.manual_seed(zlib.crc32(repr(fields).encode()))  # same weights in every process
    backbone = fam.backbone(config).eval()
    with torch.no_grad():  # weights large enough that attention is far from uniform (as conftest)
        for p in backbone.parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 0.2)
    return CausalLM(backbone, fam.head(backbone), None, config).eval()


_MODELS = {}  # (family, fields, resolved edits...) -> (lm, its layer calls, its block calls)


def model(spec):
    """The model a spec describes: the base model with its edits applied one after the other.
    Each edit is first resolved against the current calls, so equal models share one entry."""
    family, fields, edit_list = spec
    key = (family, fields)
    if key not in _MODELS:
        _MODELS[key] = _entry(base_model(family, fields))
    for i, edit in enumerate(edit_list):
        lm, calls, blocks = _MODELS[key]
        key += (_resolve(*edit, calls, blocks, i),)
        if key not in _MODELS:
            _MODELS[key] = _entry(lm.edit(_edit(lm, *key[-1])))
    return _MODELS[key][0]


def _entry(lm):
    calls = [n.target for n in layer_calls(trace(lm.backbone))]
    return lm, calls, [n for n in calls if isinstance(lm.backbone.get_submodule(n), Block)]


def _resolve(kind, target, new, seed, calls, blocks, i):
    """(kind, call name, new module kind or the block to call again, seed)."""
    if kind in ("replace", "skip"):  # only blocks: an embedding's input is token ids
        picks = blocks or calls[-1:]
    elif kind == "before":  # not before the first call (token ids again)
        picks = calls[1:]
    else:
        picks = calls
    where = picks[target % len(picks)]
    if kind == "skip":
        return ("skip", where, None, None) if blocks else ("after", where, "identity", None)
    if new == "block" and blocks:  # call a block again: its attention gets a second cache slot ("#2")
        return kind, where, blocks[(target + 1 + seed) % len(blocks)], None
    return kind, where, "add" if new == "block" else new, seed * 10 + i


def _edit(lm, kind, where, new, seed):
    if kind == "skip":
        return kw.skip(where)
    if new in NEW:
        module = _new_module(new, lm.head.weight.shape[1], torch.Generator().manual_seed(seed))
    else:
        module = nn.Identity() if new == "identity" else lm.backbone.get_submodule(new)
    return {"after": kw.insert_after, "before": kw.insert_before, "replace": kw.replace}[kind](where, module)


def _new_module(kind, width, g):
    if kind == "add":
        return AddVector(torch.randn(width, generator=g))
    if kind == "scale":
        return Scale(1.0 + 0.5 * torch.randn(width, generator=g))
    if kind == "positions":
        return PositionBias(0.5 * torch.randn(MAX_POSITIONS, width, generator=g))
    if kind == "plain positions":
        return PlainPositionBias(0.5 * torch.randn(MAX_POSITIONS, width, generator=g))
    linear = nn.Linear(width, width)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(width) + torch.randn(width, width, generator=g) / width**0.5)
        linear.bias.normal_(0.0, 0.3, generator=g)
    return linear


class AddVector(nn.Module):
    """A plain module (not a kvwire Layer): x + v; the cache pass must trace through it."""

    def __init__(self, v):
        super().__init__()
        self.register_buffer("v", v)

    def forward(self, x):
        return x + self.v


class Scale(nn.Module):
    """A plain module: x * s per channel."""

    def __init__(self, s):
        super().__init__()
        self.register_buffer("s", s)

    def forward(self, x):
        return x * self.s


class PositionBias(Layer):
    """A kvwire Layer reading positions: x + table[position]; plainly positions 0..T-1."""

    uses_positions = True

    def __init__(self, table):
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, x):
        return x + self.table[: x.shape[1]]

    def forward_cached(self, x, *, positions):
        return x + self.table[positions]


class PlainPositionBias(nn.Module):
    """PositionBias as a plain nn.Module speaking the position protocol (no kvwire base class)."""

    uses_positions = True
    forward, forward_cached = PositionBias.forward, PositionBias.forward_cached

    def __init__(self, table):
        super().__init__()
        self.register_buffer("table", table)


def token_rows(vocab, max_rows=3, max_len=24):
    """Prompts of 1..max_rows rows of different lengths (a left-padded batch)."""
    # the length drawn first: hypothesis's own list sizes stay short, and long rows matter (the
    # fused attention kernel takes chunks of >= 32 tokens)
    row = st.integers(1, max_len).flatmap(lambda n: st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    return st.lists(row, min_size=1, max_size=max_rows)


def numbered(spec):
    """{block number: call name} of model(spec) (`kw.graph.numbered_blocks`: checkpoint numbers,
    kept by edits), which is how control vectors address blocks; {} when no block is left."""
    return numbered_blocks(model(spec).backbone)


def layer_call_names(spec):
    """The layer calls of model(spec) (blocks, embeddings, norms, inserted modules), in order."""
    model(spec)
    return _MODELS[_key(spec)][1]


def _key(spec):
    family, fields, edit_list = spec
    key = (family, fields)
    for i, edit in enumerate(edit_list):
        key += (_resolve(*edit, *_MODELS[key][1:], i),)
    return key


def control_vector(lm, layers, seed):
    """A random ControlVector on block indices `layers`."""
    g = torch.Generator().manual_seed(seed)
    return kw.ControlVector({i: torch.randn(lm.head.weight.shape[1], generator=g) for i in layers})


@functools.lru_cache(maxsize=None)
def steered(spec, layers, seed, generated_only=False, second_name=None):
    """(model(spec) steered by control_vector(layers, seed) and by -0.5 times it under
    `second_name` (None: steer's default, "steer2"), both at strength 1, the vector); memoised:
    strengths come as `inputs=`."""
    lm = model(spec)
    vector = control_vector(lm, layers, seed)
    both = lm.steer(vector, 1.0, generated_only=generated_only)
    return both.steer(vector * -0.5, 1.0, generated_only=generated_only, name=second_name), vector


@contextlib.contextmanager
def shifted_blocks(spec, vector, first, second=0.0, start=0):
    """model(spec) whose uncached forward adds first * d and then second * -0.5 * d after block
    number i (direction d of `vector`), at positions >= start: forward hooks on the block modules,
    the plain reference for what the two control vectors of `steered` do."""
    lm, names = model(spec), numbered(spec)

    def hook(v):
        return lambda module, args, out: out + v * (torch.arange(out.shape[1]) >= start)[:, None]

    shifts = [(i, s * d) for s in (first, second * -0.5) for i, d in vector.directions.items()]
    handles = [lm.backbone.get_submodule(names[i]).register_forward_hook(hook(v)) for i, v in shifts]
    try:
        yield lm
    finally:
        for h in handles:
            h.remove()

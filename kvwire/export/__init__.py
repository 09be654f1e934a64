"""Export the cached graph (edits included) to ONNX Runtime, ExecuTorch and Core ML; run exported
files with kvwire's generation loop."""
from .api import export, load_exported

__all__ = ["export", "load_exported"]

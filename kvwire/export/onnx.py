"""ONNX: torch.export -> torch.onnx (dynamo exporter); runs in onnxruntime."""
from pathlib import Path

from .trace import export_program

FORBIDDEN = ("If", "Loop", "Scan")


def to_onnx(prog, path, quantize=None):
    """Write `prog` to `path` (.onnx; weights over 2 GB go to a side file). Returns op types used.

    quantize: None, "int8" or "int4": weight-only MatMulNBits quantisation by onnxruntime's
    quantiser (block size 32, symmetric), applied to the MatMuls with constant weights.
    """
    import onnx
    import torch

    from .check import describe_failure

    try:
        ep = export_program(prog)
    except Exception as e:
        raise describe_failure(prog, "onnx", e) from e
    sig = prog.signature()
    # onnxscript's optimizer (half of the export time of the default model: 105 of 190 s) buys
    # nothing in onnxruntime, which folds and fuses at load time (default model's decode step:
    # 71 ms without it, 81 ms with it); only the quantiser runs it (see _quantize).
    try:
        program = torch.onnx.export(ep, (), dynamo=True, input_names=[n for n, _, _ in sig.inputs],
                                    output_names=list(sig.outputs), verbose=False, optimize=False)
    except Exception as e:
        raise describe_failure(prog, "onnx", e, ep) from e
    # constant folding alone (seconds): leaves no CastLike of constants or unused initializers,
    # which onnxruntime cannot fold / removes, warning about each at every load
    import onnxscript.optimizer
    onnxscript.optimizer.fold_constants(program.model)
    onnxscript.optimizer.remove_unused_nodes(program.model)
    model = program.model_proto
    ops = {n.op_type for n in model.graph.node}
    bad = sorted(ops & set(FORBIDDEN))
    if bad:
        raise RuntimeError(f"the exported ONNX graph contains control flow {bad}; kvwire graphs must not")
    if quantize is not None:
        model = _quantize(model, quantize)
    path = Path(path)
    big = model.ByteSize() > 1_900_000_000 if quantize is None else False
    onnx.save_model(model, str(path), save_as_external_data=big, location=path.name + ".data")
    return ops


def _quantize(model, bits):
    import onnxscript.optimizer
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if bits not in ("int4", "int8"):
        raise ValueError(f"quantize must be None, 'int4' or 'int8', got {bits!r}")
    # the quantiser finds MatMuls with constant weights: fold the weights' transposes first
    model = onnxscript.optimizer.optimize(model)
    quantizer = MatMulNBitsQuantizer(model, bits=4 if bits == "int4" else 8, block_size=32, is_symmetric=True)
    quantizer.process()
    return quantizer.model.model

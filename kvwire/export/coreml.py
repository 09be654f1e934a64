"""Core ML: torch.export (static shapes) -> coremltools `mlprogram`, two functions sharing weights.

Core ML wants static shapes, so the package has two entry points from one copy of the weights:
`prefill` (a chunk of `prefill_length` tokens) and `decode` (one token). With `stateful=True`
(iOS 18) the caches are model state (`StateType`, updated in place); otherwise they are inputs and
outputs (`past.*` / `present.*`). Integer inputs and the mask are int32. Prediction needs macOS;
`check_coreml` verifies the package structurally on any machine.
"""
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

LOOPS = ("cond", "while_loop")


class StatefulProgram(nn.Module):
    """`ExportProgram` with its caches as buffers: torch.export records the writes as buffer
    mutations, which coremltools turns into Core ML state updates."""

    def __init__(self, prog, batch_size):
        super().__init__()
        self.prog = prog
        sig = prog.signature()
        self.cache_names = [n for n, _, _ in sig.inputs if n.startswith("past.")]
        for name, shape, _ in sig.inputs:
            if name.startswith("past."):
                self.register_buffer(_buffer(name), torch.zeros((batch_size, *shape[1:])))

    def forward(self, token_ids, positions, cache_index, attention_mask, *runtime):
        caches = [getattr(self, _buffer(n)) for n in self.cache_names]
        logits, *new = self.prog(token_ids, positions, cache_index, attention_mask, *caches, *runtime)
        for buf, value in zip(caches, new):
            buf.copy_(value)
        return logits


def _buffer(name):
    return name.replace(".", "_")


def to_coreml(prog, path, batch_size, stateful, prefill_length):
    """Convert `prog` to an .mlpackage with functions "prefill" (`prefill_length` tokens) and
    "decode" (one token); returns the path."""
    import coremltools as ct

    from .trace import export_static

    module = StatefulProgram(prog, batch_size).eval() if stateful else prog
    with tempfile.TemporaryDirectory() as tmp:
        parts = {}
        for function, T in (("prefill", prefill_length), ("decode", 1)):
            example = prog.example_inputs(batch_size, T)
            if stateful:
                example = example[:4] + example[4 + 2 * len(prog.slots):]
            kwargs = {}
            if stateful:
                kwargs["states"] = [ct.StateType(wrapped_type=ct.TensorType(shape=tuple(b.shape), dtype=np.float16),
                                                 name=name) for name, b in module.named_buffers(recurse=False)]
            try:
                ep = export_static(module, example).run_decompositions(_decompositions())
                model = ct.convert(ep, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                                   skip_model_load=True, compute_precision=ct.precision.FLOAT32, **kwargs)
            except Exception as e:
                from .check import describe_failure
                raise describe_failure(prog, "coreml", e) from e
            check_coreml(model)
            parts[function] = Path(tmp) / f"{function}.mlpackage"
            _rename(model, prog, stateful).save(str(parts[function]))
        desc = ct.utils.MultiFunctionDescriptor()
        for function, part in parts.items():
            desc.add_function(str(part), src_function_name="main", target_function_name=function)
        desc.default_function_name = "decode"
        ct.utils.save_multifunction(desc, str(path))
    return path


def _decompositions():
    """ATen ops the layers use that coremltools has no mapping for, decomposed before conversion
    (addcmul: RMSNorm's scale and the rotary's rotation, fused in eager)."""
    from torch._decomp import get_decompositions

    return get_decompositions([torch.ops.aten.addcmul])


def _rename(model, prog, stateful):
    """Give the converted features kvwire's names (dots become underscores: past_3_key)."""
    import coremltools as ct

    spec = model.get_spec()
    sig = prog.signature()
    names = [n for n, _, _ in sig.inputs if not (stateful and n.startswith("past."))]
    outputs = ["logits"] if stateful else list(sig.outputs)
    for feature, name in zip(spec.description.input, names):
        ct.utils.rename_feature(spec, feature.name, _buffer(name), rename_outputs=False)
    for feature, name in zip(spec.description.output, outputs):
        ct.utils.rename_feature(spec, feature.name, _buffer(name), rename_inputs=False)
    return ct.models.MLModel(spec, weights_dir=model.weights_dir, skip_model_load=True)


def check_coreml(model):
    """Structural checks of a converted model (what coremltools #2008's conversion failed): no control-flow
    ops, every op's `weight` a constant, tensor dtypes Core ML supports. Returns the op types."""
    from coremltools.converters.mil.mil import types

    ops, problems = set(), []
    refused = {"fp64", "int64", "uint64"}  # tensor dtypes an mlprogram cannot hold
    for function in model._mil_program.functions.values():
        for op in function.operations:
            ops.add(op.op_type)
            weight = op.inputs.get("weight") if hasattr(op, "inputs") else None
            if weight is not None and weight.op is not None and weight.op.op_type != "const":
                problems.append(f"{op.name}: weight comes from {weight.op.op_type}, not a constant")
            for out in op.outputs:
                name = types.builtin_to_string(out.dtype) if getattr(out, "dtype", None) is not None else None
                if name in refused:
                    problems.append(f"{op.name}: output dtype {name}")
    loops = sorted(ops & set(LOOPS))
    if loops:
        problems.append(f"control-flow ops {loops}")
    if problems:
        raise RuntimeError("Core ML conversion is not loadable: " + "; ".join(problems[:5]))
    return ops


def package_summary(path):
    """Read a saved .mlpackage's program: {function: {"ops": set of op types, "nonconst_weights":
    [op names whose `weight` is not a constant], "inputs", "outputs", "states": {name: shape}}}."""
    import coremltools as ct

    spec = ct.utils.load_spec(str(path))
    shapes = lambda fs: {f.name: list(f.type.multiArrayType.shape) or list(f.type.stateType.arrayType.shape)
                         for f in fs}
    out = {}
    for desc in spec.description.functions:
        fn = spec.mlProgram.functions[desc.name]
        ops, consts, nonconst = set(), set(), []
        for block in fn.block_specializations.values():
            for op in block.operations:
                ops.add(op.type)
                if op.type == "const":
                    consts.update(o.name for o in op.outputs)
            for op in block.operations:
                weight = op.inputs.get("weight")
                if weight is not None and any(a.name and a.name not in consts for a in weight.arguments):
                    nonconst.append(op.type)
        out[desc.name] = {"ops": ops, "nonconst_weights": nonconst, "inputs": shapes(desc.input),
                          "outputs": shapes(desc.output), "states": shapes(desc.state)}
    return out

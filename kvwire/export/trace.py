"""torch.export of an `ExportProgram`: dynamic batch and chunk length (ONNX), or static shapes
(ExecuTorch, Core ML)."""
import torch
import torch.fx.experimental._config as fx_config
from torch.export import Dim

from ..graph.shell import shell
from ..models.generic.experts import dense_experts


def export_program(prog, max_batch=64, batch_size=None):
    """torch.export `prog` with dynamic batch (1..max_batch) and chunk length (1..max_length);
    a given `batch_size` makes the batch static instead.

    The traced example has two rows and two tokens; shapes are treated size-obliviously so that
    the graph carries no 0/1 specialisation. (torch.export still refuses a declared minimum of 1,
    so the declared ranges start at 2; the graphs are shape-generic and the tests run them with
    one row and one token on every runtime.)
    """
    sig = prog.signature()
    batch = Dim("batch", min=2, max=max_batch)
    chunk = Dim("chunk", min=2, max=max(prog.max_length, 3))
    dims = []
    for _, shape, _ in sig.inputs:
        dynamic = ("chunk",) if batch_size else ("batch", "chunk")
        d = {i: batch if s == "batch" else chunk for i, s in enumerate(shape) if s in dynamic}
        dims.append(d or None)
    example = prog.example_inputs(batch_size or 2, 2)
    # transformers' MoE experts in a form without data-dependent shapes (a no-op for other models)
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True), dense_experts(prog):
        # a shell: the trace swaps fake tensors into the modules it runs, not into the live model
        return torch.export.export(shell(prog), example, dynamic_shapes=(*dims[:4], tuple(dims[4:])), strict=False)


def export_static(module, example):
    """torch.export `module` for exactly the shapes of `example`. No symbolic shapes: lowering
    the result is ~5x faster than a dynamic-chunk program (the default model to ExecuTorch's
    edge dialect: 54 s vs 287 s), for runtimes that take one entry point per chunk length."""
    with torch.no_grad(), dense_experts(module):
        return torch.export.export(shell(module), example, strict=False)

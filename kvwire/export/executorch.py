"""ExecuTorch: torch.export (static batch, dynamic chunk) -> edge dialect -> XNNPACK delegate
where it applies (or portable kernels only) -> .pte, run by `executorch.runtime`."""
from pathlib import Path

from .trace import export_program

DELEGATES = ("xnnpack", "portable")


def to_executorch(prog, path, batch_size, delegate="xnnpack"):
    """Write `prog` as an ExecuTorch program (method "forward") for `batch_size` rows to `path`.

    The batch is static (ExecuTorch bounds dynamic dimensions by the traced example); the chunk
    length is dynamic up to max_length. Lowering with XNNPACK takes minutes on large graphs;
    delegate="portable" skips it (slower kernels, faster export).
    """
    from executorch.exir import to_edge, to_edge_transform_and_lower

    if delegate not in DELEGATES:
        raise ValueError(f"delegate must be one of {DELEGATES}, got {delegate!r}")
    from .check import describe_failure

    try:
        ep = export_program(prog, batch_size=batch_size)
        if delegate == "xnnpack":
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
            edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
        else:
            edge = to_edge(ep)
        program = edge.to_executorch()
    except Exception as e:
        raise describe_failure(prog, "executorch", e) from e
    Path(path).write_bytes(program.buffer)

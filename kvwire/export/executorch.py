"""ExecuTorch: one static-shape torch.export per chunk length -> edge dialect -> XNNPACK delegate
where it applies (or portable kernels only) -> one .pte whose methods share the weights, run by
`executorch.runtime`.

Why static: lowering a dynamic-chunk program spends most of its time in symbolic shape
arithmetic (the default model: 378 s to a portable .pte, 631 s with XNNPACK; one static method:
80 s portable). Prompts are left-padded to whole chunks where the cache has room (`ExportedLM`);
any other chunk runs as pieces of the exported lengths (`RuntimeGraph`).
"""
from pathlib import Path

from .trace import export_static

DELEGATES = ("xnnpack", "portable")


def method_name(length):
    """The .pte method that runs chunks of `length` tokens: "decode" for 1, else "prefill_<length>"."""
    return "decode" if length == 1 else f"prefill_{length}"


def to_executorch(prog, path, batch_size, lengths, delegate="xnnpack"):
    """Write `prog` as an ExecuTorch program for `batch_size` rows to `path`, one method per chunk
    length in `lengths` (distinct, longest first, ending with 1), weights stored once.

    Lowering with XNNPACK takes minutes on large graphs; delegate="portable" skips it (slower
    kernels, faster export).
    """
    from executorch.exir import to_edge, to_edge_transform_and_lower

    from .check import describe_failure

    if delegate not in DELEGATES:
        raise ValueError(f"delegate must be one of {DELEGATES}, got {delegate!r}")
    try:
        programs = {method_name(T): export_static(prog, prog.example_inputs(batch_size, T)) for T in lengths}
        if delegate == "xnnpack":
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
            edge = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()])
        else:
            edge = to_edge(programs)
        program = edge.to_executorch()
    except Exception as e:
        raise describe_failure(prog, "executorch", e) from e
    Path(path).write_bytes(program.buffer)

"""kvwire's bridge to ggml's CPU block kernels (from llama-cpp-python).

`ops`: the `kvwire::ggml_matmul`, `ggml_matmuls` and `ggml_rows` operators' schemas; `lib`: building
and loading the bridge (`matmul.c`, `x16.c`, `op.cpp`) that runs them; `fuse`: the Inductor pass
that turns sibling matmuls into one `ggml_matmuls` call. The module holding blocks
(`kvwire.quant.ggml.GGMLLinear`) sits above, in the quant package.
"""

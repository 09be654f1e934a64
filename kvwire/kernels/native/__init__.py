"""kvwire's own C kernels, built with the machine's C compiler on first use (`kernels.build`).

`gemv`: one-row float32 and bfloat16 products at memory speed on CPUs with AVX-512 (batch-1 decode).
`fused`: a gated MLP's act(gate) * up and RMSNorm in one pass on CPUs with AVX-512.
ggml's kernels have their own bridge (`kvwire.kernels.ggml`), built by the same helper.
"""

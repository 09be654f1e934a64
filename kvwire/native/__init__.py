"""kvwire's own C kernels, built with the machine's C compiler on first use (`build`).

`gemv`: one-row float32 products at memory speed on CPUs with AVX-512 (batch-1 decode).
ggml's kernels have their own bridge (`kvwire.quant.ggml.lib`), built the same way.
"""

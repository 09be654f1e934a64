"""CPU kernels and the choice among them: everything below the layers that decides how a product runs.

- `switches`: every `KVWIRE_*` environment variable, declared once, read through `switches.get`.
- `cpu`: what this CPU computes natively, and the path each kind of product takes on it.
- `products`: the product itself (`linear`) and the packed kernel a product of some shape takes.
- `native`: kvwire's own C kernels (a one-row GEMV, one-pass gated MLP and RMSNorm).
- `ggml`: the bridge to ggml's block kernels (`kvwire::ggml_*` operators) and its Inductor pass.
- `build`: compiling C and C++ sources with the machine's compilers on first use, into the cache.
- `tracing`: whether a compiler, exporter or functorch transform runs the current call.

Nothing here imports kvwire's layers or anything above them. docs/kernels.md describes the kernels,
the choices and their measurements.
"""

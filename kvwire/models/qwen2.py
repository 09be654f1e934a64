"""Qwen 2 / 2.5: q/k/v biases and none on o; with `use_sliding_window`, layers from
`max_window_layers` on slide (transformers v5 lists them in `layer_types`)."""
from .decoder import DecoderConfig, decoder_config, decoder_family, gguf_fields

WINDOW_KEYS = ("sliding_window", "layer_types")


def windows(d):
    """Qwen's window keys resolved as transformers does: no window unless use_sliding_window;
    returns (the dict without Qwen's own keys, `decoder_config`'s sliding pattern)."""
    d = dict(d)
    if not d.pop("use_sliding_window", False):
        d["sliding_window"] = None
    first = d.pop("max_window_layers", d.get("num_hidden_layers"))
    if first is not None and not (type(first) is int and first >= 0):
        raise ValueError(f"max_window_layers={first!r}; expected an integer >= 0 (the first layer that slides)")
    return d, {"first_sliding": first}


def config_from_hf(d):
    d, sliding = windows(d)
    return decoder_config(d, "qwen2", keys=WINDOW_KEYS, defaults={"tie_word_embeddings": False}, sliding=sliding,
                          attention_bias=True, attention_out_bias=False)


def config_from_gguf(meta, vocab_size, source, file):
    # llama.cpp's qwen2 reads no window: every layer full
    fields, _ = gguf_fields(meta, "qwen2", vocab_size, source, file, attention_bias=True,
                            attention_out_bias=False)
    return DecoderConfig(**fields)


FAMILY = decoder_family("qwen2", ("qwen2",), config_from_hf, gguf_architecture="qwen2",
                        config_from_gguf=config_from_gguf)

"""Write tiny GGUF files the way llama.cpp's converter lays them out, from tiny HF models."""
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

BYTE, CONTROL, NORMAL = 6, 3, 1


def sentencepiece_vocab(size):
    """A Gemma-like vocabulary: specials, 256 byte tokens, then pieces ranked in file order."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [CONTROL] * 4
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    pieces = ["\u2581", "e", "t", "a", "\u2581t", "he", "\u2581the", "in", "\u2581a", "an", "\u2581w", "or",
              "\u2581\u2581", "  ", "er", "\u2581an", "\u2581and", "\u00e9", "\u2581th", "\n", "\n\n"]
    for p in pieces:
        if len(tokens) < size and p not in tokens:
            tokens.append(p)
            types.append(NORMAL)
    letters = iter("bcdfghijklmnopqrsuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    while len(tokens) < size:
        tokens.append(next(letters))
        types.append(NORMAL)
    return tokens, types


def _store(writer, name, array, quant):
    array = np.ascontiguousarray(array, dtype=np.float32)
    if quant is GGMLQuantizationType.F32 or array.ndim == 1 or array.shape[-1] % 32:
        writer.add_tensor(name, array)
        return array
    q = quantize(array, quant)
    writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=quant)
    return dequantize(q, quant).reshape(array.shape)


def write_gemma3(path, hf, quant=GGMLQuantizationType.F32):
    """Write HF tiny Gemma 3 `hf` as a GGUF; returns the HF state dict with the stored (rounded) values."""
    c = hf.config
    w = GGUFWriter(str(path), "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    tokens, types = sentencepiece_vocab(c.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    stored = {}
    for key, value in hf.state_dict().items():
        if key == "lm_head.weight":
            continue
        key = key.removeprefix("model.")
        array = value.numpy()
        if key == "embed_tokens.weight":
            gname = "token_embd.weight"
        elif key == "norm.weight":
            gname = "output_norm.weight"
        else:
            _, i, rest = key.split(".", 2)
            gname = f"blk.{i}.{names[rest.rsplit('.', 1)[0]]}.weight"
        if key.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp folds Gemma's (1 + w) into the file
        kept = _store(w, gname, array, quant)
        stored["model." + key] = torch.from_numpy(kept - 1.0 if key.endswith("norm.weight") else kept)
    _finish(w)
    return stored


def write_gpt2(path, hf, quant=GGMLQuantizationType.F32, extra_tensor=None):
    """Write HF tiny GPT-2 `hf` as a GGUF (Linear layout, fused qkv); returns the stored values."""
    from tokenizers.pre_tokenizers import ByteLevel

    c = hf.config
    w = GGUFWriter(str(path), "gpt2")
    w.add_context_length(c.n_positions)
    w.add_embedding_length(c.n_embd)
    w.add_block_count(c.n_layer)
    w.add_feed_forward_length(4 * c.n_embd)
    w.add_head_count(c.n_head)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    alphabet = sorted(ByteLevel.alphabet())
    merges = ["\u0120 t", "h e", "\u0120t he", "i n", "e r"]
    tokens = ["<|endoftext|>"] + alphabet + ["\u0120t", "he", "\u0120the", "in", "er"]
    tokens += [f"x{i}" for i in range(c.vocab_size - len(tokens))]
    assert len(tokens) == c.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([CONTROL] + [NORMAL] * (len(tokens) - 1))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    stored = {}
    for key, value in hf.state_dict().items():
        key = key.removeprefix("transformer.")
        if key == "lm_head.weight" or key.endswith("attn.bias") and "c_attn" not in key:
            continue
        array = value.numpy()
        top = {"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight",
               "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias"}
        if key in top:
            gname = top[key]
        else:
            _, i, rest = key.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{names[module]}.{kind}"
            if kind == "weight" and module not in ("ln_1", "ln_2"):
                array = array.T  # HF Conv1D (in, out) -> llama.cpp (out, in)
        kept = _store(w, gname, array, quant)
        transposed = kept.T if gname.endswith("weight") and key.split(".")[-2] not in ("ln_1", "ln_2") \
            and gname.startswith("blk.") else kept
        stored["transformer." + key] = torch.from_numpy(np.ascontiguousarray(transposed))
    if extra_tensor is not None:
        name, raw, qtype, shape = extra_tensor
        w.add_tensor(name, raw, raw_shape=shape, raw_dtype=qtype)
    _finish(w)
    return stored


def _finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- an independent reader/writer of GGUF layouts, for tests that edit or corrupt files --------

GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


def encode_value(vtype, value):
    """The bytes of a GGUF value: a scalar, a str (STRING), or (item type, list) for an ARRAY."""
    import struct

    if vtype == STRING:
        raw = value.encode()
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ARRAY:
        item, values = value
        return struct.pack("<IQ", item, len(values)) + b"".join(encode_value(item, v) for v in values)
    return struct.pack(GGUF_SCALARS[vtype], value)


class GGUFParts:
    """A GGUF file taken apart: `kvs` [key, type, raw value bytes], `tensors` [name, dims, type id,
    data bytes], and `regions` [(start, end, section, name)] saying what every header byte is
    (section: magic, version, counts, key, vtype, value, tname, ndims, dims, ttype, offset, pad, data).
    `write` lays the tensors out again (llama.cpp's layout) at any alignment."""

    def __init__(self, path):
        import struct

        data = open(path, "rb").read()
        self.regions, pos = [], 0

        def take(n, section, name=""):
            nonlocal pos
            self.regions.append((pos, pos + n, section, name))
            pos += n
            return data[pos - n:pos]

        def skip_value(vtype):
            nonlocal pos
            if vtype == STRING:
                pos += 8 + struct.unpack_from("<Q", data, pos)[0]
            elif vtype == ARRAY:
                item, n = struct.unpack_from("<IQ", data, pos)
                pos += 12
                for _ in range(n):
                    skip_value(item)
            else:
                pos += struct.calcsize(GGUF_SCALARS[vtype])

        take(4, "magic")
        self.version = struct.unpack("<I", take(4, "version"))[0]
        n_tensors, n_kv = struct.unpack("<QQ", take(16, "counts"))
        self.kvs = []
        for _ in range(n_kv):
            n = struct.unpack_from("<Q", data, pos)[0]
            key = take(8 + n, "key")[8:].decode()
            self.regions[-1] = self.regions[-1][:3] + (key,)
            vtype = struct.unpack("<I", take(4, "vtype", key))[0]
            start = pos
            skip_value(vtype)
            pos, end = start, pos
            self.kvs.append([key, vtype, take(end - start, "value", key)])
        infos = []
        for _ in range(n_tensors):
            n = struct.unpack_from("<Q", data, pos)[0]
            name = take(8 + n, "tname")[8:].decode()
            self.regions[-1] = self.regions[-1][:3] + (name,)
            n_dims = struct.unpack("<I", take(4, "ndims", name))[0]
            dims = list(struct.unpack(f"<{n_dims}Q", take(8 * n_dims, "dims", name)))
            kind = struct.unpack("<I", take(4, "ttype", name))[0]
            infos.append((name, dims, kind, struct.unpack("<Q", take(8, "offset", name))[0]))
        self.alignment = self.get("general.alignment", 32)
        start = -(-pos // self.alignment) * self.alignment
        take(start - pos, "pad")
        ends = [o for _, _, _, o in infos[1:]] + [len(data) - start]
        self.tensors = []
        for (name, dims, kind, offset), end in zip(infos, ends):
            self.regions.append((start + offset, start + end, "data", name))
            self.tensors.append([name, dims, kind, data[start + offset:start + end]])
        self.data = data

    def get(self, key, default=None):
        import struct

        for k, vtype, raw in self.kvs:
            if k == key and vtype in GGUF_SCALARS:
                return struct.unpack(GGUF_SCALARS[vtype], raw)[0]
            if k == key and vtype == STRING:
                return raw[8:].decode()
        return default

    def set(self, key, vtype, value):
        """Replace (or add) a key's value, with any GGUF type."""
        raw = encode_value(vtype, value)
        for kv in self.kvs:
            if kv[0] == key:
                kv[1:] = [vtype, raw]
                return self
        self.kvs.append([key, vtype, raw])
        return self

    def drop(self, key):
        self.kvs = [kv for kv in self.kvs if kv[0] != key]
        return self

    def region(self, section, name=""):
        """(start, end) of a header region, e.g. ("value", "gpt2.block_count")."""
        return next((s, e) for s, e, sec, n in self.regions if sec == section and n == name)

    def to_bytes(self, alignment=None):
        """The parts as a GGUF file laid out at `alignment` (default: the file's own)."""
        import struct

        alignment = alignment or self.alignment
        out = [b"GGUF", struct.pack("<IQQ", self.version, len(self.tensors), len(self.kvs))]
        for key, vtype, raw in self.kvs:
            out += [encode_value(STRING, key), struct.pack("<I", vtype), raw]
        offset, blobs = 0, []
        for name, dims, kind, blob in self.tensors:
            out += [encode_value(STRING, name), struct.pack("<I", len(dims)), struct.pack(f"<{len(dims)}Q", *dims),
                    struct.pack("<IQ", kind, offset)]
            size = tensor_bytes(dims, kind)
            blobs.append(blob[:size] + b"\0" * (-size % alignment))
            offset += len(blobs[-1])
        header = b"".join(out)
        return header + b"\0" * (-len(header) % alignment) + b"".join(blobs)

    def write(self, path, alignment=None):
        open(path, "wb").write(self.to_bytes(alignment))
        return path


def tensor_bytes(dims, kind):
    """Bytes of a tensor of GGUF `dims` in ggml type `kind`."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    return int(np.prod(dims)) // block * size

"""Weight-only int8 / int4 linear maps on PyTorch's own CPU kernels.

Decoding a small model on a CPU streams every weight once per token, so bytes per weight set the
speed. int8 keeps one symmetric scale per output row (`aten._weight_int8pack_mm`); int4 keeps an
asymmetric scale and zero per group of `group_size` inputs (`aten._weight_int4pack_mm_for_cpu`,
the layout gpt-fast and torchao use). Both kernels want bfloat16 activations: with float32 ones
they run 4-10x slower here, so inputs are cast to bfloat16 and the result back.

With many rows (a prefill chunk) the kernels lose to MKL's float32 GEMM on a weight dequantised
for the call, so rows above `MANY_ROWS` take that path: prefill pays a dequantisation per layer,
decode streams 4 or 8 bits a weight.
"""
import torch
from torch import nn

# from these many rows, dequantising + float32 GEMM beats the kernel (2048 x 640 weight, 2 threads:
# int4 kernel 7.0 ms vs 3.7 + 3.3 ms at 128 rows, 26.7 vs 14.9 + 3.3 at 512; int8 3.4 vs 2.7 + 0.5 at 64)
MANY_ROWS = {"int8": 64, "int4": 128}
CHUNK_ROWS = 16384
BLOCK_N = 32  # rows per block of the CPU int4 packing
SCHEMES = ("int8", "int4")


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W)^T + b with W stored as int8 (per row) or int4 (per group).

    Args:
        weight: (out, in) float weight to quantise. bias: (out,) or None.
        scheme: "int8" or "int4". group_size: inputs per int4 group (32, 64, 128 or 256).

    Shapes: x (..., in) -> (..., out), in x's dtype.

    Example:
        >>> q = QuantizedLinear(torch.randn(64, 32), None, "int4", group_size=32)
        >>> q(torch.randn(2, 32)).shape
        torch.Size([2, 64])
    """

    cpu_only = "int8/int4 (PyTorch's CPU kernels)"  # what runs it, where a move to another device is refused
    exportable = False  # no export runtime has these kernels (ONNX export quantises on its own: quantize=)

    def __init__(self, weight, bias=None, scheme="int4", group_size=32):
        super().__init__()
        out_features, in_features = weight.shape
        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantisation scheme {scheme!r}; expected one of {SCHEMES}")
        check_shape(weight.shape, scheme, group_size)
        self.scheme, self.group_size = scheme, group_size
        self.in_features, self.out_features = in_features, out_features
        # rows are quantised a slice at a time: a float32 copy of a 262k-row head would cost 671 MB
        parts = [_quantize_int8(w.float()) if scheme == "int8" else _quantize_int4(w.float(), group_size)
                 for w in weight.detach().split(CHUNK_ROWS)]
        qweights, scales = zip(*parts)
        self.register_buffer("qweight", torch.cat(qweights))
        # int8: one scale per row (out,); int4: scales and zeros (in / group_size, out, 2)
        self.register_buffer("scales", torch.cat(scales, dim=0 if scheme == "int8" else 1))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear, scheme="int4", group_size=32):
        return cls(linear.weight, linear.bias, scheme, group_size)

    def forward(self, x):
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features)
        if rows > MANY_ROWS[self.scheme]:
            out = nn.functional.linear(x2.float(), self.dequantize())
        elif self.scheme == "int8":
            out = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.qweight, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16).contiguous(), self.qweight, self.group_size, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantize(self):
        """The weight as the kernels see it: (out, in) float32."""
        if self.scheme == "int8":
            return self.qweight.float() * self.scales.float()[:, None]
        q = _unpack_int4(self.qweight, self.out_features, self.in_features)
        if q is None:  # a layout this code does not know: read the weight back through the kernel
            eye = torch.eye(self.in_features, dtype=torch.bfloat16)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size,
                                                              self.scales).float().t().contiguous()
        groups = q.view(self.out_features, -1, self.group_size).float()
        scale, zero = self.scales.float().transpose(0, 1).unbind(-1)  # (out, in / group_size) each
        return ((groups - 8) * scale[..., None] + zero[..., None]).view(self.out_features, self.in_features)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}, group_size={self.group_size}"


def check_shape(shape, scheme, group_size=32, name="weight"):
    """Refuse a weight (out, in) that `scheme`'s kernel cannot hold, before anything is quantised."""
    out_features, in_features = shape
    if scheme == "int4" and (group_size not in (32, 64, 128, 256) or in_features % group_size):
        raise ValueError(f"int4 group_size must be 32, 64, 128 or 256 and divide in_features={in_features}; "
                         f"got {group_size}")
    if scheme == "int4" and out_features % 16:  # the CPU kernel packs rows in 16s
        raise ValueError(f"int4 needs a multiple of 16 output rows; {name} has {out_features} (shape "
                         f"{tuple(shape)}): use int8 or a ggml type such as 'q4_0'")


def _quantize_int8(w):
    """Symmetric per-row int8: w ~ q * scale, q in [-127, 127]. -> (q (out, in) int8, scale (out,) bf16)."""
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _quantize_int4(w, group_size):
    """Asymmetric per-group int4: w ~ (q - 8) * scale + zero, q in [0, 15].

    -> (packed weight for the CPU kernel, scales_and_zeros (in / group_size, out, 2) bf16)."""
    out_features, in_features = w.shape
    groups = w.reshape(out_features, in_features // group_size, group_size)
    lo, hi = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    # scale and zero are rounded to bfloat16 (what the kernel reads) before choosing q
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((groups - zero) / scale + 8).clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    scales_and_zeros = torch.cat((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, scales_and_zeros


def _unpack_int4(packed, out_features, in_features):
    """The 0..15 codes (out, in) uint8 from the CPU kernel's packing, or None if it is not the one
    known here. Known layout: per block of 32 output rows, bytes run input-major, 16 per input;
    byte j holds row j in its low nibble and row 16 + j in its high one."""
    if out_features % BLOCK_N or not _layout_known():
        return None
    blocks = packed.view(out_features // BLOCK_N, in_features, BLOCK_N // 2)
    codes = torch.cat((blocks & 15, blocks >> 4), dim=2)  # (blocks, in, 32)
    return codes.transpose(1, 2).reshape(out_features, in_features)


_LAYOUT = {}


def _layout_known():
    """Whether this torch packs int4 weights as `_unpack_int4` reads them (checked once)."""
    if "known" not in _LAYOUT:
        codes = torch.randint(0, 16, (2 * BLOCK_N, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        _LAYOUT["known"] = packed.shape == (2 * BLOCK_N, 32) and packed.dtype == torch.uint8
        if _LAYOUT["known"]:
            blocks = packed.view(2, 64, BLOCK_N // 2)
            unpacked = torch.cat((blocks & 15, blocks >> 4), dim=2).transpose(1, 2).reshape(2 * BLOCK_N, 64)
            _LAYOUT["known"] = torch.equal(unpacked.int(), codes)
    return _LAYOUT["known"]

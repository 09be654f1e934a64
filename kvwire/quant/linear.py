"""Weight-only int8 / int4 linear maps on PyTorch's own CPU kernels.

Decoding a small model on a CPU streams every weight once per token, so bytes per weight set the
speed. int8 keeps one symmetric scale per output row (`aten._weight_int8pack_mm`); int4 keeps an
asymmetric scale and zero per group of `group_size` inputs (`aten._weight_int4pack_mm_for_cpu`,
the layout gpt-fast and torchao use). Both kernels want bfloat16 activations: with float32 ones
they run 4-10x slower here, so inputs are cast to bfloat16 and the result back.

With many rows (a prefill chunk) the kernels lose to MKL's float32 GEMM on a weight dequantised
for the call, so rows above `SMALL_ROWS` take that path: prefill pays a dequantisation per layer,
decode streams 4 or 8 bits a weight.
"""
import torch
from torch import nn

SMALL_ROWS = 64
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

    def __init__(self, weight, bias=None, scheme="int4", group_size=32):
        super().__init__()
        out_features, in_features = weight.shape
        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantisation scheme {scheme!r}; expected one of {SCHEMES}")
        if scheme == "int4" and (group_size not in (32, 64, 128, 256) or in_features % group_size):
            raise ValueError(f"int4 group_size must be 32, 64, 128 or 256 and divide in_features={in_features}; "
                             f"got {group_size}")
        self.scheme, self.group_size = scheme, group_size
        self.in_features, self.out_features = in_features, out_features
        w = weight.detach().float()
        if scheme == "int8":
            qweight, scales = _quantize_int8(w)
        else:
            qweight, scales = _quantize_int4(w, group_size)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear, scheme="int4", group_size=32):
        return cls(linear.weight, linear.bias, scheme, group_size)

    def forward(self, x):
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features)
        if rows > SMALL_ROWS:
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
        # the packed layout is the kernel's own: read the weight back through it with an identity
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        cols = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, self.scales)
        return cols.float().t().contiguous()

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}, group_size={self.group_size}"


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

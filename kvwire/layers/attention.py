"""Causal self-attention (MHA/GQA/MQA) that speaks the cache protocol.

One attention routine serves both calls: plainly, queries attend to the chunk itself; in the cached
graph, they attend to the layer's cache as it was *before* this chunk plus the chunk itself, and
then the chunk is written into the cache. Attending to two blocks (rather than writing first) is
what lets a sliding-window ring buffer of `window - 1` slots serve any chunk length, even one
longer than the window, and it reads the cache in place instead of concatenating a copy of it.
"""
from contextlib import contextmanager

import torch

from ..kernels.cpu import bf16_gemm
from ..kernels.products import siblings
from ..kernels.tracing import is_exporting
from .base import Layer
from .inner import InnerSites
from .linear import Linear
from .masks import chunk_mask, ring_indices, ring_sources, slot_mask
from .norm import as_float32
from .shared import shared

FLASH_ROWS = 64  # query rows per key/value head from which the fused kernel pays off
_compiled_in_place = False  # see in_place_cache_writes
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class AttentionMath:
    """What cached attention does once queries, keys and values exist: attend to the cache as it was
    before the chunk plus the chunk itself, then write the chunk into the cache (a ring for a
    sliding window). Shared by `Attention` and by attention computed in other modules (the generic
    path's transformers attention). Needs the attributes num_kv_heads, scale, softcap, sliding_window.
    """

    def cache_slots(self, max_length):
        """Cache length: a ring of window - 1 past tokens (the current one comes from the chunk)."""
        if self.sliding_window is None:
            return max_length
        return max(1, min(self.sliding_window - 1, max_length))

    def attend_cached(self, q, k, v, cache, cache_index, attention_mask, dtype=torch.float32):
        """q (B, H, T, hd), k (B, Hkv, T, hd), v (B, Hkv, T, hd_v) (positions already applied),
        cache (key, value) each (B, Hkv, slots, hd|hd_v), cache_index () or (B,), attention_mask
        (B, max_length) -> (out (B, H, T, hd_v) float32, next cache). Writes in place (functionally
        while compiled or exported, but for compiled steps that write in place)."""
        k_cache, v_cache = cache
        T, slots = q.shape[2], k_cache.shape[2]
        # layers with the same window share masks (and index maps) within one cached-graph call
        old = shared(slot_mask, cache_index, T, slots, self.sliding_window, attention_mask)
        new = shared(chunk_mask, cache_index, T, self.sliding_window, attention_mask)
        out = self._attend(q, [(k_cache, v_cache, old), (k, v, new)], dtype)
        return out, write_chunk(cache, k, v, cache_index)

    def _attend(self, q, blocks, dtype=torch.float32):
        """q (B, H, T, hd) of any float dtype; blocks: [(k, v, mask)] with k, v (B, Hkv, S_i, hd),
        mask (B|1, T, S_i) -> (B, H, T, hd) float32 (bf16 from a bf16 flash kernel's single block);
        `dtype`: the layer input's. Query heads are grouped per key/value head so no cache is repeated.

        Eager CPU calls with many query rows use the fused flash kernel once per block and merge the
        blocks by their log-sum-exp (a 512-token prefill chunk: 22 ms against 58 ms per layer);
        compilers and exporters, soft-capping and decode steps take the dense path."""
        rows = q.shape[1] * q.shape[2] // self.num_kv_heads
        if not torch.compiler.is_compiling() and self.softcap is None and rows >= FLASH_ROWS \
                and q.device.type == "cpu":
            return self._attend_flash(q, blocks, dtype)
        if not torch.compiler.is_compiling():  # eager: slots past the last one any row sees are left out
            blocks = [(k[:, :, :used], v[:, :, :used], m[..., :used]) for k, v, m in blocks
                      for used in (shared(_used_columns, m),) if used]
        B, H, T, hd = q.shape
        groups = H // self.num_kv_heads
        qg = as_float32(q).reshape(B, self.num_kv_heads, groups * T, hd)
        # a compiled decode step (one query row a head): products and sums, which Inductor fuses with
        # the softmax into a few loops; a batched-matmul call there costs more than its arithmetic
        fused = T == 1 and torch.compiler.is_dynamo_compiling()
        matmul = _broadcast_matmul if fused else torch.matmul
        scores = torch.cat([matmul(qg, as_float32(k).transpose(-1, -2)) for k, _, _ in blocks], dim=-1) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        mask = torch.cat([m for _, _, m in blocks], dim=-1)  # (B|1, T, S)
        sizes = [k.shape[2] for k, _, _ in blocks]
        scores = scores.view(B, self.num_kv_heads, groups, T, sum(sizes))
        scores = scores.masked_fill(torch.logical_not(mask[:, None, None]), float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(B, self.num_kv_heads, groups * T, sum(sizes))
        parts = torch.split(probs, sizes, dim=-1)
        out = sum(matmul(p, as_float32(v)) for p, (_, v, _) in zip(parts, blocks))
        return out.view(B, H, T, -1)  # hd of the values

    def _attend_flash(self, q, blocks, dtype):
        B, H, T, hd = q.shape
        # A bfloat16 model on a CPU with bf16 units (`cpu.bf16_gemm()`) runs the kernel in bf16, as
        # transformers does: the default model's 512-token prefill 0.36 -> 0.30 s on an AMX Xeon.
        # Queries, keys and values are rounded to bf16 for it (a cache block is copied to bf16 up to
        # the last slot any row sees); the log-sum-exp merge and the caches stay float32, and a
        # single block's bf16 output goes to `_output` as it is.
        kernel = torch.bfloat16 if dtype == torch.bfloat16 and bf16_gemm() != "upcast" else torch.float32
        groups = H // self.num_kv_heads
        qg = _dense(q, kernel).view(B, self.num_kv_heads, -1, hd)
        outs, lses = [], []
        for k, v, mask in blocks:
            if k.shape[2] == T and shared(_plain_causal, mask):
                # a chunk attending to itself with no padding: the kernel's own causal mode skips
                # the blocks above the diagonal (an explicit mask has it compute them); it takes a
                # head per query head, so the keys are repeated per group
                out, lse = _flash(qg.view(B, H, T, hd), _dense(k, kernel).repeat_interleave(groups, dim=1),
                                  _dense(v, kernel).repeat_interleave(groups, dim=1), is_causal=True,
                                  scale=self.scale)
                outs.append(out.reshape(B, self.num_kv_heads, groups * T, -1))
                lses.append(lse.reshape(B, self.num_kv_heads, groups * T))
                continue
            bias, seen, used = shared(_flash_bias, mask, groups, kernel)
            if bias is None:  # e.g. the empty cache of a prompt's first chunk: nothing to attend
                continue
            # the kernel misreads strided views: chunk k/v come transposed (caches are contiguous);
            # slots past the last one any row sees (a cache longer than what is written) are left out
            k, v = _dense(k[:, :, :used], kernel), _dense(v[:, :, :used], kernel)
            out, lse = _flash(qg, k, v, attn_mask=bias, scale=self.scale)
            if seen is not None:  # rows that see no key of this block take no part in the merge
                out, lse = out.masked_fill(~seen[..., None], 0.0), lse.masked_fill(~seen, float("-inf"))
            outs.append(out)
            lses.append(lse)
        if len(outs) == 1:  # in the kernel's dtype: `_output` casts it with its transpose, in one pass
            return outs[0].view(B, H, T, -1)
        total = torch.logsumexp(torch.stack(lses), dim=0)
        out = sum(as_float32(o) * torch.exp(lse - total)[..., None] for o, lse in zip(outs, lses))
        return out.view(B, H, T, -1)  # hd of the values


class Attention(AttentionMath, InnerSites, Layer):
    """Multi-head attention with grouped key/value heads, optional rotary, QK-norm, window, soft-cap.

    Args:
        dim: model width D. num_heads / num_kv_heads: query and key/value heads (GQA when fewer).
        head_dim: size of one head. scale: multiplier of q.k (default head_dim ** -0.5).
        bias: biases on the q/k/v projections; o_bias: on the output projection (default: `bias`;
            Qwen 2 has q/k/v biases and none on o). rotary: a `Rotary` or None (learned positions).
        qk_norm: a factory `f(width)` for query/key norms, or None; qk_norm_width "head" normalises
            each head (Qwen 3, Gemma 3), "full" the whole projection before the head split (OLMo 2).
        sliding_window: tokens a query may see, itself included (None = unlimited).
        softcap: tanh soft-capping of attention logits, or None.

    Shapes: x (B, T, D) -> (B, T, D). The cache is a (key, value) pair, each
    (B, num_kv_heads, slots, head_dim), where slots = max_length, or window - 1 for a sliding layer.
    Scores, softmax and the cache are float32 whatever the weights' dtype (an eager call rotates q and
    k in the weights' dtype first, as transformers does), but for a bf16 prompt's
    flash kernel on a CPU with bf16 units (bf16 inputs, probabilities rounded to bf16 inside it; the
    merge of blocks and the cache stay float32, a single block's output goes to o_proj in bf16).

    Inner site (`kvwire.layers.inner`): "attn_heads", the heads' outputs side by side, (B, T,
    num_heads * head_dim), as the output projection reads them; head h is columns
    [h * head_dim, (h + 1) * head_dim).

    Example:
        >>> attn = Attention(16, 4, 2, 4)
        >>> attn(torch.randn(2, 3, 16)).shape
        torch.Size([2, 3, 16])
    """

    uses_positions = True
    inner_sites = ("attn_heads",)

    def __init__(self, dim, num_heads, num_kv_heads, head_dim, *, scale=None, bias=False, o_bias=None,
                 rotary=None, qk_norm=None, qk_norm_width="head", sliding_window=None, softcap=None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window, self.softcap = sliding_window, softcap
        self.q_proj = Linear(dim, num_heads * head_dim, bias=bias)
        self.k_proj = Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, dim, bias=bias if o_bias is None else o_bias)
        self.rotary = rotary
        if qk_norm_width not in ("head", "full"):
            raise ValueError(f"qk_norm_width={qk_norm_width!r}; expected 'head' or 'full'")
        self.qk_norm_full = qk_norm_width == "full"
        full = self.qk_norm_full
        self.q_norm = qk_norm(num_heads * head_dim if full else head_dim) if qk_norm else None
        self.k_norm = qk_norm(num_kv_heads * head_dim if full else head_dim) if qk_norm else None

    def cache_spec(self, batch_size, max_length, dtype):
        shape = (batch_size, self.num_kv_heads, self.cache_slots(max_length), self.head_dim)
        return (shape, shape)

    def forward(self, x, gate=None):
        T = x.shape[1]
        positions = torch.arange(T, device=x.device)[None]
        q, k, v = self._project(x, positions)
        mask = chunk_mask(torch.zeros((), dtype=torch.long, device=x.device), T, self.sliding_window, None)
        return self._output(self._attend(q, [(k, v, mask)], x.dtype), x.dtype, gate=gate)

    def site_width(self, site):
        return self.num_heads * self.head_dim

    @property
    def head_size(self):
        """Columns per head at "attn_heads"."""
        return self.head_dim

    def forward_cached(self, x, gate=None, *, positions, cache_index, attention_mask, cache, **inputs):
        """x (B, T, D), positions (B, T), cache_index () or (B,) int (one write index for the batch,
        or one per row), attention_mask (B, max_length) bool, cache (key, value), and the runtime
        inputs (and gate (B, T, 1), for gated operations) of what is edited in at "attn_heads" ->
        (out (B, T, D), next cache). Writes the chunk into the cache in place (functionally,
        returning new tensors, while being exported or compiled, but for generation's compiled
        steps and short prompts: see `in_place_cache_writes`)."""
        q, k, v = self._project(x, positions)
        out, cache = self.attend_cached(q, k, v, cache, cache_index, attention_mask, x.dtype)
        return self._output(out, x.dtype, positions, inputs, gate), cache

    def _project(self, x, positions):
        B, T, _ = x.shape
        q, k, v = siblings(x, (self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None and self.qk_norm_full:  # over all heads at once (OLMo 2)
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_full:  # per head, on the dense layout
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # Attention runs in float32 whatever the weights: reduced-precision batched matmuls are slow
        # on CPUs without native bf16, and the cache keeps full precision (no-ops for float32);
        # a bf16 prompt's flash kernel is the exception where the CPU has bf16 units (_attend_flash).
        # Eager, the rotary runs in the projections' dtype, as transformers' does (a bf16 512-token
        # prefill faster than in float32), and q stays in it until `_attend` (the
        # flash kernel takes bf16); compilers and exporters rotate in float32 (no mixed-dtype graphs).
        if torch.compiler.is_compiling() or is_exporting():
            q, k = as_float32(q), as_float32(k)
        if self.rotary is not None:
            cos, sin = self.rotary.tables(positions, q.dtype)
            q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        return q, as_float32(k), as_float32(v)

    def _output(self, out, dtype, positions=None, inputs=None, gate=None):
        B, H, T, hd = out.shape
        if self.edits:  # (B, H, T, hd) -> (B, T, H * hd): the heads as o_proj reads them, edited
            heads = out.transpose(1, 2).reshape(B, T, H * hd)
            return self.o_proj(self.edit_at("attn_heads", heads if heads.dtype == dtype else heads.to(dtype),
                                            positions, inputs, gate))
        if torch.compiler.is_compiling() or is_exporting():  # functional ops for compilers and exporters
            out = out.transpose(1, 2).reshape(B, T, H * hd)
            return self.o_proj(out if out.dtype == dtype else out.to(dtype))
        return self.o_proj(_dense(out.transpose(1, 2), dtype).view(B, T, H * hd))


def write_chunk(cache, k, v, cache_index):
    """The cache (key, value), each (B, Hkv, slots, hd), with the chunk's k, v (B, Hkv, T, hd)
    written at cache_index () or (B,) (a ring of `slots` positions): in place, or functionally while
    compiled or exported (but for compiled steps that write in place)."""
    k_cache, v_cache = cache
    T, slots = k.shape[2], k_cache.shape[2]
    if functional_cache_writes():  # exporters and other compilers:
        # a functional, shape-free update (it reads and writes every slot of the cache)
        source, take = shared(ring_sources, cache_index, T, slots)
        return _merged(k_cache, k, source, take), _merged(v_cache, v, source, take)
    # Only the last `slots` tokens of the chunk can still be needed; older ones are overwritten.
    k_tail, v_tail = k[:, :, -slots:], v[:, :, -slots:]
    index = shared(ring_indices, cache_index, T, k_tail.shape[2], slots)
    _write(k_cache, index, k_tail)
    _write(v_cache, index, v_tail)
    return k_cache, v_cache


@contextmanager
def in_place_cache_writes(exports=False):
    """While torch.compile traces inside this scope, cached attention writes the chunk into the
    cache in place (one slot a decode step, T slots a T-token prompt chunk) instead of returning
    updated copies of whole caches.
    `CompiledDecode` uses it where it also keeps Inductor from undoing it (see compiled.py); an
    export (unless `exports`: `AheadDecode`'s AOTInductor steps, whose C++ writes the mutated cache
    inputs in place), or a graph compiled with autograd on (the attention saves the old cache for
    its backward), stays functional. Read at trace time, on the tracing thread's call.

    Example:
        >>> with in_place_cache_writes():
        ...     logits = compiled_step(token_ids, positions, cache_index, attention_mask, cache)
    """
    global _compiled_in_place
    before, _compiled_in_place = _compiled_in_place, "exports" if exports else True
    try:
        yield
    finally:
        _compiled_in_place = before


def _writes_in_place():
    return bool(_compiled_in_place) and not torch.is_grad_enabled() and (
        _compiled_in_place == "exports" or not is_exporting())


def functional_cache_writes():
    """Whether a layer writing its cache (or state) should return new tensors rather than write in
    place: while compiled or exported, but for compiled steps that write in place."""
    return torch.compiler.is_compiling() and not _writes_in_place()


def _merged(cache, new, source, take):
    """The cache with the chunk's tokens put in their slots, functionally: source/take (slots,), or
    (B, slots) per row (see masks.ring_sources)."""
    if source.dim() == 1:
        return torch.where((source < 0)[None, None, :, None], cache, new.index_select(2, take))
    B, H, _, hd = cache.shape
    gathered = new.gather(2, take[:, None, :, None].expand(B, H, take.shape[1], hd))
    return torch.where((source < 0)[:, None, :, None], cache, gathered)


def _write(cache, index, tail):
    """cache[:, :, index] = tail in place: index (n,), or (B, n) for one set of slots per row (no
    slot twice in a row: the tail is at most as long as the cache)."""
    # index_put_, not index_copy_ / scatter_: Inductor writes an index_put_ on a compiled step's
    # cache input in place, where the others become a copy of the whole cache and a copy back
    if index.dim() == 1:
        cache[:, :, index] = tail
    else:
        rows = torch.arange(tail.shape[0], device=index.device)[:, None]
        cache[rows, :, index] = tail.transpose(1, 2)  # advanced indices first: (B, n, H, hd)


def _dense(t, dtype):
    """t as a contiguous tensor of `dtype`, cast and laid out in one pass (`t.to(dtype).contiguous()`
    of a strided view takes two)."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return torch.empty(t.shape, dtype=dtype, device=t.device).copy_(t)


def _broadcast_matmul(a, b):
    """a (..., M, K) @ b (..., K, N) as a broadcast product summed over K."""
    return (a[..., :, :, None] * b[..., None, :, :]).sum(-2)


def _used_columns(mask):
    """How many leading key columns of a block's mask (B|1, T, S) any query sees: through the last
    seen one (a cache's timeline is longer than what its rows have written). Eager only."""
    seen = mask.flatten(0, -2).any(0).nonzero()
    return int(seen[-1]) + 1 if len(seen) else 0


def _plain_causal(mask):
    """Whether a chunk's mask (B|1, T, T) is exactly causal in every row (no padding, no window)."""
    T = mask.shape[-1]
    return bool(torch.equal(mask, torch.ones(T, T, dtype=torch.bool, device=mask.device).tril().expand_as(mask)))


def _flash_bias(mask, groups, dtype=torch.float32):
    """(bias, seen, used) of a block's mask (B|1, T, S) for the flash kernel: its first `used` key
    columns (through the last one any row sees: a prompt's second chunk reads the written slots of a
    max_length cache, not all of them) as an additive bias (B|1, 1, groups*T, used) of `dtype`, and
    which query rows see any key (B|1, 1, groups*T), or None where every row does. (None, None, 0)
    when no row sees a key (the kernel is skipped, so the bias is never built: 4 MB a block at 512
    rows of 4 query heads x 512 keys), (bias, None, used) when every row sees one (nothing to mask
    after the kernel). Eager only: it reads the mask on the host to decide."""
    seen = mask.any(-1)  # (B|1, T): rows with no visible key, where the kernel may give 0 or NaN
    if not bool(seen.any()):
        return None, None, 0
    used = _used_columns(mask)
    mask = mask[..., :used]
    rows = mask[:, None, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, -1, used)
    bias = torch.zeros(rows.shape, dtype=dtype, device=rows.device).masked_fill(torch.logical_not(rows), float("-inf"))
    if bool(seen.all()):
        return bias, None, used
    return bias, seen[:, None, None].expand(-1, -1, groups, -1).reshape(mask.shape[0], 1, -1), used

"""A `torch.compile`d decode step: the cached graph and the head for one token per row, and for
a prompt's short last chunk.

Decode at batch 1 runs thousands of small ops a token; eager PyTorch's dispatch for them costs
more than the weights cost to stream once they are 4-8 bits. Compiled, Inductor fuses the norms,
rotary, masks and softmax into a few C++ kernels, and the matmuls stay library calls. Shapes are
static (one compile per batch size and cache length), so cache lengths are rounded up to `bucket`
times a power of two: calls with different `max_length` share compiled steps, a long context
costs a logarithmic number of compiles, and a short one attends over few slots (decode reads
every slot). With
Inductor, ggml matmuls that read one input run as one call (`kernels/ggml/fuse.py`).

A prompt's last chunk of 2 to `prefill_tokens` (32) tokens runs through the same compiled function,
with its length dynamic: one more graph per batch size and cache length serves every short prompt
(eager, such a prompt pays more in small ops than in its matrix products; the extra graph doubles
the first call's compile). Longer chunks stay eager, where the fused flash
attention and many-row matrix products pay and small ops do not matter.

Dynamo checks hundreds of guards (every weight's metadata) before each call. Once a
call of a signature (batch, tokens per row, cache length, one cache index or one per row, input /
cache / weight dtypes, grad mode) has run without compiling anything, later calls with it evaluate
only the guards that tell compiled variants apart (`skip_guard_eval_unsafe`): safe because nothing else
those guards check changes between the steps of a generation, and an edit makes a new model (or,
swapped in place, is followed by `lm.reset_caches()`, which drops this object) and so a new
`CompiledDecode`. Past that, a decode step's signature whose compiled graph stands in for the
whole call calls Inductor's function directly, holding the weight tensors it was compiled with
(`direct.py`): the same contract (weights changed in place are seen; a module or parameter object
swapped in needs `lm.reset_caches()`). A call that dynamo
still finds would need a new graph (say its tensors were made in inference mode, generation's
were not) is refused before it runs and goes again with every guard, compiling what it needs.
"""
import contextlib

import torch

from ..layers.attention import in_place_cache_writes
from ..layers.linear import allow_packs_in_compiled_graphs
from .direct import DirectCalls, flat_args, packed

# Longest prompt chunk run compiled by default (bench/generate.py's prefill 32); longer chunks keep
# eager's flash attention and, for Q4_1 / Q5_1, its dequantised float GEMM.
PREFILL_TOKENS = 32
RECOMPILE_LIMIT = 64  # graphs of the one `step` code, all instances together (see __call__)
# Inductor's Python wrapper checks the size, strides and alignment of every input and custom-op output
# on each call, a measurable part of a token (bench/compile_options.py). kvwire's signature key
# (`__call__`) holds every tensor argument's shape and strides instead.
WRAPPER_CHECKS_OFF = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


class Buckets:
    """Cache lengths of compiled steps: `bucket` * 2^k slots, so calls of different lengths share a
    step and a long context costs a logarithmic number of them (needs `self.bucket`)."""

    def length(self, max_length, limit=None):
        """max_length rounded up to bucket * 2^k (not past `limit` when given)."""
        rounded = self.bucket
        while rounded < max_length:
            rounded *= 2
        return rounded if limit is None or max_length > limit else min(rounded, limit)


class CompiledDecode(Buckets):
    """decode(ids (B, T), positions (B, T), cache_index () or (B,), mask (B, L), cache, extra) ->
    (logits (B, V) of the last position, cache): the same values as the eager cached graph + head,
    compiled. T is 1 (a decode step) or, for a prompt chunk, up to `prefill_tokens` (`takes`; 0:
    prompts stay eager).

    Example:
        >>> lm = kw.load("gemma3-270m", quantize="gguf").compile()
        >>> lm.generate("Once upon a time", max_new_tokens=64)   # first call compiles (~1 min)
    """

    def __init__(self, cached, head, bucket=64, prefill_tokens=PREFILL_TOKENS, **options):
        check_settings(bucket, prefill_tokens)
        self.bucket, self.head, self.prefill_tokens = bucket, head, prefill_tokens
        graph = cached.graph_module

        def step(token_ids, positions, cache_index, attention_mask, cache, *extra):
            hidden, cache = graph(token_ids, positions, cache_index, attention_mask, cache, *extra)
            return head(hidden[:, -1]), cache

        allow_packs_in_compiled_graphs()  # dynamo is imported here, with the first compiled step
        options = _with_passes(options)
        self.cudagraphs = bool((options.get("options") or {}).get("triton.cudagraphs"))
        self.direct = {}  # see direct.py; CUDA graphs replay through dynamo's own calls
        self.use_direct = "options" in options and len(options) == 1 and not self.cudagraphs
        if self.use_direct:  # Inductor with kvwire's options and no others: also called directly
            self.backend = DirectCalls(options["options"])
            self.step = torch.compile(step, dynamic=False, backend=self.backend)
        else:
            self.step = torch.compile(step, dynamic=False, **options)
        # caches written in place where the Inductor pass that would copy them back is off
        self.writes = in_place_cache_writes if (options.get("options") or {}).get("reorder_for_locality") is False \
            else contextlib.nullcontext
        self.seen = set()  # call signatures that run without compiling

    def takes(self, tokens, max_length):
        """Whether a prompt chunk of `tokens` tokens per row into caches of `max_length` slots runs
        compiled: a short chunk (one token: through the decode step's graph), into caches of a
        bucket's length (64 * 2^k; a length capped by the model's context stays eager). Callers
        pass only the caches decode steps use: a scratch cache of the prompt's own length would
        compile a graph for every length."""
        return 1 <= tokens <= self.prefill_tokens and self.length(max_length) == max_length

    def __call__(self, token_ids, positions, cache_index, attention_mask, cache, extra):
        token_ids, positions = packed(token_ids), packed(positions)
        chunk = token_ids.shape[1]
        if chunk > 1:  # one graph for the chunk lengths (T = 1 keeps the static decode graph); more
            for t in (token_ids, positions):  # where a graph compares T with a ring cache's slots
                torch._dynamo.maybe_mark_dynamic(t, 1)
        # each chunk length is checked against every guard once: a dynamic graph may hold for some
        # lengths only (say those past a ring cache's slots); torch 2.13 still checks shapes with
        # guards skipped (and refuses), the exact length keeps that from resting on it
        if self.cudagraphs:
            _static_addresses(cache)
        args = (token_ids, positions, cache_index, attention_mask, cache, *extra)
        flat = flat_args(args)
        key = (token_ids.device, tuple((t.shape, t.stride()) for t in flat),  # Inductor's size asserts are off
               tuple(t.dtype for t in extra),
               cache[0][0].dtype if cache else None, self.head.weight.dtype,  # e.g. lm.to(bfloat16)
               torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        direct = self.direct.get(key)
        if direct is not None:
            return direct(flat, cache)
        if key not in self.seen:  # every guard; seen once a call of this signature compiled nothing new
            graphs = _compiled_graphs()
            direct_ok = self.use_direct and self.writes is in_place_cache_writes
            # the caches as this call finds them, for `entry`'s re-run of the step: the step writes
            # its slots in place, and a ring cache's step reads a slot it then overwrites (a copy
            # of the caches once per call signature, freed when the check is done)
            before = [t.clone() for pair in cache for t in pair] if direct_ok else None
            # every batch size, cache length and chunk kind is a graph of the one `step` code
            # (shared by all instances): past dynamo's default of 8 it would run eager. The old
            # name: torch 2.6 has no `recompile_limit`, later versions alias it
            with torch._dynamo.config.patch(cache_size_limit=RECOMPILE_LIMIT), self.writes():
                out = self.step(*args)
            if _compiled_graphs() == graphs:
                self.seen.add(key)
            elif direct_ok:
                entry = self.backend.entry(flat, cache, out, before)
                if entry is not None:
                    self.direct[key] = entry
            if self.use_direct:
                self.backend.start()  # drop the example inputs (this call's caches among them)
            return self._owned(out)
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True), self.writes():
                return self._owned(self.step(*args))
        except RuntimeError as e:  # raised before running: a guard outside the key (e.g. tensors
            if "Recompilation triggered" not in str(e):  # made outside inference mode) differs
                raise
        self.seen.discard(key)
        return self(token_ids, positions, cache_index, attention_mask, cache, extra)

    def _owned(self, out):
        """The step's (logits, cache), the logits copied out of a CUDA graph's memory, which its next
        replay overwrites (the caches are the caller's own tensors, written in place)."""
        logits, cache = out
        return (logits.clone() if self.cudagraphs else logits), cache


def _static_addresses(cache):
    """Mark the caches as tensors whose address stays (as transformers' static cache does): a CUDA
    graph then reads and writes them where they are instead of copying them into its own inputs."""
    for pair in cache:
        for t in pair:
            if getattr(t, "_dynamo_static_input_type", None) is None:
                torch._dynamo.mark_static_address(t)


def check_settings(bucket, prefill_tokens):
    """Refuse a bucket or prefill_tokens `CompiledDecode` cannot use (needs no torch.compile import)."""
    if not isinstance(bucket, int) or isinstance(bucket, bool) or bucket < 1:
        raise ValueError(f"bucket must be a positive int (the smallest cache length), got {bucket!r}")
    if not isinstance(prefill_tokens, int) or isinstance(prefill_tokens, bool) or prefill_tokens < 0:
        raise ValueError(f"prefill_tokens must be an int >= 0 (the longest prompt run compiled; 0: none), "
                         f"got {prefill_tokens!r}")


def _with_passes(options):
    """torch.compile's options plus kvwire's Inductor pass (fusing ggml matmuls that share an input),
    unless another backend or a `mode` (which excludes `options`) was asked for.

    `mode="reduce-overhead"` (CUDA graphs) becomes kvwire's settings with Inductor's CUDA graphs on:
    the steps keep writing the caches in place (marked static), where the mode's own steps would
    return new caches that the next replay frees while they are its inputs."""
    if options.get("mode") == "reduce-overhead" and options.get("backend", "inductor") == "inductor":
        rest = {k: v for k, v in options.items() if k != "mode"}
        return {**rest, "options": inductor_options({"triton.cudagraphs": True, **(rest.get("options") or {})})}
    if options.get("backend", "inductor") != "inductor" or "mode" in options:
        return options
    return {**options, "options": inductor_options(options.get("options"))}


def inductor_options(extra=None):
    """kvwire's Inductor settings for compiled steps (`CompiledDecode`, `AheadDecode`), then `extra`."""
    from ..kernels.ggml.fuse import FuseSiblingMatmuls

    # reorder_for_locality would move the attention's read of a value cache below that cache's
    # one-slot write, and Inductor then copies the whole cache out and back instead of writing it in place
    # dynamic_threads: parallel kernels take OpenMP's team size when they run. Without it Inductor
    # writes the pool's size at compile time into each kernel whenever that differs from the core
    # count, so a step compiled while the engine ran on fewer threads under load (kernels/threads.py)
    # would keep that count, on a quiet machine and in every later process reading Inductor's cache
    return {"post_grad_custom_post_pass": FuseSiblingMatmuls(), "reorder_for_locality": False,
            "cpp.dynamic_threads": True, **WRAPPER_CHECKS_OFF, **(extra or {})}


def _compiled_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]

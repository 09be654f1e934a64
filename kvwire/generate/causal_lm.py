"""`CausalLM`: a backbone, a head and a tokenizer; generation runs the backbone's cached graph.

A thin front door: the model's own state (weights, cached graph, kept caches, a compiled step)
lives here; generation's methods come from `GenerationMethods`, request checks from `request`,
steering from `kvwire.steer` (which registers itself, see `register_steering`).
"""
import torch
from torch import nn

from ..graph import clone, with_cache
from ..io.tokenizer import eos_list
from ..layers.linear import clear_packs
from . import request
from .methods import GenerationMethods
from .pool import CachePool
from .runner import Runner

_steering = {}  # what `kvwire.steer` registers: {"steer" | "ablate" | "clamp" | "capture": fn(lm, ...)}


def register_steering(**ops):
    """Make `CausalLM.steer`/`ablate`/`clamp` call the given functions (done by `kvwire.steer` on
    import, so this layer does not import the one above it)."""
    _steering.update(ops)


def _steering_op(name):
    if name not in _steering:
        raise RuntimeError("steering is provided by kvwire.steer: import kvwire (or kvwire.steer) first")
    return _steering[name]


class CausalLM(GenerationMethods, nn.Module):
    """A causal language model whose backbone is an editable layer graph.

    Args:
        backbone: token_ids (B, T) -> hidden (B, T, D). head: hidden -> logits (B, T, V).
        tokenizer: a `kvwire.io.tokenizer.Tokenizer` or None (then prompts must be token ids).
        config: the family config (context length, special ids).

    `lm.to(device)` moves the weights, the cached graph and its kept caches; generation then makes
    its tensors there (`lm.device`). Quantised CPU kernels (int8/int4, ggml) refuse other devices.

    `lm.prefill_call_tokens` (None: 512): prompt tokens, all rows together, that one prefill call
    runs at most; a long prompt runs in several. Fewer bound a prompt's activations (peak memory)
    for a little speed; ggml quantisation sets 256 (`kw.load(..., quantize="gguf")`, `kw.quantize`).

    Example:
        >>> lm = kw.load("gemma3-270m")
        >>> lm(torch.tensor([[2, 651, 6037]])).shape      # uncached logits
        torch.Size([1, 3, 262144])
        >>> lm.generate("The capital of France is", max_new_tokens=8)
    """

    def __init__(self, backbone, head, tokenizer=None, config=None, family=None):
        super().__init__()
        self.backbone, self.head = backbone, head
        self.tokenizer = tokenizer
        self.config = config if config is not None else getattr(backbone, "config", None)
        self.family = family  # the registry name ("llama", ...), when built by kw.load / kw.from_hf
        self._cached = None
        self.pool = CachePool()  # idle caches by batch size, reused across calls
        self._compile_options, self._decode = None, None  # set by `compile`
        self._prefix_store = None  # made by `prefix_store` (chat)
        self.prefill_call_tokens = None  # the class docstring says what it is

    @property
    def vocab_size(self):
        return self.head.weight.shape[0]

    @property
    def device(self):
        """Where the weights are (the head's weight; the CPU for a head without one, as an exported
        model's runtime): generation's tensors are made there."""
        weight = getattr(self.head, "weight", None)
        return weight.device if weight is not None else torch.device("cpu")

    def _apply(self, fn, recurse=True):
        """`to`, `cuda`, `half`, ... (every move or cast of nn.Module goes through here): refuse to
        move CPU-only kernels off the CPU, keep a tied head tied, and take along what generation keeps
        (caches move, float32 whatever the weights' dtype); the packed weight copies and a compiled
        decode step are for the old device and dtype, so they are dropped (made again when needed)."""
        device = fn(torch.zeros((), device="cpu")).device  # where fn sends tensors
        if device.type != "cpu":
            _refuse_cpu_only(self, device)
        tied = [name for name, p in self.backbone.named_parameters() if p is getattr(self.head, "weight", None)]
        super()._apply(fn, recurse)
        if tied and self.head.weight is not self.backbone.get_parameter(tied[0]):
            # a move that makes new Parameters (to "meta", or swapped tensors) converts the head's copy
            # of the shared weight separately: point it at the embedding's again
            self.head.weight = self.backbone.get_parameter(tied[0])
        self.pool.to(device)
        self._decode = None
        if self._prefix_store is not None:  # keys/values on the old device
            self._prefix_store.clear()
        clear_packs(self)
        return self

    @property
    def max_context(self):
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def eos_token_ids(self):
        if self.tokenizer is not None:
            return tuple(self.tokenizer.eos_token_ids)
        return eos_list(getattr(self.config, "eos_token_id", None))

    @property
    def cached(self):
        """The backbone's cached graph (`kw.with_cache(self.backbone)`), built once."""
        if self._cached is None:
            self._cached = with_cache(self.backbone)
        return self._cached

    def reset_caches(self):
        """Forget the cached graph, the kept caches, the prefix store's entries, the compiled decode
        step (made again when next needed) and the packed weight copies (`WeightPack`: the head's and
        the projections', bf16 where the CPU has bf16 units, float32 batched decode on an Intel CPU
        with AVX-512), after swapping layers in place, editing weights through `.data` (which a pack
        cannot see), or to free memory."""
        self._cached, self._decode = None, None
        self.pool.clear()
        if self._prefix_store is not None:
            self._prefix_store.clear()
        clear_packs(self)

    def compile(self, bucket=64, prefill_tokens=32, ahead=None, background=False, **options):
        """Run generation's one-token decode steps and short prompts compiled (cached graph + head):
        ahead of time and kept on disk on the CPU (`ahead`), else through `torch.compile`.

        Pays where small ops dominate a step: quantised weights at batch 1 (measured in
        bench/compile.py, bench/compiled_start.py and bench/generate.py). The first step of each batch
        size compiles (one to two minutes for the default model, once ever where kept), and so does
        each new cache length: lengths are rounded up to `bucket` * 2^k slots, so calls with
        different lengths share compiled steps and a long context compiles a few times, not often.
        A prompt of 2 to `prefill_tokens` tokens runs through the same compiled function (its
        length dynamic: one more graph per batch size and cache length, which doubles the first
        call's compile); longer prompts, or all with `prefill_tokens=0`, prefill eagerly. Longer
        compiled chunks pay on small models only (measured ahead of time: SmolLM2 1.3x eager's speed
        at 28 and at 336 tokens; a 0.5B llama 0.92x at 40 tokens, 0.82x at 120).
        `options` go to `torch.compile`; with Inductor (the default) kvwire
        adds a pass that runs ggml matmuls reading one input as one call, and turns off Inductor's
        `reorder_for_locality` so the step writes one slot of each cache in place (with another `mode=`,
        another backend or that option set, the step returns updated copies of the caches).
        `mode="reduce-overhead"` on CUDA replays CUDA graphs of these in-place steps, the caches
        marked as static addresses (on the CPU it compiles as without it).
        Returns self. Without `options` nothing is imported here: torch.compile's machinery (~1.5 s
        to import) loads with the first compiled step.

        `ahead` (default: on for a CPU model given no `options`): compile each step ahead of time with
        AOTInductor and keep it in `$KVWIRE_CACHE/steps`, keyed on the model's structure (not its
        weights' values), torch and the CPU (`kvwire.generate.ahead`): a later process, or another
        model of the same structure (say steered with other vectors), loads it in about a second
        instead of re-tracing with dynamo (10-20 s). `ahead=False` keeps `torch.compile`'s steps.

        `background` (ahead only): a step no process has built runs eager while a child process
        compiles it, instead of holding generation up for that minute; only the graph's export
        (seconds) happens in the caller's step (`kvwire.generate.background`). For servers; a short
        command would exit before the child is done.

        Example:
            >>> lm = kw.load("gemma3-270m", quantize="gguf").compile()
            >>> lm.generate("Once upon a time", max_new_tokens=64)
        """
        from .compiled import CompiledDecode, check_settings

        check_settings(bucket, prefill_tokens)
        if ahead is None:
            ahead = not options and self.device.type == "cpu"
        elif not isinstance(ahead, bool):
            raise ValueError(f"ahead must be True, False or None (kvwire decides), got {ahead!r}")
        elif ahead and options:
            raise ValueError(f"ahead=True compiles with kvwire's Inductor settings and takes no torch.compile "
                             f"options; got {sorted(options)} (use ahead=False for those)")
        elif ahead and self.device.type != "cpu":
            raise ValueError(f"ahead=True compiles steps for the CPU; this model is on {self.device} "
                             f"(use ahead=False)")
        if not isinstance(background, bool):
            raise ValueError(f"background must be True or False, got {background!r}")
        if background and not ahead:
            raise ValueError("background=True builds steps ahead of time in a child process; it needs ahead "
                             "(a CPU model compiled with no torch.compile options)")
        if options:  # torch.compile checks them now; kvwire's defaults wait for the first step, which
            CompiledDecode(self.cached, self.head, bucket, prefill_tokens, **options)  # imports dynamo (~1.5 s)
        self._compile_options, self._decode = dict(options, bucket=bucket, prefill_tokens=prefill_tokens,
                                                   ahead=ahead, background=background), None
        self.pool.clear()
        return self

    @property
    def compile_settings(self):
        """What `compile` was called with ({bucket, prefill_tokens, ahead, background, torch.compile options}), or
        None: an edited or steered copy is not compiled unless compiled with these
        (`copy.compile(**lm.compile_settings)`)."""
        return None if self._compile_options is None else dict(self._compile_options)

    def _decoder(self):
        if self._compile_options is None:
            return None
        if self._decode is None:
            options = dict(self._compile_options)
            background = options.pop("background", False)
            if options.pop("ahead"):
                options["background"] = background
                from .ahead import AheadDecode

                self._decode = AheadDecode(self.cached, self.head, **options)
            else:
                from .compiled import CompiledDecode

                self._decode = CompiledDecode(self.cached, self.head, **options)
        return self._decode

    def runner(self):
        """The `Runner` generation calls run on: the cached graph, the head, the compiled step (if
        `compile` was called) and this model's limits and cache pool."""
        decode, context = self._decoder(), self.max_context
        return Runner(self.cached, self.head, self.vocab_size, self.device, context, self.tokenizer,
                      self.eos_token_ids, decode, self.prefill_call_tokens,
                      cache_length=(lambda n: decode.length(n, context)) if decode is not None else None,
                      pool=self.pool)

    def forward(self, token_ids):
        """Uncached logits: token_ids (B, T) int -> (B, T, V)."""
        self.check_uncached_input(token_ids)
        return self.head(self.backbone(token_ids))

    def check_uncached_input(self, token_ids):
        """What `lm(token_ids)` accepts: (B, T) ids in the vocabulary on the model's device, T within
        the context (`kvwire.generate.request.uncached_input`)."""
        request.uncached_input(token_ids, self.vocab_size, self.max_context, self.device)

    def check_length(self, length, what="the prompt"):
        """Refuse `length` tokens past the model's context (positions it has no embedding or rotary
        range for)."""
        request.length(length, self.max_context, what)

    def edit(self, fn, depth="block"):
        """The same model with its backbone cloned through `fn` (see `kw.clone`); weights shared.

        Example:
            >>> v = torch.randn(640)
            >>> steered = lm.edit(lambda layer, x: layer(x) + v if layer is lm.backbone.layers[6] else layer(x))
        """
        edited = CausalLM(clone(self.backbone, fn, depth=depth), self.head, self.tokenizer, self.config, self.family)
        edited.prefill_call_tokens = self.prefill_call_tokens  # the same weights: the same memory trade
        return edited

    def steer(self, vector, strength=None, *, site=None, when=None, generated_only=False, name=None,
              allow_mismatch=False, gate=None):
        """The same model with `vector` (a `kw.ControlVector`) added at a site of its blocks.

        Args:
            strength: a number, or a (B,) tensor: one strength per prompt of a batch (0 = unsteered);
                a (B,) strength then works for batches of B rows only. None: the vector's recommended
                strength (`vector.strength`, set by `kw.steer.calibrate`), else 1.
                In cached generation it is a graph input (`<name>_strength`), also of exported models.
            site: where in each block (`kvwire.layers.site.SITES`): "block_out" (the block's output,
                as llama.cpp), "resid_pre", "attn_out", "resid_mid", "mlp_out"; None: the vector's own
                (`vector.site`, recorded when it was trained).
            when: the positions steered: "all" (default), "prompt", "generated", a first position k
                or a range (k0, k1) (see `kvwire.steer.schedule`); graph inputs `<name>_start`/`_end`.
            generated_only: when="generated" (steer only generated tokens, not the prompt).
            name: runtime-input prefix. None: "steer", or "steer2", "steer3", ... when the model is
                already steered, so stacked vectors keep their own strengths. An explicit name that
                is taken shares that input, so its strength must equal the one already there.
            allow_mismatch: use a vector recorded for another model (`vector.fingerprint`: e.g. a base
                model's vector on its instruct model); the width must still fit.
            gate: a `kw.Gate`: a linear probe read at an earlier site that opens and shuts the
                steering per position (conditional steering, `kvwire.steer.gate`).

        A vector whose operation is not "add" is refused (see `ablate`, `clamp`).
        The vector (kept on the CPU) and the strength are copied to the model's device.

        The vector's block N steers the model's block N (its checkpoint number, as llama.cpp
        counts), also on an edited model where some blocks were skipped.

        Example:
            >>> happy = lm.steer(vec, 4.0)
            >>> mixed = lm.steer(vec, torch.tensor([4.0, 0.0]))   # row 0 steered, row 1 not
            >>> mixed.generate(["I feel", "I feel"])
            >>> both = lm.steer(vec, 0.5).steer(formal, 2.0, site="attn_out")  # inputs steer_*, steer2_*
        """
        return _steering_op("steer")(self, vector, strength, site=site, when=when,
                                     generated_only=generated_only, name=name, allow_mismatch=allow_mismatch,
                                     gate=gate)

    def ablate(self, directions, *, layers=None, site=None, strength=None, when=None, name=None, allow_mismatch=False,
               gate=None):
        """The same model with `directions` projected out at a site of its blocks
        (`x - s * Q^T Q x`, Q an orthonormal basis of their span; see `kvwire.steer.Ablate`).

        Args:
            directions: a `kw.ControlVector` (its own direction per block), a {block: tensor} dict, or
                one (D,) or (K, D) tensor used at every block `layers` picks.
            layers: block indices (a list, range or "A-B"); None: the vector's blocks, or every block.
            site: as `steer` (None: a vector's own site, "block_out" for a tensor or dict).
            strength: 1 removes the component; 0 leaves it; a (B,) tensor gives each row its own.
                None: a vector's recommended strength (`directions.strength`), else 1.
            when: as `steer`.
            name: as `steer` (inputs `<name>_strength`, `_start`, `_end`; default "ablate").
            allow_mismatch: as `steer`.
            gate: as `steer`.

        Example:
            >>> refusal = vec.directions[12]
            >>> compliant = lm.ablate(refusal, site="attn_out").ablate(refusal, site="mlp_out")
        """
        return _steering_op("ablate")(self, directions, layers=layers, site=site, strength=strength,
                                      when=when, name=name, allow_mismatch=allow_mismatch, gate=gate)

    def clamp(self, directions, lo=None, hi=None, *, layers=None, site=None, when=None, name=None,
              allow_mismatch=False, gate=None):
        """The same model with the projection of the hidden state on each unit direction held in
        [lo, hi] at a site of its blocks (see `kvwire.steer.Clamp`); lo = hi clamps to a value.

        Args:
            directions: as `ablate`.
            lo: a number or (B,) tensor; None = unbounded below.
            hi: a number or (B,) tensor; None = unbounded above (lo <= hi). Neither given and a vector
                with a recommended strength (`directions.strength`): held at that value.
            layers: as `ablate`.
            site: as `ablate`.
            when: as `steer`.
            name: runtime-input prefix (inputs `<name>_lo`, `_hi`, `_start`, `_end`; default "clamp").
            allow_mismatch: as `steer`.
            gate: as `steer`.

        Example:
            >>> calm = lm.clamp(vec, hi=0.0, layers="4-8")   # no positive "angry" component
        """
        return _steering_op("clamp")(self, directions, lo, hi, layers=layers, site=site, when=when, name=name,
                                     allow_mismatch=allow_mismatch, gate=gate)

    def steer_features(self, sae, features, *, mode="set", layer=None, site=None, when=None, name=None):
        """The same model with chosen features of a sparse autoencoder set, added to or clamped at
        the SAE's hook (see `kvwire.steer.sae.steer_features`, which this calls).

        Example:
            >>> sae = kw.SAE.load("layer_6_width_16k")             # SAELens's on-disk format
            >>> calm = lm.steer_features(sae, {1024: 0.0, 77: 12.0})
        """
        return _steering_op("features")(self, sae, features, mode=mode, layer=layer, site=site, when=when, name=name)

    def capture(self, prompts, sites="block_out", layers=None, batch_size=8):
        """Activations at named sites for each prompt and position: a `kvwire.steer.capture.Capture`
        ({(site, block): (B, T, D)} float32, left-padded, pads zeroed and marked by its `mask`); see
        `kvwire.steer.capture.capture`, which this calls.

        Example:
            >>> lm.capture(["The cat sat"], sites=["attn_out", "attn_heads"], layers=[2])[("attn_out", 2)].shape
            torch.Size([1, 4, 640])
        """
        return _steering_op("capture")(self, prompts, sites=sites, layers=layers, batch_size=batch_size)


def _refuse_cpu_only(lm, device):
    """ValueError when `lm` holds layers whose kernels run on the CPU only (their `cpu_only` names
    the kernels: int8/int4 on aten's CPU kernels, ggml blocks), naming them, before anything moves."""
    found = [(name, m.cpu_only) for name, m in lm.named_modules() if getattr(m, "cpu_only", None)]
    if found:
        names = ", ".join(sorted({k for _, k in found}))
        raise ValueError(f"cannot move this model to {device}: it holds {len(found)} quantised layers "
                         f"({names}, e.g. {found[0][0]!r}) that run on the CPU only; load it without "
                         f"quantize to use {device}")

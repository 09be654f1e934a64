"""`CausalLM`: a backbone, a head and a tokenizer; generation runs the backbone's cached graph."""
import operator

import numpy as np
import torch
from torch import nn

from ..graph import clone, with_cache
from ..io.tokenizer import eos_list
from ..layers.linear import clear_packs
from .loop import Generation, Stopper, beam_search, finish
from .samplers import BeamSearch, Greedy, Sampler
from .session import Session

DEFAULT_NEW_TOKENS = 32


class CausalLM(nn.Module):
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
        self._caches = {}  # batch size -> (max_length, cache), reused across calls
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
        self._caches = {B: (length, tuple(tuple(t.to(device) for t in pair) for pair in cache))
                        for B, (length, cache) in self._caches.items()}
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
        self._cached, self._caches, self._decode = None, {}, None
        if self._prefix_store is not None:
            self._prefix_store.clear()
        clear_packs(self)

    def compile(self, bucket=64, prefill_tokens=32, **options):
        """Run generation's one-token decode steps and short prompts through `torch.compile` (cached
        graph + head).

        Pays where small ops dominate a step: quantised weights at batch 1 (measured in
        bench/compile.py and bench/generate.py). The first step of each batch size compiles (one to two
        minutes for the default model; Inductor caches it on disk for later processes), and so does
        each new cache length: lengths are rounded up to `bucket` * 2^k slots, so calls with
        different lengths share compiled steps and a long context compiles a few times, not often.
        A prompt of 2 to `prefill_tokens` tokens runs through the same compiled function (its
        length dynamic: one more graph per batch size and cache length, which doubles the first
        call's compile); longer prompts, or all with `prefill_tokens=0`, prefill eagerly.
        `options` go to `torch.compile`; with Inductor (the default) kvwire
        adds a pass that runs ggml matmuls reading one input as one call, and turns off Inductor's
        `reorder_for_locality` so the step writes one slot of each cache in place (with `mode=`,
        another backend or that option set, the step returns updated copies of the caches).
        Returns self. Without `options` nothing is imported here: torch.compile's machinery (~1.5 s
        to import) loads with the first compiled step.

        Example:
            >>> lm = kw.load("gemma3-270m", quantize="gguf").compile()
            >>> lm.generate("Once upon a time", max_new_tokens=64)
        """
        from .compiled import CompiledDecode, check_settings

        check_settings(bucket, prefill_tokens)
        if options:  # torch.compile checks them now; kvwire's defaults wait for the first step, which
            CompiledDecode(self.cached, self.head, bucket, prefill_tokens, **options)  # imports dynamo (~1.5 s)
        self._compile_options, self._decode = dict(options, bucket=bucket, prefill_tokens=prefill_tokens), None
        self._caches = {}
        return self

    def _decoder(self):
        if self._compile_options is None:
            return None
        if self._decode is None:
            from .compiled import CompiledDecode

            self._decode = CompiledDecode(self.cached, self.head, **self._compile_options)
        return self._decode

    def forward(self, token_ids):
        """Uncached logits: token_ids (B, T) int -> (B, T, V)."""
        self.check_uncached_input(token_ids)
        return self.head(self.backbone(token_ids))

    def check_uncached_input(self, token_ids):
        """What `lm(token_ids)` accepts: (B, T) ids in the vocabulary on the model's device, T within
        the context."""
        if isinstance(token_ids, torch.Tensor) and token_ids.device != self.device:
            raise ValueError(f"token_ids are on {token_ids.device} but the model is on {self.device}; "
                             f"pass token_ids.to(lm.device)")
        self.check_ids(token_ids)
        if token_ids.dim() != 2:
            raise ValueError(f"lm(token_ids) expects a (B, T) tensor, got shape {tuple(token_ids.shape)}"
                             + ("; use ids[None] for one row" if token_ids.dim() == 1 else ""))
        self.check_length(token_ids.shape[1], "the input")

    def check_length(self, length, what="the prompt"):
        """Refuse `length` tokens past the model's context (positions it has no embedding or rotary
        range for)."""
        limit = self.max_context
        if limit is not None and length > limit:
            raise ValueError(f"{what} has {length} tokens, more than the model's context of {limit} tokens")

    def edit(self, fn, depth="block"):
        """The same model with its backbone cloned through `fn` (see `kw.clone`); weights shared.

        Example:
            >>> v = torch.randn(640)
            >>> steered = lm.edit(lambda layer, x: layer(x) + v if layer is lm.backbone.layers[6] else layer(x))
        """
        edited = CausalLM(clone(self.backbone, fn, depth=depth), self.head, self.tokenizer, self.config, self.family)
        edited.prefill_call_tokens = self.prefill_call_tokens  # the same weights: the same memory trade
        return edited

    def steer(self, vector, strength=1.0, *, generated_only=False, name=None):
        """The same model with `vector` (a `kw.ControlVector`) added after its blocks.

        Args:
            strength: a number, or a (B,) tensor: one strength per prompt of a batch (0 = unsteered);
                a (B,) strength then works for batches of B rows only.
                In cached generation it is a graph input (`<name>_strength`), also of exported models.
            generated_only: steer only generated tokens, not the prompt (see `kvwire.steer.Steer`).
            name: runtime-input prefix. None: "steer", or "steer2", "steer3", ... when the model is
                already steered, so stacked vectors keep their own strengths. An explicit name that
                is taken shares that input, so its strength must equal the one already there.

        The vector (kept on the CPU) and the strength are copied to the model's device.

        The vector's block N steers the model's block N (its checkpoint number, as llama.cpp
        counts), also on an edited model where some blocks were skipped.

        Example:
            >>> happy = lm.steer(vec, 4.0)
            >>> mixed = lm.steer(vec, torch.tensor([4.0, 0.0]))   # row 0 steered, row 1 not
            >>> mixed.generate(["I feel", "I feel"])
            >>> both = lm.steer(vec, 0.5).steer(formal, 2.0)       # inputs steer_* and steer2_*
        """
        from ..graph import insert_after, numbered_blocks
        from ..graph.edit import summarize_indices
        from ..steer import ControlVector, Steer

        if not isinstance(vector, ControlVector):
            raise TypeError(f"steer expects a kw.ControlVector, got {type(vector).__name__}")
        blocks = numbered_blocks(self.backbone)
        width = self.head.weight.shape[1]
        if vector.width != width:
            raise ValueError(f"control vector width {vector.width} does not fit this model's hidden size {width}")
        bad = [i for i in vector.layers if i not in blocks]
        if bad:
            raise ValueError(f"control vector steers blocks {bad}, but this model has blocks "
                             f"{summarize_indices(blocks) or 'none'}")
        taken = {m.name: m for m in self.backbone.modules() if isinstance(m, Steer)}
        if name is None:
            name = next(n for n in ("steer", *(f"steer{k}" for k in range(2, len(taken) + 3))) if n not in taken)
        new = Steer(vector.directions[vector.layers[0]], strength, generated_only, name, device=self.device)
        if name in taken and not taken[name].same_inputs(new):
            raise ValueError(f"this model already has steering inputs named {name!r} with strength "
                             f"{taken[name].strength.tolist()} (generated_only={taken[name].generated_only}); "
                             f"layers sharing a name share their inputs: pick another name")
        index = {blocks[i]: i for i in vector.layers}
        device = self.device  # the vector (kept on the CPU) and the strength move to the weights
        return self.edit(insert_after(list(index), lambda call, layer: Steer(
            vector.directions[index[call]], strength, generated_only, name, device=device)))

    def check_ids(self, token_ids):
        if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int64, torch.int32):
            got = token_ids.dtype if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
            raise TypeError(f"token_ids must be an integer tensor, got {got}")
        if token_ids.numel() == 0:
            raise ValueError("token_ids is empty; expected at least one token")
        low, high = int(token_ids.min()), int(token_ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got values in [{low}, {high}]")

    def generate(self, prompt, max_new_tokens=None, max_length=None, *, sampler=None, seed=None, stop=(),
                 stop_token_ids=(), repetition_penalty=None, ignore_eos=False, return_logprobs=False, inputs=None):
        """Continue `prompt` through the cached graph.

        Args:
            prompt: a str, a list of str (a batch, left-padded), or token ids: a 1-D tensor, a 2-D
                (B, T) tensor, or a list of 1-D tensors of different lengths (left-padded).
            max_new_tokens: tokens to generate at most (default 32 when max_length is not given).
            max_length: prompt + new tokens at most (the longest prompt of a batch counts).
                With both, the smaller limit wins.
            sampler: kw.Greedy() (default), kw.Random, kw.TopK, kw.TopP, kw.MinP or kw.BeamSearch.
            seed: seeds the sampler's random generator (same seed, same output).
            stop: stop strings; a row ends once its text contains one, which is not returned.
            stop_token_ids: extra ids that end a row (besides the model's end-of-sequence ids).
            repetition_penalty: > 0; transformers' penalty on tokens already in the row.
            ignore_eos: do not stop at end-of-sequence ids (benchmarks).
            return_logprobs: return the `Generation` record (ids, texts, chosen tokens'
                log-probabilities, timings) instead of the continuation alone.
            inputs: values for the cached graph's runtime inputs, {name: (B,) tensor}, e.g.
                {"steer_strength": torch.tensor([4.0, 0.0])}; others take their defaults.
        Returns the continuation only: str for a str, list of str for a list, a 1-D id tensor for
        a 1-D tensor, a list of 1-D id tensors for a 2-D tensor or a list of 1-D tensors.
        """
        run = self._start(prompt, max_new_tokens, max_length, sampler, seed, stop, stop_token_ids,
                          repetition_penalty, ignore_eos, inputs, logprobs=return_logprobs)
        gen = _last(run)
        if return_logprobs:
            return gen
        if isinstance(prompt, str):
            return gen.texts[0]
        if isinstance(prompt, torch.Tensor) or _is_id_row(prompt[0]):
            device = prompt.device if isinstance(prompt, torch.Tensor) else prompt[0].device  # as given
            out = [torch.tensor(t, dtype=torch.long, device=device) for t in gen.tokens]
            return out[0] if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 else out
        return gen.texts

    def generate_ids(self, prompt, max_new_tokens=None, max_length=None, **options):
        """Like `generate(..., return_logprobs=True)`: the `Generation` record."""
        return self.generate(prompt, max_new_tokens, max_length, return_logprobs=True, **options)

    def stream(self, prompt, max_new_tokens=None, max_length=None, **options):
        """Yield the continuation of a str prompt as text pieces while tokens are produced.

        A character whose bytes span several tokens is yielded whole; text that may be the start
        of a stop string is held back until it is not. The pieces concatenate to `generate`'s text.
        Options are those of `generate` (beam search excluded).

        Example:
            >>> for piece in lm.stream("Once upon a time", max_new_tokens=20):
            ...     print(piece, end="", flush=True)
        """
        return (piece for piece, _ in self._stream(prompt, max_new_tokens, max_length, False, options))

    def stream_with_record(self, prompt, max_new_tokens=None, max_length=None, logprobs=True, **options):
        """Like `stream`, yielding (piece, the `Generation` record so far) for timings and ids;
        logprobs=False leaves the record's log-probabilities NaN and skips computing them."""
        return self._stream(prompt, max_new_tokens, max_length, logprobs, options)

    def chat(self, messages, max_new_tokens=None, max_length=None, *, stream=False, reuse_prefix=True, **options):
        """The assistant's reply to a conversation, rendered with the model's own chat template.

        Args:
            messages: [{"role": "system" | "user" | "assistant", "content": str}, ...] as the
                template accepts them (see `tokenizer.apply_chat_template`).
            stream: yield the reply as text pieces instead of returning it whole.
            reuse_prefix: keep this conversation's keys/values in `lm.prefix_store`, so the next
                turn (these messages, the reply and a new message) prefills only what is new.
            options: those of `generate` (sampler, seed, stop, inputs, ...; beam search excluded).
        The reply ends at the template's end-of-turn token (e.g. <|im_end|>) or an end-of-sequence id.

        Example:
            >>> lm = kw.load("smollm2-135m-instruct")
            >>> messages = [{"role": "user", "content": "Name three colours."}]
            >>> reply = lm.chat(messages, max_new_tokens=40)
            >>> messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And two more?"}]
            >>> for piece in lm.chat(messages, stream=True):   # the first turn is not prefilled again
            ...     print(piece, end="")
        """
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template; use generate with token ids")
        if isinstance(options.get("sampler"), BeamSearch):
            raise ValueError("chat samples (kw.Greedy, kw.TopP, ...); beam search runs through generate")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if ids and max(ids) >= self.vocab_size:
            raise ValueError(f"the chat template's tokens reach id {max(ids)}, but the model has {self.vocab_size} "
                             f"tokens: tokenizer and model do not match")
        store = self.prefix_store if reuse_prefix else None
        run = self._start(None, max_new_tokens, max_length, **options, _rows=[ids],
                          _extra_stop_ids=self.tokenizer.end_of_turn_ids, _prefix_store=store)
        if stream:
            return (piece for piece, _ in self._pieces(run, options))
        return _last(run).texts[0]

    @property
    def prefix_store(self):
        """The `PrefixStore` that `chat` keeps conversations' keys/values in (made on first use)."""
        if self._prefix_store is None:
            from .prefix import PrefixStore

            self._prefix_store = PrefixStore()
        return self._prefix_store

    def _stream(self, prompt, max_new_tokens, max_length, logprobs, options):
        """Checks the request now (a bad option raises before anything is yielded or printed) and
        returns the generator of (piece, record) pairs."""
        if not isinstance(prompt, str):
            raise TypeError(f"stream expects a str prompt, got {type(prompt).__name__}")
        if isinstance(options.get("sampler"), BeamSearch):
            raise ValueError("stream does not support beam search (the best beam is known only at the end)")
        return self._pieces(self._start(prompt, max_new_tokens, max_length, **options, logprobs=logprobs), options)

    def _pieces(self, run, options):
        sent = ""
        for gen in run:
            if gen.finished:
                text = gen.texts[0]
            else:
                text = _visible(self.tokenizer.decode(gen.tokens[0]), options.get("stop", ()))
            if text.startswith(sent) and len(text) > len(sent):
                yield text[len(sent):], gen
                sent = text

    def score(self, text_or_ids):
        """Log-probability of every token given the ones before it, in one uncached pass.

        Args: a str (encoded with BOS when the tokenizer adds one) or a 1-D token-id tensor.
        Returns a float tensor (T - 1,): entry t is log p(token[t+1] | token[:t+1]).
        """
        ids = self._ids_for_scoring(text_or_ids).to(self.device)
        with torch.inference_mode():
            logp = torch.log_softmax(self(ids[None])[0, :-1].float(), -1)
        return logp.gather(1, ids[1:, None])[:, 0]

    def perplexity(self, text_or_ids):
        """exp of the mean negative log-likelihood of `score`."""
        return float(torch.exp(-self.score(text_or_ids).mean()))

    def _ids_for_scoring(self, text_or_ids):
        if isinstance(text_or_ids, str):
            ids = torch.tensor(self._encode(text_or_ids), dtype=torch.long, device=self.device)
        else:
            ids = text_or_ids
            self.check_ids(ids)
            if ids.dim() != 1:
                raise ValueError(f"score expects a 1-D token-id tensor, got shape {tuple(ids.shape)}")
        if len(ids) < 2:
            raise ValueError(f"score needs at least 2 tokens, got {len(ids)}")
        return ids

    def _start(self, prompt, max_new_tokens, max_length, sampler=None, seed=None, stop=(), stop_token_ids=(),
               repetition_penalty=None, ignore_eos=False, inputs=None, logprobs=True, _rows=None, _extra_stop_ids=(),
               _prefix_store=None):
        """Validate options and start a generation: an iterator of growing `Generation` records,
        the last one finished (beam search yields only the finished one). logprobs=False: the
        records' log-probabilities are NaN (sampling skips computing them). `_rows` (token-id
        lists, already checked), `_extra_stop_ids` and `_prefix_store` are chat's."""
        rows = self._rows(prompt) if _rows is None else _rows
        longest = max(len(r) for r in rows)
        new = self._new_tokens(longest, max_new_tokens, max_length)
        sampler = Greedy() if sampler is None else sampler
        if not isinstance(sampler, (Sampler, BeamSearch)):
            raise TypeError(f"sampler must be a kvwire sampler (kw.Greedy(), kw.TopP(0.9), ...), got {sampler!r}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty str, got {stop!r}")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        if repetition_penalty is not None and not repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty!r}")
        stop_ids = _token_id_list(stop_token_ids, self.vocab_size) + (() if ignore_eos else self.eos_token_ids) \
            + tuple(_extra_stop_ids)
        stopper = Stopper(stop_ids, stop, self.tokenizer if not isinstance(prompt, torch.Tensor) or stop else None)
        if isinstance(sampler, BeamSearch):
            if stop:
                raise ValueError("stop strings are not supported with beam search")
            session = self._session(rows, longest + new, inputs, reuse=False)
            return iter([beam_search(session, sampler, new, stopper, repetition_penalty)])
        per_row = self._row_inputs(inputs, len(rows))
        engine = self._engine(rows, longest + new, _prefix_store)
        # row i draws from its own CPU generator seeded seed + i (samplers draw on the CPU, see
        # kvwire.generate.samplers): a seed gives the same tokens wherever the model runs, and a
        # row's tokens do not depend on the others of its batch
        seqs = [engine.submit(row, new, sampler=sampler, seed=None if seed is None else int(seed) + i,
                              stop_ids=stop_ids, stop_strings=stop, inputs=per_row[i],
                              repetition_penalty=repetition_penalty, logprobs=logprobs,
                              reuse_prefix=_prefix_store is not None,
                              label=f"row {i}")
                for i, row in enumerate(rows)]
        return self._returning(engine, _records(engine, seqs, stopper))

    def _row_inputs(self, inputs, batch_size):
        """generate's `inputs` ({name: (B,) tensor}) as one {name: value} per row, checked."""
        inputs = dict(inputs or {})
        known = self.cached.runtime_inputs
        unknown = set(inputs) - set(known)
        if unknown:
            raise TypeError(f"unknown runtime inputs {sorted(unknown)}; this graph takes {sorted(known) or 'none'}")
        for name, value in inputs.items():
            if not isinstance(value, torch.Tensor) or value.dtype != known[name] or tuple(value.shape) != (batch_size,):
                got = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
                    else type(value).__name__
                raise TypeError(f"runtime input {name!r} must be a {known[name]} tensor of shape ({batch_size},); "
                                f"got {got}")
        return [{name: value[i] for name, value in inputs.items()} for i in range(batch_size)]

    def _engine(self, rows, max_length, prefix_store=None):
        """An engine for one batch that takes this model's idle caches for the batch size when they
        are long enough (and not more than twice as long: decode attends over every full-length slot)."""
        from .engine import Engine

        decode = self._decoder()
        if decode is not None:
            max_length = decode.length(max_length, self.max_context)
        kept = self._caches.pop(len(rows), None)  # taken: an interleaved run gets its own
        if kept is not None and max_length <= kept[0] <= 2 * max_length:
            max_length, cache = kept
        else:
            cache = None
        return Engine(self, len(rows), max_length, cache=cache, prefix_store=prefix_store)

    def _session(self, rows, max_length, inputs=None, reuse=True):
        """A session that takes this model's idle caches for the batch size when they are long
        enough (and not more than twice as long: decode attends over every full-length slot)."""
        decode = self._decoder()
        if decode is not None:
            max_length = decode.length(max_length, self.max_context)
        kept = self._caches.pop(len(rows), None) if reuse else None  # taken: an interleaved run gets its own
        if kept is not None and max_length <= kept[0] <= 2 * max_length:
            return Session(self.cached, self.head, rows, kept[0], kept[1], inputs, decode=decode, device=self.device,
                           call_tokens=self.prefill_call_tokens)
        return Session(self.cached, self.head, rows, max_length, inputs=inputs, decode=decode, device=self.device,
                       call_tokens=self.prefill_call_tokens)

    def _returning(self, engine, run):
        """Yield from run, then give the engine's caches back for the next call."""
        yield from run
        if engine.cache is not None:
            self._caches[engine.capacity] = (engine.max_length, engine.cache)

    def _rows(self, prompt):
        if isinstance(prompt, str):
            return [self._encode(prompt)]
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() not in (1, 2):
                raise ValueError(f"a token-id prompt must be 1-D or 2-D, got shape {tuple(prompt.shape)}")
            self.check_ids(prompt)
            return [r.tolist() for r in prompt.reshape(-1, prompt.shape[-1])]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            return [self._encode(p) for p in prompt]
        if isinstance(prompt, (list, tuple)) and prompt and all(_is_id_row(p) for p in prompt):
            for row in prompt:  # rows of different lengths: a batch of ids, left-padded like text
                self.check_ids(row)
            return [row.tolist() for row in prompt]
        raise TypeError("prompt must be a str, a non-empty list of str, a token-id tensor or a list of 1-D "
                        f"token-id tensors; got {prompt!r:.80}")

    def _encode(self, text):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids instead of text")
        if not text:
            raise ValueError("prompt is empty; expected at least one character")
        ids = self.tokenizer.encode(text)
        if ids and max(ids) >= self.vocab_size:
            raise ValueError(f"the tokenizer gave token id {max(ids)} for {text!r:.40}, but the model has "
                             f"{self.vocab_size} tokens: tokenizer and model do not match")
        return ids

    def _new_tokens(self, prompt_length, max_new_tokens, max_length):
        for name, value in (("max_new_tokens", max_new_tokens), ("max_length", max_length)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_length is not None:
            if prompt_length >= max_length:
                raise ValueError(f"prompt has {prompt_length} tokens but max_length is {max_length}")
            room = max_length - prompt_length
            new = room if max_new_tokens is None else min(max_new_tokens, room)
        else:
            new = DEFAULT_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        limit = self.max_context
        if limit is not None and prompt_length + new > limit:
            raise ValueError(f"prompt ({prompt_length} tokens) + {new} new tokens exceeds the model's "
                             f"context of {limit} tokens")
        return new


def _refuse_cpu_only(lm, device):
    """ValueError when `lm` holds layers whose kernels run on the CPU only (int8/int4 on aten's CPU
    kernels, ggml blocks), naming them, before anything moves."""
    from ..quant.ggml.linear import GGMLLinear
    from ..quant.linear import QuantizedLinear

    kinds = {QuantizedLinear: "int8/int4 (PyTorch's CPU kernels)", GGMLLinear: "ggml blocks (ggml's CPU kernels)"}
    found = [(name, kinds[type(m)]) for name, m in lm.named_modules() if type(m) in kinds]
    if found:
        names = ", ".join(sorted({k for _, k in found}))
        raise ValueError(f"cannot move this model to {device}: it holds {len(found)} quantised layers "
                         f"({names}, e.g. {found[0][0]!r}) that run on the CPU only; load it without "
                         f"quantize to use {device}")


def _records(engine, seqs, stopper):
    """Run the engine over a batch's sequences: a growing `Generation` after every step, then the
    finished one (stop strings cut, texts decoded). A row's error (non-finite logits) is raised."""
    gen = Generation([s.tokens for s in seqs], [s.logprobs for s in seqs])
    for _ in engine.run(seqs):
        failed = next((s.error for s in seqs if s.error is not None), None)
        if failed is not None:
            raise failed
        gen.prefill_seconds, gen.decode_seconds = engine.prefill_seconds, engine.decode_seconds
        gen.decode_steps = engine.decode_steps
        yield gen
    finish(gen, stopper)
    yield gen


def _last(iterator):
    item = None
    for item in iterator:
        pass
    return item


def _visible(text, stops):
    """The part of partial output text that is safe to show: cut at a stop string; without a
    character still being assembled from byte tokens (U+FFFD) or a possible stop-string start."""
    stops = (stops,) if isinstance(stops, str) else tuple(stops)
    found = [text.find(s) for s in stops if s in text]
    if found:
        return text[:min(found)]
    text = text.rstrip("\ufffd")
    held = max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
    return text[:len(text) - held]


def _token_id_list(ids, vocab_size):
    """stop_token_ids as a tuple of ints: an int (Python or NumPy), a list of them, or an integer
    tensor or array (0-d or 1-D)."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        if ids.dtype in (torch.bool, np.bool_) or ids.ndim > 1 or not _integer_dtype(ids.dtype):
            raise TypeError(f"stop_token_ids must be integer ids (0-d or 1-D), got a {ids.dtype} "
                            f"{type(ids).__name__} of shape {tuple(ids.shape)}")
        ids = ids.reshape(-1).tolist()
    elif _as_int(ids) is not None:
        ids = [ids]
    elif not isinstance(ids, (list, tuple, set, frozenset)):
        raise TypeError(f"stop_token_ids must be an int, a list of ints or an integer tensor; got "
                        f"{type(ids).__name__}")
    out = []
    for item in ids:
        i = _as_int(item)
        if i is None:
            raise TypeError(f"stop_token_ids must be integer token ids, got {item!r} ({type(item).__name__})")
        if not 0 <= i < vocab_size:
            raise ValueError(f"stop token id {i} is outside the vocabulary [0, {vocab_size})")
        out.append(i)
    return tuple(out)


def _integer_dtype(dtype):
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex
    return np.issubdtype(dtype, np.integer)


def _as_int(value):
    """value as a Python int if it is an integer (int, NumPy integer, 0-d integer tensor), not a
    bool; else None."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    if isinstance(value, torch.Tensor):
        return int(value) if value.dim() == 0 and _integer_dtype(value.dtype) else None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _is_id_row(p):
    return isinstance(p, torch.Tensor) and p.dim() == 1

"""`CausalLM`: a backbone, a head and a tokenizer; generation runs the backbone's cached graph."""
import torch
from torch import nn

from ..graph import clone, with_cache
from .loop import greedy

DEFAULT_NEW_TOKENS = 32


class CausalLM(nn.Module):
    """A causal language model whose backbone is an editable layer graph.

    Args:
        backbone: token_ids (B, T) -> hidden (B, T, D). head: hidden -> logits (B, T, V).
        tokenizer: a `kvwire.io.tokenizer.Tokenizer` or None (then prompts must be token ids).
        config: the family config (context length, special ids).

    Example:
        >>> lm = kw.load("gemma3-270m")
        >>> lm(torch.tensor([[2, 651, 6037]])).shape      # uncached logits
        torch.Size([1, 3, 262144])
        >>> lm.generate("The capital of France is", max_new_tokens=8)
        ' Paris...'
    """

    def __init__(self, backbone, head, tokenizer=None, config=None):
        super().__init__()
        self.backbone, self.head = backbone, head
        self.tokenizer = tokenizer
        self.config = config if config is not None else getattr(backbone, "config", None)
        self._cached = None

    @property
    def vocab_size(self):
        return self.head.weight.shape[0]

    @property
    def max_context(self):
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def cached(self):
        """The backbone's cached graph (`kw.with_cache(self.backbone)`), built once."""
        if self._cached is None:
            self._cached = with_cache(self.backbone)
        return self._cached

    def forward(self, token_ids):
        """Uncached logits: token_ids (B, T) int -> (B, T, V)."""
        self.check_ids(token_ids)
        return self.head(self.backbone(token_ids))

    def edit(self, fn, depth="block"):
        """The same model with its backbone cloned through `fn` (see `kw.clone`); weights shared.

        Example:
            >>> v = torch.randn(640)
            >>> steered = lm.edit(lambda layer, x: layer(x) + v if layer is lm.backbone.layers[6] else layer(x))
        """
        return CausalLM(clone(self.backbone, fn, depth=depth), self.head, self.tokenizer, self.config)

    def check_ids(self, token_ids):
        if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int64, torch.int32):
            got = token_ids.dtype if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
            raise TypeError(f"token_ids must be an integer tensor, got {got}")
        if token_ids.numel() == 0:
            raise ValueError("token_ids is empty; expected at least one token")
        low, high = int(token_ids.min()), int(token_ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got values in [{low}, {high}]")

    def generate(self, prompt, max_new_tokens=None, max_length=None):
        """Greedy continuation of `prompt` through the cached graph.

        Args:
            prompt: a str, a list of str (a batch, left-padded), or token ids: a 1-D tensor, or a 2-D
                (B, T) tensor.
            max_new_tokens: tokens to generate at most (default 32 when max_length is not given).
            max_length: prompt + new tokens at most, for the longest prompt of the batch.
        Returns the continuation only: str for a str, list of str for a list, a 1-D id tensor for
        a 1-D tensor, a list of 1-D id tensors for a 2-D tensor. Generation stops at EOS.
        """
        return self._finish(prompt, self.generate_ids(prompt, max_new_tokens, max_length).tokens)

    def generate_ids(self, prompt, max_new_tokens=None, max_length=None):
        """Like `generate`, but returns the `Generation` record (ids per row and timings)."""
        rows = self._rows(prompt)
        longest = max(len(r) for r in rows)
        new = self._new_tokens(longest, max_new_tokens, max_length)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else _eos(self.config)
        return greedy(self.cached, self.head, rows, new, eos)

    def _rows(self, prompt):
        if isinstance(prompt, str):
            rows = [self._encode(prompt)]
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() not in (1, 2):
                raise ValueError(f"a token-id prompt must be 1-D or 2-D, got shape {tuple(prompt.shape)}")
            self.check_ids(prompt)
            rows = [r.tolist() for r in prompt.reshape(-1, prompt.shape[-1])]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            rows = [self._encode(p) for p in prompt]
        else:
            raise TypeError(f"prompt must be a str, a non-empty list of str or a token-id tensor; got {prompt!r:.80}")
        return rows

    def _encode(self, text):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids instead of text")
        if not text:
            raise ValueError("prompt is empty; expected at least one character")
        return self.tokenizer.encode(text)

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

    def _finish(self, prompt, tokens):
        if isinstance(prompt, torch.Tensor):
            out = [torch.tensor(t, dtype=torch.long) for t in tokens]
            return out[0] if prompt.dim() == 1 else out
        texts = [self.tokenizer.decode(t) for t in tokens]
        return texts[0] if isinstance(prompt, str) else texts


def _eos(config):
    value = getattr(config, "eos_token_id", None)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)

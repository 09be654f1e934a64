"""Token mixers whose call of several tokens ignores the state it is handed, continued one token
at a time.

transformers' Mamba-1 selective scan (mamba, falcon_mamba, jamba, zamba) starts every call of
more than one token from a zero recurrent state: only its one-token step continues the state in
the cache. A prompt prefilled in chunks, a stored prefix followed by a chunk, a row joining a batch
in chunks would each continue from a wrong state. The build finds such layers by prefilling its
probe in two chunks (`kvwire.models.generic.build`); their mixers get `install`. In a cached call
that continues a state (`continues`), the cache the layer is handed carries `MARK`, and the mixer
makes its call of T tokens T calls of one token, each continuing the state the one before left.
T is static in a trace, so the loop unrolls. A chunk in which every row starts afresh keeps the
mixer's multi-token scan (a zero initial state is what the scan assumes).

The cost: a continuing chunk runs the mixer's projections on one token at a time (T small matrix
products instead of one) and its one-token step T times.
"""
import inspect
import types

import torch

from ...kernels.tracing import is_exporting

MARK = "_kvwire_one_token_at_a_time"  # on a transformers Cache: its stepping mixers go token by token
INSTALLED = "_kvwire_stepping"  # on a mixer whose forward `install` wrapped


def continues(fresh, tokens, mixer=None):
    """Whether a cached call of `tokens` tokens per row must step its mixers: more than one token,
    and a row not starting afresh (`fresh` (B,) float32, 1 where the row's first real token is in
    the chunk). A traced call cannot look at its rows: it steps every chunk of several tokens.

    Raises RuntimeError in an export whose chunk length is dynamic: the steps unroll, so an
    exported program would hold one length only (`lm.compile()`'s prompt chunks then run eager)."""
    refuse_dynamic_steps(tokens, mixer)
    if tokens == 1:
        return False  # the mixer's own one-token step
    if torch.compiler.is_compiling() or is_exporting():
        return True
    return bool((fresh < 1).any())


def refuse_dynamic_steps(tokens, mixer=None):
    """Raise RuntimeError naming `mixer` (the module stepping) in an export whose chunk length
    `tokens` is dynamic: the steps unroll."""
    if isinstance(tokens, torch.SymInt) and is_exporting():
        who = "" if mixer is None else f" ({type(mixer).__name__})"
        raise RuntimeError(f"a state-keeping mixer{who} that continues a state one token at a time unrolls its "
                           f"steps: a prompt chunk of dynamic length cannot be exported (export fixed chunk "
                           f"lengths instead: ExecuTorch or Core ML with prefill_length)")


def install(mixer):
    """Make `mixer`'s forward go token by token when the cache it is given carries `MARK` (once).
    Its signature stays its class's (hooks and checks that read it see the same arguments)."""
    if getattr(mixer, INSTALLED, False):
        return

    def forward(self, *args, **kwargs):
        own = type(self).forward.__get__(self)
        if not any(getattr(value, MARK, False) for value in (*args, *kwargs.values())):
            return own(*args, **kwargs)
        return one_at_a_time(own, args, kwargs)

    forward.__signature__ = inspect.signature(type(mixer).forward)
    mixer.forward = types.MethodType(forward, mixer)
    setattr(mixer, INSTALLED, True)


def one_at_a_time(own, args, kwargs, before=None):
    """own(*args, **kwargs) as T calls of one token: every tensor argument of shape (B | 1, T, ...)
    (the hidden states, the padding mask, other per-token inputs) sliced at each token, the outputs
    joined along the tokens; `before(t)`, where given, runs before token t's call."""
    hidden = args[0] if args else kwargs["hidden_states"]
    B, T = hidden.shape[:2]
    outs = []
    for t in range(T):
        if before is not None:
            before(t)
        outs.append(own(*(at_token(a, B, T, t) for a in args),
                        **{k: at_token(v, B, T, t) for k, v in kwargs.items()}))
    return _joined(outs)


def _joined(outs):
    """The outputs of T one-token calls joined along the tokens (a tuple's non-tensors: the last's)."""
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs, dim=1)
    return type(outs[0])(torch.cat(parts, dim=1) if isinstance(parts[0], torch.Tensor) else parts[-1]
                         for parts in zip(*outs))


def at_token(value, B, T, t):
    """`value` at token t where it is per token ((B | 1, T, ...)), else as it is."""
    per_token = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] in (1, B) \
        and value.shape[1] == T
    return value[:, t:t + 1] if per_token else value


def at_row(value, B, row):
    """`value` at row `row` (a slice of one) where it is per row ((B, ...)), else as it is (row None: all)."""
    per_row = row is not None and isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == B
    return value[row:row + 1] if per_row else value

"""The served model's named control vectors, which can grow while the server runs: adding one
builds `lm.steer(v, 0.0, name=...)` over all of them and swaps the engine thread onto it (see
`EngineThread.swap`: running requests finish on the old model, new ones wait for them)."""
import asyncio
import re

from ..generate.engine import Engine
from ..generate.prefix import PrefixStore
from ..graph import numbered_blocks
from ..steer.schedule import Scheduled
from ..steer.turns import taking_turns
from .errors import APIError
from .options import check_names, steered_model


# names of the banks' runtime inputs: the inline bank's slot k reads inline{k}_strength, _lo, _hi and
# the SAE bank's slot j sae{j}_add, _lo, _hi; each bank its schedule's inline_start/_end, sae_start/_end
RESERVED = re.compile(r"(?:inline|sae)(?:0|[1-9][0-9]*)?")


def check_unreserved(names):
    """Refuse control vector names the server's banks use (`kvwire.serve.inline`,
    `kvwire.serve.inline_sae`): a vector named N reads N_strength (or N_lo, N_hi), N_start and
    N_end, and layers reading one input name share it, so a vector named "inline0" would take the
    strength of requests' inline vectors in slot 0 (and they its), one named "sae" the SAE bank's
    schedule. Refused on every server, with banks or without: a name one server takes, all take."""
    for name in names:
        if RESERVED.fullmatch(name):
            raise ValueError(f"control vector name {name!r} is reserved: 'inline' and 'sae', alone or followed by a "
                             f"slot number (inline0, sae12), name the runtime inputs of the server's inline-vector "
                             f"and SAE-feature slots; expected another name, e.g. '{name}_style'")


class ServedVectors:
    """The base model, its named vectors, and the steered model the engine runs.

    Args:
        lm: the unsteered `CausalLM`. vectors: {name: kw.ControlVector}.
        inline: an `InlineBank` whose slots requests borrow for their own vectors, or None.
        engine_options: `Engine` keyword arguments (max_batch, max_length); prefix_bytes: each
            engine's prefix-store budget (every model gets a fresh store: keys/values of one
            model are never reused by another).

    Example:
        >>> served = ServedVectors(lm, {"happy": vec}, dict(max_batch=8, max_length=1024))
        >>> served.bridge.start(); await served.add("formal", formal_vec)
    """

    def __init__(self, lm, vectors, engine_options, prefix_bytes=512 << 20, inline=None):
        from .bridge import EngineThread

        check_names(vectors)
        check_unreserved(vectors)
        self.lm, self.vectors, self.inline = lm, dict(vectors), inline
        self.engine_options, self.prefix_bytes = dict(engine_options), prefix_bytes
        self.model = self._steered(self.vectors)
        # traced once, now: a trace on the event loop would patch nn.Module.__call__ process-wide
        # while an engine step runs (see `Gate`); the base model's blocks never change
        self._blocks = numbered_blocks(lm.backbone)
        self.bridge = EngineThread(self._engine(self.model))
        self.version = 0  # bumped by every added vector (the page reloads its graph)
        self.listeners = []  # called with (model, names) after a swap (the handlers)
        self._adding = asyncio.Lock()

    @property
    def names(self):
        return tuple(self.vectors)

    @property
    def max_length(self):
        return self.bridge.engine.max_length

    def exclusive(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) with no engine step running meanwhile (it may trace; see `Gate`), but
        where its loops give the engine a turn between batches (`kvwire.steer.turns`)."""
        gate = self.bridge.gate
        with gate.exclusive(), taking_turns(gate.turn):
            return fn(*args, **kwargs)

    def _steered(self, vectors):
        """The named vectors at strength 0, then the inline bank's layers (the same modules in every
        model built: a swap keeps the vectors lent to running requests)."""
        model = steered_model(self.lm, vectors)
        return model if self.inline is None else self.inline.apply(model)

    def _build(self, vectors):
        model = self._steered(vectors)
        return model, self._engine(model)

    def _engine(self, model):
        settings = self.lm.compile_settings
        if settings is not None and model.compile_settings is None:  # a steered copy of a compiled model
            model.compile(**settings)
        return Engine(model, **self.engine_options, prefix_store=PrefixStore(max_bytes=self.prefix_bytes))

    def check_new_name(self, name):
        """Refuse a name that is not an identifier, is reserved (`check_unreserved`) or is taken (a
        vector is never replaced: clients may be steering with it)."""
        try:
            check_names([name])
            check_unreserved([name])
        except ValueError as e:
            raise APIError(str(e).replace(" (--control-vector NAME=FILE)", ""), param="name",
                           code="invalid_value") from None
        if name in self.vectors:
            raise APIError(f"a control vector named {name!r} is already loaded; pick another name",
                           param="name", code="name_taken", status=409)

    async def add(self, name, vector):
        """Serve `vector` as `name`: build the steered model and its engine off the event loop,
        then swap on it. Returns once new requests may steer with `name`."""
        async with self._adding:
            self.check_new_name(name)
            vectors = {**self.vectors, name: vector}
            model, engine = await asyncio.to_thread(self.exclusive, self._build, vectors)
            self.bridge.swap(engine)  # on the loop, between requests' checks and submits
            self.vectors, self.model = vectors, model
            self.version += 1
            for listener in self.listeners:
                listener(model, self.names)

    def describe(self, name):
        vector = self.vectors[name]
        return {"name": name, "layers": vector.layers, "width": vector.width, "method": vector.method or None,
                "model_hint": vector.model_hint or None, "operation": vector.operation, "site": vector.site}

    def steer_nodes(self, model=None):
        """{graph node name: control-vector name} for the steering layers of `model`'s backbone (default:
        the served model); how the page tells which orange box of the graph belongs to which vector."""
        backbone = (self.model if model is None else model).backbone
        nodes = {}
        for node in getattr(backbone, "graph", None).nodes if hasattr(backbone, "graph") else ():
            if node.op == "call_module":
                module = backbone.get_submodule(node.target)
                if isinstance(module, Scheduled) and module.name in self.vectors:
                    nodes[node.name] = module.name
        return nodes

    def blocks(self):
        """{block index: dotted name} of the base model (what `layers` of a training job may name)."""
        return dict(self._blocks)

"""`lm.steer(vector, strength)`: a control vector added after the blocks it names, as `Steer`
layers edited into the model's graph (registered as `CausalLM.steer`'s implementation)."""
from ..graph import insert_after, numbered_blocks
from ..graph.edit import summarize_indices
from .layer import Steer
from .vector import ControlVector


def add_vector(lm, vector, strength=1.0, *, generated_only=False, name=None):
    """The same model with `vector` added after its blocks; see `CausalLM.steer`."""
    if not isinstance(vector, ControlVector):
        raise TypeError(f"steer expects a kw.ControlVector, got {type(vector).__name__}")
    blocks = numbered_blocks(lm.backbone)
    width = lm.head.weight.shape[1]
    if vector.width != width:
        raise ValueError(f"control vector width {vector.width} does not fit this model's hidden size {width}")
    bad = [i for i in vector.layers if i not in blocks]
    if bad:
        raise ValueError(f"control vector steers blocks {bad}, but this model has blocks "
                         f"{summarize_indices(blocks) or 'none'}")
    taken = {m.name: m for m in lm.backbone.modules() if isinstance(m, Steer)}
    if name is None:
        name = next(n for n in ("steer", *(f"steer{k}" for k in range(2, len(taken) + 3))) if n not in taken)
    new = Steer(vector.directions[vector.layers[0]], strength, generated_only, name, device=lm.device)
    if name in taken and not taken[name].same_inputs(new):
        raise ValueError(f"this model already has steering inputs named {name!r} with strength "
                         f"{taken[name].strength.tolist()} (generated_only={taken[name].generated_only}); "
                         f"layers sharing a name share their inputs: pick another name")
    index = {blocks[i]: i for i in vector.layers}
    device = lm.device  # the vector (kept on the CPU) and the strength move to the weights
    return lm.edit(insert_after(list(index), lambda call, layer: Steer(
        vector.directions[index[call]], strength, generated_only, name, device=device)))

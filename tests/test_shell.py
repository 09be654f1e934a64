"""`kvwire.graph.shell`: a module tree of its own over the same tensors."""
import pytest
import torch
from torch import fx, nn

from kvwire.graph.shell import shell


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.again = self.inner  # registered twice: shared in the shell too
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.again(self.inner(x)) * self.scale


def test_a_shell_computes_the_same_with_the_same_tensors_in_its_own_modules():
    x = torch.randn(3, 4)
    traced = fx.symbolic_trace(_Tied())  # a GraphModule: its forward lives on its own class
    assert torch.equal(shell(traced)(x), traced(x))
    model = _Tied()
    twin = shell(model)
    assert torch.equal(twin(x), model(x))
    assert twin is not model and twin.inner is not model.inner and twin.inner is twin.again
    assert all(a is b for a, b in zip(twin.parameters(), model.parameters()))
    twin._buffers["scale"] = torch.tensor(5.0)  # what a trace does to the modules it runs
    assert float(model.scale) == 2.0 and float(twin.scale) == 5.0
    with torch.no_grad():
        twin.inner.weight.zero_()  # the same storage
    assert not model.inner.weight.any()


def test_a_shell_of_something_else_is_refused():
    with pytest.raises(TypeError, match="takes an nn.Module, got list"):
        shell([nn.Linear(2, 2)])


@pytest.mark.parametrize("trace", ["export_program", "export_static"])
def test_exporting_leaves_the_live_model_real_tensors_while_it_traces(trace):
    # kw.export traces a shell: a thread reading (or steering) the live model meanwhile sees its
    # real weights, not the fake tensors export runs the trace on
    import kvwire as kw
    from kvwire.export import trace as traces
    from kvwire.export.program import ExportProgram

    from .conftest import FAMILIES

    lm = kw.from_hf(FAMILIES["llama"](vocab_size=64))
    prog = ExportProgram(lm, 16, False).eval()
    live = next(m for m in prog.modules() if m._parameters)
    seen = []
    live.register_forward_pre_hook(lambda *_: seen.extend(type(p) for p in live._parameters.values()))
    if trace == "export_program":
        traces.export_program(prog)
    else:
        traces.export_static(prog, prog.example_inputs(1, 2))
    assert seen and all(t is nn.Parameter for t in seen), seen


def test_a_forward_set_on_an_instance_runs_on_the_twin():
    """A pass that wraps one module's forward (a bound method in its __dict__): the shell's twin
    calls the wrapper bound to itself, so what the wrapped code sets lands on the twin."""
    import types

    model = _Tied()

    def forward(self, x):
        self.seen = x  # a plain attribute the module's own code sets (state some mixers keep so)
        return type(self).forward(self, x)

    model.inner.forward = types.MethodType(forward, model.inner)
    twin = shell(model)
    x = torch.randn(3, 4)
    assert torch.equal(twin(x), model(x))
    model.inner.seen = None
    twin(x + 1)
    assert model.inner.seen is None and twin.inner.seen is not None

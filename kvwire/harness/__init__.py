"""lm-evaluation-harness for kvwire models: `import kvwire.harness` registers the "kvwire" model.

    >>> import kvwire.harness, lm_eval
    >>> lm_eval.simple_evaluate(model="kvwire", model_args="pretrained=smollm2-135m-instruct,"
    ...                         "control_vector=happy.gguf,strength=4", tasks=["hellaswag"])

lm-eval is an optional extra (`pip install 'kvwire[eval]'`); `kvwire eval` wraps its
`simple_evaluate` on the command line. See docs/harness.md.
"""
EXTRA = "lm-eval (lm-evaluation-harness) is needed for kvwire.harness and `kvwire eval`: pip install 'kvwire[eval]'"

try:
    from lm_eval.api.registry import register_model
except ImportError as e:  # the optional extra is missing
    raise ImportError(EXTRA) from e

from .model import KvwireLM, steered  # noqa: E402
from .scoring import continuation_logprobs  # noqa: E402

register_model("kvwire")(KvwireLM)

__all__ = ["KvwireLM", "continuation_logprobs", "steered"]

"""Request bodies of the OpenAI endpoints kvwire serves, as pydantic models.

Types are strict (a "0.5" string is not a number, true is not an int), so a wrong type is a 400
naming the field rather than a guess; null is taken wherever OpenAI's spec allows it (the field's
default). Fields OpenAI has and kvwire does not use are ignored, except those that would change the
answer (penalties, `echo`, `suffix`, `best_of`), which `unsupported` refuses. kvwire's own
additions: `steer`, {control-vector name: strength} (a clamp vector: {"lo": a, "hi": b}),
`steer_vectors`, vectors carried inline (see `kvwire.serve.inline`), `sae_features` and `sae_mode`,
SAE features set, added to or clamped (see `kvwire.serve.inline_sae`), and `response_format` types
"regex" and "grammar" (both endpoints take `response_format`). The body of kvwire's `POST /kvwire/evaluate` is here too
(`EvaluateRequest`; see `kvwire.serve.analysis`).
"""
from typing import Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      field_validator)
from pydantic_core import PydanticCustomError

Number = Union[StrictInt, StrictFloat]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class InlineVector(BaseModel):
    """A vector a request carries: {block: base64 of D little-endian float32, or a list of D numbers}
    added after those blocks at `strength` (default 1), projected out (operation "ablate"), or with
    its projection held in [lo, hi] (operation "clamp"; a side left out is unbounded). See
    `kvwire.serve.inline_wire`."""

    model_config = ConfigDict(strict=True, extra="forbid")
    directions: dict[str, Union[str, list[Number]]]
    strength: Number | None = None
    operation: str = "add"  # or "ablate": project the direction out; or "clamp": bound its projection
    lo: Number | None = None
    hi: Number | None = None


class SteerBounds(BaseModel):
    """A named clamp vector's bounds in `steer`: {"lo": a, "hi": b}, either side left out unbounded."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lo: Number | None = None
    hi: Number | None = None


class JSONSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's structured-output schema. The schema is enforced whether
    or not `strict` is set (kvwire's constraint machinery has no best-effort mode)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """What the output must be: "text" (anything), "json_object", "json_schema" (OpenAI's), or
    kvwire's extensions "regex" (`regex`: a pattern the whole output matches) and "grammar"
    (`grammar`: Lark, as llguidance reads it, or GBNF)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JSONSchemaFormat | None = None
    regex: str | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)


class _Sampling(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    max_tokens: StrictInt | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    n: StrictInt | None = None  # null: 1, as OpenAI's spec allows
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    steer: dict[str, Union[Number, SteerBounds]] | None = None
    steer_vectors: list[InlineVector] | None = None
    sae_features: dict[str, Union[Number, list[Number | None]]] | None = None
    sae_mode: str | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """A function the model may call (OpenAI's `tools` entry)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming the one function the reply must call."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionName


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: `messages` rendered with the model's chat template."""

    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions: a prompt (or a list of prompts, one choice each) continued as is."""

    prompt: str | list[str]
    logprobs: StrictInt | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None


class EvalVector(BaseModel):
    """A vector `POST /kvwire/evaluate` carries: {block: base64 of D little-endian float32, or a list
    of D numbers}, its operation ("add": s times it added; "ablate": the fraction s of it projected
    out; "clamp": its projection held at s) and the block site it acts at."""

    model_config = ConfigDict(strict=True, extra="forbid")
    directions: dict[str, Union[str, list[Number]]]
    operation: str = "add"
    site: str = "block_out"


class EvalExample(BaseModel):
    """One A/B example: the prompt, and the answers that show the behaviour (positive) or not."""

    model_config = ConfigDict(strict=True, extra="forbid")
    prompt: StrictStr
    positive: StrictStr
    negative: StrictStr


class EvaluateRequest(BaseModel):
    """POST /kvwire/evaluate: `kw.steer.evaluate` of `vector` (a served vector's name, or one inline)
    at `strengths` on a shipped `dataset` (default "sentiment-ab") or on `examples`, with side effects
    on `neutral` text (default: the package's neutral prose) cut into rows of `neutral_tokens`;
    `generated_only` steers each example's answer alone (`when="generated"`), not its prompt."""

    model_config = ConfigDict(strict=True, extra="forbid")
    vector: Union[StrictStr, EvalVector]
    strengths: list[Number]
    dataset: StrictStr | None = None
    examples: list[EvalExample] | None = None
    neutral: Union[StrictStr, list[StrictStr], None] = None
    neutral_tokens: StrictInt = 128
    generated_only: StrictBool = False

    @field_validator("vector", mode="wrap")
    @classmethod
    def _inline_vector(cls, value, handler):
        # pydantic would report the union's first member (a name: "should be a valid string") for
        # an object; the client wants what is wrong with the object
        if not isinstance(value, dict):
            return handler(value)
        try:
            return EvalVector.model_validate(value)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "object"
            raise PydanticCustomError("invalid_vector", "the inline vector's {field}: {why}",
                                      {"field": field, "why": first["msg"][:1].lower() + first["msg"][1:]}) from None


def unsupported(request):
    """(field, why) for a field set to something kvwire cannot honour, or None."""
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name) not in (None, 0):
            return name, f"{name} is not supported (only 0); kvwire has no presence/frequency penalties"
    if request.logit_bias:
        return "logit_bias", "logit_bias is not supported"
    if getattr(request, "echo", False):
        return "echo", "echo is not supported"
    if getattr(request, "suffix", None):
        return "suffix", "suffix (insertion) is not supported"
    if getattr(request, "best_of", None) not in (None, 1):
        return "best_of", f"best_of is not supported (only 1), got {request.best_of}; ask for n choices instead"
    return None

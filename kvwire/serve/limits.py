"""What one request may ask of the server: body bytes, prompt tokens, new tokens, wall time, and how
many sequences may wait for a row. One place defines them, their command-line flags and their
checks, so later limits (per key, per minute) join here.

Bytes are checked as the body arrives, before anything parses or tokenises it (`body_limit.py`);
tokens once the prompt is tokenised (off the event loop), before the engine sees it; the queue when
a request's sequences are submitted and the wall time while they run (`bridge.py`). No web
framework here: the command line reads the flags without loading the server.
"""
import math
from dataclasses import dataclass, fields

from ..generate.request import RequestError

DEFAULT_BODY_BYTES = 4 << 20  # a 4096-token prompt is ~16-50 kB of text; 4 MiB leaves room for long chats


@dataclass(frozen=True)
class Limits:
    """Per-request bounds, and the engine queue's.

    Args:
        body_bytes: the largest request body (bytes); larger ones get 413 before they are read whole.
        prompt_tokens: the longest prompt (tokens); None: what the server's max_length leaves for one
            new token.
        max_tokens: the most new tokens a request may ask for (max_tokens / max_completion_tokens) and
            the default budget's cap; None: what is left of max_length.
        max_waiting: sequences that may wait in the engine's queue for a row; a request that finds
            that many waiting gets 429 with Retry-After (None: no bound, every request waits).
        request_seconds: a request's wall time from its submission to the engine (seconds); past it
            its sequences are cancelled and it gets 504 (a stream: an error event). None: no bound.

    Example:
        >>> app = create_app(lm, limits=Limits(body_bytes=1 << 20, max_tokens=512, max_waiting=64,
        ...                                    request_seconds=120))
    """

    body_bytes: int = DEFAULT_BODY_BYTES
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_waiting: int | None = None
    request_seconds: float | None = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name != "body_bytes":
                continue
            if f.name == "request_seconds":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                        or value <= 0:
                    raise ValueError(f"{FLAGS[f.name]} must be a positive number of seconds, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{FLAGS[f.name]} must be a positive int, got {value!r}")

    def check_prompt(self, length, param):
        """Refuse a tokenised prompt longer than `prompt_tokens`."""
        if self.prompt_tokens is not None and length > self.prompt_tokens:
            raise RequestError(f"{param}: the prompt is {length} tokens; this server takes at most "
                               f"{self.prompt_tokens} ({FLAGS['prompt_tokens']})", param, "context_length_exceeded")

    def check_new_tokens(self, asked, param):
        """Refuse max_tokens above `max_tokens`; the cap for a request that gives none (or None)."""
        if self.max_tokens is not None and asked is not None and not isinstance(asked, bool) and \
                isinstance(asked, int) and asked > self.max_tokens:
            raise RequestError(f"{param} is {asked}; this server gives at most {self.max_tokens} new tokens a "
                               f"request ({FLAGS['max_tokens']})", param, "invalid_value")
        return self.max_tokens


FLAGS = {"body_bytes": "--max-body-bytes", "prompt_tokens": "--max-prompt-tokens", "max_tokens": "--max-tokens",
         "max_waiting": "--max-waiting", "request_seconds": "--request-timeout"}


def add_arguments(parser):
    """The limits' flags on a command (`kvwire serve`)."""
    parser.add_argument(FLAGS["body_bytes"], type=int, default=DEFAULT_BODY_BYTES, metavar="BYTES",
                        help="largest request body; larger ones get 413 before they are parsed (default 4 MiB)")
    parser.add_argument(FLAGS["prompt_tokens"], type=int, default=None, metavar="N",
                        help="longest prompt in tokens (default: what --max-length leaves for one new token)")
    parser.add_argument(FLAGS["max_tokens"], type=int, default=None, metavar="N",
                        help="most new tokens one request may ask for, and the cap when it asks for none "
                        "(default: what is left of --max-length)")
    parser.add_argument(FLAGS["max_waiting"], type=int, default=None, metavar="N",
                        help="sequences that may wait for a row; a request that finds N waiting gets 429 with "
                        "Retry-After (default: no bound)")
    parser.add_argument(FLAGS["request_seconds"], type=float, default=None, metavar="SECONDS",
                        help="a request's wall time once queued; past it its rows are cancelled and it gets 504 "
                        "(a stream: an error event) (default: no bound)")


def from_args(args):
    return Limits(body_bytes=args.max_body_bytes, prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                  max_waiting=args.max_waiting, request_seconds=args.request_timeout)

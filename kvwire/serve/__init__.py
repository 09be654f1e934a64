"""The OpenAI-compatible HTTP server over kvwire's engine (`kvwire serve`).

`create_app` and `serve` load the web framework when first used, so the command line can read the
server's flags (`limits`) without it."""

__all__ = ["create_app", "serve"]


def __getattr__(name):
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Griffe extension for the API reference: kvwire's docstrings head their doctest blocks
"Example:" (as Napoleon reads them); Google-style parsing in griffe knows only "Examples:", so
without this the example would render as an admonition of plain text instead of code."""
import re

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)

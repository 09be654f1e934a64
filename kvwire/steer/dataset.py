"""Contrastive A/B datasets for `evaluate` and `calibrate`: a prompt and the answer that shows the
behaviour (positive) or not (negative). JSONL files in either of two layouts, one object a line:

- kvwire's: `{"prompt": ..., "positive": ..., "negative": ...}`;
- CAA's (Rimsky et al. 2024): `{"question": ..., "answer_matching_behavior": ...,
  "answer_not_matching_behavior": ...}` (other keys are ignored in both).

The answer's tokens follow the prompt's as the tokenizer encodes each alone, so write the space
between them into the answer (" (A"). Shipped with the package (`dataset(name)`): "sentiment-ab",
30 multiple-choice questions whose positive answer is the happier one (the letter is the last
token of prompt + answer, as `ControlVector.train(method="caa")` reads it). `neutral_text()` is the
plain prose that side effects are measured on by default.
"""
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

SHIPPED = {"sentiment-ab": "sentiment_ab.jsonl"}
LAYOUTS = (("prompt", "positive", "negative"),
           ("question", "answer_matching_behavior", "answer_not_matching_behavior"))


@dataclass(frozen=True)
class Example:
    """One item: the prompt and its two answers; `where` names it in errors ("file.jsonl line 3")."""

    prompt: str
    positive: str
    negative: str
    where: str = field(default="", compare=False)


@dataclass(frozen=True)
class ABDataset:
    """A list of `Example`s and the name it was loaded by.

    Example:
        >>> data = kw.steer.dataset("sentiment-ab")
        >>> len(data), data[0].positive
        (30, ' (A')
        >>> vec = kw.ControlVector.train(lm, *data.pairs(), method="caa")
    """

    examples: tuple
    name: str = ""

    def __len__(self):
        return len(self.examples)

    def __iter__(self):
        return iter(self.examples)

    def __getitem__(self, i):
        return self.examples[i]

    def pairs(self):
        """(positive prompts, negative prompts): prompt + answer for each example, the contrastive
        pairs `ControlVector.train` takes."""
        return [e.prompt + e.positive for e in self], [e.prompt + e.negative for e in self]

    @classmethod
    def from_jsonl(cls, path):
        """Read a JSONL file (either layout); an empty or malformed line is refused by number."""
        path = Path(path)
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        while lines and not lines[-1].strip():  # trailing blank lines
            lines.pop()
        records = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                raise ValueError(f"{path.name} line {n} is empty; expected one JSON object a line")
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path.name} line {n} is not valid JSON ({e.msg}): {line!r:.80}") from None
        return cls.from_records(records, path.name, path.stem)

    @classmethod
    def from_records(cls, records, source="records", name=""):
        """From dicts (either layout) or (prompt, positive, negative) tuples; record n is "line n"."""
        if isinstance(records, (str, bytes)) or not hasattr(records, "__iter__"):
            raise TypeError(f"records must be a list of dicts or (prompt, positive, negative) tuples, got "
                            f"{type(records).__name__}")
        examples = tuple(_example(r, f"{source} line {n}") for n, r in enumerate(records, 1))
        if not examples:
            raise ValueError(f"{source} holds no examples; expected at least one prompt with two answers")
        return cls(examples, name or source)


def dataset(name_or_path):
    """A shipped dataset by name (`SHIPPED`) or a JSONL file by path, as an `ABDataset`."""
    if isinstance(name_or_path, ABDataset):
        return name_or_path
    if name_or_path in SHIPPED:
        with resources.as_file(resources.files(__package__) / "data" / SHIPPED[name_or_path]) as path:
            return ABDataset(ABDataset.from_jsonl(path).examples, name_or_path)
    if not isinstance(name_or_path, (str, Path)) or not Path(name_or_path).is_file():
        raise ValueError(f"dataset {name_or_path!r} is neither a shipped dataset ({', '.join(SHIPPED)}) nor a "
                         f"JSONL file")
    return ABDataset.from_jsonl(name_or_path)


def neutral_text():
    """The package's neutral prose (a few paragraphs) that side effects are measured on by default."""
    return (resources.files(__package__) / "data" / "neutral.txt").read_text(encoding="utf-8")


def _example(record, where):
    if isinstance(record, (tuple, list)) and len(record) == 3:
        record = dict(zip(LAYOUTS[0], record))
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with keys {LAYOUTS[0]} or {LAYOUTS[1]}, got "
                         f"{type(record).__name__}")
    keys = next((layout for layout in LAYOUTS if layout[0] in record), None)
    missing = [k for k in (keys or LAYOUTS[0]) if k not in record]
    if keys is None or missing:
        raise ValueError(f"{where}: expected keys {LAYOUTS[0]} (or CAA's {LAYOUTS[1]}); "
                         f"{'missing ' + repr(missing) if keys else 'got ' + repr(sorted(record))}")
    values = [record[k] for k in keys]
    for k, v in zip(keys, values):
        if not isinstance(v, str) or not v:
            raise ValueError(f"{where}: {k!r} must be a non-empty string, got {v!r:.60}")
    if values[1] == values[2]:
        raise ValueError(f"{where}: the two answers are the same ({values[1]!r}); they must differ")
    return Example(*values, where=where)

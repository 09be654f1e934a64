"""Constrained decoding: outputs valid against their JSON schema, regex or grammar (complete when the
row stops, a valid prefix when the budget ends first), constrained and free rows sharing a batch
exactly as each runs alone, and clear refusals of what cannot be compiled."""
import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import kvwire as kw
from kvwire.generate import Engine
from kvwire.generate.constrain import Constraint, ConstraintError

from .serve_fixtures import tiny_chat_lm

NEW = 160  # enough for the tiny random model to finish most small objects


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


def run(lm, prompts, constraints, new=NEW, samplers=None, seeds=None, max_batch=None):
    """Each prompt's (tokens, finish_reason) through one engine: rows share batches."""
    engine = Engine(lm, max_batch or len(prompts), 256)
    stops = tuple(lm.eos_token_ids)
    seqs = [engine.submit(lm.encode(p), new, constraint=c, stop_ids=stops,
                          sampler=(samplers or [None] * len(prompts))[i], seed=(seeds or [None] * len(prompts))[i])
            for i, (p, c) in enumerate(zip(prompts, constraints))]
    for _ in engine.run(seqs):
        pass
    for s in seqs:
        assert s.error is None, s.error
    return [(s.tokens, s.finish_reason) for s in seqs], engine


def check_json(lm, tokens, reason, schema):
    text = lm.tokenizer.decode(tokens)
    if reason == "stop":
        jsonschema.validate(json.loads(text), schema)  # complete and valid
    else:
        assert reason == "length"
        prefix = Constraint.json_schema(schema).matcher(lm.tokenizer, lm.vocab_size)
        assert prefix.m.try_consume_tokens(tokens) == len(tokens), text  # a valid prefix


# -- schemas drawn by hypothesis -------------------------------------------------------------------

leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["red", "green", "blue", "a b", "x\"y"]), min_size=1, max_size=3, unique=True)
    .map(lambda v: {"enum": v}),
    st.just({"type": "null"}),
)


def objects(children):
    return st.dictionaries(st.sampled_from(["a", "b", "name", "n_2", "ok"]), children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))


schemas = st.recursive(leaf, lambda inner: st.one_of(
    objects(inner), st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 3))),
    max_leaves=6)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2 ** 16))
def test_outputs_are_valid_against_drawn_schemas(lm, schema, seed):
    """Complete outputs validate with jsonschema (an independent checker); outputs the budget cut
    are prefixes the grammar still accepts. Sampled, so the rows wander over the schema."""
    (tokens, reason), = run(lm, ["data:"], [Constraint.json_schema(schema)], samplers=[kw.Random(1.0)],
                            seeds=[seed])[0]
    check_json(lm, tokens, reason, schema)


def test_json_object_and_pydantic_models(lm):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    for constraint, check in ((Constraint.json_object(), dict), (Constraint.json_schema(Person), Person)):
        (tokens, reason), = run(lm, ["x"], [constraint], new=200)[0]
        if reason == "stop":
            value = json.loads(lm.tokenizer.decode(tokens))
            assert isinstance(value, dict)
            if check is Person:
                Person.model_validate(value)


def test_regex_and_grammars_match_whole(lm):
    cases = [(Constraint.regex(r"[0-9]{3}-[a-z]{2,4}"), r"[0-9]{3}-[a-z]{2,4}"),
             (Constraint.grammar('start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]+/'), r"yes|no|maybe [0-9]+"),
             (Constraint.grammar('root ::= "(" [a-c]+ ")"'), r"\([a-c]+\)")]  # GBNF, converted
    results, _ = run(lm, ["a", "b", "c"], [c for c, _ in cases], samplers=[kw.Random(1.0)] * 3, seeds=[1, 2, 3])
    for (tokens, reason), (_, pattern) in zip(results, cases):
        text = lm.tokenizer.decode(tokens)
        if reason == "stop":
            assert re.fullmatch(pattern, text), text
        else:
            assert reason == "length" and len(tokens) == NEW


def test_constrained_and_free_rows_share_a_batch_as_each_runs_alone(lm):
    """Masks are per row: a batch of rows with different constraints (and none) gives every row
    the tokens it gets alone, greedy and seeded."""
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    constraints = [Constraint.json_schema(schema), None, Constraint.regex("[a-z]{4,9}"), Constraint.json_object(), None]
    prompts = ["one", "two", "three", "four", "five"]
    samplers = [None, kw.Random(0.9), kw.TopP(0.9), None, None]
    seeds = [None, 5, 6, None, None]
    together, engine = run(lm, prompts, constraints, new=40, samplers=samplers, seeds=seeds)
    assert engine.mask_seconds > 0
    for i in range(len(prompts)):
        alone, _ = run(lm, [prompts[i]], [constraints[i]], new=40, samplers=[samplers[i]], seeds=[seeds[i]])
        assert alone[0] == together[i], i
    assert together[1][0] != together[0][0]


def test_rows_joining_a_running_batch_keep_their_constraints(lm):
    """Continuous batching: constrained rows admitted while others decode."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    results, engine = run(lm, ["p1", "p2 longer prompt", "p3"], [Constraint.json_schema(schema)] * 3, max_batch=2)
    assert engine.stats["scratch_prefills"] >= 1
    for tokens, reason in results:
        check_json(lm, tokens, reason, schema)


def test_generate_and_chat_take_json_schema(lm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    text = lm.generate("Answer:", max_new_tokens=NEW, json_schema=schema)
    gen = lm.generate_ids("Answer:", max_new_tokens=NEW, json_schema=schema)
    assert gen.texts[0] == text
    reply = lm.chat([{"role": "user", "content": "hi"}], max_new_tokens=NEW, json_schema=schema)
    for out in (text, reply):
        if out.endswith("}"):
            jsonschema.validate(json.loads(out), schema)
    assert re.fullmatch(r"[0-9]+", lm.generate(["a", "bb"], max_new_tokens=6, regex=r"[0-9]+")[1])


def test_a_budget_too_short_gives_a_valid_prefix(lm):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    (tokens, reason), = run(lm, ["x"], [Constraint.json_schema(schema)], new=3)[0]
    assert reason == "length" and lm.tokenizer.decode(tokens).startswith("{")
    check_json(lm, tokens, reason, schema)


@pytest.mark.parametrize("options, param, words", [
    (dict(json_schema={"type": "wat"}), "json_schema", "Invalid type: wat"),
    (dict(json_schema="{not json"), "json_schema", "not valid JSON"),
    (dict(json_schema=[1, 2]), "json_schema", "JSON schema object"),
    (dict(regex="[a-"), "regex", "unclosed character class"),
    (dict(grammar="start: missing_rule\n"), "grammar", "unknown name"),
    (dict(grammar="root ::= ("), "grammar", "grammar"),
    (dict(regex=""), "regex", "non-empty"),
    (dict(json_schema={"type": "object"}, regex="a"), "regex", "give one of"),
])
def test_what_cannot_be_compiled_is_refused_naming_the_field(lm, options, param, words):
    with pytest.raises(kw.RequestError, match=re.escape(words)) as info:
        lm.generate("x", max_new_tokens=4, **options)
    assert info.value.param == param


def test_stop_strings_and_beam_search_are_refused_with_a_constraint(lm):
    with pytest.raises(kw.RequestError, match="grammar decides where the output ends"):
        lm.generate("x", max_new_tokens=4, regex="[a-z]+", stop=["q"])
    with pytest.raises(kw.RequestError, match="beam search does not take"):
        lm.generate("x", max_new_tokens=4, regex="[a-z]+", sampler=kw.BeamSearch(2))


def test_a_constraint_compiles_once_per_tokenizer(lm):
    c = Constraint.regex("[a-z]+")
    c.compile(lm.tokenizer, lm.vocab_size)
    first = list(c._compiled)
    c.compile(lm.tokenizer, lm.vocab_size)
    assert c._compiled == first and len(first) == 1
    a, b = c.matcher(lm.tokenizer, lm.vocab_size), c.matcher(lm.tokenizer, lm.vocab_size)
    assert a.take(lm.encode("q")[0]) and not b.finished  # rows hold their own state
    assert isinstance(ConstraintError("x"), kw.RequestError)


def test_the_mask_allows_stop_ids_only_where_the_output_is_complete(lm):
    c = Constraint.regex("ab")
    m = c.matcher(lm.tokenizer, lm.vocab_size)
    stop = lm.eos_token_ids[0]
    allowed = m.allowed({stop})
    assert not allowed[stop] and allowed[lm.encode("a")[0]] and allowed.sum() == 1
    m.take(lm.encode("a")[0])
    m.take(lm.encode("b")[0])
    assert m.finished


def test_masked_logits_leave_free_rows_untouched(lm):
    from kvwire.generate.constrain import mask_logits

    class Row:
        def __init__(self, matcher):
            self.matcher, self.stopper = matcher, type("S", (), {"stop_ids": set()})()

    logits = torch.randn(2, lm.vocab_size)
    masked, stuck, _ = mask_logits(logits, [Row(None), Row(Constraint.regex("z").matcher(lm.tokenizer, lm.vocab_size))])
    assert not stuck and torch.equal(masked[0], logits[0])
    assert torch.isfinite(masked[1]).sum() == 1 and masked[1].argmax() == lm.encode("z")[0]

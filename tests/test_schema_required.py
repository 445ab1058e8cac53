"""A structured answer cannot close an object without a `required` property: the grammar engine enforces `required`
only for properties its object lists, so `engine_schema` lists every required name (`list_required`, exact: the
rewritten schema accepts the same values as the user's), and where that is not exact strict mode refuses the schema
(`unenforced`)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from molora.schema_rules import engine_schema, list_required, unenforced
from molora.structured import StructuredCompiler, StructuredOutputError, StructuredSpec
from tests.structured_fixtures import char_tokenizer

STR = {"type": "string"}
REWRITTEN = {  # what xgrammar 0.2.9 let close early before the rewrite (probed), each now exact
    "required not in properties": {"type": "object", "properties": {"a": STR}, "required": ["b"]},
    "required, no properties": {"type": "object", "required": ["b"]},
    "additionalProperties gives it": {
        "type": "object",
        "properties": {"a": STR},
        "additionalProperties": STR,
        "required": ["a", "b"],
    },
}
REFUSED = {  # not exact to rewrite: strict mode refuses them
    "anyOf branches require": {
        "type": "object",
        "properties": {"a": STR, "b": STR},
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
    },
    "beside patternProperties": {"type": "object", "patternProperties": {"^b": STR}, "required": ["b"]},
    "beside $ref": {
        "$defs": {"o": {"type": "object", "properties": {"a": STR}}},
        "$ref": "#/$defs/o",
        "required": ["a"],
    },
}
INSTANCES = [{}, {"a": "x"}, {"b": "y"}, {"a": "x", "b": "y"}, {"b": 1}, {"a": "x", "c": "z"}, {"a": 1, "b": "y"}]


@pytest.mark.parametrize("name", sorted(REWRITTEN))
def test_every_required_name_is_listed_exactly_and_enforced(name):
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    schema = REWRITTEN[name]
    assert unenforced(schema) == []
    rewritten = engine_schema(schema)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(rewritten), any_whitespace=False)  # as compiled
    verdicts = []
    for obj in INSTANCES:
        valid = jsonschema.Draft202012Validator(schema).is_valid(obj)
        assert jsonschema.Draft202012Validator(rewritten).is_valid(obj) == valid, obj  # the same values
        accepted = _is_grammar_accept_string(grammar, json.dumps(obj))
        assert not accepted or valid, obj  # the engine lets no object close without a required property
        # and accepts every valid one whose keys it lists (the engine closes an object to unlisted names when
        # additionalProperties is absent: a narrowing it makes with or without this rewrite)
        listed = set(rewritten.get("properties", {})) if "additionalProperties" not in rewritten else set(obj)
        assert accepted or not (valid and set(obj) <= listed), obj
        verdicts.append(accepted)
    assert True in verdicts and False in verdicts
    before = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)  # what the engine had
    assert any(
        _is_grammar_accept_string(before, json.dumps(o)) and not jsonschema.Draft202012Validator(schema).is_valid(o)
        for o in INSTANCES
    ) or not any(_is_grammar_accept_string(before, json.dumps(o)) for o in INSTANCES if "b" in o)


def test_the_rewrite_leaves_listed_and_unsafe_objects_alone():
    listed = {"type": "object", "properties": {"a": STR}, "required": ["a"]}
    assert list_required(listed) is listed
    closed = {"type": "object", "properties": {"a": STR}, "additionalProperties": False, "required": ["b"]}
    assert list_required(closed) is closed and unenforced(closed)  # no value is valid: not made satisfiable
    for schema in REFUSED.values():
        assert list_required(schema) is schema


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_strict_mode_refuses_what_cannot_be_listed_exactly(name):
    compiler = StructuredCompiler(char_tokenizer(), vocab_size=128, stop_token_ids=[1])
    assert any("required" in u for u in unenforced(REFUSED[name]))
    with pytest.raises(StructuredOutputError, match="required"):
        compiler.compile(StructuredSpec.json_schema(REFUSED[name], strict=True))
    assert compiler.compile(StructuredSpec.json_schema(REFUSED[name]))  # not strict: served, the check reports

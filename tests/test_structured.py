"""Structured output: one constraint mechanism (packed bitmasks) in the engine's sampling step, grammars on
xgrammar, and the server's response_format / structured_outputs / guided_* fields.

Tiny random Qwen3 models with a character-level tokenizer that can spell JSON (tests/structured_fixtures.py);
every randomness is a seeded generator. The invariants: every answer that ends parses and validates; a bad spec is
a 400 before any compute; a dead end ends only its own request; routing is the same with and without a mask.
"""

from __future__ import annotations

import json
import pickle
import re

import httpx
import jsonschema
import pytest
import torch

import molora
from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.routing import VocabRouter
from molora.sampling import (
    Constraint,
    ConstraintState,
    apply_bitmask,
    constraint_bitmask,
    is_allowed,
    pack_bitmask,
    unpack_bitmask,
)
from molora.server import ServerThread, create_app
from molora.structured import (
    GrammarConstraint,
    StructuredCompiler,
    StructuredOutputError,
    StructuredSpec,
    engine_schema,
)
from tests.conftest import make_peft_adapter, tiny_model
from tests.structured_fixtures import char_tokenizer

ARCH = "qwen3"
CFG = EngineConfig(max_num_seqs=8, max_model_len=256, kv_budget_tokens=4096)
# schemas whose every instance is short (enums, bounded strings, ranges, bounded arrays): a random model must end them
SCHEMAS = {
    "weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "flags": {
        "type": "object",
        "properties": {"on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["on", "level"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "x"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "shape": {
        "type": "object",
        "properties": {
            "s": {
                "anyOf": [
                    {"const": "dot"},
                    {
                        "type": "object",
                        "properties": {"r": {"type": "integer", "minimum": 1, "maximum": 5}},
                        "required": ["r"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["s"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return StructuredCompiler(tok, vocab_size=128, stop_token_ids=[1])


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_peft_adapter(root / n, ARCH, seed=i) for i, n in enumerate(("a", "b"))}


def _mm(paths, tok):
    return molora.attach(
        tiny_model(ARCH), paths, router=VocabRouter([(0, 64, "a")], default="b"), tokenizer=tok, check_base=False
    )


def _text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------ the mechanism


def test_bitmask_pack_unpack_and_apply_agree_with_a_bool_mask():
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(5, 77, generator=g) < 0.3  # V not a multiple of 32
    bits = pack_bitmask(allowed)
    assert bits.shape == (5, 3) and bits.dtype == torch.int32
    assert torch.equal(unpack_bitmask(bits, 77), allowed)
    logits = torch.randn(5, 77, generator=g)
    assert torch.equal(apply_bitmask(logits, bits), logits.masked_fill(~allowed, float("-inf")))
    ids = torch.randint(0, 77, (5,), generator=g)
    assert is_allowed(bits, ids).tolist() == allowed[torch.arange(5), ids].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_and_masked_greedy_equal_the_reference(dtype):
    """The kernel-backed apply equals unpack + masked_fill; masked_greedy picks what greedy picks from the masked
    logits, on dense and sparse masks, rows with nothing of their top candidates allowed, heavy ties (bf16 logits
    rounded to a few values) and an empty mask row."""
    from molora.sampling import apply_bitmask_reference, greedy, masked_greedy

    g = torch.Generator().manual_seed(3)
    for V, density in ((77, 0.5), (1000, 0.01), (49152, 0.002), (49152, 0.9)):
        allowed = torch.rand(12, V, generator=g) < density
        allowed[0] = False
        allowed[0, V - 1] = True  # one id, at the end of the vocabulary
        allowed[3, [V - 2, 5, V // 2]] = True
        allowed[3, 1] = False
        bits = pack_bitmask(allowed)
        logits = torch.randn(12, V, generator=g).to(dtype)
        logits[3, [V - 2, 5, V // 2, 1]] = 10.0  # a tie at the top: the first allowed id wins
        logits[1] = torch.randint(0, 3, (V,), generator=g).to(dtype)  # ties everywhere
        logits[2, allowed[2]] = -50.0  # every allowed id far below the top ones
        ref = apply_bitmask_reference(logits, bits)
        assert torch.equal(apply_bitmask(logits, bits), ref)
        assert masked_greedy(logits, bits).tolist() == greedy(ref).tolist(), (V, density)
        assert masked_greedy(logits, bits, candidates=1).tolist() == greedy(ref).tolist()


class _AllowOnly(Constraint, ConstraintState):
    """Allows one id after k generated tokens, then nothing (a dead end): a stand-in for a grammar."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.start = ids, 0

    def begin(self, prompt):
        state = _AllowOnly(self.ids)
        state.start = len(prompt)
        return state

    def fill(self, tokens, bitmask, row):
        k = len(tokens) - self.start
        allowed = torch.zeros(1, bitmask.shape[-1] * 32, dtype=torch.bool)
        if k < len(self.ids):
            allowed[0, self.ids[k]] = True
        bitmask[row] = pack_bitmask(allowed)[0]


def test_constraint_bitmask_ands_several_states():
    a, b = _AllowOnly([5]).begin([1]), _AllowOnly([6]).begin([1])
    both = constraint_bitmask([[a], [a, b], []], [[1], [1], [1]], 64)
    assert unpack_bitmask(both, 64).sum(-1).tolist() == [1, 0, 64]


def test_dead_end_ends_that_request_alone_and_the_batch_goes_on(paths, tok):
    engine = Engine(_mm(paths, tok), CFG)
    p, q = [5, 6, 7], [9, 10, 11]
    alone = engine.generate([q], SamplingParams(max_new_tokens=8))[0]
    outs = engine.generate(
        [p, q],
        [SamplingParams(max_new_tokens=8, temperature=0.7, seed=1), SamplingParams(max_new_tokens=8)],
        constraint=[_AllowOnly([40, 41, 42]), None],
    )
    assert outs[0].new_token_ids == [40, 41, 42]
    assert outs[0].finish_reason == "error" and "constraint dead end" in outs[0].error
    assert outs[1].new_token_ids == alone.new_token_ids and outs[1].finish_reason == alone.finish_reason
    engine.check()
    assert not engine.requests and engine.allocator.num_free == CFG.kv_blocks


# ------------------------------------------------------------------------------------------ grammars


def test_every_constrained_answer_parses_and_validates(paths, tok, compiler):
    engine = Engine(_mm(paths, tok), CFG)
    prompts = [[5 + i, 20, 30 + i] for i in range(4)]
    for name, schema in SCHEMAS.items():
        c = compiler.compile(StructuredSpec.json_schema(schema))
        params = [SamplingParams(max_new_tokens=120)] + [
            SamplingParams(max_new_tokens=120, temperature=1.0, seed=s) for s in range(3)
        ]
        for out in engine.generate(prompts, params, constraint=c):
            assert out.finish_reason == "stop", (name, out.finish_reason, _text(tok, out.new_token_ids))
            jsonschema.validate(json.loads(_text(tok, out.new_token_ids)), schema)


def test_the_fast_paths_give_the_tokens_of_the_full_mask(paths, tok, compiler, monkeypatch):
    """Masks filled ahead on the worker thread, masked_greedy and xgrammar's kernel: the same tokens as filling in
    the step and masking every constrained row in full with the torch reference, greedy and sampled."""
    import molora.engine.engine as engine_module
    import molora.engine.sampler as sampler_module
    from molora.sampling import apply_bitmask_reference, greedy

    prompts = [[5 + i, 20, 30 + i] for i in range(6)]
    params = [SamplingParams(max_new_tokens=60)] * 3 + [
        SamplingParams(max_new_tokens=60, temperature=0.8, seed=s) for s in range(3)
    ]
    constraints = [compiler.compile(StructuredSpec.json_schema(SCHEMAS[n])) for n in ("weather", "tags", "shape")] * 2

    def run():
        engine = Engine(_mm(paths, tok), CFG)
        outs = engine.generate(prompts, params, constraint=constraints)
        engine.close()
        return [(o.new_token_ids, o.finish_reason) for o in outs]

    fast = run()
    monkeypatch.setattr(engine_module.Engine, "_fill_masks", lambda self, reqs: None)
    monkeypatch.setattr(
        sampler_module, "masked_greedy", lambda logits, bits: greedy(apply_bitmask_reference(logits, bits))
    )
    monkeypatch.setattr(sampler_module, "apply_bitmask", apply_bitmask_reference)
    assert fast == run()
    assert {reason for _, reason in fast} == {"stop"}


def test_json_object_regex_and_choice(paths, tok, compiler):
    engine = Engine(_mm(paths, tok), CFG)
    prompts = [[5, 6], [7, 8, 9], [40, 41]]
    params = [SamplingParams(max_new_tokens=60, temperature=1.0, seed=s) for s in range(3)]
    regex = compiler.compile(StructuredSpec("regex", r"[a-c]{3}-[0-9]{2}"))
    choice = compiler.compile(StructuredSpec.choice(["yes", "no", "maybe so"]))
    for out in engine.generate(prompts, params, constraint=regex):
        assert out.finish_reason == "stop" and re.fullmatch(r"[a-c]{3}-[0-9]{2}", _text(tok, out.new_token_ids))
    for out in engine.generate(prompts, params, constraint=choice):
        assert out.finish_reason == "stop" and _text(tok, out.new_token_ids) in ("yes", "no", "maybe so")
    obj = compiler.compile(StructuredSpec("json_object"))
    ended = [
        o
        for o in engine.generate(prompts, SamplingParams(max_new_tokens=200), constraint=obj)
        if o.finish_reason == "stop"
    ]
    for out in ended:
        assert isinstance(json.loads(_text(tok, out.new_token_ids)), dict)


def test_bad_specs_raise_naming_the_problem_and_the_cache_hits(compiler):
    with pytest.raises(StructuredOutputError, match="invalid at properties/a/type"):
        compiler.compile(StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    with pytest.raises(StructuredOutputError, match="cannot be compiled"):
        compiler.compile(StructuredSpec("regex", "(unclosed"))
    with pytest.raises(StructuredOutputError, match="over this server's limit"):
        compiler.compile(StructuredSpec.json_schema({"enum": ["x" * 100] * 1000}))
    with pytest.raises(StructuredOutputError, match="not valid JSON"):
        StructuredSpec.json_schema("{nope")
    spec = StructuredSpec.json_schema(SCHEMAS["flags"])
    first, hits = compiler.compile(spec), compiler.hits
    assert compiler.compile(StructuredSpec.json_schema(dict(reversed(SCHEMAS["flags"].items())))) is first
    assert compiler.hits == hits + 1


def test_unenforced_keywords_are_found_and_strict_refuses_them(compiler):
    from molora.structured import unenforced

    schema = {
        "type": "object",
        "properties": {
            "t": {"type": "array", "uniqueItems": True},
            "r": {"type": "number", "multipleOf": 0.5},
            "n": {"type": "integer", "multipleOf": 5},
            "s": {"anyOf": [{"type": "string", "pattern": "^a", "maxLength": 3}]},
        },
        "if": {"required": ["t"]},
        "then": {"required": ["r"]},
    }
    assert unenforced(schema) == [
        "(top level): if",
        "(top level): then",
        "/properties/t: uniqueItems",
        "/properties/r: multipleOf on a number",
        "/properties/s/anyOf/0: pattern with minLength/maxLength",
    ]
    assert compiler.compile(StructuredSpec.json_schema(schema)) is not None  # best effort
    with pytest.raises(StructuredOutputError, match="strict: the grammar engine cannot enforce"):
        compiler.compile(StructuredSpec.json_schema(schema, strict=True))


def test_allof_is_enforced_only_as_a_lone_branch(compiler):
    from molora.structured import unenforced

    obj = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    two = {"allOf": [obj, {"required": ["a", "b"]}]}
    beside = {**obj, "allOf": [{"required": ["a", "b"]}]}
    lone = {"title": "t", "allOf": [{**obj, "required": ["a"]}]}
    merged = "(top level): allOf (not merged: an answer may break all but one part)"
    assert unenforced(two)[0] == unenforced(beside)[0] == merged
    # and the bare {"required": [...]} branch, which lists none of its names (tests/test_schema_required.py)
    assert [u.split(": ", 1)[1] for u in unenforced(two)[1:] + unenforced(beside)[1:]] == [
        "required ['a', 'b'] not in properties (the object may close early)"
    ] * 2
    assert unenforced(lone) == []
    for schema in (two, beside):
        with pytest.raises(StructuredOutputError, match="allOf"):
            compiler.compile(StructuredSpec.json_schema(schema, strict=True))
    # what the flag is about: the engine's grammar accepts an object that breaks the allOf's "required"
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    loose = xgr.Grammar.from_json_schema(json.dumps(beside))
    assert _is_grammar_accept_string(loose, '{"a": 1}')
    strict = xgr.Grammar.from_json_schema(json.dumps(lone))
    assert not _is_grammar_accept_string(strict, "{}") and _is_grammar_accept_string(strict, '{"a": 1}')


PAYMENT = {  # a conditional of the shape split_conditional rewrites: the tested property is required and listed
    "type": "object",
    "properties": {
        "method": {"type": "string", "enum": ["card", "iban", "cash"]},
        "number": {"type": "string"},
        "amount": {"type": "number"},
    },
    "required": ["method", "amount"],
    "if": {"properties": {"method": {"const": "card"}}, "required": ["method"]},
    "then": {
        "required": ["number"],
        "properties": {"number": {"pattern": "^[0-9]{4}$"}, "amount": {"type": "integer"}},
    },
    "else": {"properties": {"number": {"pattern": "^[A-Z]{2}[0-9]$"}, "method": {"enum": ["iban", "cash", "card"]}}},
}


def _instances() -> list[dict]:
    """Every object over PAYMENT's properties from a small grid, keys in declared order (as the engine writes them)."""
    out = []
    for method in ("card", "iban", "cash", "cheque", None):
        for number in ("1234", "NL5", "x", None):
            for amount in (3, 2.5, None):
                obj = {"method": method, "number": number, "amount": amount}
                out.append({k: v for k, v in obj.items() if v is not None})
    return out


@pytest.mark.parametrize(
    "schema",
    [
        PAYMENT,
        {**PAYMENT, "then": {"required": ["number"]}},  # then only requires
        {k: v for k, v in PAYMENT.items() if k != "else"},  # no else
        {**PAYMENT, "if": {"properties": {"method": {"enum": ["iban", "cash"]}}}},  # an enum test
        {**PAYMENT, "else": {"properties": {"method": {"const": "iban"}}}},  # else narrows the tested property
    ],
)
def test_an_if_then_else_on_a_listed_required_property_is_split_exactly(compiler, schema):
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from molora.structured import engine_schema, split_conditional, unenforced

    split = split_conditional(schema)
    assert split is not None and "if" not in json.dumps(split) and unenforced(schema) == []
    validator = jsonschema.Draft202012Validator(schema)
    assert compiler.compile(StructuredSpec.json_schema(schema, strict=True))  # strict: enforced, so not refused
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(engine_schema(schema)), any_whitespace=False)  # as compiled
    verdicts = []
    for obj in _instances():
        valid = validator.is_valid(obj)
        assert jsonschema.Draft202012Validator(split).is_valid(obj) == valid, obj
        assert _is_grammar_accept_string(grammar, json.dumps(obj)) == valid, obj
        assert jsonschema.Draft202012Validator(engine_schema(schema)).is_valid(obj) == valid
        verdicts.append(valid)
    assert any(verdicts) and not all(verdicts)


@pytest.mark.parametrize(
    "change",
    [
        {"required": ["amount"]},  # the tested property may be absent: `if` then holds vacuously
        {"properties": {**PAYMENT["properties"], "method": {"type": "string"}}},  # its values are not listed
        {"if": {"properties": {"method": {"const": "card"}}, "minProperties": 2}},  # `if` tests more than one value
        {"then": {"properties": {"extra": {"type": "string"}}}},  # a property the schema does not declare
        {"then": {"properties": {"amount": {"type": "string"}}}},  # types that do not intersect as one schema
    ],
)
def test_other_conditionals_stay_listed_as_unenforced(change):
    from molora.structured import split_conditional, unenforced

    schema = {**PAYMENT, **change}
    assert split_conditional(schema) is None
    assert unenforced(schema)[:3] == ["(top level): if", "(top level): then", "(top level): else"]


def _random_pattern(g: torch.Generator, depth: int = 0) -> str:
    """A random regex over a, b, c, '-', '.': atoms, classes, groups, alternations, every quantifier."""

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    k = float(torch.rand((), generator=g))
    if depth > 2 or k < 0.35:
        atom = pick(["a", "b", "c", "\\.", "-", "[a-c]", "[-ab]", "[ab.-]", "[^a]", "."])
    elif k < 0.75:
        parts = 1 + int(torch.randint(3, (1,), generator=g))
        atom = "(" + "".join(_random_pattern(g, depth + 1) for _ in range(parts)) + ")"
    else:
        atom = "(" + "|".join(_random_pattern(g, depth + 1) for _ in range(2)) + ")"
    return atom + pick(["", "", "?", "*", "+", "{1,2}", "{0,1}", "{0,2}", "{0,}", "??"])


def test_a_schema_pattern_accepts_only_what_the_regex_matches(compiler):
    """xgrammar 0.2.9 alone lets '^a(b*c)?$' accept "ab"; the schema goes to it through engine_pattern, which keeps
    the language (checked with Python's re) and which xgrammar enforces: no string over the alphabet that the
    matcher accepts is one the pattern rejects, on random patterns."""
    import itertools

    import xgrammar as xgr

    from molora.structured import engine_pattern

    def accepts(c, s):
        m = xgr.GrammarMatcher(c.compiled)
        return m.accept_string(json.dumps(s)) and m.accept_token(1)

    strings = [""] + ["".join(t) for n in (1, 2, 3) for t in itertools.product("abc-.", repeat=n)]
    c = compiler.compile(StructuredSpec.json_schema({"type": "string", "pattern": "^a(b*c)?$"}))
    assert [s for s in ("a", "ab", "abc", "abbc", "ac", "abcb") if accepts(c, s)] == ["a", "abc", "abbc", "ac"]
    g = torch.Generator().manual_seed(35)
    for _ in range(40):
        pattern = "^" + "".join(_random_pattern(g) for _ in range(2)) + "$"
        rewritten = engine_pattern(pattern)
        assert all(bool(re.fullmatch(pattern, s)) == bool(re.fullmatch(rewritten, s)) for s in strings), pattern
        c = compiler.compile(StructuredSpec.json_schema({"type": "string", "pattern": pattern}))
        assert [s for s in strings if accepts(c, s) and not re.search(pattern, s)] == [], (pattern, rewritten)


def test_a_compiled_constraint_survives_pickling(compiler, tok):
    """The Ray path sends engine requests to another process: the constraint travels as xgrammar's own JSON."""
    c = compiler.compile(StructuredSpec.json_schema(SCHEMAS["weather"]))
    back = pickle.loads(pickle.dumps(c))
    assert isinstance(back, GrammarConstraint) and back.spec == c.spec
    a, b = c.begin([5]), back.begin([5])
    ids = tok.encode('{"city":"x')
    masks = [constraint_bitmask([[s]], [[5] + ids], 128) for s in (a, b)]
    assert torch.equal(masks[0], masks[1])


@pytest.mark.parametrize("mode", ["vocab", "pinned", "learned"])
def test_routing_is_the_same_under_a_constraint(paths, tok, compiler, mode):
    """A constraint that admits exactly the unconstrained greedy answer gives the same ids and the same adapter
    per token in every routing mode: the mask never touches routing."""
    from tests.test_engine import StandInRouter

    mm = _mm(paths, tok)
    kw = {"adapter": "a"} if mode == "pinned" else {"routing": mode}
    if mode == "learned":
        mm.router = StandInRouter()
        mm.router.adapter_names = ["b", "a"]
    engine = Engine(mm, CFG)
    prompt = tok.encode('{"k": "ab')
    free = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True), **kw)[0]
    text = _text(tok, free.new_token_ids)
    exact = compiler.compile(StructuredSpec("regex", re.escape(text) + ".*"))
    held = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True), constraint=exact, **kw)[0]
    assert held.new_token_ids == free.new_token_ids
    assert held.token_adapters == free.token_adapters and set(free.token_adapters) <= {"a", "b", None}


# ------------------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server(paths, tok):
    engine = Engine(_mm(paths, tok), CFG)
    app = create_app(engine, model_name="tiny")
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


SCHEMA = SCHEMAS["weather"]


def _chat(**extra):
    return {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 100, **extra}


def test_response_format_json_schema_chat_and_completions(server):
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    r = server.post("/chat/completions", json=_chat(response_format=rf, n=3, temperature=1.0, seed=4))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    r = server.post(
        "/completions",
        json={
            "model": "tiny",
            "prompt": [5, 6, 7],
            "max_tokens": 100,
            "response_format": rf,
            "molora": {"return_routing": True},
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    jsonschema.validate(json.loads(choice["text"]), SCHEMA)
    assert set(choice["molora"]["adapters"]) <= {"a", "b"} and choice["molora"]["token_ids"]


def test_streamed_json_schema_and_json_object(server):
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    with server.stream("POST", "/chat/completions", json=_chat(response_format=rf, stream=True)) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    r = server.post(
        "/completions",
        json={
            "model": "tiny",
            "prompt": [9, 9],
            "max_tokens": 200,
            "seed": 0,
            "temperature": 0.5,
            "response_format": {"type": "json_object"},
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)


def test_vllm_structured_outputs_and_guided_fields(server):
    base = {"model": "tiny", "prompt": [5, 6], "max_tokens": 20, "temperature": 1.0, "seed": 2}
    r = server.post("/completions", json={**base, "structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}})
    assert r.status_code == 200, r.text and re.fullmatch("[a-c]{3}-[0-9]{2}", r.json()["choices"][0]["text"])
    r = server.post("/completions", json={**base, "structured_outputs": {"choice": ["red", "green"]}})
    assert r.json()["choices"][0]["text"] in ("red", "green")
    r = server.post("/completions", json={**base, "guided_choice": ["up", "down"]})
    assert r.json()["choices"][0]["text"] in ("up", "down")
    r = server.post("/completions", json={**base, "max_tokens": 100, "structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)
    r = server.post("/completions", json={**base, "structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")'}})
    assert r.json()["choices"][0]["text"] in ("ab", "ac")


def test_an_answer_that_breaks_an_unenforced_keyword_says_so(server):
    """uniqueItems is accepted and not enforced: an enum of one value and two items can only be ["a","a"], which
    the answer check flags (streamed and not); strict=true refuses the schema instead."""
    schema = {"type": "array", "items": {"enum": ["a"]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    rf = {"type": "json_schema", "json_schema": {"name": "u", "schema": schema}}
    r = server.post("/chat/completions", json=_chat(response_format=rf))
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["message"]["content"] == '["a", "a"]' and choice["finish_reason"] == "stop"
    assert "uniqueItems" in choice["molora"]["structured_output_error"]
    with server.stream(
        "POST",
        "/completions",
        json={"model": "tiny", "prompt": [5], "max_tokens": 30, "response_format": rf, "stream": True},
    ) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and "uniqueItems" in last["molora"]["structured_output_error"]
    r = server.post(
        "/chat/completions", json=_chat(response_format={**rf, "json_schema": {**rf["json_schema"], "strict": True}})
    )
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"]
    r = server.post(
        "/chat/completions",
        json=_chat(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}),
    )
    assert "molora" not in r.json()["choices"][0]  # a valid answer carries no extension


def test_check_names_what_an_answer_breaks(compiler):
    c = compiler.compile(
        StructuredSpec.json_schema({"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}})
    )
    assert c.check('{"t": [1, 2]}') is None
    assert "at t (uniqueItems)" in c.check('{"t": [1, 1]}')
    assert "not JSON" in c.check('{"t": [1')
    assert compiler.compile(StructuredSpec("regex", "[a-c]{2}")).check("ab") is None
    assert compiler.compile(StructuredSpec("regex", "[a-c]{2}")).check("abc") is not None


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
            "invalid",
        ),
        (
            {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}},
            "structured_outputs.json",
            "cannot be compiled",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "cannot be compiled"),
        ({"guided_json": {"enum": ["x" * 200] * 500}}, "guided_json", "limit"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured output"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema.schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "strict": True,
                        "schema": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True},
                    },
                }
            },
            "response_format.json_schema.schema",
            "cannot enforce (top level): uniqueItems",
        ),
    ],
)
def test_bad_specs_get_a_400_and_the_server_keeps_serving(server, body, param, words):
    r = server.post("/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    ok = server.post("/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 5, "guided_choice": ["fine"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"


def test_a_dead_end_answers_with_its_reason(server):
    """ignore_eos after a complete choice: the grammar allows nothing more; the request ends with an error
    naming the dead end (streamed: finish_reason "error" then the error event)."""
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 20, "ignore_eos": True, "guided_choice": ["ok"]}
    r = server.post("/completions", json=body)
    assert r.status_code == 400 and "constraint dead end" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "structured_output_dead_end"
    with server.stream("POST", "/completions", json={**body, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "error"
    assert "constraint dead end" in json.loads(lines[-1][6:])["error"]["message"]
    assert server.post("/completions", json={**body, "ignore_eos": False}).json()["choices"][0]["text"] == "ok"


def test_properties_are_written_in_the_schemas_order(paths, tok, compiler):
    """The grammar follows `properties` in the order the schema gives them (not sorted): a schema that puts "name"
    before "arguments" gets answers in that order."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    mm = _mm(paths, tok)
    engine = Engine(mm, CFG)
    out = engine.generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=100), constraint=compiler.compile(StructuredSpec.json_schema(schema))
    )[0]
    text = _text(tok, out.new_token_ids)
    assert list(json.loads(text)) == ["zeta", "alpha"], text


def test_free_strings_and_unbounded_arrays_get_the_compilers_bounds():
    """bound_runaways: maxLength on a free string, maxItems on an array without one (at least its minItems); a
    string shaped by pattern, format, enum or const, and a schema's own bounds, are left as they are."""
    schema = {
        "type": "object",
        "properties": {
            "free": {"type": "string"},
            "nullable": {"type": ["string", "null"]},
            "own": {"type": "string", "maxLength": 3},
            "pat": {"type": "string", "pattern": "^[a-z]+$"},
            "mail": {"type": "string", "format": "email"},
            "pick": {"type": "string", "enum": ["a", "b"]},
            "list": {"type": "array", "items": {"type": "string"}},
            "long": {"type": "array", "minItems": 40},
            "short": {"type": "array", "maxItems": 2},
        },
    }
    p = engine_schema(schema, 256, 16)["properties"]
    assert p["free"]["maxLength"] == 256 and p["nullable"]["maxLength"] == 256 and p["own"]["maxLength"] == 3
    assert all("maxLength" not in p[k] for k in ("pat", "mail", "pick"))
    assert p["list"]["maxItems"] == 16 and p["list"]["items"]["maxLength"] == 256
    assert p["long"]["maxItems"] == 40 and p["short"]["maxItems"] == 2
    assert engine_schema(schema) == engine_schema(schema, None, None)  # unbounded: the schema's own grammar
    assert "maxLength" not in engine_schema(schema)["properties"]["free"]


def test_open_objects_and_unbounded_numbers_get_the_compilers_bounds():
    """bound_runaways: maxProperties on an object open to unlisted properties (at least its listed ones and its
    minProperties), none on a closed one; a minimum / maximum of -/+ (10**digits - 1) on a number or integer where it
    has none, none where its own bound lies beyond the edge or a multipleOf, enum or const shapes it. The grammar
    engine then accepts no number with more digits before the point, and no object with more properties."""
    schema = {
        "type": "object",
        "properties": {
            "open": {"type": "object", "additionalProperties": {"type": "boolean"}},
            "wide": {"type": "object", "properties": {f"k{i}": {} for i in range(5)}, "minProperties": 6},
            "closed": {"type": "object", "additionalProperties": False},
            "n": {"type": "number"},
            "low": {"type": "integer", "minimum": 3},
            "far": {"type": "integer", "minimum": 10**12},
            "step": {"type": "integer", "multipleOf": 5},
            "pick": {"type": "integer", "enum": [1, 2]},
        },
        "additionalProperties": False,
    }
    p = engine_schema(schema, 256, 16, 4, 3)["properties"]
    assert p["open"]["maxProperties"] == 4 and p["wide"]["maxProperties"] == 6 and "maxProperties" not in p["closed"]
    assert (p["n"]["minimum"], p["n"]["maximum"]) == (-999, 999)
    assert (p["low"]["minimum"], p["low"]["maximum"]) == (3, 999)
    assert "maximum" not in p["far"] and "minimum" not in p["step"] and "minimum" not in p["pick"]
    assert engine_schema(schema, 256, 16) == engine_schema(schema, 256, 16, None, None)  # off: as before
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    number = xgrammar.Grammar.from_json_schema(json.dumps(engine_schema(schema, 256, 16, 4, 3)["properties"]["n"]))
    assert accepts(number, "-998.5") and not accepts(number, "1000") and not accepts(number, "12345")
    bounded = engine_schema(schema, 256, 16, 4, 3)["properties"]["open"]
    obj = xgrammar.Grammar.from_json_schema(json.dumps(bounded), any_whitespace=False)
    four, five = ({f"k{i}": True for i in range(n)} for n in (4, 5))
    assert accepts(obj, json.dumps(four)) and not accepts(obj, json.dumps(five))


def test_a_string_the_model_would_repeat_in_closes_at_the_bound(paths, tok):
    """With a bound of 6 characters every free string of the answer has at most 6; the answer finishes and is valid."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string"}},
        "required": ["s"],
        "additionalProperties": False,
    }
    compiler = StructuredCompiler(tok, vocab_size=128, stop_token_ids=[1], max_string_chars=6)
    engine = Engine(_mm(paths, tok), CFG)
    params = [SamplingParams(max_new_tokens=100, temperature=1.0, seed=s) for s in range(4)]
    outs = engine.generate([[5, 6, 7]] * 4, params, constraint=compiler.compile(StructuredSpec.json_schema(schema)))
    for out in outs:
        assert out.finish_reason == "stop"
        value = json.loads(_text(tok, out.new_token_ids))
        assert len(value["s"]) <= 6

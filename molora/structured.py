"""Structured output: a JSON schema, any JSON object, a regex, a choice of strings or an EBNF grammar, compiled
for one tokenizer into a `GrammarConstraint` (a `molora.sampling.Constraint`: one packed bitmask row per step).

    compiler = StructuredCompiler(tokenizer, vocab_size=49152, stop_token_ids=(2,))
    constraint = compiler.compile(StructuredSpec("json_schema", json.dumps(schema)))   # cached by spec
    engine.add_request(prompt_ids, params, constraint=constraint)

The grammar engine is xgrammar, chosen by measurement (experiments/choose_grammar_engine.py, docs/serving.md):
on real-world schemas it accepted the most (26 of 27 validation schemas, against 25 for llguidance and
outlines-core), filled the masks of a 32-row decode step fastest on this CPU, and takes a transformers
tokenizer as it is. JSON is generated compact (no free whitespace: a small model given free whitespace may
emit it forever). Limits (`Limits`) are checked before compiling; a spec the engine cannot compile raises
`StructuredOutputError` naming the problem. Compiling runs on the caller's thread (a server's worker thread,
never the engine's). What a schema means to the engine (what it does not enforce, the exact rewrites it is
given instead) lives in molora.schema_rules, re-exported here.

Knows the tokenizer and the grammar engine; nothing of HTTP, requests or routing.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from molora.config import (
    DEFAULT_MAX_ARRAY_ITEMS,
    DEFAULT_MAX_NUMBER_DIGITS,
    DEFAULT_MAX_OBJECT_PROPERTIES,
    DEFAULT_MAX_STRING_CHARS,
)
from molora.errors import MoLoRAError
from molora.sampling import Constraint, ConstraintState
from molora.schema_rules import (
    UNENFORCED,
    engine_pattern,
    engine_schema,
    external_refs,
    split_conditional,
    unenforced,
)

__all__ = [  # the schema rules are re-exported: callers import them from here
    "INSTALL_HINT",
    "UNENFORCED",
    "GrammarConstraint",
    "GrammarEngineMissing",
    "Limits",
    "StructuredCompiler",
    "StructuredOutputError",
    "StructuredSpec",
    "engine_pattern",
    "engine_schema",
    "external_refs",
    "split_conditional",
    "unenforced",
]

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(MoLoRAError):
    """A structured-output spec that is too large, malformed, or that the grammar engine cannot compile."""


class GrammarEngineMissing(StructuredOutputError):
    """xgrammar (and jsonschema) are not installed: no spec can be compiled."""


INSTALL_HINT = "pip install 'molora[structured]'"  # xgrammar and jsonschema (pyproject.toml's structured extra)


@dataclass(frozen=True)
class Limits:
    """What a request may ask for, in characters of its spec (checked before any compiling)."""

    max_schema_chars: int = 64 << 10  # a JSON schema, as JSON text
    max_regex_chars: int = 4 << 10
    max_grammar_chars: int = 64 << 10
    max_choices: int = 1024
    max_choice_chars: int = 64 << 10  # all choices together

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise MoLoRAError(f"structured output limit {name}={value} must be >= 1")


@dataclass(frozen=True)
class StructuredSpec:
    """What to constrain to. text: the schema as JSON (json_schema), the regex, the choices as a JSON list
    (choice), the EBNF grammar (grammar), "" (json_object: any JSON object)."""

    kind: Kind
    text: str = ""
    strict: bool = False  # json_schema: refuse a schema with keywords the engine does not enforce

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise MoLoRAError(f"structured output kind {self.kind!r} is not one of {list(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | str, strict: bool = False) -> StructuredSpec:
        """From a schema (dict or JSON text), written compactly; the same schema gives the same spec: keys sorted
        everywhere but inside `properties`, whose order is kept, since the grammar engine writes an object's
        properties in that order, as OpenAI does ("reasoning" before "answer" is the schema author's choice)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from e
        return cls("json_schema", json.dumps(_canonical(schema), separators=(",", ":")), strict)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredSpec:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))


def _canonical(schema: Any, ordered: bool = False) -> Any:
    """`schema` with every object's keys sorted, except a `properties` object's (`ordered`): their order is the
    order an answer writes them in. Values under enum/const/default/examples are data and are left as they are."""
    if isinstance(schema, list):
        return [_canonical(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    keys = list(schema) if ordered else sorted(schema)
    return {
        k: schema[k]
        if k in ("enum", "const", "default", "examples") and not ordered
        else _canonical(schema[k], ordered=(k == "properties" and not ordered and isinstance(schema[k], dict)))
        for k in keys
    }


class _MatcherState(ConstraintState):
    """One request's matcher: it accepts the ids generated since the prompt as `fill` sees them."""

    def __init__(self, constraint: GrammarConstraint, start: int) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(constraint.compiled)
        self.seen = start  # ids of the growing token list already fed to the matcher
        self.rejected: int | None = None
        self.words = (constraint.compiled.tokenizer_info.vocab_size + 31) // 32
        self.scratch: torch.Tensor | None = None

    def fill(self, tokens: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        for t in tokens[self.seen :]:
            if self.rejected is None and not self.matcher.accept_token(int(t)):
                self.rejected = int(t)
        self.seen = len(tokens)
        if self.rejected is not None or self.matcher.is_terminated():
            bitmask[row] = 0  # nothing may follow: a dead end the engine reports
            return
        if bitmask.shape[-1] == self.words:
            self.matcher.fill_next_token_bitmask(bitmask, row)
            return
        # the model's vocabulary is not the tokenizer's: ids past the tokenizer's are never allowed
        if self.scratch is None:
            self.scratch = torch.zeros(1, self.words, dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(self.scratch, 0)
        n = min(self.words, bitmask.shape[-1])
        bitmask[row] = 0
        bitmask[row, :n] = self.scratch[0, :n]


class GrammarConstraint(Constraint):
    """A compiled grammar (xgrammar's CompiledGrammar) with the spec it came from; shared by requests."""

    def __init__(self, spec: StructuredSpec, compiled: Any, compile_s: float = 0.0) -> None:
        self.spec, self.compiled, self.compile_s = spec, compiled, compile_s

    def begin(self, prompt: Sequence[int]) -> ConstraintState:
        return _MatcherState(self, len(prompt))

    def check(self, text: str) -> str | None:
        """Why a finished answer breaks the spec (None: it keeps it). The grammar engine enforces all but the
        keywords `unenforced` lists; this is the check of those, with jsonschema (json_schema, json_object) or
        Python's re (regex, choice); a grammar's answer is accepted by construction."""
        kind = self.spec.kind
        if kind in ("json_schema", "json_object"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                return f"the answer is not JSON: {e}"
            return _violation(json.loads(self.spec.text) if kind == "json_schema" else {"type": "object"}, value)
        if kind == "regex":
            _budget.deadline = time.monotonic() + CHECK_BUDGET_S
            try:
                matched = _search(self.spec.text, text, full=True)
            except _CheckTimeout:
                return f"the answer could not be checked against the regex (over {CHECK_BUDGET_S:g} s)"
            except _Uncheckable as e:
                return f"the answer could not be checked against the regex ({e})"
            return None if matched else f"the answer does not match {self.spec.text!r}"
        if kind == "choice":
            return None if text in json.loads(self.spec.text) else "the answer is none of the choices"
        return None

    def __repr__(self) -> str:
        return f"GrammarConstraint({self.spec.kind}, {len(self.spec.text)} chars)"

    def __reduce__(self) -> tuple:
        # to an engine in another process (Ray): xgrammar's own serialisation (grammar and tokenizer info)
        return _rebuild, (self.spec, self.compiled.serialize_json(), self.compiled.tokenizer_info.serialize_json())


def _rebuild(spec: StructuredSpec, grammar_json: str, info_json: str) -> GrammarConstraint:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    return GrammarConstraint(spec, xgr.CompiledGrammar.deserialize_json(grammar_json, info))


class StructuredCompiler:
    """Compiles specs for one tokenizer, with an LRU cache of `cache_size` constraints (thread-safe)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] = (),
        limits: Limits = Limits(),
        cache_size: int = 256,
        max_string_chars: int | None = DEFAULT_MAX_STRING_CHARS,
        max_array_items: int | None = DEFAULT_MAX_ARRAY_ITEMS,
        max_object_properties: int | None = DEFAULT_MAX_OBJECT_PROPERTIES,
        max_number_digits: int | None = DEFAULT_MAX_NUMBER_DIGITS,
    ) -> None:
        try:
            import xgrammar as xgr
        except ImportError as e:
            raise GrammarEngineMissing(
                f"structured output (response_format, structured_outputs, guided_*, tool_choice required or named) "
                f"needs the grammar engine, which is not installed ({e}): {INSTALL_HINT}"
            ) from e

        self.xgr, self.limits, self.cache_size = xgr, limits, cache_size
        # schema_rules.bound_runaways: free strings, unbounded arrays, open objects and numbers close at these (None:
        # unbounded)
        self.bounds = (max_string_chars, max_array_items, max_object_properties, max_number_digits)
        stops = sorted({int(t) for t in stop_token_ids}) or None
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[StructuredSpec, GrammarConstraint] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, spec: StructuredSpec) -> GrammarConstraint:
        """The constraint of `spec` (cached); StructuredOutputError if it is too large or does not compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return hit
        self.check(spec)
        t0 = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except StructuredOutputError:
            raise
        except Exception as e:  # the grammar engine's own message names the problem
            what = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise StructuredOutputError(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {what}") from e
        constraint = GrammarConstraint(spec, compiled, time.perf_counter() - t0)
        self._check_spellable(constraint)
        with self._lock:
            self.misses += 1
            self._cache[spec] = constraint
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return constraint

    def check(self, spec: StructuredSpec) -> None:
        """Size limits and, for a schema, that it is a JSON Schema at all (jsonschema's meta-schema check)."""
        lim = self.limits
        cap = {
            "json_schema": lim.max_schema_chars,
            "regex": lim.max_regex_chars,
            "grammar": lim.max_grammar_chars,
            "choice": lim.max_choice_chars,
            "json_object": 0,
        }[spec.kind]
        if spec.kind != "json_object" and len(spec.text) > cap:
            raise StructuredOutputError(
                f"the {spec.kind.replace('_', ' ')} is {len(spec.text)} characters, over "
                f"this server's limit of {cap}; simplify it"
            )
        if spec.kind == "json_schema":
            schema = json.loads(spec.text)
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError(f"the JSON schema must be an object, not {type(schema).__name__}")
            outside = external_refs(schema)
            if outside:
                raise StructuredOutputError(
                    f"the JSON schema refers outside itself ({'; '.join(outside[:3])}); molora never fetches a "
                    "schema from a file or URL: put the referenced schema under $defs and refer to it as "
                    "#/$defs/NAME"
                )
            _check_schema(schema)
            loose = unenforced(schema) if spec.strict else []
            if loose:
                raise StructuredOutputError(
                    f"strict: the grammar engine cannot enforce {'; '.join(loose[:5])}; drop "
                    "them or send strict=false (an answer may then break them)"
                )
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            if not choices or len(choices) > lim.max_choices or not all(isinstance(c, str) and c for c in choices):
                raise StructuredOutputError(
                    f"choice needs 1 to {lim.max_choices} non-empty strings (got {len(choices)})"
                )
        if spec.kind in ("regex", "grammar") and not spec.text:
            raise StructuredOutputError(f"the {spec.kind} is empty")

    def _check_spellable(self, constraint: GrammarConstraint) -> None:
        """StructuredOutputError when no token of the vocabulary can start an answer (a regex of characters the
        tokenizer has no token for): every request on it would dead-end at its first step."""
        state = constraint.begin([])
        mask = torch.zeros(1, (self.info.vocab_size + 31) // 32, dtype=torch.int32)
        state.fill([], mask, 0)
        if not bool(mask.any()):
            raise StructuredOutputError(
                f"no token of this model's vocabulary can start an answer that matches the {constraint.spec.kind} "
                "(characters the tokenizer cannot spell?); change the spec"
            )

    def _compile(self, spec: StructuredSpec) -> Any:
        c = self._compiler
        if spec.kind == "json_schema":
            schema = engine_schema(json.loads(spec.text), *self.bounds)
            return c.compile_json_schema(json.dumps(schema), any_whitespace=False)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "choice":
            alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec.text))
            return c.compile_grammar(self.xgr.Grammar.from_ebnf(f"root ::= {alts}"))
        return c.compile_grammar(self.xgr.Grammar.from_ebnf(spec.text))


# The answer check runs user regexes (a regex spec, a schema's pattern/patternProperties) on the server's event loop,
# against answers a stop string may have cut: Python's re can take exponential time on such input. The check uses
# the `regex` module with a deadline instead; past it, the answer is reported as unchecked.
CHECK_BUDGET_S = 0.25


class _CheckTimeout(Exception):
    pass


class _Uncheckable(Exception):
    """A pattern the `regex` module cannot parse: the answer is reported unchecked (no unbounded matcher runs)."""


class _Budget(threading.local):
    deadline = 0.0


_budget = _Budget()


def _search(pattern: str, text: str, *, full: bool = False) -> bool:
    import regex

    left = _budget.deadline - time.monotonic()
    if left <= 0:
        raise _CheckTimeout
    try:
        return (regex.fullmatch if full else regex.search)(pattern, text, timeout=left) is not None
    except TimeoutError:
        raise _CheckTimeout from None
    except regex.error as e:
        raise _Uncheckable(f"the checker cannot parse the pattern {pattern[:80]!r}: {e}") from None


def _pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Any:
    import jsonschema

    if validator.is_type(instance, "string") and not _search(patrn, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")


def _pattern_properties(validator: Any, patterns: dict, instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for k, v in instance.items():
            if _search(pattern, k):
                yield from validator.descend(v, subschema, path=k, schema_path=pattern)


def _additional_properties(validator: Any, extra_schema: Any, instance: Any, schema: Any) -> Any:
    import jsonschema

    if not validator.is_type(instance, "object"):
        return
    named, patterns = schema.get("properties", {}), list(schema.get("patternProperties", {}))
    extras = [k for k in instance if k not in named and not any(_search(p, k) for p in patterns)]
    if validator.is_type(extra_schema, "object"):
        for k in extras:
            yield from validator.descend(instance[k], extra_schema, path=k)
    elif not extra_schema and extras:
        yield jsonschema.ValidationError(f"additional properties are not allowed ({', '.join(map(repr, extras))})")


@functools.cache
def _guarded(cls: Any) -> Any:
    """jsonschema's validator class `cls` with its regex keywords under the check's deadline."""
    import jsonschema

    return jsonschema.validators.extend(
        cls,
        {"pattern": _pattern, "patternProperties": _pattern_properties, "additionalProperties": _additional_properties},
    )


def _violation(schema: Any, value: Any) -> str | None:
    """The first way `value` breaks `schema` ("at path: message", jsonschema's best match), None if it does not.
    The validator resolves references only inside the schema: its registry refuses every retrieval (jsonschema
    would otherwise open a `file:` or `http:` reference itself). `check` refuses such schemas before compiling;
    this is the second line."""
    import jsonschema
    import referencing.exceptions

    validator = _guarded(jsonschema.validators.validator_for(schema))(schema, registry=_closed_registry())
    _budget.deadline = time.monotonic() + CHECK_BUDGET_S
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except (referencing.exceptions.Unresolvable, RecursionError) as e:
        return f"the answer could not be checked against the schema ({type(e).__name__}: {str(e)[:200]})"
    except _CheckTimeout:
        return f"the answer could not be checked against the schema (its patterns took over {CHECK_BUDGET_S:g} s)"
    except _Uncheckable as e:
        return f"the answer could not be checked against the schema ({e})"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
    return f"the answer breaks the schema at {where} ({error.validator}): {error.message[:200]}"


def _refuse_retrieval(uri: str) -> Any:
    raise StructuredOutputError(f"schema reference {uri[:200]!r} is outside the schema; nothing is fetched")


@functools.cache
def _closed_registry() -> Any:
    """A referencing registry that holds nothing and retrieves nothing (immutable: one serves every validator)."""
    import referencing

    return referencing.Registry(retrieve=_refuse_retrieval)


def _check_schema(schema: dict | bool) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise StructuredOutputError(f"the JSON schema is invalid at {where}: {e.message}") from e

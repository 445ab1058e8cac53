"""Structured output: a JSON schema, any JSON object, a regex, a choice of strings or an EBNF grammar, compiled
for one tokenizer into a `GrammarConstraint` (a `molora.sampling.Constraint`: one packed bitmask row per step).

    compiler = StructuredCompiler(tokenizer, vocab_size=49152, stop_token_ids=(2,))
    constraint = compiler.compile(StructuredSpec("json_schema", json.dumps(schema)))   # cached by spec
    engine.add_request(prompt_ids, params, constraint=constraint)

The grammar engine is xgrammar, chosen by measurement (scripts/choose_grammar_engine.py, docs/serving.md):
on real-world schemas it accepted the most (26 of 27 validation schemas, against 25 for llguidance and
outlines-core), filled the masks of a 32-row decode step fastest on this CPU, and takes a transformers
tokenizer as it is. JSON is generated compact (no free whitespace: a small model given free whitespace may
emit it forever). Limits (`Limits`) are checked before compiling; a spec the engine cannot compile raises
`StructuredOutputError` naming the problem. Compiling runs on the caller's thread (a server's worker thread,
never the engine's).

Knows the tokenizer and the grammar engine; nothing of HTTP, requests or routing.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from molora.errors import MoLoRAError
from molora.sampling import Constraint, ConstraintState

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


# what xgrammar 0.2.9 accepts in a schema but does not enforce (probed: a violating instance passes the matcher):
# an answer may break these. `strict` specs with any of them are refused instead (`unenforced`).
UNENFORCED = ("uniqueItems", "if", "then", "else", "not", "dependentRequired", "dependentSchemas")


class StructuredOutputError(MoLoRAError):
    """A structured-output spec that is too large, malformed, or that the grammar engine cannot compile."""


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
        """From a schema (dict or JSON text); the same schema gives the same spec (keys sorted)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from e
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")), strict)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredSpec:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))


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
            return None if re.fullmatch(self.spec.text, text) else f"the answer does not match {self.spec.text!r}"
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
    ) -> None:
        import xgrammar as xgr

        self.xgr, self.limits, self.cache_size = xgr, limits, cache_size
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

    def _compile(self, spec: StructuredSpec) -> Any:
        c = self._compiler
        if spec.kind == "json_schema":
            return c.compile_json_schema(json.dumps(engine_schema(json.loads(spec.text))), any_whitespace=False)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "choice":
            alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec.text))
            return c.compile_grammar(self.xgr.Grammar.from_ebnf(f"root ::= {alts}"))
        return c.compile_grammar(self.xgr.Grammar.from_ebnf(spec.text))


def unenforced(schema: Any, path: str = "") -> list[str]:
    """Where `schema` uses what the engine accepts but does not enforce ("path: keyword"), in document order:
    the keywords of UNENFORCED, multipleOf on numbers that are not integers, pattern with minLength/maxLength,
    oneOf whose branches are not provably disjoint (xgrammar then enforces anyOf), allOf but a lone branch with
    nothing beside it (xgrammar 0.2.9 keeps one part of an allOf and drops the rest; measured)."""
    out: list[str] = []
    if isinstance(schema, dict):
        here = path or "(top level)"
        out += [f"{here}: {k}" for k in UNENFORCED if k in schema and not (k == "uniqueItems" and not schema[k])]
        if "multipleOf" in schema and schema.get("type") != "integer":
            out.append(f"{here}: multipleOf on a number")
        if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
            out.append(f"{here}: pattern with minLength/maxLength")
        if isinstance(schema.get("oneOf"), list) and not _disjoint(schema["oneOf"]):
            out.append(f"{here}: oneOf (enforced as anyOf: an answer may match two branches)")
        if isinstance(schema.get("allOf"), list) and (len(schema["allOf"]) > 1 or set(schema) - _ANNOTATIONS):
            out.append(f"{here}: allOf (not merged: an answer may break all but one part)")
        for k, v in schema.items():
            if k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(
                v, dict
            ):
                for name, sub in v.items():
                    out += unenforced(sub, f"{path}/{k}/{name}")
            elif k in ("items", "additionalProperties", "contains", "propertyNames") and isinstance(v, (dict, list)):
                for i, sub in enumerate(v if isinstance(v, list) else [v]):
                    out += unenforced(sub, f"{path}/{k}" + (f"/{i}" if isinstance(v, list) else ""))
            elif k in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(v, list):
                for i, sub in enumerate(v):
                    out += unenforced(sub, f"{path}/{k}/{i}")
    return out


# keywords that constrain nothing: a lone allOf branch beside only these is the whole schema (xgrammar enforces it)
_ANNOTATIONS = {"allOf", "title", "description", "$schema", "$id", "$comment", "default", "examples", "$defs"}
_ANNOTATIONS |= {"definitions"}


_GROUP_OPTIONAL = re.compile(r"\?\??|\{0,(\d*)\}\??")  # what may follow a group's ")": ?, {0,1}, {0,n}, {0,}


def engine_pattern(pattern: str) -> str:
    """`pattern` with each optional group written as an alternative with the empty string, the same language:
    (X)? and (X){0,1} -> (X|), (X){0,n} -> (X|){1,n}, (X){0,} -> (X|)+ (lazy or not: a schema's pattern only
    accepts or rejects). xgrammar 0.2.9 turns a schema's pattern into a matcher that accepts too much when a
    group is optional ('^a(b*c)?$' accepts "ab"); the rewritten form it enforces exactly (a differential test
    against Python's re: tests/test_structured.py). Escapes and character classes are copied as they are."""
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = ch != "]" or out[-1] == "[" or out[-1] == "[^"
            out.append(ch)
            i += 1
            continue
        if ch == "[":
            in_class = True
            out.append("[^" if pattern.startswith("[^", i) else "[")
            i += 2 if out[-1] == "[^" else 1
            continue
        m = _GROUP_OPTIONAL.match(pattern, i + 1) if ch == ")" else None
        if m is None:
            out.append(ch)
            i += 1
            continue
        upper = m.group(1)
        out.append("|)" + ("" if upper is None or upper == "1" else "+" if upper == "" else f"{{1,{upper}}}"))
        i = m.end()
    return "".join(out)


def engine_schema(schema: Any) -> Any:
    """A copy of `schema` for the grammar engine: every `pattern` (and patternProperties key) through
    `engine_pattern`; everything else as it is."""
    if isinstance(schema, list):
        return [engine_schema(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "pattern" and isinstance(v, str):
            out[k] = engine_pattern(v)
        elif k == "patternProperties" and isinstance(v, dict):
            out[k] = {engine_pattern(p): engine_schema(sub) for p, sub in v.items()}
        elif k in ("enum", "const", "default", "examples"):
            out[k] = v  # values, not schemas
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: engine_schema(sub) for name, sub in v.items()}
        else:
            out[k] = engine_schema(v)
    return out


def _disjoint(branches: list) -> bool:
    """Whether no JSON value can match two of `branches`, by a simple proof: by type, or by a discriminator."""
    return _disjoint_by_type(branches) or _disjoint_by_tag(branches)


def _disjoint_by_tag(branches: list) -> bool:
    """Objects that all require one property whose const/enum values no two branches share ({"kind": "circle"})."""
    if not all(isinstance(b, dict) and isinstance(b.get("required"), list) for b in branches):
        return False
    for tag in set.intersection(*(set(b["required"]) for b in branches)):
        values = [b.get("properties", {}).get(tag) for b in branches]
        if not all(isinstance(v, dict) and ("const" in v or "enum" in v) for v in values):
            continue
        sets = [[json.dumps(x, sort_keys=True) for x in ([v["const"]] if "const" in v else v["enum"])] for v in values]
        if sum(len(set(x)) for x in sets) == len(set().union(*sets)):
            return True
    return False


def _disjoint_by_type(branches: list) -> bool:
    """Each branch names one type (or a const or an enum) and no type is shared (integer counts as a number)."""
    seen: set[str] = set()
    for b in branches:
        if not isinstance(b, dict):
            return False
        if "const" in b or "enum" in b:
            values = [b["const"]] if "const" in b else b["enum"]
            types = {_json_type(v) for v in values}
        elif isinstance(b.get("type"), str):
            types = {"number" if b["type"] == "integer" else b["type"]}
        else:
            return False
        if types & seen:
            return False
        seen |= types
    return True


def _json_type(v: Any) -> str:
    return {
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        type(None): "null",
        list: "array",
        dict: "object",
    }[type(v)]


def _violation(schema: Any, value: Any) -> str | None:
    """The first way `value` breaks `schema` ("at path: message", jsonschema's best match), None if it does not."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
    return f"the answer breaks the schema at {where} ({error.validator}): {error.message[:200]}"


def _check_schema(schema: dict | bool) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise StructuredOutputError(f"the JSON schema is invalid at {where}: {e.message}") from e

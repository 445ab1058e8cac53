"""What a JSON schema means to the grammar engine: which keywords it accepts without enforcing (`unenforced`), and
the schema it is given instead of the user's (`engine_schema`): the same set of JSON values, written in the forms
xgrammar 0.2.9 enforces exactly.

Three rewrites, each exact (the rewritten schema accepts the same values; differential tests in
tests/test_structured.py and tests/test_schema_required.py):

- `engine_pattern`: a regex's optional groups as alternatives with the empty string.
- `split_conditional`: an `if`/`then`/`else` that tests one required property against a const or enum, where the
  property's own schema lists its values, becomes an `anyOf` of two objects, one per case, with `then` (or `else`)
  merged into the properties it constrains. The engine accepts if/then/else and enforces neither branch
  (probed); the two cases are disjoint by that property's values, so anyOf is the schema's own meaning. A
  conditional of another shape is left as it is and listed by `unenforced`.
- `list_required`: a `required` name that its object's `properties` does not list is added to `properties` with
  the schema `additionalProperties` gives it ({} when absent or true). xgrammar 0.2.9 enforces `required` only for
  listed properties (probed: {"properties": {"a": ...}, "required": ["b"]} accepts {"a": "x"}; a bare
  {"required": [...]} in an anyOf branch accepts {}), so an answer could close the object without it. Beside
  patternProperties, additionalProperties false, unevaluatedProperties or $ref, or in a schema with neither
  properties nor type object (an anyOf branch), the rewrite would not be exact (or the engine's handling is
  unprobed): those are listed by `unenforced`.

Pure functions over JSON values; nothing of tokenizers, requests or the engine's objects.
"""

from __future__ import annotations

import json
import re
from typing import Any

# what xgrammar 0.2.9 accepts in a schema but does not enforce (probed: a violating instance passes the matcher):
# an answer may break these. `strict` specs with any of them are refused instead (`unenforced`). An if/then/else
# that `split_conditional` rewrites is enforced.
UNENFORCED = ("uniqueItems", "if", "then", "else", "not", "dependentRequired", "dependentSchemas")


REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


def external_refs(schema: Any, path: str = "") -> list[str]:
    """Every reference in `schema` that points outside the document ("path: $ref 'value'"), in document order. A
    reference inside it is "#" or starts with "#/" (a JSON pointer); anything else (a file, a URL, a name resolved
    against an `$id`) would make a validator fetch it, and the grammar engine reads only in-document pointers
    (it turns any other reference into "any value"). Values under enum/const/default/examples are data, not
    schemas, and are not searched."""
    out: list[str] = []
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k in REF_KEYWORDS:
                if not (isinstance(v, str) and (v == "#" or v.startswith("#/"))):
                    out.append(f"{path or '(top level)'}: {k} {v!r}"[:300])
            elif k in _NAMED_SCHEMAS and isinstance(v, dict):  # keys are names (a property may be called "$ref")
                for name, sub in v.items():
                    out += external_refs(sub, f"{path}/{k}/{name}")
            elif k not in _DATA_KEYWORDS:
                out += external_refs(v, f"{path}/{k}")
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            out += external_refs(v, f"{path}/{i}")
    return out


_DATA_KEYWORDS = ("enum", "const", "default", "examples")
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced(schema: Any, path: str = "") -> list[str]:
    """Where `schema` uses what the engine accepts but does not enforce ("path: keyword"), in document order:
    the keywords of UNENFORCED, multipleOf on numbers that are not integers, pattern with minLength/maxLength,
    oneOf whose branches are not provably disjoint (xgrammar then enforces anyOf), allOf but a lone branch with
    nothing beside it (xgrammar 0.2.9 keeps one part of an allOf and drops the rest; measured). An if/then/else
    that `split_conditional` rewrites is judged in its rewritten form (paths through its anyOf)."""
    out: list[str] = []
    split = split_conditional(schema) if isinstance(schema, dict) and "if" in schema else None
    if split is not None:
        return unenforced(split, path)
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
        if _unlisted_required(schema) and not _listable(schema):
            out.append(f"{here}: required {_unlisted_required(schema)} not in properties (the object may close early)")
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


# a lone allOf branch beside only annotations (_ANNOTATIONS) is the whole schema (xgrammar enforces it)
_NOTES = {"title", "description", "$comment", "default", "examples"}  # keywords that constrain nothing
_ANNOTATIONS = _NOTES | {"allOf", "$schema", "$id", "$defs", "definitions"}


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


def _unlisted_required(schema: dict) -> list[str]:
    """The names `required` lists that `properties` does not (module docstring: list_required)."""
    req, props = schema.get("required"), schema.get("properties")
    if not isinstance(req, list):
        return []
    listed = props if isinstance(props, dict) else {}
    return [n for n in req if isinstance(n, str) and n not in listed]


def _listable(schema: dict) -> bool:
    """Whether `list_required` is exact here: no patternProperties (a name may match a pattern), no $ref (its
    target's properties), no unevaluatedProperties, additionalProperties absent, true or a schema."""
    extra = schema.get("additionalProperties", True)
    blocked = ("patternProperties", "unevaluatedProperties", *REF_KEYWORDS)
    # a bare {"required": [...]} (an anyOf branch) would become a closed object of those names alone: xgrammar closes
    # an object whose additionalProperties is absent, which narrows the branch, so it is not rewritten
    shaped = "properties" in schema or schema.get("type") == "object"
    return shaped and not any(k in schema for k in blocked) and (extra is True or isinstance(extra, dict))


def list_required(schema: dict) -> dict:
    """`schema` with every required name listed in `properties` (module docstring), where that is exact; else as
    it is."""
    missing = _unlisted_required(schema)
    if not missing or not _listable(schema):
        return schema
    extra = schema.get("additionalProperties", True)
    props = dict(schema.get("properties") or {})
    props.update({n: (extra if isinstance(extra, dict) else {}) for n in missing})
    return {**schema, "properties": props}


def engine_schema(
    schema: Any,
    max_string: int | None = None,
    max_items: int | None = None,
    max_props: int | None = None,
    max_digits: int | None = None,
) -> Any:
    """A copy of `schema` for the grammar engine: every `pattern` (and patternProperties key) through
    `engine_pattern`, every if/then/else `split_conditional` can rewrite as its anyOf, every required name listed
    in its object's properties (`list_required`); with the bounds (`bound_runaways`), every free string at most
    `max_string` characters, every unbounded array at most `max_items` items, every open object at most `max_props`
    properties and every number at most `max_digits` digits before its point; everything else as it is."""
    bounds = (max_string, max_items, max_props, max_digits)
    if isinstance(schema, list):
        return [engine_schema(v, *bounds) for v in schema]
    if not isinstance(schema, dict):
        return schema
    split = split_conditional(schema) if "if" in schema else None
    if split is not None:
        return engine_schema(split, *bounds)
    schema = list_required(schema)
    out = {}
    for k, v in schema.items():
        if k == "pattern" and isinstance(v, str):
            out[k] = engine_pattern(v)
        elif k == "patternProperties" and isinstance(v, dict):
            out[k] = {engine_pattern(p): engine_schema(sub, *bounds) for p, sub in v.items()}
        elif k in ("enum", "const", "default", "examples"):
            out[k] = v  # values, not schemas
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: engine_schema(sub, *bounds) for name, sub in v.items()}
        else:
            out[k] = engine_schema(v, *bounds)
    return bound_runaways(out, *bounds)


# keywords that already shape a string (the grammar engine enforces them itself; maxLength beside a pattern it
# would not enforce: `unenforced`)
_SHAPED = ("maxLength", "pattern", "format", "enum", "const")


def bound_runaways(
    schema: dict,
    max_string: int | None,
    max_items: int | None,
    max_props: int | None = None,
    max_digits: int | None = None,
) -> dict:
    """`schema` with `maxLength: max_string` when it is a free string (type string, or a type list holding it, and
    none of maxLength, pattern, format, enum, const), `maxItems: max_items` when it is an array without maxItems,
    `maxProperties` of at least `max_props` (and of its listed properties) when it is an object open to properties
    it does not list (additionalProperties not false) without maxProperties, and a `minimum` / `maximum` of
    -/+ (10**max_digits - 1) where a number (or integer) has none (and no multipleOf): the grammar then closes a
    string, list, object or number the model would repeat inside until its token budget runs out. Not the schema's
    own meaning but a server bound; the mask of every shorter string, list, object or number is unchanged, so an
    answer that stays under the bounds is the same, token for token (a bounded number is written without an
    exponent and with at most 6 decimals, the grammar engine's form of a range)."""
    t = schema.get("type")
    types = set(t) if isinstance(t, list) else {t}
    out = schema
    valued = any(k in schema for k in ("enum", "const"))
    if max_string and "string" in types and not any(k in schema for k in _SHAPED):
        out = {**out, "maxLength": max_string}
    if max_items and "array" in types and "maxItems" not in schema and not valued:
        out = {**out, "maxItems": max(max_items, int(schema.get("minItems", 0)))}
    if max_props and "object" in types and "maxProperties" not in schema and not valued:
        if schema.get("additionalProperties", True) is not False:
            listed = len(schema.get("properties") or {})
            out = {**out, "maxProperties": max(max_props, listed, int(schema.get("minProperties", 0)))}
    if max_digits and types & {"number", "integer"} and not valued and "multipleOf" not in schema:
        edge = 10**max_digits - 1
        low = _number(schema.get("minimum", schema.get("exclusiveMinimum")))
        high = _number(schema.get("maximum", schema.get("exclusiveMaximum")))
        if high is None and (low is None or low < edge):
            out = {**out, "maximum": edge}
        if low is None and (high is None or high > -edge):
            out = {**out, "minimum": -edge}
    return out


def _number(v: Any) -> float | None:
    """A bound's value if it is a number (a bool is not), else None."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


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


_CONDITIONAL = ("if", "then", "else")
_WRAPPER = ("$schema", "$id", "$defs", "definitions", "title", "description", "$comment")  # stay outside the anyOf


def split_conditional(schema: dict) -> dict | None:
    """`schema`'s if/then/else as an anyOf of its two cases, or None where this exact rewrite does not apply.

    It applies when `if` only constrains one property p to a const or enum (it may also require p), p is in the
    schema's `required` and its schema lists its values (enum or const), and `then`/`else` only add `required` names
    and constrain properties the schema declares, in ways `_merge` can intersect. The case where `if` holds gets
    p's values inside the `if`'s set and `then`; the other case gets the rest of p's values and `else`; a case
    with no values left is dropped. Since p is required, an object's p decides its case, as `if` would."""
    cond = schema.get("if")
    if not isinstance(cond, dict) or set(cond) - {"properties", "required"} - _NOTES:
        return None
    props, required = schema.get("properties"), schema.get("required")
    tested = cond.get("properties")
    if not (isinstance(props, dict) and isinstance(required, list) and isinstance(tested, dict) and len(tested) == 1):
        return None
    ((p, test),) = tested.items()
    own = props.get(p)
    if p not in required or not set(cond.get("required", [])) <= {p} or not isinstance(own, dict):
        return None
    picked, values = _values(test), _values(own)
    if picked is None or values is None or set(test) - {"const", "enum"} - _NOTES:
        return None
    inside = _common(values, picked)
    outside = [v for v in values if _key(v) not in {_key(x) for x in picked}]
    plain = {k: v for k, v in schema.items() if k not in _CONDITIONAL and k not in _WRAPPER}
    cases = []
    for vals, branch in ((inside, schema.get("then", {})), (outside, schema.get("else", {}))):
        case = _merge_object(plain, branch)
        if case is None:
            return None
        vals = _common(vals, _values(case["properties"][p]))  # `then`/`else` may narrow p too
        if vals:
            case["properties"] = {**case["properties"], p: {**case["properties"][p], "enum": vals}}
            cases.append(case)
    wrapper = {k: v for k, v in schema.items() if k in _WRAPPER}
    return {**wrapper, "anyOf": cases} if cases else None


def _values(s: dict) -> list | None:
    """The values a schema allows when it lists them (const or enum), else None."""
    if "const" in s:
        return [s["const"]]
    return list(s["enum"]) if isinstance(s.get("enum"), list) else None


def _key(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def _merge_object(base: dict, extra: Any) -> dict | None:
    """`base` (an object schema) also obeying `extra` (only `required` and `properties` of names `base` declares), or
    None where that cannot be written exactly as one object schema."""
    if not isinstance(extra, dict) or set(extra) - {"properties", "required", "type"} - _NOTES:
        return None
    if extra.get("type", "object") != "object":
        return None
    out = dict(base)
    props = dict(out.get("properties", {}))
    for name, sub in extra.get("properties", {}).items():
        merged = _merge(props[name], sub) if name in props else None
        if merged is None:
            return None
        props[name] = merged
    out["properties"] = props
    if "required" in extra:
        out["required"] = list(dict.fromkeys([*out.get("required", []), *extra["required"]]))
    return out


def _merge(a: Any, b: Any) -> dict | None:
    """One schema for "a and b", for the keywords where that is simple: b's keywords that a lacks, equal ones,
    one type (integer within number), the values of const/enum in both. None otherwise."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return None
    out = dict(a)
    for k, v in b.items():
        if k in ("const", "enum"):
            continue  # intersected below
        if k in _NOTES or k not in out or out[k] == v:
            out.setdefault(k, v)
        elif k == "type" and {out[k], v} == {"integer", "number"}:
            out[k] = "integer"
        else:
            return None
    va, vb = _values(a), _values(b)
    if va is not None or vb is not None:
        out.pop("const", None)
        out["enum"] = _common(va, vb)
    return out


def _common(a: list | None, b: list | None) -> list:
    """The values in both lists (None: any value), in a's order."""
    if a is None or b is None:
        return list(a if b is None else b)
    keys = {_key(y) for y in b}
    return [x for x in a if _key(x) in keys]

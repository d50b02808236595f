"""SGLang's `structural_tag` grammar: a JSON object (the sampling parameter is its JSON
text; on the OpenAI routes it is `response_format: {"type": "structural_tag", ...}`), in
either of the two shapes SGLang takes:

- xgrammar's structural tag, `{"type": "structural_tag", "format": {...}}` (`const_string`,
  `json_schema`, `regex`, `tag`, `sequence`, `or`, `triggered_tags`, ...; see xgrammar's
  "Structural Tag Usage");
- the legacy one, `{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...],
  "at_least_one": false}`: free text until a trigger, then the structure whose `begin`
  follows, its JSON schema, its `end`, and free text again.

A `schema` / `json_schema` that is missing or null means any JSON value (`{}`), as in
SGLang. xgrammar compiles both shapes (the legacy one converted as xgrammar's
`StructuralTag.from_legacy_structural_tag` converts it); llguidance has the legacy shape
only (its `StructTag`); outlines has neither.
"""

from __future__ import annotations

import json
from typing import Any

FIELD = "sampling_params.structural_tag"


class StructuralTagError(ValueError):
    """A structural tag of the wrong shape; the message names the field (a 400)."""


def _invalid(reason: str) -> StructuralTagError:
    return StructuralTagError(f"{FIELD}: invalid structural_tag: {reason}")


def load(value: str) -> dict[str, Any]:
    """The structural tag of `value` (JSON text) as an object; ValueError naming the field."""
    try:
        tag = json.loads(value)
    except (json.JSONDecodeError, RecursionError) as e:
        raise _invalid(f"not valid JSON ({e})") from None
    if not isinstance(tag, dict):
        raise _invalid("must be a JSON object")
    return tag


def is_legacy(tag: dict[str, Any]) -> bool:
    """The legacy shape (`structures` and `triggers`), as SGLang tells them apart."""
    return tag.get("structures") is not None


def legacy_parts(tag: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The legacy tag's structures (each `begin`, `schema` (`{}` when null), `end`) and
    triggers, checked; ValueError naming what is wrong."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise _invalid("'structures' must be a non-empty list")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise _invalid("'triggers' must be a non-empty list of non-empty strings")
    checked = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise _invalid(f"structures[{i}] must have string 'begin' and 'end'")
        schema = {} if s.get("schema") is None else s["schema"]
        if not isinstance(schema, dict):
            raise _invalid(f"structures[{i}].schema must be a JSON schema object")
        checked.append({"begin": s["begin"], "schema": schema, "end": s["end"]})
    return checked, triggers


def _any_json_where_missing(fmt: Any) -> None:
    """Fill a missing or null `json_schema` with `{}` throughout `fmt` (SGLang does)."""
    if not isinstance(fmt, dict):
        return
    kind = fmt.get("type")
    if kind in ("json_schema", "qwen_xml_parameter") and fmt.get("json_schema") is None:
        fmt["json_schema"] = {}
    children = {"tag": [fmt.get("content")], "sequence": fmt.get("elements"), "or": fmt.get("elements")}
    children["triggered_tags"] = children["tags_with_separator"] = fmt.get("tags")
    for child in children.get(kind) or []:
        _any_json_where_missing(child)


def xgrammar_structural_tag(value: str) -> str:
    """xgrammar's structural tag (JSON text) for `value`, the legacy shape converted."""
    tag = load(value)
    if is_legacy(tag):
        structures, triggers = legacy_parts(tag)
        tags = [
            {
                "type": "tag",
                "begin": s["begin"],
                "content": {"type": "json_schema", "json_schema": s["schema"]},
                "end": s["end"],
            }
            for s in structures
        ]
        fmt = {
            "type": "triggered_tags",
            "triggers": triggers,
            "tags": tags,
            "at_least_one": bool(tag.get("at_least_one")),
        }
        return json.dumps({"type": "structural_tag", "format": fmt})
    if not isinstance(tag.get("format"), dict):
        raise _invalid("needs 'format' (an object), or the legacy 'structures' and 'triggers'")
    _any_json_where_missing(tag["format"])
    return json.dumps({**tag, "type": "structural_tag"})

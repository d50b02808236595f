"""The JSON schema that constrains generation for `tool_choice` required or a named
function, so that any model writes a call that parses and validates."""

from __future__ import annotations

from typing import Any


def get_json_schema_constraint(
    functions: list[dict[str, Any]], name: str | None, parallel_tool_calls: bool = True
) -> dict[str, Any]:
    """`functions` are the tools' `function` objects (`name`, `parameters`).

    A named function (`name`): its parameters schema; the output is the arguments object.
    Otherwise (`required`): an array of one or more `{"name", "parameters"}` objects, any
    of the functions (at most one with `parallel_tool_calls` false), as SGLang builds it;
    the functions' `$defs` move to the top, where their `#/$defs/...` references point.
    Raises ValueError when two functions define the same `$defs` name differently.
    """
    if name is not None:
        return next(parameters_of(f) for f in functions if f["name"] == name)
    defs: dict[str, Any] = {}
    items = []
    for f in functions:
        parameters = dict(parameters_of(f))
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise ValueError(f"tools: the $defs entry {key!r} has multiple schemas, which is not supported")
        items.append(
            {
                "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def parameters_of(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; one declared without takes an object of anything."""
    return function.get("parameters") or {"type": "object", "properties": {}}

"""Everyday asks and three tools for tool-call checks on real models, and the part of JSON
Schema they use, checked by hand: `test_serve_realmodel` asserts on them, and
`benchmarks/tool_calls.py` counts what a model makes of them."""

from __future__ import annotations

from typing import Any

__all__ = ["ASKS", "SCHEMAS", "TOOLS", "fits"]

ASKS = (
    "Wake me up at half past seven for my flight.",
    "Remind me in ten minutes to take the pizza out.",
    "Is it cold in Reykjavik right now?",
    "Set something for 6:15 am, gym.",
    "What should I wear in Tokyo today?",
)


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _int(low: int, high: int | None = None) -> dict[str, Any]:
    return {"type": "integer", "minimum": low} | ({} if high is None else {"maximum": high})


TEXT = {"type": "string"}
TOOLS = [
    _tool("set_alarm", {"hour": _int(0, 23), "minute": _int(0, 59), "label": TEXT}),
    _tool("start_timer", {"seconds": _int(1)}),
    _tool("get_weather", {"city": TEXT, "unit": {"enum": ["celsius", "fahrenheit"]}}),
]
SCHEMAS: dict[str, dict[str, Any]] = {
    t["function"]["name"]: t["function"]["parameters"] for t in TOOLS
}


def fits(value: Any, schema: dict[str, Any]) -> bool:
    """The parts of JSON Schema `TOOLS` uses: objects with required, closed properties;
    bounded integers, strings and enums."""
    if "enum" in schema:
        return value in schema["enum"]
    if schema["type"] == "object":
        props = schema["properties"]
        return (
            isinstance(value, dict)
            and set(value) == set(props)
            and all(fits(value[k], props[k]) for k in props)
        )
    if schema["type"] == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return ok and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return isinstance(value, str)

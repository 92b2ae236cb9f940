"""Tool definitions (OpenAI ``tools`` entries) shared by the tests and the benchmarks.

Pure data, no imports beyond typing. Every list here is sent byte for byte to vLLM and to serve_app
and rendered into prompts by chat templates, so a change to any of them changes the prompts (and
the expected outputs) of the tests and benches that use it. That is why near-identical variants
stay apart: each keeps the exact content its users were written and measured against.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "MINIMAL_WEATHER_TOOLS",
    "SERVER_TIME_TOOL",
    "TRANSLATE_TOOL",
    "UNTYPED_WEATHER_TOOLS",
    "WEATHER_AND_CONVERSION_TOOLS",
    "WEATHER_AND_DOCS_TOOLS",
    "WEATHER_AND_SEARCH_TOOLS",
    "WEATHER_AND_TIME_TOOLS",
    "WEATHER_BY_LOCATION_TOOL",
    "WEB_SEARCH_TOOL",
    "function_tool",
]


def function_tool(name: str, description: str | None = None, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``{"type": "function", "function": {...}}`` entry; fields left as None are absent.

    Key order (name, description, parameters) is kept: templates render the tool as JSON."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


# get_weather(city) and nothing else: no description, no required list. The parser derender tests
# (unit and integration) script hermes calls of it.
MINIMAL_WEATHER_TOOLS: list[dict[str, Any]] = [
    function_tool("get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}}),
]

# get_weather(city, unit) with a free-text unit and no required list: the parser benchmark's workload.
UNTYPED_WEATHER_TOOLS: list[dict[str, Any]] = [
    function_tool(
        "get_weather",
        "Current weather for a city.",
        {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
    ),
]

# get_weather and search_docs: the parser parity tests (tests/differential/parser_cases.py).
WEATHER_AND_DOCS_TOOLS: list[dict[str, Any]] = [
    function_tool(
        "get_weather",
        "Current weather for a city.",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    ),
    function_tool(
        "search_docs",
        "Search the documentation.",
        {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}, "filters": {"type": "object"}},
            "required": ["query"],
        },
    ),
]

# get_weather and get_time: the composed-vs-`vllm serve` parity and OpenAI SDK tests, whose scripted
# outputs call both.
WEATHER_AND_TIME_TOOLS: list[dict[str, Any]] = [
    function_tool(
        "get_weather",
        "Current weather for a city",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    ),
    function_tool(
        "get_time",
        "Local time in a city",
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    ),
]

# get_weather and convert_temperature: the render benchmark's `chat_tools` payload.
WEATHER_AND_CONVERSION_TOOLS: list[dict[str, Any]] = [
    function_tool(
        "get_weather",
        "Current weather for a city.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    ),
    function_tool(
        "convert_temperature",
        "Convert a temperature between Celsius and Fahrenheit.",
        {
            "type": "object",
            "properties": {
                "value": {"type": "number"},
                "from_unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "to_unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["value", "from_unit", "to_unit"],
        },
    ),
]

# The render differential corpus (tests/differential/corpus.py): richer schemas, unicode in names and
# descriptions, a tool without parameters.
WEATHER_BY_LOCATION_TOOL: dict[str, Any] = function_tool(
    "get_weather",
    "Current weather for a city. Returns temperature and sky conditions.",
    {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City name, e.g. Paris or 東京"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["location"],
    },
)
WEB_SEARCH_TOOL: dict[str, Any] = function_tool(
    "search_web",
    "Search the web and return the top results.",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5},
            "filters": {
                "type": "object",
                "properties": {
                    "site": {"type": "string"},
                    "after": {"type": "string", "format": "date"},
                    "languages": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
        "required": ["query"],
    },
)
TRANSLATE_TOOL: dict[str, Any] = function_tool(
    "traduire_texte",
    "Traduit un texte. 翻訳ツール: テキストを翻訳します。🌐",
    {
        "type": "object",
        "properties": {"texte": {"type": "string"}, "langue_cible": {"type": "string", "pattern": "^[a-z]{2}$"}},
        "required": ["texte", "langue_cible"],
    },
)
SERVER_TIME_TOOL: dict[str, Any] = function_tool("get_server_time", "UTC time now.")
WEATHER_AND_SEARCH_TOOLS: list[dict[str, Any]] = [WEATHER_BY_LOCATION_TOOL, WEB_SEARCH_TOOL]

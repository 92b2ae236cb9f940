"""Example: your own Ray Serve deployment using the graph by handle, through :class:`serve_app.client.ServeAppClient`.

``Assistant`` answers a question with a tool-calling chat request: render, engine and derender are
called by handle, nothing goes over HTTP. It runs next to the ``serve_app`` application (engine
enabled)::

    serve run serve_config.yaml                          # the graph, application "serve_app"
    python -m examples.by_handle                         # deploys Assistant as application "assistant"

or in code: ``serve.run(Assistant.bind("serve_app"), name="assistant", route_prefix=None)``, then
``serve.get_app_handle("assistant").ask.remote("What's the weather in Paris?")``.
"""

from __future__ import annotations

import json
from typing import Any

from ray import serve

from serve_app.client import ServeAppClient

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Assistant:
    def __init__(self, app_name: str = "serve_app") -> None:
        self.client = ServeAppClient(app_name)

    async def ask(self, question: str, **request: Any) -> dict[str, Any]:
        """One chat completion: ``{"content", "reasoning", "tool_calls", "finish_reason", "usage"}``."""
        response = await self.client.chat(
            {"messages": [{"role": "user", "content": question}], "tools": [WEATHER_TOOL], **request}
        )
        choice = response["choices"][0]
        message = choice["message"]
        return {
            "content": message.get("content"),
            "reasoning": message.get("reasoning"),
            "tool_calls": [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in message.get("tool_calls") or []
            ],
            "finish_reason": choice["finish_reason"],
            "usage": response["usage"],
        }

    async def ask_stream(self, question: str, **request: Any) -> str:
        """The same question streamed chunk by chunk (render, engine stream, derender per chunk)."""
        text = []
        async for chunk in self.client.chat_stream({"messages": [{"role": "user", "content": question}], **request}):
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
        return "".join(text)


if __name__ == "__main__":
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    handle = serve.run(Assistant.bind("serve_app"), name="assistant", route_prefix=None)
    print(handle.ask.remote("What's the weather in Paris?", max_tokens=32).result())

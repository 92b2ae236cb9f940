"""Agent-like chat traffic for render benchmarks: conversations that share one system prompt and 8
tools, grow turn by turn with reasoning, tool calls and tool results, and never repeat text.

Each conversation is a list of chat render requests, one per turn, each the whole conversation so
far (as an agent loop sends it): ``conversation(seed)``. Every request carries text no earlier
request had (the newest user message or tool results), and everything before it is what the previous
request sent, so a server sees long shared prefixes and a new tail. Prompts grow from about 1k to
``max_tokens`` tokens (estimated at 4 characters per token; the bench reports the real counts).
"""

from __future__ import annotations

import json
import random
from typing import Any

SYSTEM = (
    "You are a careful software engineering agent working inside a developer's repository. You can read and "
    "write files, run shell commands, search the code and the web, and fetch documentation. Work in small "
    "steps: state what you intend to do, call one or two tools, read their results, and decide the next step. "
    "Never invent file contents or command output; when you are unsure, look. Prefer the smallest change that "
    "fixes the problem, keep the project's style, and run the tests that cover what you changed. When a command "
    "fails, read the error before trying again, and do not repeat a failing command unchanged. Report what you "
    "did, what you verified and what is left, in plain words, with file paths and line numbers. Do not touch "
    "files outside the repository, do not push, and ask before deleting anything the user did not ask you to "
    "delete. Keep secrets out of logs and answers. If the task is ambiguous, ask one precise question."
)


def _fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": required}}}


_S = {"type": "string"}
TOOLS: list[dict[str, Any]] = [
    _fn("read_file", "Read a text file of the repository, optionally a line range.",
        {"path": {**_S, "description": "Path relative to the repository root."},
         "start_line": {"type": "integer", "description": "First line, 1-based."},
         "end_line": {"type": "integer", "description": "Last line, inclusive."}}, ["path"]),
    _fn("write_file", "Create or overwrite a file with the given content.",
        {"path": _S, "content": {**_S, "description": "The whole new content."}}, ["path", "content"]),
    _fn("edit_file", "Replace one exact occurrence of a string in a file.",
        {"path": _S, "old": {**_S, "description": "Text to replace; must occur exactly once."}, "new": _S},
        ["path", "old", "new"]),
    _fn("run_shell", "Run a shell command in the repository and return its exit code, stdout and stderr.",
        {"command": _S, "timeout_s": {"type": "number", "description": "Seconds before the command is killed."}},
        ["command"]),
    _fn("search_code", "Search the repository for a regular expression; returns matching lines with paths.",
        {"pattern": _S, "glob": {**_S, "description": "Only files matching this glob."},
         "max_results": {"type": "integer"}}, ["pattern"]),
    _fn("list_dir", "List a directory of the repository.",
        {"path": _S, "recursive": {"type": "boolean"}}, ["path"]),
    _fn("web_search", "Search the web and return titles, URLs and snippets.",
        {"query": _S, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}, ["query"]),
    _fn("fetch_url", "Fetch a URL and return its text content.",
        {"url": {**_S, "format": "uri"}, "max_chars": {"type": "integer"}}, ["url"]),
]

_WORDS = (
    "the a of to and in is that for it with as on be this are by from or an was which at not can but have has "
    "function file test error value module request response server client cache token prompt template render "
    "config parser stream chunk replica process thread queue lock buffer index offset length limit timeout retry "
    "build install import return raise class method field type string integer list dict bytes json schema path "
    "line column branch commit merge diff patch review check fails passes works slow fast memory cpu disk network "
    "user model message tool call result reasoning answer step plan next first then after before because so if "
    "when while until each every some any all none other same different new old small large short long simple "
    "update change fix add remove rename move copy read write open close start stop run wait send receive parse"
).split()
_NAMES = "serve_app render engine ingress compose wire errors limits config metrics health client stages".split()


def _text(rng: random.Random, words: int) -> str:
    out, sentence = [], []
    for _ in range(words):
        w = rng.choice(_WORDS)
        r = rng.random()
        if r < 0.04:
            w = f"{rng.choice(_NAMES)}/{rng.choice(_WORDS)}.py:{rng.randint(1, 900)}"
        elif r < 0.07:
            w = str(rng.randint(0, 100000))
        elif r < 0.09:
            w = f"`{rng.choice(_WORDS)}_{rng.choice(_WORDS)}()`"
        sentence.append(w)
        if len(sentence) > rng.randint(6, 18):
            out.append(" ".join(sentence).capitalize() + rng.choice(".....?:;"))
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


def _code(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        indent = "    " * rng.randint(0, 3)
        a, b = rng.choice(_WORDS), rng.choice(_WORDS)
        out.append(rng.choice([
            f"{indent}def {a}_{b}(self, {rng.choice(_WORDS)}: int = {i}) -> None:",
            f"{indent}{a} = {b}.get({a!r}, {rng.randint(0, 99)})",
            f"{indent}if {a} is None or len({b}) > {rng.randint(1, 4096)}:",
            f"{indent}return {{\"{a}\": {b}, \"n\": {i}}}",
            f"{indent}# {_text(rng, rng.randint(4, 10))}",
        ]))
    return "\n".join(out)


def _call(rng: random.Random, k: int) -> tuple[dict[str, Any], str]:
    """One tool call (as the assistant message carries it) and the tool's result text."""
    tool = rng.choice(TOOLS)["function"]["name"]
    path = f"{rng.choice(_NAMES)}/{rng.choice(_WORDS)}_{rng.choice(_WORDS)}.py"
    args: dict[str, Any] = {
        "read_file": {"path": path, "start_line": rng.randint(1, 200)},
        "write_file": {"path": path, "content": _code(rng, rng.randint(3, 12))},
        "edit_file": {"path": path, "old": _code(rng, 1).strip(), "new": _code(rng, 2).strip()},
        "run_shell": {"command": f"pytest tests/unit/test_{rng.choice(_WORDS)}.py -q -k {rng.choice(_WORDS)}"},
        "search_code": {"pattern": f"def {rng.choice(_WORDS)}_\\w+", "glob": "*.py"},
        "list_dir": {"path": rng.choice(_NAMES), "recursive": rng.random() < 0.5},
        "web_search": {"query": _text(rng, rng.randint(4, 9)), "max_results": 5},
        "fetch_url": {"url": f"https://docs.example.org/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.html"},
    }[tool]
    if tool in ("read_file", "write_file", "edit_file", "search_code", "list_dir"):
        result = _code(rng, rng.randint(8, 60))
    else:
        result = _text(rng, rng.randint(60, 350))
    call = {"id": f"call_{rng.getrandbits(48):012x}_{k}", "type": "function",
            "function": {"name": tool, "arguments": json.dumps(args)}}
    return call, result


def conversation(seed: int, model: str = "qwen3-tiny", max_tokens: int = 8000) -> list[dict[str, Any]]:
    """One agent conversation as its render requests, turn by turn, until a prompt would pass ``max_tokens``."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": _text(rng, rng.randint(30, 150))}]
    requests: list[dict[str, Any]] = []
    base = len(json.dumps(TOOLS))
    k = 0
    while (base + len(json.dumps(messages))) / 4 <= max_tokens:
        requests.append({"model": model, "messages": [dict(m) for m in messages], "tools": TOOLS,
                         "tool_choice": "auto", "max_tokens": 512, "temperature": 0.7})
        if rng.random() < 0.2 and messages[-1]["role"] == "tool":
            # The agent answers and the user follows up: earlier turns' reasoning is history now.
            messages.append({"role": "assistant", "content": _text(rng, rng.randint(20, 80)),
                             "reasoning_content": _text(rng, rng.randint(20, 60))})
            messages.append({"role": "user", "content": _text(rng, rng.randint(10, 60))})
            continue
        calls = [_call(rng, k + i) for i in range(rng.choice((1, 1, 2)))]
        k += len(calls)
        messages.append({"role": "assistant", "content": _text(rng, rng.randint(0, 30)) if rng.random() < 0.5 else "",
                         "reasoning_content": _text(rng, rng.randint(15, 70)), "tool_calls": [c for c, _ in calls]})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in calls]
    return requests

"""Tool calls (core): OpenAI `tools` checked, rendered into the prompt by the model's chat template, and the
model's answer parsed back into calls.

    tools = check_tools(body_tools)                    # ToolError (one line, the schema library's message)
    text = chat_text(tokenizer, messages, tools)       # the template renders tools itself (Qwen2.5, Llama 3.1)
                                                       # or they go in a system message, Hermes style (SmolLM2)
    schema = call_schema(tools, "required" | name)     # the JSON a constrained call must be
    content, calls = parse_calls(text, names)          # [{"name", "arguments": JSON text}]

A template that names `tools` gets them as HF transformers passes them (`tools=[...]`, assistant `tool_calls`
with `arguments` as an object, `tool` messages); any other template (SmolLM2's ChatML) gets the Hermes format
SmolLM2 and Qwen2.5 were trained on: the tools as JSON inside <tools></tools> in the system message, a call as
<tool_call>{"name": ..., "arguments": {...}}</tool_call>, a result as <tool_response>...</tool_response> in a
user turn. The parser reads that format, Llama 3.1's bare {"name", "parameters"} object (after <|python_tag|>
or not) and a list of such objects.
"""
from __future__ import annotations

import json
import re

from .grammar import GrammarError, check_schema

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
HERMES = ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
          "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
          "about what values to plug into functions. For each function call return a json object with function "
          "name and arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
          '{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>\n<tools>\n')


class ToolError(ValueError):
    """A tool definition or tool_choice that cannot be used; one line."""


def check_tools(tools) -> list[dict]:
    """OpenAI's tools, normalised to [{"type": "function", "function": {"name", "description", "parameters"}}].
    Each `parameters` schema is checked by llguidance, so a bad one fails here with its message."""
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise ToolError(f"tools must be a list of 1..{MAX_TOOLS} function definitions")
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name", "parameters"}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"tools[{i}].function.name must be 1..64 letters, digits, _ . or -, got {name!r}"[:160])
        if name in seen:
            raise ToolError(f"tools[{i}]: the function name {name!r} appears twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON Schema object")
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise ToolError(f"tools[{i}].function.description must be a string")
        try:
            check_schema(params)
        except GrammarError as e:
            raise ToolError(f"tools[{i}] ({name}) parameters: {e}") from None
        out.append({"type": "function", "function": {"name": name, "description": desc, "parameters": params}})
    return out


def check_choice(choice, tools) -> str | dict:
    """tool_choice: "auto" (default), "none", "required" or {"type": "function", "function": {"name": N}} -> N."""
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type", "function") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise ToolError(f"tool_choice names the function {name!r}, which is not in tools"[:160])
        return {"name": name}
    raise ToolError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name"}}')


def call_schema(tools, choice) -> dict:
    """The JSON Schema of one call: {"name": one of the tools (or the chosen one), "arguments": its parameters}."""
    pick = [t["function"] for t in tools if not isinstance(choice, dict) or t["function"]["name"] == choice["name"]]
    one = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False} for f in pick]
    return one[0] if len(one) == 1 else {"anyOf": one}


# ------------------------------------------------------------------------------------------ rendering
def _args_object(a):
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


def _template_messages(messages) -> list[dict]:
    """Messages as HF templates expect them: tool_calls' arguments as objects, content always a string."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args_object(
                c["function"].get("arguments", {}))}} for c in m["tool_calls"]]
        m["content"] = m.get("content") or ""
        out.append(m)
    return out


def _hermes_messages(messages, tools) -> list[dict]:
    """The Hermes format in plain role/content messages, for a template that knows nothing of tools."""
    out = []
    if tools:
        spec = HERMES + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + "\n</tools>"
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0].get('content') or ''}\n\n{spec}".lstrip()})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": spec})
    for m in messages:
        text = m.get("content") or ""
        if m.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": _args_object(
                c["function"].get("arguments", {}))}, ensure_ascii=False) for c in m["tool_calls"]]
            text = (text + "\n" if text else "") + "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": text})
    return out


def template_knows_tools(tokenizer) -> bool:
    src = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in src and "tool_calls" in src


def chat_text(tokenizer, messages, tools=None) -> str:
    """The prompt text of a chat, with tools and tool turns rendered by the template where it can."""
    has_template = getattr(tokenizer, "has_chat_template", False)
    if has_template and template_knows_tools(tokenizer):
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(_template_messages(messages), add_generation_prompt=True, **extra)
    plain = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    msgs = _hermes_messages(messages, tools) if tools or plain else messages
    if has_template:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    return text + "<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------ parsing
def _as_call(obj, names):
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _calls_of(text, names):
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_as_call(o, names) for o in objs]
    return calls if calls and all(calls) else None


def parse_calls(text: str, names=None) -> tuple[str | None, list[dict]]:
    """(content, calls) of a model's answer; calls [] when it made none (content is then the text itself).
    `names`: the tools' names; a call to any other is not a call."""
    blocks = CALL.findall(text)
    if blocks:
        calls = [c for c in (_calls_of(b, names) for b in blocks) if c]
        if calls:
            rest = CALL.sub("", text).strip()
            return (rest or None), [c for group in calls for c in group]
        return text, []
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    calls = _calls_of(body, names) if body[:1] in ("{", "[") else None
    return (None, calls) if calls else (text, [])


def may_be_call(text: str) -> bool:
    """While streaming with tools: could the text so far still begin a call (hold it back) or not (stream it)?"""
    s = text.lstrip()
    if not s:
        return True
    return any(s.startswith(p) or p.startswith(s) for p in ("<tool_call>", "<|python_tag|>")) or s[0] in "{["

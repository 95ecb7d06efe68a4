"""Chat templates: a checkpoint's jinja2 template rendered the way Hugging Face transformers renders it
(sandboxed, trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text, `{% generation %}` blocks), so a prompt matches what the model was trained on."""
from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's part for training masks; for
    rendering a prompt it is just its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _first_line(e) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]


def validate_messages(messages) -> list[dict]:
    """A copy of messages after checking their shape: a list of {"role": one of ROLES, "content": str}
    (other keys pass through). Bad input raises ValueError with one line."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError("messages must be a list of {\"role\": ..., \"content\": ...} objects, "
                         f"not {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} is a {type(m).__name__}, not an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} ({role}) needs a string content, "
                             f"not {type(m.get('content')).__name__}")
        out.append(dict(m))
    return out


class ChatTemplate:
    """One compiled template. ``render`` raises ValueError (one line) for bad messages or a template
    that fails to compile or render."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        if not isinstance(source, str) or not source.strip():
            raise ValueError("the chat template is empty or not a string")
        self.source, self.bos_token, self.eos_token = source, bos_token or "", eos_token or ""
        self._compiled = None

    def _template(self):
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.source)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"the chat template does not compile (line {e.lineno}): "
                                 f"{_first_line(e.message or e)}") from None
        return self._compiled

    def render(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        msgs = validate_messages(messages)
        tmpl = self._template()
        try:
            return tmpl.render(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                               bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except Exception as e:  # a template's raise_exception, sandbox refusals, its own type errors
            raise ValueError(f"the chat template failed to render: {_first_line(e)}") from None


def pick_template(value, where: str) -> str | None:
    """The template text of a tokenizer_config.json / chat_template.json `chat_template` value: a
    string, or a list of {"name", "template"} where the one named "default" is the chat template."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, dict)}
        tmpl = named.get("default")
        if isinstance(tmpl, str):
            return tmpl
        if not named:
            return None
        raise ValueError(f"{where}: chat_template lists {sorted(map(str, named))} but none named 'default'")
    raise ValueError(f"{where}: chat_template is a {type(value).__name__}, not a string or a list")


def find_template(model_dir: str, tokenizer_config: dict) -> str | None:
    """The chat template of a Hugging Face style directory: chat_template.jinja, else
    chat_template.json, else tokenizer_config.json's chat_template (transformers' order)."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not readable UTF-8 text: {_first_line(e)}") from None
    path = os.path.join(model_dir, "chat_template.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError) as e:
            raise ValueError(f"{path} is not valid JSON: {_first_line(e)}") from None
        if isinstance(data, dict):
            return pick_template(data.get("chat_template"), path)
        return pick_template(data, path)
    return pick_template(tokenizer_config.get("chat_template"), os.path.join(model_dir, "tokenizer_config.json"))

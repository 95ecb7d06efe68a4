"""kog_dist.tools: tools and tool turns rendered by templates that know them (Qwen2.5's and Llama 3.1's
formats, in short templates written here in their shape) and in the Hermes format for one that does not
(SmolLM2's ChatML); the answer parsed back into calls; bad definitions refused in one line."""
import json

import pytest
from tokenizers import Tokenizer, models

from kog_dist.tokenizer import HFTokenizer
from kog_dist.tools import ToolError, call_schema, chat_text, check_choice, check_tools, may_be_call, parse_calls

# the shape of Qwen2.5's template: tools as JSON lines in the system turn, calls as <tool_call> with
# `arguments | tojson`, results as <tool_response> inside a user turn
QWEN = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are Qwen.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif not (m.role == 'system' and tools) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# the shape of Llama 3.1's: the tools in the first user turn, calls as {"name", "parameters"}, results as ipython
LLAMA31 = """{{ bos_token }}
{%- for m in messages %}
{%- if m.role == 'user' and loop.first and tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, respond with a JSON for a function call.
{% for t in tools %}{{ t | tojson }}
{% endfor %}
{{ m.content }}<|eot_id|>
{%- elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

TOOLS = check_tools([{"type": "function", "function": {
    "name": "get_weather", "description": "The weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
               "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "{\"sky\": \"clear\"}"}]


def tok(template):
    return HFTokenizer(Tokenizer(models.BPE()), kind="bpe", vocab_size=10, bos_id=None, eos_ids=[], add_bos=False,
                       chat_template=template, bos_token="<|begin_of_text|>")


def test_qwen_format_renders_tools_calls_and_results():
    text = chat_text(tok(QWEN), HISTORY, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>") and json.dumps(TOOLS[0]) in text
    assert text.count("Be brief.") == 1                     # the system turn once, with the tools
    # the arguments string became an object: tojson writes it once, not as an escaped string
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"sky\": \"clear\"}\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama31_format_renders_tools_calls_and_results():
    text = chat_text(tok(LLAMA31), HISTORY[1:], TOOLS)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nGiven the following")
    assert json.dumps(TOOLS[0]) in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"sky": "clear"}<|eot_id|>' in text


def test_chatml_without_tools_support_gets_the_hermes_format():
    text = chat_text(tok(CHATML), HISTORY, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling AI model.")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>user\n<tool_response>\n{\"sky\": \"clear\"}\n</tool_response><|im_end|>" in text
    # without tools, a plain chat renders exactly as before
    plain = [{"role": "user", "content": "Hi"}]
    assert chat_text(tok(CHATML), plain) == tok(CHATML).apply_chat_template(plain)


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>', "Let me look.",
     [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ('{"name": "launch_rockets", "arguments": {}}', '{"name": "launch_rockets", "arguments": {}}', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ("It is sunny.", "It is sunny.", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": ', None, None),     # cut short: no call
])
def test_parse_calls(text, content, calls):
    got_content, got = parse_calls(text, ["get_weather"])
    if calls is None:
        assert got == [] and got_content == text
        return
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls


def test_may_be_call():
    assert may_be_call("") and may_be_call("  <tool") and may_be_call("<tool_call>{") and may_be_call("{")
    assert not may_be_call("Hello") and not may_be_call("<b>")


def test_choice_schema_and_bad_definitions():
    two = check_tools([TOOLS[0], {"type": "function", "function": {"name": "noop"}}])
    assert call_schema(two, check_choice({"type": "function", "function": {"name": "noop"}}, two)) == {
        "type": "object", "properties": {"name": {"const": "noop"}, "arguments": {"type": "object", "properties": {}}},
        "required": ["name", "arguments"], "additionalProperties": False}
    assert len(call_schema(two, "required")["anyOf"]) == 2
    for bad, words in ((None, "list"), ([{"type": "function"}], r"tools\[0\]"),
                       ([{"type": "function", "function": {"name": "x", "parameters": {"type": "nope"}}}], "nope"),
                       ([{"type": "function", "function": {"name": "x", "description": 3}}], "description")):
        with pytest.raises(ToolError, match=words):
            check_tools(bad)
    with pytest.raises(ToolError, match="not in tools"):
        check_choice({"type": "function", "function": {"name": "y"}}, two)

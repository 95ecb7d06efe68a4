"""Chat templates rendered as transformers renders them: sandboxed jinja2 with trim_blocks and
lstrip_blocks, raise_exception, strftime_now, tojson, loop controls; bad messages or a failing
template give a one-line ValueError."""
import json
from datetime import datetime

import pytest

from kog_dist.chat_template import ChatTemplate, find_template, pick_template, validate_messages

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# bos_token written by the template, block tags on their own lines: trim_blocks and lstrip_blocks
# must swallow those lines' indentation and newlines, or the prompt gets stray whitespace
LLAMA3 = """{{ bos_token }}
{% for m in messages %}
    {% set content = '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' %}
    {{ content }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{% endif %}
"""

USER = [{"role": "user", "content": "What is the capital of France?"}]


def test_chatml_with_default_system_prompt():
    t = ChatTemplate(CHATML, "<|im_start|>", "<|im_end|>")
    assert t.render(USER) == ("<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\n"
                              "What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Be brief."}] + USER
    out = t.render(own, add_generation_prompt=False)
    assert out.startswith("<|im_start|>system\nBe brief.<|im_end|>") and "You are helpful" not in out
    assert not out.endswith("assistant\n")


def test_trim_and_lstrip_blocks_as_transformers():
    t = ChatTemplate(LLAMA3, "<|begin_of_text|>", "<|eot_id|>")
    out = t.render(USER + [{"role": "assistant", "content": " Paris. "}], add_generation_prompt=True)
    # block-tag lines vanish whole; an expression line keeps its indentation and its newline
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert out == ("<|begin_of_text|>\n"
                   "    " + head.format("user") + "What is the capital of France?<|eot_id|>\n"
                   "    " + head.format("assistant") + "Paris.<|eot_id|>\n"
                   "    " + head.format("assistant") + "\n")


def test_helpers_raise_exception_tojson_strftime_loopcontrols_generation():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                     "{% endif %}{{ messages | tojson }}|{{ {'k': 'é'} | tojson(indent=1) }}|"
                     "{{ strftime_now('%Y') }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}"
                     "{% endif %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    msgs = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "second"}]
    a, b, year, body = t.render(msgs).split("|")
    assert json.loads(a) == msgs and "héllo" in a                     # not \u00e9: ensure_ascii off
    assert b == '{\n "k": "é"\n}' and year == str(datetime.now().year) and body == "héllo"
    with pytest.raises(ValueError, match="failed to render: first must be user"):
        t.render([{"role": "system", "content": "x"}])


def test_sandbox_refuses_unsafe_access_and_mutation():
    for src in ["{{ ''.__class__.__mro__[1].__subclasses__() }}",
                "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages | length }}"]:
        with pytest.raises(ValueError, match="failed to render") as e:
            ChatTemplate(src).render(USER)
        assert "\n" not in str(e.value)


def test_broken_templates_are_one_line_errors():
    with pytest.raises(ValueError, match=r"does not compile \(line 2\)") as e:
        ChatTemplate("ok\n{% for m in messages %}{{ m }").render(USER)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="failed to render") as e:
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(USER)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="empty"):
        ChatTemplate("   ")


@pytest.mark.parametrize("msgs,msg", [
    ("hello", "must be a list"),
    ([["user", "hi"]], "message 0 is a list"),
    ([{"role": "bot", "content": "hi"}], "message 0 has role 'bot'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], r"message 1 \(assistant\) needs a string"),
    ([{"role": "user", "content": ["hi"]}], "needs a string content, not list"),
])
def test_messages_are_validated(msgs, msg):
    with pytest.raises(ValueError, match=msg) as e:
        ChatTemplate(CHATML).render(msgs)
    assert "\n" not in str(e.value)


def test_validate_keeps_extra_keys_and_copies():
    msgs = [{"role": "tool", "content": "42", "name": "calc"}]
    out = validate_messages(msgs)
    assert out == msgs and out[0] is not msgs[0]


def test_template_sources(tmp_path):
    assert pick_template("x", "here") == "x" and pick_template(None, "here") is None
    assert pick_template([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}], "h") == "D"
    with pytest.raises(ValueError, match="none named 'default'"):
        pick_template([{"name": "tool_use", "template": "T"}], "h")
    with pytest.raises(ValueError, match="not a string or a list"):
        pick_template(3, "h")
    d = str(tmp_path)
    assert find_template(d, {"chat_template": "from config"}) == "from config"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert find_template(d, {"chat_template": "from config"}) == "from json"
    (tmp_path / "chat_template.jinja").write_text("from jinja")
    assert find_template(d, {"chat_template": "from config"}) == "from jinja"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").write_text("{not json")
    with pytest.raises(ValueError, match="chat_template.json is not valid JSON"):
        find_template(d, {})

"""The frontend's chat template renders as transformers' apply_chat_template does, whichever of
the layouts a model directory uses (chat_template.jinja, tokenizer_config.json's string, or its
list of named templates), and refuses what a template refuses as a clear InvalidRequest."""
from __future__ import annotations

import json
import shutil

import pytest

from scheduler_svc.frontend.chat import ChatMessage, render_chat
from scheduler_svc.frontend.tokenizer import load_tokenizer
from scheduler_svc.frontend.validation import InvalidRequest

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<b>Hi</b> & \"you\""},
                {"role": "assistant", "content": "Hello", "reasoning_content": "greet", "tool_calls": None},
                {"role": "user", "content": "Weather?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "<now>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# Everything transformers gives a template: special tokens, tojson's options, namespace, loop
# controls, {% generation %}, strftime_now (its date only: the time may tick between two renders).
FEATURES = ("{{ bos_token or '' }}{{ eos_token }}|{{ pad_token }}|{% set ns = namespace(n=0) %}"
            "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
            "{% generation %}{{ m.role }}:{{ m.content }}{% if m.thinking %}[{{ m.thinking }}]{% endif %}"
            "{% endgeneration %}\n{% endfor %}{{ tools | tojson(indent=2) }}{{ ns.n }}"
            "{{ strftime_now('%Y') }}{% if add_generation_prompt %}>{% endif %}{{ enable_thinking }}")


def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def with_config(tiny_model_dir, tmp_path, **fields):
    """A copy of the tiny model's tokenizer files with tokenizer_config.json's `fields` set and no
    chat_template.jinja (Qwen3's own layout: the template inline)."""
    out = tmp_path / "model"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, **fields}))
    return out


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_the_tiny_model_s_template_renders_as_transformers(tiny_model_dir, tools, kwargs):
    ours = load_tokenizer(tiny_model_dir).chat_template.render(CONVERSATION, tools=tools, **kwargs)
    assert ours == hf_tokenizer(tiny_model_dir).apply_chat_template(CONVERSATION, tools=tools, tokenize=False,
                                                                   add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_an_inline_template_sees_what_transformers_gives_it(tiny_model_dir, tmp_path, tools):
    model = with_config(tiny_model_dir, tmp_path, chat_template=FEATURES, bos_token="<|endoftext|>")
    ours = load_tokenizer(model).chat_template.render(CONVERSATION, tools=tools, enable_thinking=True)
    expected = hf_tokenizer(model).apply_chat_template(CONVERSATION, tools=tools, tokenize=False,
                                                       add_generation_prompt=True, enable_thinking=True)
    assert ours == expected
    assert ours.startswith("<|endoftext|><|im_end|>|<|endoftext|>|") and "[greet]" in ours
    assert ("<now>" in ours) == (tools is not None)      # tojson leaves HTML alone


def test_named_templates_serve_tools_with_tool_use_and_the_rest_with_default(tiny_model_dir, tmp_path):
    named = [{"name": "default", "template": "plain{{ messages | length }}"},
             {"name": "tool_use", "template": "tools{{ tools | length }}"}]
    model = with_config(tiny_model_dir, tmp_path, chat_template=named)
    template, hf = load_tokenizer(model).chat_template, hf_tokenizer(model)
    for tools in (None, TOOLS):
        assert template.render(CONVERSATION, tools=tools) == hf.apply_chat_template(
            CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=True)
    assert template.render(CONVERSATION) == "plain4" and template.render(CONVERSATION, tools=TOOLS) == "tools1"


def test_a_template_s_refusal_and_a_missing_template_are_invalid_requests(tiny_model_dir, tmp_path):
    refusing = with_config(tiny_model_dir, tmp_path,
                           chat_template="{{ raise_exception('only one user turn, got ' ~ messages | length) }}")
    with pytest.raises(InvalidRequest, match="refused these messages: only one user turn, got 1") as caught:
        render_chat(load_tokenizer(refusing), [ChatMessage("user", "Hi")])
    assert caught.value.field == "messages"
    (refusing / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert load_tokenizer(refusing).chat_template is None
    with pytest.raises(InvalidRequest, match="the model has no chat template"):
        render_chat(load_tokenizer(refusing), [ChatMessage("user", "Hi")])


def test_a_template_cannot_reach_python_internals(tiny_model_dir, tmp_path):
    for i, source in enumerate(("{% set ns = namespace(_x=1) %}", "{{ messages.__class__.__mro__ }}",
                                "{% set ns = namespace(a=1) %}{% set ns._b = 2 %}")):
        (tmp_path / str(i)).mkdir()
        model = with_config(tiny_model_dir, tmp_path / str(i), chat_template=source)
        with pytest.raises(InvalidRequest, match="refused these messages"):
            render_chat(load_tokenizer(model), [ChatMessage("user", "Hi")])


def test_the_tokenizer_is_transformers_own(tiny_model_dir):
    """The same vocabulary, added tokens and special marks as transformers loads from the directory."""
    ours, hf = load_tokenizer(tiny_model_dir), hf_tokenizer(tiny_model_dir)
    assert len(ours) == len(hf)
    assert ours.control_tokens == {t.content: i for i, t in hf.added_tokens_decoder.items()}
    assert ours.backend.to_str() == hf.backend_tokenizer.to_str()
    assert ours.chat_template.special_tokens == hf.special_tokens_map

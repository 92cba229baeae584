"""fle_engine.chat against llama.cpp's own C++ chat-template path.

``tests/llama_chat_render.cpp`` renders a prompt through llama.cpp's common
chat API (``common_chat_templates_init`` + ``common_chat_templates_apply``,
the path llama-server takes) and its C++ Jinja engine (``common/jinja``), so
this reference shares no code with Python's jinja2, unlike
llama-cpp-python's ``Jinja2ChatFormatter`` used in test_tokenizer.py. It is
compiled against the static libraries of the llama.cpp build that
test_kld_llama.py keeps under ``$FLE_CACHE_DIR/llama-tools-0.3.36``
(default ``~/.cache/fle``); the libraries are built there first when missing
(several minutes on two cores). Tests skip when the sources, cmake or a C++
compiler are missing. llama-cpp-python itself is not needed.

Every ``*Qwen*.jinja`` template of ``models/templates/`` is rendered for
several conversations, with and without the generation prompt and with
``enable_thinking`` False/True/unset; FLE's output must equal llama.cpp's
byte for byte. Where llama.cpp does something on purpose that FLE does not
(documented below with the llama.cpp source that does it), the test asserts
the exact difference, so that it fails when either side changes; where FLE
follows llama.cpp, the test asserts equality:

* llama.cpp has no "unset" ``enable_thinking``: ``common_chat_templates_inputs``
  holds a bool defaulting to true and ``common_chat_template_direct_apply_impl``
  always passes it to the template (common/chat.h, common/chat.cpp). FLE's
  default is the same (true, passed); FLE's explicit None leaves it undefined
  (transformers' behaviour), which closes the think block in templates that
  test ``not enable_thinking`` (QwQ, DeepSeek-R1-Distill-Qwen): asserted
  below as the one intended difference.
* llama.cpp rewrites messages before rendering (common/chat.cpp:
  ``common_chat_msg::to_json_oaicompat`` gives every message a ``content``,
  "" when absent; ``workaround::func_args_not_string`` parses tool-call
  ``arguments`` given as a JSON string into an object when the template's
  caps say it takes object arguments). FLE's ``normalize_messages`` does the
  same, so raw and normalized messages render identically in both.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fle_engine.chat import apply_chat_template
from fle_quant.gguf_reader import GGUFModel

pytestmark = pytest.mark.reference

@pytest.fixture(scope="session")
def llama_chat_render(llama_src, llama_program) -> Path:
    """The compiled renderer (cached; see ``llama_program`` in conftest.py)."""
    src = llama_src / "vendor" / "llama.cpp"
    if not (src / "common" / "chat.h").is_file():
        pytest.skip(f"{src} lacks common/chat.h; set FLE_LLAMA_SRC to a full llama-cpp-python sdist")
    return llama_program("llama_chat_render.cpp", "llama-chat-render")


def llama_render(exe: Path, template: str, messages: list[dict], add_generation_prompt: bool, *,
                 tools: list[dict] | None, enable_thinking: bool | None, bos: str, eos: str) -> str:
    request = {"template": template, "bos": bos, "eos": eos, "messages": messages,
               "add_generation_prompt": add_generation_prompt, "enable_thinking": enable_thinking, "tools": tools}
    r = subprocess.run([str(exe)], input=json.dumps(request).encode(), capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-3000:]
    return r.stdout.decode("utf-8")


_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. München"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}


def _call(city: str, unit: str = "celsius") -> dict:
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city, "unit": unit}}}


CONVERSATIONS = {
    "system_user": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Wie groß ist der Kölner Dom? 🏰"},
    ], None),
    "user_only": ([{"role": "user", "content": "Hello"}], None),
    "multi_turn": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
        {"role": "user", "content": "And 日本 in English?"},
    ], None),
    # reasoning_content on earlier and on the final assistant turn
    "reasoning": ([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Also simple."},
    ], None),
    "tool_call": ([
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in München?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("München")]},
        {"role": "tool", "content": '{"temp": 21, "sky": "klar"}'},
    ], [_WEATHER_TOOL]),
    "two_calls": ([
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in München and Köln?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [_call("München"), _call("Köln", "fahrenheit")]},
        {"role": "tool", "content": "21"},
        {"role": "tool", "content": "64"},
        {"role": "assistant", "content": "München 21 °C, Köln 64 °F."},
    ], [_WEATHER_TOOL]),
}

# templates whose text tests ``not enable_thinking``: for an undefined value
# (FLE's explicit None) they close the think block, for llama.cpp's default
# true they leave it open; the templates' lines are quoted
UNDEFINED_THINKING_DIFFERS = {
    "Qwen-QwQ-32B.jinja": "{%- if not enable_thinking -%}{{- '</think>' -}}{%- endif -%}",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "{% if not enable_thinking %}{{- '</think>' -}}{% endif %}",
}


def _qwen_templates(models: Path) -> list[Path]:
    found = sorted((models / "templates").glob("*Qwen*.jinja"))
    if not found:
        pytest.skip(f"no Qwen templates under {models / 'templates'}")
    return found


@pytest.fixture(scope="module")
def qwen_bos_eos(llama_models) -> tuple[str, str]:
    """BOS/EOS token texts of the Qwen vocabulary, as templates receive them."""
    with GGUFModel.open(llama_models / "ggml-vocab-qwen2.gguf") as m:
        tokens = m.metadata["tokenizer.ggml.tokens"]
        return tokens[m.metadata["tokenizer.ggml.bos_token_id"]], tokens[m.metadata["tokenizer.ggml.eos_token_id"]]


def test_qwen_templates_present(llama_models):
    names = {p.name for p in _qwen_templates(llama_models)}
    assert {"Qwen-Qwen3-0.6B.jinja", "Qwen3-Coder.jinja", "Qwen3.5-4B.jinja"} <= names


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_templates_match_llama_cpp(llama_chat_render, llama_models, qwen_bos_eos, conversation):
    messages, tools = CONVERSATIONS[conversation]
    bos, eos = qwen_bos_eos
    differs = set()
    for path in _qwen_templates(llama_models):
        template = path.read_text(encoding="utf-8")
        for gen in (True, False):
            ref, got = {}, {}
            for thinking in (False, True, None):
                ref[thinking] = llama_render(llama_chat_render, template, messages, gen, tools=tools,
                                             enable_thinking=thinking, bos=bos, eos=eos)
                extra = {} if thinking is None else {"enable_thinking": thinking}  # None: FLE's default
                got[thinking] = apply_chat_template(template, messages, gen, tools=tools, bos_token=bos,
                                                    eos_token=eos, **extra)
            where = f"{path.name} {conversation} gen={gen}"
            assert got == ref, where
            # llama.cpp's unset is its default, true
            assert ref[None] == ref[True], where
            undefined = apply_chat_template(template, messages, gen, tools=tools, enable_thinking=None,
                                            bos_token=bos, eos_token=eos)
            if undefined != ref[None]:
                # only in a generation prompt, only for the templates listed, and
                # exactly as if the undefined value were false
                assert gen and UNDEFINED_THINKING_DIFFERS.get(path.name, "<unlisted>") in template, where
                assert undefined == got[False], where
                differs.add(path.name)
            for m in messages:
                if m["role"] in ("system", "user"):
                    assert m["content"] in ref[True], where
    if conversation == "user_only":
        listed = {p.name for p in _qwen_templates(llama_models)} & set(UNDEFINED_THINKING_DIFFERS)
        assert differs == listed


# conversations that llama.cpp rewrites before rendering, and the messages it
# renders instead (see the module docstring)
NORMALIZED = {
    "arguments_as_json_string": (
        [{"role": "user", "content": "Weather in München?"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "get_weather", "arguments": '{"city":"München","unit":"celsius"}'}}]},
         {"role": "tool", "content": "21"}],
        [{"role": "user", "content": "Weather in München?"},
         {"role": "assistant", "content": "", "tool_calls": [_call("München")]},
         {"role": "tool", "content": "21"}],
    ),
    "tool_call_without_content": (
        [{"role": "user", "content": "Weather in München?"},
         {"role": "assistant", "tool_calls": [_call("München")]},
         {"role": "tool", "content": "21"}],
        [{"role": "user", "content": "Weather in München?"},
         {"role": "assistant", "content": "", "tool_calls": [_call("München")]},
         {"role": "tool", "content": "21"}],
    ),
}


@pytest.mark.parametrize("case", sorted(NORMALIZED))
def test_llama_cpp_normalizes_messages(llama_chat_render, llama_models, qwen_bos_eos, case):
    """llama.cpp renders these messages as their normalized form (missing
    content -> "", string tool-call arguments -> objects); FLE normalizes
    them the same way, so the raw form renders identically in both."""
    raw, normalized = NORMALIZED[case]
    bos, eos = qwen_bos_eos
    for path in _qwen_templates(llama_models):
        template = path.read_text(encoding="utf-8")
        kw = dict(tools=[_WEATHER_TOOL], enable_thinking=False)
        ref = llama_render(llama_chat_render, template, raw, True, bos=bos, eos=eos, **kw)
        assert ref == llama_render(llama_chat_render, template, normalized, True, bos=bos, eos=eos, **kw), path.name
        assert apply_chat_template(template, normalized, True, bos_token=bos, eos_token=eos, **kw) == ref, path.name
        assert apply_chat_template(template, raw, True, bos_token=bos, eos_token=eos, **kw) == ref, path.name

"""fle_engine.tokenizer and fle_engine.chat.

Unit tier: a synthetic model's byte-level BPE vocabulary against a slow
reference BPE written here, special tokens, the streaming detokenizer, errors,
the template environment.

Reference tier (``-m reference``): llama.cpp's own vocabulary tests
(``models/ggml-vocab-qwen2.gguf`` / ``qwen35`` with their ``.inp``/``.out``
expected ids, produced by HF tokenizers), and llama.cpp itself through
llama-cpp-python on mixed and random text, per-token pieces, end-of-generation
ids; chat templates from ``models/templates/`` against llama-cpp-python's
Jinja2 formatter (the renderer its ``Llama`` uses for a model's template) and,
for plain conversations, against llama.cpp's built-in ChatML formatter
``llama_chat_apply_template`` (C++, independent of Jinja).
"""
from __future__ import annotations

import ctypes
import random
import re
from pathlib import Path

import pytest

from fle_engine.chat import apply_chat_template, render_prompt
from fle_engine.tokenizer import StreamDecoder, Tokenizer, TokenType
from fle_quant.errors import FleError
from fle_quant.gguf_reader import GGUFModel
from fle_quant.synth import make_model

MIXED_TEXT = (
    "def fib(n: int) -> int:\n"
    '    """Return the n-th Fibonacci number."""\n'
    "    if n < 2:\r\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)   # recursion!!\n\n\n"
    "Größe, Übergröße und Maßstäbe: Äpfel, Öl, süß — STRASSE, straße.\n"
    "日本語のテキストと中文文本，한국어 텍스트。\n"
    "Emoji: 🦙🚀👍🏽 👨‍👩‍👧 ❤️ flags 🇩🇪\n"
    "Numbers 1234567890 3.14159 -42 1e-9 ١٢٣ Ⅻ ²³\n"
    "Whitespace:\t\ttabs   spaces\u00a0nbsp\u3000ideographic\u2009thin  \n  \n\n   end"
    "Marks: é (e\u0301) n\u0303 नमस्ते مَرْحَبًا بِالْعَالَمِ I'm you'RE they'll WE'VE it's\n"
    "Specials: <|im_start|>user [PAD151650] <|endoftext|> <think> </s> <|im_end|>"
)

# alphabets for random text: whitespace of all kinds, contractions, digits of
# several scripts, letters with marks, CJK, emoji with joiners, punctuation,
# private-use / unassigned / non-BMP code points, special token texts
_POOLS = (
    " \t\n\r\u00a0\u3000\u2009\x0b\x0c\x1c\x85",
    "abcXYZ'sStTmMdDlLrReEvV",
    "0123456789٠١²½Ⅻ",
    "äöüßÄÖÜéèñçø",
    "\u0301\u0303\u0308\u093c\u0942",
    "日本語中文한국어ひらがなカタカナ",
    "🦙🚀👍🏽\u200d❤️🇩🇪",
    ".,;:!?-_()[]{}<>/\\|\"#$%&*+=~^`@",
    "\U000e0001\U0010fffd\ue000\u0378\u0fff\ufffd\u200b\u2028\u2029",
    "<|im_start|><|im_end|><|endoftext|>[PAD151650]</s>",
)


def _random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 30)):
            pool = rng.choice(_POOLS)
            if rng.random() < 0.8:
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 4))))
            else:
                parts.append(pool[: rng.randint(1, len(pool))])
        out.append("".join(parts))
    return out


# ---------------------------------------------------------------------------
# unit tier: a synthetic model's vocabulary
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def synth_path(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("tok") / "m.gguf", "qwen3moe")


@pytest.fixture(scope="module")
def synth_tok(synth_path) -> Tokenizer:
    return Tokenizer.from_gguf(synth_path)


@pytest.fixture(scope="module")
def synth_meta(synth_path) -> dict:
    with GGUFModel.open(synth_path) as m:
        return dict(m.metadata)


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(extra)}}


# Qwen2's split regex restricted to ASCII text, where \p{L} is [A-Za-z], \p{N}
# is [0-9] and \s is ASCII whitespace: expressible with Python's re
_ASCII_QWEN2 = re.compile(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
    r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    re.ASCII,
)


def _reference_bpe(text: str, meta: dict) -> list[int]:
    """Slow, obvious byte-level BPE for ASCII text: split, map bytes to the
    GPT-2 alphabet, repeatedly merge the lowest-ranked adjacent pair."""
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
    b2u = _gpt2_bytes_to_unicode()
    ids = []
    for word in _ASCII_QWEN2.findall(text):
        syms = [b2u[b] for b in word.encode("utf-8")]
        while len(syms) > 1:
            best = min(range(len(syms) - 1), key=lambda i: (ranks.get((syms[i], syms[i + 1]), 1 << 60), i))
            if (syms[best], syms[best + 1]) not in ranks:
                break
            syms[best:best + 2] = [syms[best] + syms[best + 1]]
        ids.extend(vocab[s] for s in syms)
    return ids


def test_synth_metadata(synth_tok, synth_meta):
    tokens = synth_meta["tokenizer.ggml.tokens"]
    assert synth_tok.n_vocab == len(tokens)
    assert synth_tok.eos_id == synth_meta["tokenizer.ggml.eos_token_id"]
    assert synth_tok.bos_id == synth_meta["tokenizer.ggml.bos_token_id"]
    assert synth_tok.add_bos is bool(synth_meta.get("tokenizer.ggml.add_bos_token", False))
    assert synth_tok.chat_template == synth_meta["tokenizer.chat_template"]
    # <|endoftext|> (eos) and <|im_end|> end generation; <|im_start|> does not
    assert synth_tok.eog_ids == {tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")}
    assert synth_tok.eot_id == tokens.index("<|im_end|>")
    assert not synth_tok.is_eog(tokens.index("<|im_start|>"))


@pytest.mark.parametrize("text", [
    "The router picks the experts for every token.",
    "  leading spaces, trailing spaces   ",
    "Numbers 2048 and 512; it's, we'll, THEY'RE, I'M\n\n\tdone\r\n",
    "tabs\t\tand   runs   of    spaces\n   \n",
    "symbols: {a: [1, 2]} -> (x) !! ?? ... ~~~",
    "",
])
def test_bpe_matches_reference(synth_tok, synth_meta, text):
    assert synth_tok.encode(text) == _reference_bpe(text, synth_meta)


@pytest.mark.parametrize("text", [
    "Größe und Maßstäbe: Äpfel, Öl, süß.",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "🦙🚀👍🏽 👨\u200d👩\u200d👧 ❤️ 🇩🇪",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "\u00a0\u3000\u2009\x0b\x0c mixed\u0301 \U0010fffd",
])
def test_synth_round_trip(synth_tok, text):
    ids = synth_tok.encode(text)
    assert all(0 <= i < synth_tok.n_vocab for i in ids)
    assert synth_tok.decode(ids) == text
    assert synth_tok.decode_bytes(ids) == text.encode("utf-8")


def test_synth_special_tokens(synth_tok):
    tokens = synth_tok.tokens
    im_start, im_end, eot = (tokens.index(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    text = "<|im_start|>user\nHello there<|im_end|>\n<|endoftext|>"
    ids = synth_tok.encode(text, add_special=False, parse_special=True)
    assert ids[0] == im_start and ids[-1] == eot
    assert ids.count(im_end) == 1
    # the text between the specials is tokenized as plain text
    assert ids[1:ids.index(im_end)] == synth_tok.encode("user\nHello there", add_special=False)
    assert synth_tok.decode(ids, special=True) == text
    assert synth_tok.decode(ids) == "user\nHello there\n"  # control tokens hidden by default
    # without parse_special the marker texts are plain text
    plain = synth_tok.encode(text, add_special=False)
    assert not {im_start, im_end, eot} & set(plain)
    assert synth_tok.decode(plain) == text
    assert synth_tok.split_special(text, parse_special=True) == [im_start, "user\nHello there", im_end, "\n", eot]


def test_add_special_follows_metadata(synth_meta):
    meta = dict(synth_meta)
    meta["tokenizer.ggml.add_bos_token"] = True
    meta["tokenizer.ggml.add_eos_token"] = True
    meta["tokenizer.ggml.bos_token_id"] = 3
    tok = Tokenizer(meta)
    body = tok.encode("hi there", add_special=False)
    assert tok.encode("hi there") == [3, *body, tok.eos_id]
    assert tok.encode("") == [3, tok.eos_id]


def test_user_defined_tokens_always_match(synth_meta):
    types = list(synth_meta["tokenizer.ggml.token_type"])
    tokens = synth_meta["tokenizer.ggml.tokens"]
    im_start = tokens.index("<|im_start|>")
    types[im_start] = TokenType.USER_DEFINED
    tok = Tokenizer({**synth_meta, "tokenizer.ggml.token_type": types})
    assert tok.encode("a<|im_start|>b", add_special=False) == [*tok.encode("a", False), im_start, *tok.encode("b", False)]
    assert tok.decode([im_start]) == "<|im_start|>"  # user-defined tokens always render
    # a control-looking text is promoted to control whatever its stored type
    types[im_start] = TokenType.CONTROL
    types[tokens.index("<|im_end|>")] = TokenType.USER_DEFINED
    tok = Tokenizer({**synth_meta, "tokenizer.ggml.token_type": types})
    assert tok.token_types[tokens.index("<|im_end|>")] == TokenType.CONTROL
    assert tokens.index("<|im_end|>") not in tok.encode("x<|im_end|>", add_special=False)


def test_longest_special_wins(synth_meta):
    meta = dict(synth_meta)
    tokens = [*meta["tokenizer.ggml.tokens"], "<|a|>", "<|a|><|b|>"]
    types = [*meta["tokenizer.ggml.token_type"], TokenType.CONTROL, TokenType.CONTROL]
    tok = Tokenizer({**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    a, ab = len(tokens) - 2, len(tokens) - 1
    assert tok.split_special("x<|a|><|b|><|a|>y", parse_special=True) == ["x", ab, a, "y"]


def test_stream_decoder_split_utf8(synth_tok):
    text = "aß🦙日本語 e\u0301 👨\u200d👩\u200d👧!"
    ids = synth_tok.encode(text)
    stream = synth_tok.stream()
    outs = [stream.add(i) for i in ids]
    # the small vocabulary has no multi-byte merges: characters span tokens,
    # and a token ending inside a character yields nothing yet
    assert any(o == "" for o in outs)
    assert all("\ufffd" not in o for o in outs)
    assert "".join(outs) + stream.flush() == text
    pieces = [synth_tok.decode_token(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")


def test_stream_decoder_incomplete_and_invalid(synth_tok):
    llama = "🦙".encode("utf-8")
    ids = synth_tok.encode("🦙")
    assert len(ids) >= 2
    stream = StreamDecoder(synth_tok)
    assert [stream.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.flush() == "\ufffd"  # cut off mid-character
    assert stream.flush() == ""
    # a stray continuation byte is replaced at once, not held back
    byte_ids = {synth_tok.decode_token(i): i for i in range(synth_tok.n_vocab)}
    assert stream.add(byte_ids[llama[1:2]]) == "\ufffd"
    assert synth_tok.decode([byte_ids[llama[:1]]]) == "\ufffd"


def test_stream_decoder_random_splits(synth_tok):
    rng = random.Random(7)
    for text in _random_texts(3, 40):
        ids = synth_tok.encode(text, parse_special=rng.random() < 0.5)
        for special in (False, True):
            stream = synth_tok.stream(special=special)
            got = "".join(stream.add(i) for i in ids) + stream.flush()
            assert got == synth_tok.decode(ids, special=special)


def test_errors(synth_tok, synth_meta, tmp_path):
    with pytest.raises(FleError, match="out of range"):
        synth_tok.decode([0, synth_tok.n_vocab])
    with pytest.raises(FleError, match="out of range"):
        synth_tok.decode([-1])
    with pytest.raises(FleError, match="out of range"):
        synth_tok.stream().add(synth_tok.n_vocab)
    with pytest.raises(FleError, match="str"):
        synth_tok.encode(b"bytes")
    with pytest.raises(FleError, match="Unicode"):
        synth_tok.encode("lone \ud800 surrogate")
    with pytest.raises(FleError, match="tokenizer.ggml.pre"):
        Tokenizer({**synth_meta, "tokenizer.ggml.pre": "llama-bpe"})
    with pytest.raises(FleError, match="tokenizer.ggml.model"):
        Tokenizer({**synth_meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(FleError, match="merges"):
        Tokenizer({**synth_meta, "tokenizer.ggml.merges": ["a b", "nospace"]})
    with pytest.raises(FleError, match="merges"):
        Tokenizer({**synth_meta, "tokenizer.ggml.merges": ["zzzq qqqz"]})
    with pytest.raises(FleError, match="duplicate"):
        Tokenizer({**synth_meta, "tokenizer.ggml.tokens": ["a", "a", *synth_meta["tokenizer.ggml.tokens"][2:]]})
    with pytest.raises(FleError, match="no such file"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")


# ---------------------------------------------------------------------------
# unit tier: chat templates
# ---------------------------------------------------------------------------

def test_chat_environment():
    assert apply_chat_template("{{ x | tojson }}", [], x={"k": "ü<&>'"}) == '{"k": "ü<&>\'"}'
    assert apply_chat_template("{{ x | tojson(indent=2) }}", [], x=[1]) == "[\n  1\n]"
    assert apply_chat_template("{% generation %}a{% endgeneration %}b", []) == "ab"
    assert apply_chat_template("{% for i in [1,2,3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", []) == "1"
    assert apply_chat_template("{{ enable_thinking }}", []) == "True"  # llama.cpp's default
    assert apply_chat_template("{{ enable_thinking is defined }}", [], enable_thinking=None) == "False"
    assert apply_chat_template("{{ enable_thinking }}", [], enable_thinking=False) == "False"
    assert apply_chat_template("{{ tools is none }}{{ add_generation_prompt }}", [], False) == "TrueFalse"
    assert len(apply_chat_template("{{ strftime_now('%Y-%m-%d') }}", [])) == 10
    # trim_blocks / lstrip_blocks
    assert apply_chat_template("  {% if true %}\nx\n  {% endif %}\n", []) == "x\n"
    with pytest.raises(FleError, match="no user"):
        apply_chat_template("{{ raise_exception('no user message') }}", [])
    with pytest.raises(FleError, match="syntax error"):
        apply_chat_template("{% if %}", [])
    with pytest.raises(FleError, match="chat template"):
        apply_chat_template("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}])
    with pytest.raises(FleError, match="empty"):
        apply_chat_template("", [])
    # the sandbox refuses to reach Python internals
    with pytest.raises(FleError, match="unsafe"):
        apply_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])


def test_render_prompt_synth(synth_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü"}]
    prompt = render_prompt(synth_tok, messages)
    ids = synth_tok.encode(prompt, add_special=False, parse_special=True)
    im_start, im_end = synth_tok.tokens.index("<|im_start|>"), synth_tok.tokens.index("<|im_end|>")
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert synth_tok.decode(ids, special=True) == prompt
    for m in messages:
        assert m["content"] in prompt


# ---------------------------------------------------------------------------
# reference tier: llama.cpp's vocab tests and llama.cpp itself
# ---------------------------------------------------------------------------

VOCABS = ("qwen2", "qwen35")


def _read_vocab_tests(models: Path, name: str) -> list[tuple[str, list[int]]]:
    """Cases as llama.cpp's tests/test-tokenizer-0.cpp reads them: inputs
    separated by "\\n__ggml_vocab_test__\\n" (the file ends with one), one line
    of space-separated ids per input."""
    base = models / f"ggml-vocab-{name}.gguf"
    raw = (base.parent / (base.name + ".inp")).read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs = raw.split(sep)
    if inputs and inputs[-1] == "":
        inputs.pop()
    lines = (base.parent / (base.name + ".out")).read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines), f"{base}: .inp and .out disagree on the number of cases"
    return [(s, [int(t) for t in o.strip().split()]) for s, o in zip(inputs, lines)]


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request, llama_models):
    path = llama_models / f"ggml-vocab-{request.param}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not in this llama.cpp checkout")
    return request.param, path, Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def llama_vocab(vocab):
    llama_cpp = pytest.importorskip("llama_cpp")
    name, path, tok = vocab
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return llama_cpp, llm, tok


@pytest.mark.reference
def test_vocab_expected_outputs(vocab, llama_models):
    name, path, tok = vocab
    cases = _read_vocab_tests(llama_models, name)
    assert len(cases) > 30
    failures = []
    for text, expected in cases:
        got = tok.encode(text, add_special=False, parse_special=False)
        if got != expected:
            failures.append((text, expected, got))
        assert tok.decode(got) == text
    assert not failures, f"{name}: {len(failures)} of {len(cases)} cases differ, first: {failures[0]!r}"


@pytest.mark.reference
def test_matches_llama_cpp_mixed_text(llama_vocab):
    _, llm, tok = llama_vocab
    for parse_special in (False, True):
        ref = llm.tokenize(MIXED_TEXT.encode("utf-8"), add_bos=False, special=parse_special)
        assert tok.encode(MIXED_TEXT, add_special=False, parse_special=parse_special) == ref
    ids = tok.encode(MIXED_TEXT, add_special=False)
    assert tok.decode(ids) == MIXED_TEXT
    assert tok.decode_bytes(ids) == llm.detokenize(ids)
    # with add_special llama.cpp adds what the vocabulary asks for, as we do
    assert tok.encode(MIXED_TEXT) == llm.tokenize(MIXED_TEXT.encode("utf-8"), add_bos=True, special=False)


@pytest.mark.reference
def test_matches_llama_cpp_random_text(llama_vocab):
    _, llm, tok = llama_vocab
    rng = random.Random(11)
    for text in _random_texts(5, 400):
        parse_special = rng.random() < 0.5
        ref = llm.tokenize(text.encode("utf-8"), add_bos=False, special=parse_special)
        got = tok.encode(text, add_special=False, parse_special=parse_special)
        assert got == ref, f"{text!r} (parse_special={parse_special})"
        assert tok.decode_bytes(got, special=parse_special) == llm.detokenize(got, special=parse_special)


@pytest.mark.reference
def test_pieces_and_specials_match_llama_cpp(llama_vocab):
    llama_cpp, llm, tok = llama_vocab
    v = llm._model.vocab
    assert tok.n_vocab == llama_cpp.llama_vocab_n_tokens(v)
    assert tok.bos_id == llama_cpp.llama_vocab_bos(v)
    assert tok.eos_id == llama_cpp.llama_vocab_eos(v)
    buf = ctypes.create_string_buffer(512)
    for special in (False, True):
        for i in range(tok.n_vocab):
            n = llama_cpp.llama_token_to_piece(v, i, buf, len(buf), 0, special)
            assert buf.raw[:n] == tok.decode_token(i, special), (i, special)
    eog = {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(v, i)}
    assert tok.eog_ids == eog
    control = {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_control(v, i)}
    assert control == {i for i, t in enumerate(tok.token_types) if t == TokenType.CONTROL}


# ---------------------------------------------------------------------------
# reference tier: chat templates
# ---------------------------------------------------------------------------

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

CONVERSATIONS = {
    "system_user": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Wie groß ist der Kölner Dom? 🏰"},
    ], None),
    "multi_turn": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
        {"role": "user", "content": "And 日本 in English?"},
    ], None),
    "user_only": ([{"role": "user", "content": "Hello"}], None),
    "tool_call": ([
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in München?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "München", "unit": "celsius"}},
        }]},
        {"role": "tool", "content": '{"temp": 21, "sky": "klar"}'},
    ], [_WEATHER_TOOL]),
}

# conversations whose rendering by these templates is plain ChatML, so that
# llama.cpp's built-in (C++) ChatML formatter must give the same text
CHATML_PLAIN = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("system_user", "multi_turn"),
    "Qwen-Qwen3-0.6B.jinja": ("system_user",),
    "Qwen3-Coder.jinja": ("system_user", "multi_turn"),
}


def _qwen_templates(models: Path) -> list[Path]:
    found = sorted((models / "templates").glob("*Qwen*.jinja"))
    if not found:
        pytest.skip(f"no Qwen templates under {models / 'templates'}")
    return found


@pytest.mark.reference
def test_qwen_templates_present(llama_models):
    names = {p.name for p in _qwen_templates(llama_models)}
    assert {"Qwen-Qwen3-0.6B.jinja", "Qwen3-Coder.jinja", "Qwen3.5-4B.jinja"} <= names


@pytest.fixture(scope="module")
def qwen_bos_eos(llama_models) -> tuple[str, str]:
    """BOS/EOS token texts of the Qwen vocabulary, as templates receive them."""
    with GGUFModel.open(llama_models / "ggml-vocab-qwen2.gguf") as m:
        tokens = m.metadata["tokenizer.ggml.tokens"]
        return tokens[m.metadata["tokenizer.ggml.bos_token_id"]], tokens[m.metadata["tokenizer.ggml.eos_token_id"]]


@pytest.mark.reference
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_templates_match_llama_cpp_python(llama_models, qwen_bos_eos, conversation):
    chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    messages, tools = CONVERSATIONS[conversation]
    bos, eos = qwen_bos_eos
    for path in _qwen_templates(llama_models):
        template = path.read_text(encoding="utf-8")
        for gen in (True, False):
            formatter = chat_format.Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos,
                                                        add_generation_prompt=gen)
            for thinking in (None, False, True):
                # llama-cpp-python's formatter leaves an unset value undefined: FLE's None
                extra = {} if thinking is None else {"enable_thinking": thinking}
                ref = formatter(messages=messages, tools=tools, **extra).prompt
                got = apply_chat_template(template, messages, gen, tools=tools, bos_token=bos, eos_token=eos,
                                          enable_thinking=thinking)
                assert got == ref, f"{path.name} {conversation} gen={gen} thinking={thinking}"
                for m in messages:
                    if m["role"] in ("system", "user") and m["content"]:
                        assert m["content"] in got


@pytest.mark.reference
def test_template_refusal_matches_llama_cpp_python(llama_models):
    chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    path = llama_models / "templates" / "Qwen3.5-4B.jinja"
    if not path.is_file():
        pytest.skip(f"{path} not in this llama.cpp checkout")
    template = path.read_text(encoding="utf-8")
    messages = [{"role": "system", "content": "A system prompt and nothing else."}]
    with pytest.raises(ValueError, match="No user query") as ref:
        chat_format.Jinja2ChatFormatter(template, eos_token="", bos_token="")(messages=messages)
    with pytest.raises(FleError) as got:
        apply_chat_template(template, messages)
    assert str(ref.value) in str(got.value)


@pytest.mark.reference
def test_templates_tokenize_like_llama_cpp(llama_vocab, llama_models):
    _, llm, tok = llama_vocab
    for path in _qwen_templates(llama_models):
        template = path.read_text(encoding="utf-8")
        for conversation in ("multi_turn", "tool_call"):
            messages, tools = CONVERSATIONS[conversation]
            try:
                prompt = apply_chat_template(template, messages, tools=tools)
            except FleError:
                continue
            ref = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
            assert tok.encode(prompt, add_special=False, parse_special=True) == ref, path.name


@pytest.mark.reference
@pytest.mark.parametrize("template_name", sorted(CHATML_PLAIN))
def test_templates_match_llama_cpp_chatml(llama_models, template_name):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = llama_models / "templates" / template_name
    if not path.is_file():
        pytest.skip(f"{path} not in this llama.cpp checkout")
    template = path.read_text(encoding="utf-8")
    for conversation in CHATML_PLAIN[template_name]:
        messages, _ = CONVERSATIONS[conversation]
        keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
        chat = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(keep), True, buf, len(buf))
        assert 0 < n < len(buf)
        ref = buf.raw[:n].decode("utf-8")
        assert apply_chat_template(template, messages, True) == ref, f"{template_name} {conversation}"

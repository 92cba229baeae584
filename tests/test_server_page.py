"""The chat page at ``/``: served as HTML from package data, self-contained,
and its JS asks for what the server really provides. The page keeps the
endpoints and the event fields it reads in one JSON block (``#fle-api``)
that its script reads; the test parses the HTML, checks that the script
takes every path from that block, then sends the page's request to the
server (a scripted model that reasons, then answers) and finds each field
where the page looks for it."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from html.parser import HTMLParser

import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

import fle_engine  # noqa: E402
from fle_engine.server import create_app  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_server import THINKING_TEMPLATE, chat_engine, events  # noqa: E402


@pytest.fixture(scope="module")
def engine(model_path):
    eng, _ = chat_engine(fle_engine.load(model_path), model_path, "Let me add.\n</think>\n\nIt is 4.",
                         THINKING_TEMPLATE)
    return eng


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.scripts: list[tuple[dict, str]] = []
        self.tags: list[tuple[str, dict]] = []
        self.ids: set[str] = set()
        self._in: dict | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "script":
            self._in = a
            self.scripts.append((a, ""))

    def handle_endtag(self, tag):
        if tag == "script":
            self._in = None

    def handle_data(self, data):
        if self._in is not None:
            a, text = self.scripts[-1]
            self.scripts[-1] = (a, text + data)


def pick(obj, path):
    for k in path.split("."):
        if obj is None:
            return None
        obj = obj[int(k)] if k.isdigit() and isinstance(obj, list) and int(k) < len(obj) else \
            obj.get(k) if isinstance(obj, dict) else None
    return obj


def call(engine, fn, **kw):
    async def main():
        async with TestClient(TestServer(create_app(engine, **kw))) as client:
            return await fn(client)
    return asyncio.run(main())


def get_page(engine, **kw):
    async def fn(client):
        r = await client.get("/")
        return r.status, r.headers["Content-Type"], await r.text()
    return call(engine, fn, **kw)


def test_page_is_served_as_self_contained_html(engine):
    status, ctype, html = get_page(engine)
    assert status == 200 and ctype == "text/html; charset=utf-8"
    assert html.lstrip().lower().startswith("<!doctype html>")
    p = Page()
    p.feed(html)
    p.close()
    # no external resources: no fetched scripts, styles, images, frames or fonts
    for tag, a in p.tags:
        assert "src" not in a, (tag, a)
        assert tag != "link" or a.get("rel") not in ("stylesheet", "preload", "icon"), (tag, a)
        assert not a.get("href", "").startswith(("http", "//")), (tag, a)
    assert "http://" not in html and "https://" not in html and "@import" not in html and "url(" not in html
    # open without the API key (the page asks for it); the API behind it is not
    status, _, _ = get_page(engine, api_key="k")
    assert status == 200


def test_page_js_uses_what_the_server_provides(engine):
    _, _, html = get_page(engine)
    p = Page()
    p.feed(html)
    (blocks, codes) = ([t for a, t in p.scripts if a.get("type") == "application/json"],
                       [t for a, t in p.scripts if "type" not in a])
    assert len(blocks) == 1 and len(codes) == 1
    api, js = json.loads(blocks[0]), codes[0]
    assert 'JSON.parse(document.getElementById("fle-api").textContent)' in js
    # every endpoint and field comes from the block; nothing is hard-coded beside it
    assert not re.search(r"""["'`]/(v1|completion|slots|props)""", js)
    for key in ("chat", "models", "model_id"):
        assert f"API.{key}" in js, key
    for key in api["events"]:
        assert f"API.events.{key}" in js, key
    assert "fetch(API.chat" in js and "fetch(API.models" in js and '"[DONE]"' in js
    # the elements the script looks up exist
    for el in set(re.findall(r"""\$\("([\w-]+)"\)""", js)):
        assert el in p.ids, el
    # the request body the page builds has the fields it declares, and no others
    body_js = re.search(r"const body = \{(.*?)\n  \};", js, re.S).group(1)
    assert sorted(re.findall(r"^\s*(\w+)", body_js, re.M)) == sorted(api["request"])

    ev = api["events"]

    async def fn(client):
        models = await (await client.get(api["models"])).json()
        mid = pick(models, api["model_id"])
        body = {"model": mid, "messages": [{"role": "user", "content": "2+2?"}], "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": 64, "temperature": 0.8}
        assert sorted(body) == sorted(api["request"])
        r = await client.post(api["chat"], json=body)
        raw = await r.read()
        bad = await client.post(api["chat"], json={**body, "messages": []})
        return mid, r.status, r.headers["Content-Type"], raw, bad.status, await bad.json()

    mid, status, ctype, raw, bad_status, bad = call(engine, fn)
    assert mid == engine.name
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    evs = events(ctype, raw)
    # what the page shows, read the way the page reads it
    reasoning = "".join(pick(e, ev["reasoning"]) or "" for e in evs)
    content = "".join(pick(e, ev["content"]) or "" for e in evs)
    assert reasoning == "Let me add." and content == "It is 4."
    assert [pick(e, ev["finish"]) for e in evs if pick(e, ev["finish"])] == ["stop"]
    assert any(isinstance(pick(e, ev["tokens"]), int) for e in evs)
    assert any(isinstance(pick(e, ev["speed"]), (int, float)) for e in evs)
    assert not any(pick(e, ev["error"]) for e in evs)
    # an error answer: the page shows its message
    assert bad_status == 400 and isinstance(pick(bad, ev["error"]), str) and pick(bad, ev["error"])



# ---------------------------------------------------------------- the page's script, run


SHIM = r"""
const __realFetch = globalThis.fetch;
globalThis.fetch = (u, o) => __realFetch(__BASE + u, o);
class __El {
  constructor(tag, id) {
    Object.assign(this, { tagName: tag, id: id || "", children: [], _text: "", value: "", className: "",
                          hidden: false, open: false, disabled: false, handlers: {}, scrollTop: 0, scrollHeight: 0 });
  }
  get textContent() { return this._text + this.children.map((c) => c.textContent).join(""); }
  set textContent(v) { this._text = String(v); this.children = []; }
  appendChild(c) { this.children.push(c); return c; }
  append(...cs) { this.children.push(...cs); }
  addEventListener(type, fn) { this.handlers[type] = fn; }
  requestSubmit() { this.handlers.submit({ preventDefault() {} }); }
  dump() { return { tag: this.tagName, cls: this.className, hidden: this.hidden, text: this.textContent,
                    children: this.children.map((c) => c.dump()) }; }
}
const __els = {};
for (const id of __IDS) __els[id] = new __El("x", id);
__els["fle-api"]._text = __API;
Object.assign(__els.max_tokens, { value: "64" });
Object.assign(__els.temperature, { value: "0" });
globalThis.document = {
  getElementById(id) { if (!(id in __els)) throw new Error("no element " + id); return __els[id]; },
  createElement(tag) { return new __El(tag); },
};
"""

DRIVER = r"""
const __sleep = (ms) => new Promise((r) => setTimeout(r, ms));
(async () => {
  const out = {};
  await __sleep(300);
  out.model = __els.model.textContent;
  for (const [i, text] of ["2+2?", "and 3+3?"].entries()) {
    __els.input.value = text;
    __els.input.handlers.keydown({ key: "Enter", shiftKey: false, preventDefault() {} });
    for (let n = 0; n < 400 && turns.length < 2 * (i + 1); n++) await __sleep(25);
  }
  out.turns = turns;
  out.log = __els.log.dump();
  out.send_disabled = __els.send.disabled;
  process.stdout.write(JSON.stringify(out));
})();
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="no node to run the page's script")
def test_page_script_runs_a_chat_in_node(engine, tmp_path):
    """The page's script itself, in node with a small DOM stand-in, against
    the server: two turns typed in, streamed, reasoning shown apart."""
    _, _, html = get_page(engine)
    p = Page()
    p.feed(html)
    api = [t for a, t in p.scripts if a.get("type") == "application/json"][0]
    js = [t for a, t in p.scripts if "type" not in a][0]

    async def fn(client):
        base = str(client.make_url("")).rstrip("/")
        script = tmp_path / "page.js"
        script.write_text(f"const __BASE = {json.dumps(base)};\nconst __API = {json.dumps(api)};\n"
                          f"const __IDS = {json.dumps(sorted(p.ids))};\n" + SHIM + js + DRIVER)
        proc = await asyncio.create_subprocess_exec("node", str(script), stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        return json.loads(out)

    out = call(engine, fn)
    assert out["model"] == engine.name and out["send_disabled"] is False
    assert out["turns"] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4."},
                            {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "It is 4."}]
    msgs = out["log"]["children"]
    assert [m["cls"] for m in msgs] == ["msg user", "msg assistant"] * 2
    for m in msgs[1::2]:
        parts = {c["cls"]: c for c in m["children"]}
        assert parts["reasoning"]["hidden"] is False
        assert parts["reasoning"]["children"][1]["text"] == "Let me add."
        assert parts["content"]["text"] == "It is 4."
        assert parts["stats"]["text"].startswith("stop · ") and " tokens" in parts["stats"]["text"]
        assert "error" not in parts


# ---------------------------------------------------------------- in a real browser


async def _launch(pw):
    """Playwright's own Chromium, else a system one (chromium-headless-shell,
    chromium); None when there is none."""
    try:
        return await pw.chromium.launch()
    except Exception:  # noqa: BLE001 - no browser of playwright's own
        pass
    for name in ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome"):
        exe = shutil.which(name)
        if exe:
            try:
                return await pw.chromium.launch(executable_path=exe)
            except Exception:  # noqa: BLE001 - try the next one
                continue
    return None


_WATCH = """() => {
  window.__seen = [];
  new MutationObserver(() => {
    const m = document.querySelectorAll('.msg.assistant');
    if (!m.length) return;
    const last = m[m.length - 1];
    window.__seen.push([last.querySelector('.reasoning .text').textContent,
                        last.querySelector('.content').textContent]);
  }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
}"""


def test_page_in_headless_chromium(model_path):
    """The page in headless Chromium against a served scripted model that
    reasons, then answers (a token every 30 ms): a message typed and sent
    comes back streamed (the text grows in several steps), the reasoning in
    its own block apart from the answer. Skipped without playwright or a
    Chromium."""
    pw_api = pytest.importorskip("playwright.async_api")
    eng, _ = chat_engine(fle_engine.load(model_path), model_path, "Let me add.\n</think>\n\nIt is 4.",
                         THINKING_TEMPLATE, delay=0.03)

    async def fn(client):
        base = str(client.make_url("/"))
        async with pw_api.async_playwright() as pw:
            browser = await _launch(pw)
            if browser is None:
                return None
            try:
                page = await browser.new_page()
                await page.goto(base)
                await page.wait_for_function("document.getElementById('model').textContent.length > 0")
                model = await page.text_content("#model")
                await page.evaluate(_WATCH)
                await page.fill("#input", "2+2?")
                await page.click("#send")
                await page.wait_for_function(
                    "() => { const c = document.querySelectorAll('.msg.assistant .content');"
                    " return c.length && c[c.length - 1].textContent === 'It is 4.'"
                    " && !document.getElementById('send').disabled; }", timeout=60000)
                got = await page.evaluate(
                    "() => { const m = document.querySelector('.msg.assistant');"
                    " const r = m.querySelector('.reasoning');"
                    " return {reasoning: m.querySelector('.reasoning .text').textContent,"
                    " hidden: r.hidden, content: m.querySelector('.content').textContent,"
                    " user: document.querySelector('.msg.user .content').textContent,"
                    " seen: window.__seen}; }")
                return model, got
            finally:
                await browser.close()

    out = call(eng, fn)
    if out is None:
        pytest.skip("no Chromium for playwright (python -m playwright install chromium, or a system chromium)")
    model, got = out
    assert model == eng.name
    assert got["user"] == "2+2?"
    assert got["reasoning"] == "Let me add." and got["hidden"] is False
    assert got["content"] == "It is 4."                  # the reasoning is not in the answer
    contents = [c for _, c in got["seen"]]
    reasonings = [r for r, _ in got["seen"]]
    assert len({c for c in contents if c}) >= 3, contents   # the answer grew piece by piece
    assert all("It is 4.".startswith(c) for c in contents)
    assert len({r for r in reasonings if r}) >= 3, reasonings
    assert all("Let me add.".startswith(r) for r in reasonings)

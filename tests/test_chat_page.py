"""The browser chat page at `GET /` (frontend/http/chat_page.py, static/chat.html): served as HTML by the
app, found as package data, self-contained, calling only routes the app serves; and its stream reader (the
page's `// <sse>` block) run in node on streams the app itself wrote (cut into chunks mid-line and
mid-character, the reasoning split out, `[DONE]`, an engine fault's error event), and on a hand-written one
(CRLF lines, comments, a multi-line data field); its markdown renderer (the `// <markdown>` block) in node
on a stand-in DOM: elements and text nodes only, so HTML in a reply stays text and only http(s) and mailto
links are made. tests/test_chat_browser.py runs the page in a real browser."""
from __future__ import annotations

import ast
import asyncio
import base64
import fnmatch
import json
import re
import shutil
import subprocess
from importlib.resources import files
from pathlib import Path

import httpx2
import pytest

from tandem.frontend.http.chat_page import PAGE, page_html
from tandem.protocol.errors import RequestFailedError
from tests.scripted_engine import KEY, NAME, Reply, scripted_app

REPO = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": f"Bearer {KEY}"}
THOUGHT, ANSWER = "They greet me.\nI greet back.", "Hello, wörld 世界 🙂!"
NODE = shutil.which("node")


@pytest.fixture(scope="module")
def app(tiny_model):
    return scripted_app(tiny_model("qwen3"), "qwen3")


def _request(app, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    async def go():
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://page") as http:
            return await http.request(method, path, json=body, headers=headers)

    return asyncio.run(go())


def test_get_root_serves_the_page_without_a_key(app) -> None:
    _, app = app
    r = _request(app, "GET", "/")  # no Authorization: the page is public, the API behind it is not
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/html")
    assert r.text == page_html() and "<title>tandem chat</title>" in r.text
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert _request(app, "HEAD", "/").status_code == 200  # ollama's clients probe a server so
    assert _request(app, "GET", "/v1/models").status_code == 401
    # Not an API operation: the OpenAPI document (and the fuzzer that reads it) leaves it out.
    assert "/" not in _request(app, "GET", "/openapi.json", headers=AUTH).json()["paths"]


def test_the_page_calls_only_routes_the_app_serves(app) -> None:
    _, app = app
    html = page_html()
    called = set(re.findall(r"""["'`](/v1/[^"'`?]*)""", html))
    assert called == {"/v1/models", "/v1/chat/completions"}, called
    served = {(r.path, m) for r in app.routes for m in getattr(r, "methods", None) or ()}
    assert ("/v1/models", "GET") in served and ("/v1/chat/completions", "POST") in served
    assert "fetch(\"/v1/chat/completions\", {\n      method: \"POST\"" in html


def test_the_page_is_self_contained_and_writes_text_only() -> None:
    html = page_html()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "a resource from elsewhere"
    assert not re.search(r"@import|url\(", html)
    assert "innerHTML" not in html and "outerHTML" not in html and "insertAdjacentHTML" not in html
    assert "document.write" not in html and "eval(" not in html
    for what in ("AbortController", "localStorage", "Authorization", "reasoning_content", "error.message",
                 "getReader", "shiftKey"):
        assert what in html, what


def test_the_page_is_package_data() -> None:
    page = files("tandem.frontend.http").joinpath(PAGE)
    assert page.is_file() and page.read_text(encoding="utf-8") == page_html()
    # setup.py ships it in the wheel (tests/test_packaging.py installs one; this is the fast check)
    tree = ast.parse((REPO / "setup.py").read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"]
    (data,) = [ast.literal_eval(k.value) for k in call.keywords if k.arg == "package_data"]
    assert any(fnmatch.fnmatch(PAGE, pat) for pat in data["tandem.frontend.http"]), data


def _stream(app, engine, reply: Reply) -> bytes:
    engine.script(reply)
    body = {"model": NAME, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}
    r = _request(app, "POST", "/v1/chat/completions", body, AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    return r.content


# Feeds each stream to the page's readEvents in chunks of each size (1 byte cuts every line and every
# multi-byte character), collecting chatEvent() of every event; then once more with an onEvent that throws
# at the error event, as the page's does: readEvents must reject and cancel the body.
HARNESS = r"""
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
function body(bytes, size, onCancel) {
  let at = 0;
  return new ReadableStream({
    pull(c) { if (at >= bytes.length) { c.close(); return; } c.enqueue(bytes.slice(at, at + size)); at += size; },
    cancel() { onCancel(); },
  }, {highWaterMark: 0});
}
(async () => {
  const out = {};
  for (const [name, b64] of Object.entries(input.streams)) {
    const bytes = new Uint8Array(Buffer.from(b64, "base64"));
    const runs = [];
    for (const size of input.sizes) {
      const events = [];
      await readEvents(body(bytes, size, () => {}), (ev) => events.push([ev.event, chatEvent(ev.data)]));
      runs.push(events);
    }
    let cancelled = false, thrown = null;
    try {
      await readEvents(body(bytes, 5, () => { cancelled = true; }), (ev) => {
        const e = chatEvent(ev.data);
        if (e.error) throw new Error(e.error);
      });
    } catch (e) { thrown = e.message; }
    out[name] = {runs, thrown, cancelled};
  }
  out.errorText = [
    errorText(401, "Unauthorized", JSON.stringify({error: {message: "Incorrect API key provided."}})),
    errorText(502, "Bad Gateway", "<html>proxy</html>"),
    errorText(500, "", ""),
  ];
  process.stdout.write(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed (the page's script runs in a browser)")
def test_the_whole_script_compiles_in_node() -> None:
    (script,) = re.findall(r"<script>(.*?)</script>", page_html(), re.S)
    check = "new (require('vm').Script)(require('fs').readFileSync(0, 'utf8'), {filename: 'chat.html'})"
    r = subprocess.run([NODE, "-e", check], input=script, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _sse_block() -> str:
    html = page_html()
    start, end = html.index("// <sse>"), html.index("// </sse>")
    return html[start:end]


def _run_node(streams: dict[str, bytes], sizes: list[int]) -> dict:
    src = {"streams": {k: base64.b64encode(v).decode() for k, v in streams.items()}, "sizes": sizes}
    r = subprocess.run([NODE, "-e", _sse_block() + HARNESS], input=json.dumps(src), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(NODE is None, reason="node is not installed (the page's script runs in a browser)")
def test_the_page_reads_the_servers_streams_in_node(app) -> None:
    engine, app = app
    text = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    reply = _stream(app, engine, Reply([text[i:i + 4] for i in range(0, len(text), 4)]))
    fault = _stream(app, engine, Reply(["Hel", "lo"], fault=RequestFailedError("the worker died",
                                                                                "request_failed.internal")))
    # By hand: CRLF and lone-CR line ends, a comment, an event name, a data field over two lines, and an
    # event the stream ends before finishing (dropped, as the SSE spec says).
    chunk = {"choices": [{"delta": {"content": "a\nb"}, "finish_reason": None}]}
    lines = json.dumps(chunk, indent=1).splitlines()
    by_hand = (": keep-alive\r\n\r\nevent: chunk\r\ndata: " + "\rdata: ".join(lines) + "\r\n\r\n"
               + 'data: {"choices": [{"delta": {"content": "c"}, "finish_reason": "stop"}]}\n\n'
               + "data: [DONE]\n\ndata: {\"choices\": [").encode()
    sizes = [1, 2, 3, 7, 64, 1 << 20]
    out = _run_node({"reply": reply, "fault": fault, "by_hand": by_hand}, sizes)

    runs = out["reply"]["runs"]
    assert all(r == runs[-1] for r in runs), "the chunking changed what was read"
    events = [e for _, e in runs[0]]
    assert events[-1] == {"done": True}
    assert "".join(e.get("reasoning", "") for e in events).strip() == THOUGHT
    assert "".join(e.get("content", "") for e in events).strip() == ANSWER
    assert [e["finish"] for e in events if e.get("finish")] == ["stop"]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] >= 1
    assert out["reply"]["thrown"] is None and not out["reply"]["cancelled"]

    runs = out["fault"]["runs"]
    assert all(r == runs[-1] for r in runs)
    events = [e for _, e in runs[0]]
    assert "".join(e.get("content", "") for e in events) == "Hello"
    assert [e["error"] for e in events if "error" in e] == ["the worker died"]
    assert out["fault"]["thrown"] == "the worker died" and out["fault"]["cancelled"]

    runs = out["by_hand"]["runs"]
    assert all(r == runs[-1] for r in runs)
    assert runs[0] == [
        ["chunk", {"content": "a\nb", "reasoning": "", "finish": None, "usage": None}],
        ["message", {"content": "c", "reasoning": "", "finish": "stop", "usage": None}],
        ["message", {"done": True}],
    ]
    assert out["errorText"] == ["Incorrect API key provided.", "HTTP 502 Bad Gateway: <html>proxy</html>",
                                "HTTP 500"]


# A small stand-in for the DOM (elements and text nodes, text only), requestAnimationFrame as a timer, and
# `outer(node)`: a node as HTML, its text escaped, so a test reads what the page built.
FAKE_DOM = r"""
class El {
  constructor(tag, id) {
    Object.assign(this, {tagName: tag, id, children: [], parent: null, className: "", _text: "", hidden: false,
                         open: false, disabled: false, listeners: {}, attrs: {}, scrollTop: 0, scrollHeight: 0,
                         clientHeight: 0, _value: ""});
    const self = this;
    this.classList = {
      add(c) { if (!self.classList.contains(c)) self.className = (self.className + " " + c).trim(); },
      remove(c) { self.className = self.className.split(" ").filter((x) => x !== c).join(" "); },
      contains(c) { return self.className.split(" ").includes(c); },
      toggle(c) { const on = !self.classList.contains(c); on ? self.classList.add(c) : self.classList.remove(c); return on; },
    };
  }
  get value() { return this.tagName === "select" ? (this._value || (this.children[0] || {}).value || "") : this._value; }
  set value(v) { this._value = v; }
  get textContent() { return this._text + this.children.map((c) => c.textContent).join(""); }
  set textContent(v) { this._text = String(v); this.children = []; }
  append(...els) { for (const e of els) { e.parent = this; this.children.push(e); } }
  replaceChildren(...els) { this.children = []; this._text = ""; this._value = ""; this.append(...els); }
  remove() { this.parent.children = this.parent.children.filter((c) => c !== this); }
  all() { return [this, ...this.children.flatMap((c) => c.all())]; }
  querySelector(sel) { return this.all().slice(1).find((e) => e.classList.contains(sel.slice(1))) || null; }
  addEventListener(type, f) { (this.listeners[type] = this.listeners[type] || []).push(f); }
  fire(type, extra) {
    const ev = Object.assign({currentTarget: this, defaultPrevented: false}, extra || {});
    ev.preventDefault = () => { ev.defaultPrevented = true; };
    for (const f of this.listeners[type] || []) f(ev);
    return ev;
  }
  setAttribute(k, v) { this.attrs[k] = v; }
  focus() {}
}
function text(t) { const n = new El("#text"); n._text = String(t); return n; }
const esc = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
function outer(n) {
  if (n.tagName === "#text") return esc(n._text);
  const attrs = (n.className ? ` class="${n.className}"` : "") +
    Object.entries(n.attrs).map(([k, v]) => ` ${k}="${esc(v).replace(/"/g, "&quot;")}"`).join("");
  if (n.tagName === "br" || n.tagName === "hr") return `<${n.tagName}${attrs}>`;
  return `<${n.tagName}${attrs}>${esc(n._text)}${n.children.map(outer).join("")}</${n.tagName}>`;
}
globalThis.requestAnimationFrame = (f) => setTimeout(f, 0);
globalThis.cancelAnimationFrame = (id) => clearTimeout(id);
"""

# The page's own script on that DOM (elements by id), with a scripted fetch: each chat request's reply is a
# list of steps (an event's data to send, "hang" to wait for Stop, or an HTTP error), and what the page sent
# and shows is checked.
PAGE_HARNESS = FAKE_DOM + r"""
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const byId = {};
for (const [, tag, id] of input.html.matchAll(/<(\w+)[^>]*\bid="([^"]+)"/g)) byId[id] = new El(tag, id);
const document = {getElementById: (id) => byId[id], createElement: (tag) => new El(tag), createTextNode: text};
const store = {"tandem.chat.apiKey": "sk-page", "tandem.chat.system": "Be brief.", "tandem.chat.maxTokens": "7"};
const localStorage = {getItem: (k) => (k in store ? store[k] : null), setItem: (k, v) => { store[k] = String(v); }};
const requests = [];
let replies = [];
const tick = () => new Promise((r) => setTimeout(r, 0));
async function fetch(url, opts) {
  opts = opts || {};
  requests.push({url, headers: opts.headers || {}, body: opts.body ? JSON.parse(opts.body) : null});
  if (url === "/v1/models") {
    return new Response(JSON.stringify({data: [{id: "tiny"}, {id: "other", state: "unloaded"}]}), {status: 200});
  }
  const steps = replies.shift();
  if (steps.status) return new Response(JSON.stringify(steps.body), {status: steps.status});
  const enc = new TextEncoder();
  return new Response(new ReadableStream({
    async start(c) {
      const abort = () => c.error(new DOMException("The user aborted a request.", "AbortError"));
      if (opts.signal) opts.signal.addEventListener("abort", abort);
      for (const step of steps) {
        await tick();
        if (step === "hang") return;  // until Stop
        c.enqueue(enc.encode(step === "[DONE]" ? "data: [DONE]\n\n" : "data: " + JSON.stringify(step) + "\n\n"));
      }
      c.close();
    },
  }), {status: 200, headers: {"Content-Type": "text/event-stream"}});
}
const delta = (content, reasoning) => ({choices: [{delta: reasoning ? {reasoning_content: reasoning} : {content}, finish_reason: null}]});
const view = () => byId.log.children.filter((c) => c.classList.contains("msg")).map((m) => {
  const [role, reasoning, content, error, meta] = m.children;
  return {role: role.textContent, reasoning: reasoning.hidden ? null : reasoning.children[1].textContent,
          content: content.textContent, error: error.hidden ? null : error.textContent,
          meta: meta.hidden ? null : meta.textContent, html: outer(content)};
});
const until = async (cond) => { for (let i = 0; i < 500 && !cond(); i++) await tick(); if (!cond()) throw new Error("timed out"); };
const page = new Function("document", "localStorage", "fetch", input.script + "\nreturn {messages: () => JSON.parse(JSON.stringify(messages)), busy: () => controller !== null};");
(async () => {
  const out = {};
  const api = page(document, localStorage, fetch);
  await until(() => byId.model.children.length === 2);
  out.models = {options: byId.model.children.map((o) => [o.value, o.textContent]), selected: byId.model.value,
                auth: requests[0].headers.Authorization};
  byId.model.value = "other";
  byId.model.fire("change");
  out.state = byId["model-state"].textContent;
  byId.model.value = "tiny";
  byId.model.fire("change");

  // A reply: reasoning apart, content streamed, usage; Shift+Enter does not send, Enter does.
  replies.push([delta(null, "Hmm."), delta("Hi"), delta(" there"), {choices: [], usage: {prompt_tokens: 5, completion_tokens: 3}}, "[DONE]"]);
  byId.input.value = "hello";
  out.shiftEnter = byId.input.fire("keydown", {key: "Enter", shiftKey: true}).defaultPrevented;
  out.requestsAfterShiftEnter = requests.length;
  byId.input.fire("keydown", {key: "Enter", shiftKey: false});
  await until(() => !api.busy());
  out.first = {request: requests[requests.length - 1], messages: api.messages(), view: view(), input: byId.input.value};

  // Stop while it streams: the partial reply stays in the conversation and the next turn carries it.
  replies.push([delta("Par"), delta("tial"), "hang"]);
  byId.input.value = "more";
  byId.send.fire("click");
  await until(() => view().length === 4 && view()[3].content === "Partial");
  out.stopEnabled = !byId.stop.disabled && byId.send.disabled;
  byId.stop.fire("click");
  await until(() => !api.busy());
  out.stopped = {messages: api.messages(), view: view().slice(-1)[0], stopDisabled: byId.stop.disabled};

  // An HTTP error before any text: shown in place, the turn leaves the conversation, its text back in the input.
  replies.push({status: 401, body: {error: {message: "Incorrect API key provided.", type: "authentication_error"}}});
  byId.input.value = "again";
  byId.send.fire("click");
  await until(() => !api.busy());
  out.httpError = {messages: api.messages().length, view: view().slice(-1)[0], input: byId.input.value};

  // An error event mid-stream: the text so far is kept, the error shown.
  replies.push([delta("Half"), {error: {message: "the worker died"}}, delta("never")]);
  byId.input.value = "last";
  byId.send.fire("click");
  await until(() => !api.busy());
  out.streamError = {messages: api.messages(), view: view().slice(-1)[0], request: requests[requests.length - 1].body};

  // Markdown as it streams (an open fence is an open code block); a user's text stays text.
  replies.push([delta("**Code**:\n```js\nlet a = '<i>'"), "hang"]);
  byId.input.value = "**not bold** <b>x</b>";
  byId.send.fire("click");
  await until(() => view().length > 0 && view().slice(-1)[0].html.includes("codeblock open"));
  out.markdown = {reply: view().slice(-1)[0].html, user: view().slice(-2)[0].html};
  byId.stop.fire("click");
  await until(() => !api.busy());

  // New chat while a reply streams: a fresh conversation, which the stopped reply does not join.
  replies.push([delta("Lost"), "hang"]);
  byId.input.value = "one more";
  byId.send.fire("click");
  await until(() => view().length > 0 && view().slice(-1)[0].content === "Lost");
  byId.clear.fire("click");
  await until(() => !api.busy());
  out.cleared = {messages: api.messages(), log: byId.log.textContent};
  process.stdout.write(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed (the page's script runs in a browser)")
def test_the_page_chats_stops_and_shows_errors_in_node() -> None:
    html = page_html()
    (script,) = re.findall(r"<script>(.*?)</script>", html, re.S)
    r = subprocess.run([NODE, "-e", PAGE_HARNESS], input=json.dumps({"html": html, "script": script}),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["models"] == {"options": [["tiny", "tiny"], ["other", "other (unloaded)"]], "selected": "tiny",
                             "auth": "Bearer sk-page"}
    assert out["state"] == "state: unloaded"
    assert out["shiftEnter"] is False and out["requestsAfterShiftEnter"] == 1

    first = out["first"]
    assert first["request"]["url"] == "/v1/chat/completions"
    assert first["request"]["headers"]["Authorization"] == "Bearer sk-page"
    body = first["request"]["body"]
    assert body["model"] == "tiny" and body["stream"] is True and body["max_tokens"] == 7
    assert "temperature" not in body  # left empty: the server's default
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    assert first["messages"] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi there"}]
    user, reply = first["view"]
    assert user["content"] == "hello" and user["role"] == "user"
    assert reply["reasoning"] == "Hmm." and reply["content"] == "Hi there" and reply["error"] is None
    assert "5 prompt + 3 tokens" in reply["meta"]
    assert first["input"] == ""

    assert out["stopEnabled"]
    stopped = out["stopped"]
    assert stopped["messages"][-2:] == [{"role": "user", "content": "more"},
                                        {"role": "assistant", "content": "Partial"}]
    assert stopped["view"]["content"] == "Partial" and "stopped" in stopped["view"]["meta"]
    assert stopped["stopDisabled"]

    err = out["httpError"]
    assert err["messages"] == 4 and err["view"]["error"] == "Incorrect API key provided."
    assert err["input"] == "again"

    streamed = out["streamError"]
    assert streamed["view"]["content"] == "Half" and streamed["view"]["error"] == "the worker died"
    assert streamed["messages"][-1] == {"role": "assistant", "content": "Half"}
    assert [m["content"] for m in streamed["request"]["messages"]] == [
        "Be brief.", "hello", "Hi there", "more", "Partial", "last"]

    assert out["markdown"] == {
        "reply": '<div class="content md cursor"><p><strong>Code</strong>:</p>'
                 + _code("js", "let a = '&lt;i&gt;'", closed=False) + "</div>",
        "user": '<div class="content">**not bold** &lt;b&gt;x&lt;/b&gt;</div>'}
    assert out["cleared"]["messages"] == [] and "Lost" not in out["cleared"]["log"]


def _code(lang: str, text: str, closed: bool = True) -> str:
    """A code block as the page builds it (text already escaped)."""
    cls = "codeblock" if closed else "codeblock open"
    code = f'<code class="language-{lang}">' if lang else "<code>"
    return (f'<div class="{cls}"><div class="codehead"><span class="lang">{lang or "code"}</span>'
            f'<button class="copy">Copy</button></div><pre>{code}{text}</code></pre></div>')


def _a(href: str, label: str) -> str:
    return f'<a href="{href}" target="_blank" rel="noopener noreferrer">{label}</a>'


# Renders each case with the page's `// <markdown>` block into a <div>, twice (a re-render replaces what was
# there, as the page does each frame of a streamed reply), and clicks the first code block's Copy.
MD_HARNESS = FAKE_DOM + r"""
const document = {createElement: (tag) => new El(tag), createTextNode: text};
const copied = [];
Object.defineProperty(globalThis, "navigator", {value: {clipboard: {writeText: async (t) => { copied.push(t); }}},
                                                configurable: true});
const cases = JSON.parse(require("fs").readFileSync(0, "utf8"));
const out = {html: [], tags: new Set(), copied, label: null};
for (const md of cases) {
  const div = new El("div");
  renderMarkdown("stale **text**", div);
  renderMarkdown(md, div);
  out.html.push(div.children.map(outer).join(""));
  for (const n of div.all()) out.tags.add(n.tagName);
}
(async () => {
  const div = new El("div");
  renderMarkdown(cases[0], div);
  const button = div.all().find((n) => n.classList.contains("copy"));
  button.fire("click");
  await new Promise((r) => setTimeout(r, 0));
  out.label = button.textContent;
  out.tags = [...out.tags];
  process.stdout.write(JSON.stringify(out), () => process.exit(0));  // not waiting for the label's reset
})().catch((e) => { console.error(e); process.exit(1); });
"""


def _markdown_block() -> str:
    html = page_html()
    start, end = html.index("// <markdown>"), html.index("// </markdown>")
    return html[start:end]


MD_CASES: list[tuple[str, str]] = [
    # a fence with a language, HTML inside it (and outside): text, never markup
    ('Here <b>is</b>:\n```html\n<script>alert("x")</script>\n  <b>&amp;</b>\n```\nAfter.',
     '<p>Here &lt;b&gt;is&lt;/b&gt;:</p>'
     + _code("html", '&lt;script&gt;alert("x")&lt;/script&gt;\n  &lt;b&gt;&amp;amp;&lt;/b&gt;')
     + "<p>After.</p>"),
    # a fence still streaming: an open code block, the line being written not yet a blank one
    ("Run:\n```python\nprint(1)\nfor x in y:\n",
     "<p>Run:</p>" + _code("python", "print(1)\nfor x in y:", closed=False)),
    ("```", _code("", "", closed=False)),
    ("~~~\nplain `ticks`\n~~~", _code("", "plain `ticks`")),
    # inline code holds * and ` as they are; emphasis outside it is rendered; a lone * is a character
    ("Use `a*b*c` and ``x ` y``, not *emphasis* or **strong**; 2 * 3 * 4, snake_case_name, \\*escaped\\*",
     "<p>Use <code>a*b*c</code> and <code>x ` y</code>, not <em>emphasis</em> or <strong>strong</strong>; "
     "2 * 3 * 4, snake_case_name, *escaped*</p>"),
    ("So **bold `code **`** and ***both*** and ~~gone~~ and **unclosed",
     "<p>So <strong>bold <code>code **</code></strong> and <strong><em>both</em></strong> and <del>gone</del>"
     " and **unclosed</p>"),
    # lists in lists, an ordered list's start, a list of another kind after, and text that only looks like one
    ("1. First\n2. Second\n   - a\n   - b with **bold**\n     1. deep\n3. Third\n- other list\n\n"
     "3.14 is not a list, nor is -5 or *this*\n\n3. three\n4. four",
     "<ol><li>First</li><li>Second<ul><li>a</li><li>b with <strong>bold</strong><ol><li>deep</li></ol></li>"
     "</ul></li><li>Third</li></ol><ul><li>other list</li></ul>"
     "<p>3.14 is not a list, nor is -5 or <em>this</em></p>"
     '<ol start="3"><li>three</li><li>four</li></ol>'),
    ("1. Install:\n   ```sh\n   pip install x\n   ```\n2. Run\n* star\n+ plus",
     "<ol><li>Install:" + _code("sh", "pip install x") + "</li><li>Run</li></ol>"
     "<ul><li>star</li><li>plus</li></ul>"),  # one list, whichever bullets
    # links: http(s) and mailto only; any other stays the text as written
    ("[click](javascript:alert(1)) [x](JAVASCRIPT:alert(1)) [y]( javascript:void(0)) [z](data:text/html,hi) "
     "[w](/relative) [**site**](https://example.com/a_(b) \"title\") <mailto:me@example.com> "
     "see https://example.org/x?q=1. and <javascript:alert(1)>",
     "<p>[click](javascript:alert(1)) [x](JAVASCRIPT:alert(1)) [y]( javascript:void(0)) "
     "[z](data:text/html,hi) [w](/relative) " + _a("https://example.com/a_(b)", "<strong>site</strong>") + " "
     + _a("mailto:me@example.com", "mailto:me@example.com") + " see "
     + _a("https://example.org/x?q=1", "https://example.org/x?q=1")
     + ". and &lt;javascript:alert(1)&gt;</p>"),
    # headings, a rule, a quote, paragraphs and line breaks
    ("# Title\n## Sub *it*\n###### six ##\n#hashtag\nnext line\n\n---\n> quoted **b**\n> more\n\nPara two",
     "<h1>Title</h1><h2>Sub <em>it</em></h2><h6>six</h6><p>#hashtag<br>next line</p><hr>"
     "<blockquote><p>quoted <strong>b</strong><br>more</p></blockquote><p>Para two</p>"),
]


@pytest.mark.skipif(NODE is None, reason="node is not installed (the page's script runs in a browser)")
def test_the_page_renders_markdown_as_elements_and_text_in_node() -> None:
    cases = [md for md, _ in MD_CASES]
    r = subprocess.run([NODE, "-e", _markdown_block() + MD_HARNESS], input=json.dumps(cases),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for (md, want), got in zip(MD_CASES, out["html"]):
        assert got == want, md
    # what it builds: these elements and text, nothing that runs or loads
    assert set(out["tags"]) <= {"div", "#text", "p", "br", "hr", "h1", "h2", "h6", "strong", "em", "del",
                                "code", "pre", "span", "button", "ol", "ul", "li", "a", "blockquote"}, out["tags"]
    assert out["copied"] == ['<script>alert("x")</script>\n  <b>&amp;</b>'] and out["label"] == "Copied"

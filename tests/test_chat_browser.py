"""The chat page at `GET /` in a real browser (Debian's headless chromium, driven by Selenium through Debian's
chromedriver), on `tandem serve` with two tiny random models: every configured model in the selector, the
page's markdown renderer on the browser's own DOM (markup in a reply stays text), a reply streamed token by
token, Stop mid-reply (the engine's running count back to 0, the partial reply kept), and the other model
picked in the selector answering the next message. tests/test_chat_page.py holds the page's parts to finer
checks in node; this one holds the whole page to a browser."""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

from tests.served import Served

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# The last assistant message as the page shows it: its text, its meta line and error (if shown), and whether
# Stop is enabled (a reply is running).
LAST_REPLY = """
const last = (sel) => {
  const all = document.querySelectorAll(".msg.assistant " + sel);
  return all[all.length - 1];
};
const shown = (e) => (e && !e.hidden ? e.textContent : null);
const c = last(".content");
return {text: c ? c.textContent : null, meta: shown(last(".meta")), error: shown(last(".error")),
        running: !document.getElementById("stop").disabled,
        replies: document.querySelectorAll(".msg.assistant").length};
"""


@pytest.fixture(scope="module")
def browser():
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:  # a failure, not a skip: this is the one test of the page in a browser
        pytest.fail(f"{' and '.join(missing)} missing: `make test` installs Debian's chromium and "
                    "chromium-driver (`make browser` alone)")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)  # Debian's, with its own driver: Selenium Manager fetches nothing
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(tiny_model):
    a, b = tiny_model("llama"), tiny_model("qwen3")
    s = Served(a, "--model", str(b), "--kv-cache-tokens", "2048").ready()
    yield s, a.name, b.name  # each served under its directory's name
    s.close()


def _metric(url: str, name: str, model: str) -> float | None:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        page = r.read().decode()
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*model_name="{re.escape(model)}"[^}}]*\}} (\S+)$', page, re.M)
    return float(m.group(1)) if m else None


def _states(url: str) -> dict[str, str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return {m["id"]: m["state"] for m in json.load(r)["data"]}


def _send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)  # Enter sends (Shift+Enter would be a new line)


def _set(driver, field: str, value: str) -> None:
    el = driver.find_element(By.ID, field)
    el.clear()
    el.send_keys(value)


def _until(cond, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while (got := cond()) is None or got is False:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)
    return got


def test_the_page_streams_stops_and_switches_models_in_a_browser(browser, served) -> None:
    server, name_a, name_b = served
    driver = browser
    driver.get(server.url + "/")
    select = Select(driver.find_element(By.ID, "model"))
    # every configured model, loaded or not
    _until(lambda: len(select.options) == 2, 30, "the model list")
    assert [o.get_attribute("value") for o in select.options] == [name_a, name_b]
    assert all("(unloaded)" in o.text for o in select.options), [o.text for o in select.options]
    assert driver.find_element(By.ID, "clear").text == "New chat"

    # The page's markdown renderer on the browser's own DOM: markup in a reply stays text (an <img> made an
    # element would run its onerror), a fence is a code block, only an http(s) link is a link.
    md = ('<img src=x onerror="window.ran = 1"> **b**\n```html\n<script>window.ran = 2</script>\n```\n'
          "[ok](https://example.com) [no](javascript:window.ran=3)")
    html = driver.execute_script("const d = document.createElement('div'); document.body.append(d);"
                                 "renderMarkdown(arguments[0], d); d.remove(); return d.innerHTML;", md)
    assert html.startswith('<p>&lt;img src=x onerror="window.ran = 1"&gt; <strong>b</strong></p>'), html
    assert '<code class="language-html">&lt;script&gt;window.ran = 2&lt;/script&gt;</code>' in html
    assert '<a href="https://example.com" target="_blank" rel="noopener noreferrer">ok</a> ' \
           "[no](javascript:window.ran=3)</p>" in html
    time.sleep(0.2)
    assert driver.execute_script("return window.ran === undefined")

    driver.find_element(By.ID, "toggle-settings").click()
    _set(driver, "temperature", "0")  # greedy: the same long reply every run
    _set(driver, "max-tokens", "1500")  # a reply long enough to watch grow and to stop
    select.select_by_value(name_a)
    _send(driver, "Tell me a long story about a river.")

    # Streamed: the reply's text seen in at least 3 states while it runs (the first request starts the model).
    _until(lambda: (s := driver.execute_script(LAST_REPLY))["text"] or not s["running"], 120,
           "the reply's first text")
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while len(seen) < 4 and time.monotonic() < deadline:
        state = driver.execute_script(LAST_REPLY)
        if not state["running"]:
            break
        if state["text"] and (not seen or state["text"] != seen[-1]):
            seen.append(state["text"])
        time.sleep(0.02)
    assert state["running"] and state["error"] is None, f"the reply ended before Stop: {state}, seen {seen}"
    assert len(seen) >= 3, seen
    assert _metric(server.url, "tandem:num_requests_running", name_a) == 1.0  # it runs in the engine

    driver.find_element(By.ID, "stop").click()
    state = _until(lambda: (s := driver.execute_script(LAST_REPLY))["meta"] is not None and s, 10, "Stop")
    assert not state["running"] and "stopped" in state["meta"] and state["error"] is None, state
    assert len(state["text"]) >= len(seen[-1]) > 0  # the partial reply stays
    _until(lambda: _metric(server.url, "tandem:num_requests_running", name_a) == 0.0, 5,
           "the engine's running count back to 0 after Stop")
    time.sleep(0.3)
    assert driver.execute_script(LAST_REPLY)["text"] == state["text"]  # nothing more arrived

    # The other model, picked in the selector, answers the next message (its engine started for it).
    select.select_by_value(name_b)
    _set(driver, "max-tokens", "16")
    _send(driver, "Hello")
    state = _until(lambda: (s := driver.execute_script(LAST_REPLY))["replies"] == 2 and not s["running"]
                   and s["meta"] is not None and s, 120, "the second model's reply")
    assert state["error"] is None and "tokens" in state["meta"], state
    assert _metric(server.url, "tandem:model_loads", name_b) == 1.0
    assert _metric(server.url, "tandem:model_loads", name_a) == 1.0
    assert _states(server.url) == {name_a: "loaded", name_b: "loaded"}

"""Takes docs/chat_page.png, the chat page at `GET /` in the README, in Debian's headless chromium.

A random test model cannot write markdown, so the page talks to the test suite's scripted engine
(tests/scripted_engine.py): the real HTTP app with the reply's text scripted (and paced), on a local port.
The page does what it does for a model: sends the message, reads the SSE stream, splits out the reasoning,
renders the markdown. Run `python docs/chat_page_screenshot.py` (from the checkout, once `make test` has
installed chromium) after changing how the page looks; the PNG is committed."""
from __future__ import annotations

import asyncio
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import uvicorn
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tandem.launch.make_model import make_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.scripted_engine import KEY, Reply, scripted_app  # noqa: E402 (the checkout's tests/, above)

OUT = ROOT / "docs" / "chat_page.png"
QUESTION = "How do I stream a reply from tandem in Python?"
THOUGHT = "They want the streaming call. The openai client works unchanged against /v1."
ANSWER = """## Streaming with the `openai` client

Point the **official** client at the server and pass `stream=True`:

```python
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
stream = client.chat.completions.create(
    model="SmolLM2-135M-Instruct", stream=True,
    messages=[{"role": "user", "content": "Hi!"}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="")
```

- Each chunk holds a *delta*: the text since the last one.
- Closing the stream (or **Stop** here) aborts the request:
  1. the engine drops it from the batch
  2. its KV cache blocks are freed

> `stream_options={"include_usage": True}` adds a last chunk with the token counts.

More in the [API reference](https://platform.openai.com/docs/api-reference/chat)."""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "qwen3-tiny"
        make_model("qwen3", "tiny", model, seed=0)  # for its tokenizer and chat template only
        engine, app = scripted_app(model, "qwen3")
        text = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
        engine.script(Reply([text[i:i + 4] for i in range(0, len(text), 4)]))
        scripted = engine.stream

        async def paced(*args, **kw):  # at a small model's pace on a CPU, so the meta line reads like one
            async for delta in scripted(*args, **kw):
                await asyncio.sleep(0.015)
                yield delta

        engine.stream = paced
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        try:
            shoot(f"http://127.0.0.1:{sock.getsockname()[1]}/")
        finally:
            server.should_exit = True
    print(f"wrote {OUT} ({OUT.stat().st_size // 1024} KiB)")


def shoot(url: str) -> None:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800",
                "--hide-scrollbars", "--force-color-profile=srgb"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)
    try:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",  # the page's own size, not the window's
                               {"width": 1200, "height": 800, "deviceScaleFactor": 1, "mobile": False})
        driver.get(url)
        key = driver.find_element(By.ID, "api-key")
        deadline = time.monotonic() + 10
        while not key.is_displayed():  # the model list's 401 opens the settings, where the key goes
            assert time.monotonic() < deadline, "the settings did not open"
            time.sleep(0.05)
        key.send_keys(KEY)
        key.send_keys(Keys.TAB)  # its change event: the page keeps the key and lists the models with it
        driver.find_element(By.ID, "toggle-settings").click()
        box = driver.find_element(By.ID, "input")
        box.send_keys(QUESTION)
        box.send_keys(Keys.ENTER)
        deadline = time.monotonic() + 30
        while not driver.execute_script("const m = document.querySelectorAll('.msg .meta');"
                                         "return m.length > 0 && !m[m.length - 1].hidden;"):
            assert time.monotonic() < deadline, "the reply did not finish"
            time.sleep(0.05)
        driver.execute_script("document.activeElement.blur(); const log = document.getElementById('log');"
                              "log.scrollTop = 0;")
        time.sleep(0.3)
        driver.save_screenshot(str(OUT))
    finally:
        driver.quit()


if __name__ == "__main__":
    main()

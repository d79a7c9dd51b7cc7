"""`tandem run` and `tandem list` (launch/run_chat.py, launch/list_models.py).

The chat loop on a scripted transport (fast, no terminal): messages, commands, multi-line input, /clear,
the history each request carries, a reply stopped by Ctrl-C keeping what came (its stream closed, which
aborts the request) and the next turn working, failures. The HTTP transport against the app on scripted
replies, served on a loopback port. Then end to end: `tandem run PATH "prompt"` prints the greedy chat
reply the Python client gets; a reply interrupted on a real engine leaves it idle and serving; `tandem
list` on a fake models folder."""
from __future__ import annotations

import contextlib
import copy
import io
import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest

from tandem.launch.chat_session import (
    DONE_THINKING,
    EXIT_HINT,
    THINKING,
    ChatError,
    ChatOptions,
    ChatSession,
    ThinkingText,
    interact,
)
from tandem.launch.chat_transports import EngineTransport, HTTPTransport, normalize_url
from tandem.launch.list_models import human_ago, human_size, table
from tandem.launch.model_names import PulledModel
from tests.conftest import check_idle_engine

PINNED = ["--dtype", "float32", "--no-cpu-int8-activations"]  # as tests/served.py pins a served engine


class Scripted:
    """A transport whose replies are lists of pieces; an exception among them is raised there (a Ctrl-C
    while the reply streams, a failed request). Records every request's messages and every stream closed
    before its end (what aborts a request)."""

    def __init__(self, *replies: list) -> None:
        self.replies = deque(replies)
        self.requests: list[list[dict]] = []
        self.options: list[ChatOptions] = []
        self.aborted = 0

    def stream(self, messages, options):
        self.requests.append(copy.deepcopy(messages))
        self.options.append(options)
        return self._pieces(self.replies.popleft() if self.replies else ["ok"])

    def _pieces(self, pieces):
        try:
            for piece in pieces:
                if isinstance(piece, BaseException):
                    raise piece
                yield piece
        except GeneratorExit:
            self.aborted += 1
            raise


def _session(*replies, **kw):
    transport = Scripted(*replies)
    out, err = io.StringIO(), io.StringIO()
    return ChatSession(transport, out=out, err=err, **kw), transport, out, err


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def test_each_request_carries_the_conversation_after_the_system_message() -> None:
    s, t, out, _ = _session(["Hel", "lo", "!"], ["Fine."], options=ChatOptions(system="Be brief.",
                                                                                  temperature=0.5))
    assert s.prompt() == ">>> "
    assert s.feed("Hi there")
    assert out.getvalue() == "Hello!\n"
    assert s.feed("  How are you?  ")  # sent as typed
    assert t.requests == [
        [{"role": "system", "content": "Be brief."}, _user("Hi there")],
        [{"role": "system", "content": "Be brief."}, _user("Hi there"), _assistant("Hello!"),
         _user("  How are you?  ")],
    ]
    assert t.options[0].temperature == 0.5
    assert s.history == [_user("Hi there"), _assistant("Hello!"), _user("  How are you?  "), _assistant("Fine.")]
    assert t.aborted == 0


def test_commands_and_blank_lines() -> None:
    s, t, out, _ = _session(["A"], ["B"])
    assert s.feed("") and s.feed("   ")
    assert s.feed("/?") and "/clear" in out.getvalue() and "/bye" in out.getvalue() and '"""' in out.getvalue()
    s.feed("/help")
    s.feed("first")
    assert s.history == [_user("first"), _assistant("A")]
    s.feed("/clear")
    assert s.history == [] and "Cleared session context" in out.getvalue()
    s.feed("second")
    assert t.requests[-1] == [_user("second")]  # /clear forgot the first turn
    s.feed("/nope")
    assert "Unknown command '/nope'" in out.getvalue()
    assert len(t.requests) == 2
    assert s.feed("/bye") is False and s.feed("  /bye  ") is False and s.feed("/exit") is False


def test_multi_line_messages() -> None:
    s, t, _, _ = _session()
    s.feed('"""')
    assert s.prompt() == "... "
    s.feed("line one")
    s.feed("")  # a blank line inside is kept
    s.feed("  /clear is text here")
    s.feed('line four"""')
    assert s.prompt() == ">>> "
    s.feed('"""starts here')
    s.feed('and ends here  """  ')
    s.feed('"""all on one line"""')
    s.feed('"""')
    s.feed('"""')  # nothing between: no request
    assert [r[-1]["content"] for r in t.requests] == [
        "line one\n\n  /clear is text here\nline four",
        "starts here\nand ends here  ",
        "all on one line",
    ]
    assert len(s.history) == 6


def test_ctrl_c_stops_a_reply_keeps_what_came_and_the_next_turn_works() -> None:
    s, t, out, err = _session(["Once ", "upon", KeyboardInterrupt(), " a time"], ["Next."])
    assert s.feed("tell a story")
    assert out.getvalue() == "Once upon\n"
    assert s.history == [_user("tell a story"), _assistant("Once upon")]
    s.feed("go on")
    assert t.requests[-1] == [_user("tell a story"), _assistant("Once upon"), _user("go on")]
    assert s.history[-1] == _assistant("Next.") and err.getvalue() == ""


class _InterruptingOut(io.StringIO):
    """Ctrl-C arrives while the reply is being written: on the Nth write."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.writes, self.at = 0, at

    def write(self, s: str) -> int:
        self.writes += 1
        if self.writes == self.at:
            raise KeyboardInterrupt
        return super().write(s)


def test_ctrl_c_between_pieces_closes_the_stream() -> None:
    t = Scripted(["one ", "two ", "three ", "four"], ["again"])
    s = ChatSession(t, out=_InterruptingOut(at=3), err=io.StringIO())
    s.feed("count")
    assert t.aborted == 1  # the stream was closed mid-way: a real transport aborts the request there
    assert s.history == [_user("count"), _assistant("one two ")]
    s.feed("more")
    assert s.history[-1] == _assistant("again") and t.aborted == 1


def test_a_turn_stopped_or_failed_before_any_text_leaves_no_trace() -> None:
    s, t, out, err = _session([KeyboardInterrupt()], [ChatError("the engine is draining")], ["Hi."])
    s.feed("one")
    assert s.history == [] and not s.failed
    s.feed("two")
    assert s.history == [] and s.failed and err.getvalue() == "Error: the engine is draining\n"
    s.feed("three")
    assert t.requests[-1] == [_user("three")] and s.history == [_user("three"), _assistant("Hi.")]
    assert not s.failed


def test_a_failure_mid_reply_keeps_the_text_and_says_why() -> None:
    s, _, out, err = _session(["Par", "tial", ChatError("the worker died")])
    s.feed("q")
    assert out.getvalue() == "Partial\n" and err.getvalue() == "Error: the worker died\n"
    assert s.history == [_user("q"), _assistant("Partial")] and s.failed


def test_reasoning_is_shown_apart_and_not_kept() -> None:
    s, _, out, _ = _session([ThinkingText("Hmm, "), ThinkingText("a greeting."), "Hello", "!"])
    s.feed("hi")
    assert out.getvalue() == THINKING + "Hmm, a greeting." + DONE_THINKING + "Hello!\n"
    assert s.history == [_user("hi"), _assistant("Hello!")]
    s, _, out, _ = _session([ThinkingText("dim"), "Hi"], color=True)
    s.feed("hi")
    assert out.getvalue() == THINKING + "\x1b[2mdim\x1b[0m" + DONE_THINKING + "Hi\n"


def test_the_prompt_loop() -> None:
    s, t, out, _ = _session(["Hi!"])
    lines = iter(["hello", KeyboardInterrupt(), '"""', "half", KeyboardInterrupt(), "/?", EOFError()])
    prompts = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        x = next(lines)
        if isinstance(x, BaseException):
            raise x
        return x

    assert interact(s, read) == 0
    assert prompts == [">>> ", ">>> ", ">>> ", "... ", "... ", ">>> ", ">>> "]
    text = out.getvalue()
    assert text.startswith("Hi!\n\n")  # the reply, then a blank line before the next prompt
    assert text.count(EXIT_HINT) == 1  # Ctrl-C at an empty prompt; in a multi-line message it drops it
    assert len(t.requests) == 1 and s.pending is None
    s, _, _, _ = _session()
    lines = iter(["/bye", "never read"])
    assert interact(s, lambda _: next(lines)) == 0 and next(lines) == "never read"


def test_urls() -> None:
    assert normalize_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert normalize_url("http://h:1/v1/") == "http://h:1"
    assert normalize_url("https://h/") == "https://h"


# The HTTP transport against the real app (on scripted replies), served on a loopback port.


@contextlib.contextmanager
def _serving(app):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_http_transport_streams_and_reports_errors(tiny_model) -> None:
    from tandem.protocol.errors import RequestFailedError
    from tandem.protocol.tokenizer_loader import load_tokenizer
    from tests.scripted_engine import KEY, NAME, Reply, scripted_app

    model = tiny_model("qwen3")
    engine, app = scripted_app(model, "qwen3")
    text = "<think>\nThey greet.\n</think>\n\nHello, wörld 世界!"
    engine.script(Reply([text[i:i + 3] for i in range(0, len(text), 3)]), ["Fine, ", "thanks."])
    engine.script(Reply(["Hal", "f"], fault=RequestFailedError("the worker died", "request_failed.internal")))
    with _serving(app) as url:
        out, err = io.StringIO(), io.StringIO()
        s = ChatSession(HTTPTransport(url + "/v1", NAME, KEY), ChatOptions("Be kind.", 0.0, 16), out, err)
        s.feed("hi")
        assert out.getvalue() == THINKING + "They greet." + DONE_THINKING + "Hello, wörld 世界!\n"
        s.feed("how are you?")
        assert s.history == [_user("hi"), _assistant("Hello, wörld 世界!"), _user("how are you?"),
                             _assistant("Fine, thanks.")]
        assert engine.params[-1]["temperature"] == 0.0 and engine.params[-1]["max_tokens"] == 16
        assert "Be kind." in load_tokenizer(model).decode(engine.prompts[0])  # the system message
        s.feed("and then?")
        assert err.getvalue() == "Error: the worker died\n" and s.history[-1] == _assistant("Half")
        for transport, message in [
            (HTTPTransport(url, NAME, "sk-wrong"), "Incorrect API key provided."),
            (HTTPTransport(url, "no-such-model", KEY), "no-such-model"),
        ]:
            with pytest.raises(ChatError, match=message):
                list(transport.stream([_user("hi")], ChatOptions()))
    with pytest.raises(ChatError, match="cannot reach"):
        list(HTTPTransport(url, NAME, KEY).stream([_user("hi")], ChatOptions()))
    assert len(engine.prompts) == 3  # the failed requests never reached the engine


# End to end, on a tiny model.


def _tandem(*args: str, env: dict | None = None, stdin: str | None = "", timeout: float = 240):
    return subprocess.run([sys.executable, "-m", "tandem.launch.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_tandem_run_prints_the_greedy_chat_reply(tiny_model, launch_client) -> None:
    from tandem import SamplingParams

    model = tiny_model("llama")
    prompt = "Tell me about the sea."
    r = _tandem("run", str(model), prompt, "--temperature", "0", "--max-tokens", "24", *PINNED)
    assert r.returncode == 0, r.stderr[-3000:]
    client = launch_client(model)
    expected = client.generate([_user(prompt)], SamplingParams(temperature=0, max_tokens=24)).text
    assert expected and r.stdout == expected + "\n"

    # A reply interrupted on the real engine: the request is aborted, the engine idle and serving on.
    out = _InterruptingOut(at=4)
    s = ChatSession(EngineTransport(client), ChatOptions(temperature=0, max_tokens=24), out, io.StringIO())
    s.feed(prompt)
    assert s.history[-1]["role"] == "assistant" and expected.startswith(s.history[-1]["content"])
    assert len(s.history[-1]["content"]) < len(expected)
    check_idle_engine(client)
    s.history.clear()
    assert s.ask(prompt) == expected  # the same greedy reply again: nothing of the stopped one lingers
    check_idle_engine(client)


def test_tandem_list(tmp_path: Path) -> None:
    models = tmp_path / "models"
    gguf = tmp_path / "elsewhere" / "weights.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"G" * 1_234_567)
    (models / "pulled").mkdir(parents=True)
    (models / "pulled" / "config.json").write_text("{}")  # the converted directory beside the file
    (models / "pulled" / "model.gguf").symlink_to(gguf)
    (models / "made").mkdir()
    (models / "made" / "config.json").write_text("{}" * 10)
    with open(models / "made" / "model.safetensors", "wb") as f:
        f.truncate(98_000_000)  # sparse: the size without the writing
    (models / "scratch").mkdir()  # no model: not listed
    old = time.time() - 3 * 86400 - 60
    os.utime(gguf, (old, old))
    r = _tandem("list", env={"TANDEM_MODELS": str(models)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "MODIFIED", "PATH"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"made", "pulled"}
    assert rows["pulled"].split()[1:] == ["1.2", "MB", "3", "days", "ago", str(models / "pulled" / "model.gguf")]
    assert rows["made"].split()[1:3] == ["98", "MB"] and rows["made"].endswith(str(models / "made"))
    assert lines[0].index("SIZE") == lines[1].index(lines[1].split()[1])  # the columns line up
    r = _tandem("list", env={"TANDEM_MODELS": str(tmp_path / "none")})
    assert r.returncode == 0 and r.stdout.count("\n") == 1 and "tandem pull NAME" in r.stdout
    assert "smollm2-135m-instruct" in r.stdout


def test_human_sizes_and_times() -> None:
    assert [human_size(n) for n in (5, 1_000, 1_500, 98_700_000, 270_000_000, 1_234_000_000, 2 * 10**12)] == [
        "5 B", "1 KB", "1.5 KB", "98 MB", "270 MB", "1.2 GB", "2 TB"]
    minute, hour, day = 60, 3600, 86400
    assert [human_ago(s) for s in (-5, 0.5, 1, 42, 90, 5 * minute, 70 * minute, 5 * hour, 3 * day + 60,
                                   20 * day, 100 * day, 3 * 365 * day)] == [
        "Less than a second ago", "Less than a second ago", "1 second ago", "42 seconds ago",
        "About a minute ago", "5 minutes ago", "About an hour ago", "5 hours ago", "3 days ago",
        "2 weeks ago", "3 months ago", "3 years ago"]
    now = 1_000_000.0
    text = table([PulledModel("a", Path("/m/a"), 5, now - 10), PulledModel("long-name", Path("/m/b"), 10**9, now)],
                 now)
    header, first, second = text.splitlines()
    assert [header.index(c) for c in ("SIZE", "MODIFIED", "PATH")] == [
        first.index("5 B"), first.index("10 seconds"), first.index("/m/a")]
    assert second.index("1 GB") == header.index("SIZE")


class _Terminal:
    """`tandem run` at a pseudo-terminal it controls (its own session, the pty its controlling terminal), so
    that a typed Ctrl-C is a SIGINT to its whole process group, the engine it started included, as at a
    real terminal."""

    def __init__(self, *args: str) -> None:
        import fcntl
        import pty
        import termios

        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.launch.cli", *args], stdin=slave, stdout=slave, stderr=slave,
            start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
            env={**os.environ, "TERM": "dumb", "PYTHONUNBUFFERED": "1"},
        )
        os.close(slave)
        self.buf = ""
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character may span two reads
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                self.buf += decoder.decode(data)

    def text(self) -> str:
        import re

        with self.lock:
            raw = self.buf
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", raw)

    def wait_for(self, what: str, count: int = 1, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while self.text().count(what) < count:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what!r} x{count}: {self.text()[-3000:]}"
            time.sleep(0.02)
        return self.text()

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.mark.skipif(sys.platform != "linux", reason="a pseudo-terminal made controlling with TIOCSCTTY")
def test_tandem_run_at_a_terminal_ctrl_c_stops_a_reply_not_the_engine(tiny_model) -> None:
    question = "Tell me about the sea."
    term = _Terminal("run", str(tiny_model("llama")), "--temperature", "0", "--max-tokens", "400", *PINNED)
    try:
        term.wait_for(">>> ")
        term.type(question + "\n")
        text = term.wait_for(">>> ", 2)
        whole = text.split(question + "\n", 1)[1].rsplit("\n\n>>> ", 1)[0]
        assert whole.strip(), text
        # At the prompt: a key first, and its echo awaited: readline is then reading (a SIGINT between its
        # prompt and its first wait would sit until the next key, the race of every readline program)
        term.type("x")
        term.wait_for(">>> x")
        term.type("\x03")  # the way out is shown, the line dropped
        term.wait_for(EXIT_HINT)
        term.wait_for(">>> ", 3)

        # Ctrl-C once the reply has started: it stops, the prompt is back, and the engine (which got the
        # SIGINT too) still serves: after /clear the same question gets the same greedy reply.
        term.type("/clear\n")
        term.wait_for(">>> ", 4)
        start = len(term.text())
        term.type(question + "\n")
        deadline = time.monotonic() + 60
        while len(term.text()) < start + len(question) + 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        term.type("\x03")
        text = term.wait_for(">>> ", 5)
        cut = text[start:].split(question + "\n", 1)[1].rsplit("\n\n>>> ", 1)[0]
        cut = cut.rstrip("\n").removesuffix("^C")  # the terminal echoes the Ctrl-C
        assert whole.startswith(cut) and len(cut) < len(whole), (cut, whole)
        term.type("/clear\n")
        term.wait_for(">>> ", 6)
        start = len(term.text())
        term.type(question + "\n")
        text = term.wait_for(">>> ", 7)
        assert text[start:].split(question + "\n", 1)[1].rsplit("\n\n>>> ", 1)[0] == whole
        assert "Error" not in text
        term.type("/bye\n")
        assert term.proc.wait(60) == 0
    finally:
        term.close()

"""`tandem run`'s conversation, socket-free: history, commands, multi-line input and the prompt loop,
fed a line at a time with its transport injected (launch/chat_transports.py), so tests drive it without a
terminal or an engine."""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TextIO

MULTILINE = '"""'
EXIT_HINT = "Use Ctrl + d or /bye to exit."
HELP = """Available commands:
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command

Use \"\"\" to begin a multi-line message.
"""
THINKING, DONE_THINKING = "Thinking...\n", "\n...done thinking.\n\n"
DIM, RESET = "\x1b[2m", "\x1b[0m"


class ThinkingText(str):
    """A piece of the model's reasoning (a server's `reasoning_content`): shown, never kept in history."""


class ChatError(Exception):
    """A request that failed: its message is the server's or the engine's."""


@dataclass
class ChatOptions:
    system: str | None = None
    temperature: float | None = None  # None: the engine's or server's default
    max_tokens: int | None = None


class Transport(Protocol):
    def stream(self, messages: list[dict[str, str]], options: ChatOptions) -> Iterator[str]:
        """The reply's pieces (Thinking ones among them, possibly). Closing the iterator early aborts the
        request; a failure raises ChatError."""
        ...


class ChatSession:
    """One conversation: its history, the multi-line state and the commands, fed a line at a time."""

    def __init__(self, transport: Transport, options: ChatOptions | None = None, out: TextIO | None = None,
                 err: TextIO | None = None, color: bool = False) -> None:
        self.transport = transport
        self.options = options or ChatOptions()
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.color = color  # the reasoning dimmed (a terminal)
        self.history: list[dict[str, str]] = []
        self.pending: list[str] | None = None  # the lines of a multi-line message being typed
        self.failed = False  # the last request failed
        self.stopped = False  # the last reply was stopped (Ctrl-C)
        self.turns = 0  # requests made

    def prompt(self) -> str:
        return "... " if self.pending is not None else ">>> "

    def feed(self, line: str) -> bool:
        """One line typed at the prompt (no newline); False: the user asked to leave."""
        if self.pending is not None:
            end = line.rstrip()
            if end.endswith(MULTILINE):
                self.pending.append(end[: -len(MULTILINE)])
                text, self.pending = "\n".join(self.pending), None
                if text.strip():
                    self.ask(text)
            else:
                self.pending.append(line)
            return True
        stripped = line.strip()
        if stripped.startswith(MULTILINE):
            rest = stripped[len(MULTILINE):]
            if len(rest) >= len(MULTILINE) and rest.endswith(MULTILINE):  # """one line"""
                if rest[: -len(MULTILINE)].strip():
                    self.ask(rest[: -len(MULTILINE)])
            else:
                self.pending = [rest] if rest else []
            return True
        if not stripped:
            return True
        if stripped.startswith("/"):
            return self.command(stripped)
        self.ask(line)
        return True

    def command(self, text: str) -> bool:
        name = text.split()[0]
        if name in ("/bye", "/exit"):
            return False
        if name == "/clear":
            self.history.clear()
            self._say("Cleared session context")
        elif name in ("/?", "/help"):
            self.out.write(HELP)
        else:
            self._say(f"Unknown command '{name}'. Type /? for help")
        return True

    def interrupted_at_prompt(self) -> None:
        """Ctrl-C at the prompt: a multi-line message is dropped; otherwise the way out is shown."""
        if self.pending is not None:
            self.pending = None
            self.out.write("\n")
        else:
            self.out.write("\n" + EXIT_HINT + "\n")
        self.out.flush()

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.options.system}] if self.options.system else []
        return system + self.history

    def ask(self, text: str) -> str:
        """One turn: the reply streams to `out` and joins the history. Ctrl-C (KeyboardInterrupt) stops it:
        the stream is closed, which aborts the request, and what came is kept. A turn that failed or was
        stopped before any text leaves the history as it was."""
        self.history.append({"role": "user", "content": text})
        self.failed = self.stopped = False
        self.turns += 1
        reply: list[str] = []
        thinking = stopped = False
        error: str | None = None
        stream = None
        try:
            stream = self.transport.stream(self.messages(), self.options)
            for piece in stream:
                if not piece:
                    continue
                if isinstance(piece, ThinkingText):
                    if not thinking:
                        thinking = True
                        self.out.write(THINKING + (DIM if self.color else ""))
                    self.out.write(piece)
                else:
                    if thinking:
                        thinking = False
                        self.out.write((RESET if self.color else "") + DONE_THINKING)
                    self.out.write(piece)
                    reply.append(piece)  # once shown: the history keeps what the user saw
                self.out.flush()
        except KeyboardInterrupt:
            stopped = True
        except ChatError as e:
            error = str(e) or type(e).__name__
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        self.stopped = stopped
        if thinking and self.color:
            self.out.write(RESET)
        text_out = "".join(reply)
        if text_out:
            self.history.append({"role": "assistant", "content": text_out})
        elif stopped or error is not None:
            self.history.pop()
        if text_out or thinking or stopped or error is None:
            self.out.write("\n")
        self.out.flush()
        if error is not None:
            self.failed = True
            self.err.write(f"Error: {error}\n")
            self.err.flush()
        return text_out

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def interact(session: ChatSession, read: Callable[[str], str] = input) -> int:
    """The prompt loop until /bye or end of input (Ctrl-D). READ is `input` at a terminal (readline edits
    the line then)."""
    while True:
        try:
            line = read(session.prompt())
        except EOFError:
            session.out.write("\n")
            return 0
        except KeyboardInterrupt:
            session.interrupted_at_prompt()
            continue
        turns = session.turns
        try:
            if not session.feed(line):
                return 0
        except KeyboardInterrupt:  # between the line and its reply, or a second one while a reply stops
            session.out.write("\n")
        if session.turns != turns:
            session.out.write("\n")  # a blank line after each reply, as ollama leaves

"""`tandem run NAME [PROMPT]`: chat with a model in the terminal, as `ollama run` does.

NAME is a model name `tandem pull` knows (pulled first when absent), a folder in the models folder, or a
path (launch/model_names.py). Without `--host` the engine starts here, owned by this process (it stops
with it); with `--host URL` the chat goes to a running server's `POST /v1/chat/completions`.

At the `>>> ` prompt: a line is a message; `\"\"\"` starts and ends one of several lines; `/clear` forgets the
conversation, `/bye` or Ctrl-D leaves, `/?` helps. Ctrl-C during a reply stops it (the request is aborted)
and keeps what came in the conversation. With a PROMPT, or stdin not a terminal: one answer, then exit.

The loop is a `ChatSession` driven by lines with its transport injected, so that tests drive it without a
terminal or an engine."""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from typing import Any

from tandem.launch.chat_session import HELP, ChatOptions, ChatSession, Transport, interact
from tandem.launch.chat_transports import EngineTransport, HTTPTransport


class _EngineFlags:
    """What add_engine_flags writes to: the engine's flags in their own group, all but --model (NAME)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.dests: list[str] = []

    def add_argument(self, *names: str, **kw: Any) -> None:
        if names != ("--model",):
            self.dests.append(self.group.add_argument(*names, **kw).dest)


def _parser() -> tuple[argparse.ArgumentParser, list[str]]:
    from tandem.launch.cli_options import add_engine_flags

    p = argparse.ArgumentParser(
        prog="tandem run", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="tandem run NAME [PROMPT ...] [--host URL [--api-key KEY]] [--system TEXT] [--temperature F] "
        "[--max-tokens N] [engine flags]",
        description="Chat with a model, as ollama run does. NAME: a name tandem pull knows (pulled when\n"
        "absent), a folder in the models folder ($TANDEM_MODELS, else models/), or a path.",
        epilog="At the prompt:\n" + HELP,
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument("prompt", metavar="PROMPT", nargs="*", help="answer this once and exit (stdin too, piped)")
    p.add_argument("--host", metavar="URL",
                   help="chat with the server at this URL instead of starting the engine here")
    p.add_argument("--api-key", metavar="KEY", help="the server's key (with --host)")
    p.add_argument("--system", metavar="TEXT", help="a system message before the conversation")
    p.add_argument("--temperature", type=float, metavar="F",
                   help="sampling temperature (default: the engine's or server's)")
    p.add_argument("--max-tokens", type=int, metavar="N", help="the most tokens a reply may have")
    engine = _EngineFlags(p.add_argument_group("engine flags (as tandem serve's; without --host)"))
    add_engine_flags(engine)  # type: ignore[arg-type]
    return p, engine.dests


def main(argv: list[str] | None = None) -> int:
    from tandem.launch.model_names import resolve_model, served_name

    p, engine_dests = _parser()
    args = p.parse_intermixed_args(argv)  # flags after the PROMPT's words too
    options = ChatOptions(args.system, args.temperature, args.max_tokens)
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error("--max-tokens must be at least 1")
    if args.temperature is not None and args.temperature < 0:
        p.error("--temperature must not be negative")
    prompt = " ".join(args.prompt)
    if not sys.stdin.isatty():  # piped: stdin, then the words given, answered once (as ollama)
        prompt = " ".join(x for x in (sys.stdin.read(), prompt) if x)
        if not prompt.strip():
            p.error("nothing to answer: stdin was empty and no PROMPT was given")
    once = bool(prompt)
    tty = sys.stdout.isatty()

    if args.host:
        given = [d for d in engine_dests if getattr(args, d) != p.get_default(d)]
        if given:
            p.error(f"engine flags (--{given[0].replace('_', '-')}) do not apply with --host")
        http = HTTPTransport(args.host, served_name(args.name), args.api_key)
        return _chat(http, options, prompt, once, tty)

    from tandem import Client
    from tandem.launch.cli_options import config_from_args

    try:
        path = resolve_model(args.name)
    except ValueError as e:
        raise SystemExit(f"tandem run: {e}") from e
    args.model = path
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"tandem run: {e}") from e
    if not once and sys.stderr.isatty():
        sys.stderr.write(f"tandem: starting {served_name(args.name)} ...\r")
        sys.stderr.flush()
    try:
        client = Client.launch(cfg.model, **cfg.options())
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130
    except Exception as e:  # a configuration the model cannot run, an engine that failed to start
        raise SystemExit(f"tandem run: {e}") from e
    if not once and sys.stderr.isatty():
        sys.stderr.write("\x1b[2K")  # the line cleared
    with client:
        return _chat(EngineTransport(client), options, prompt, once, tty)


def _chat(transport: Transport, options: ChatOptions, prompt: str, once: bool, tty: bool) -> int:
    session = ChatSession(transport, options, color=tty)
    if once:
        session.ask(prompt)
        return 1 if session.failed else 130 if session.stopped else 0
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    # Ctrl-C is the chat's own key (stop a reply, leave a line): Python keeps SIGINT ignored when it started
    # so (a parent that ignored it, as the engine's own children do), which would make it do nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return interact(session)

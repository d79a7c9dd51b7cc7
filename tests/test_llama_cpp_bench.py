"""`--llama-cpp DIR` on `tandem bench latency`: llama-bench found in a build directory, its JSON read, the
ratio
printed and recorded (against a stand-in llama-bench: no llama.cpp build is part of the project)."""
from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from tandem.benchmarks.cli import main
from tandem.benchmarks.llama_cpp import find_binary, llama_bench, ratio_line
from tests.gguf_files import write_gguf

FAKE_TG = 40.0


def _fake_build(root: Path) -> Path:
    """A build tree whose bin/llama-bench prints llama-bench's JSON for the -p/-n it is given."""
    exe = root / "build-native" / "bin" / "llama-bench"
    exe.parent.mkdir(parents=True)
    exe.write_text(f"""#!/usr/bin/env python3
import json, sys
a = sys.argv
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
assert a[a.index("-o") + 1] == "json" and a[a.index("-m") + 1].endswith(".gguf")
rows = []
if p: rows.append({{"build_commit": "fake", "n_prompt": p, "n_gen": 0, "avg_ts": 500.0, "stddev_ts": 5.0}})
if n: rows.append({{"build_commit": "fake", "n_prompt": 0, "n_gen": n, "avg_ts": {FAKE_TG}, "stddev_ts": 1.5}})
print(json.dumps(rows))
open({str(root / "argv.json")!r}, "w").write(json.dumps(a[1:]))
""")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return root


def test_llama_bench_output_is_read(tmp_path: Path) -> None:
    build = _fake_build(tmp_path)
    assert find_binary(build, "llama-bench").name == "llama-bench"
    with pytest.raises(FileNotFoundError):
        find_binary(build, "llama-server")
    r = llama_bench(build, "m.gguf", 512, 128, threads=2)
    assert r == {"pp_tok_s": 500.0, "tg_tok_s": FAKE_TG, "tg_std": 1.5, "build": "fake", "repack": True}
    assert ratio_line("x", 80.0, 40.0).endswith("= 2.00x")
    assert ratio_line("tpot", 10.0, 20.0, higher_is_better=False).endswith("= 2.00x")


def test_latency_prints_llama_cpp_beside_tandem(tiny_model, tmp_path: Path, capsys) -> None:
    gguf = write_gguf(tiny_model("llama"), tmp_path / "m.gguf", "Q4_1")
    out = tmp_path / "latency.json"
    rc = main(
        [
            "latency",
            "--model",
            str(gguf),
            "--prompt-len",
            "16",
            "--output-len",
            "16",
            "--num-requests",
            "1",
            "--kv-cache-tokens",
            "1024",
            "--skip-baseline",
            "--llama-cpp",
            str(_fake_build(tmp_path / "lc")),
            "--llama-cpp-args",
            "--repack 0",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    # a value that starts with '-' is the flags to pass, not the next option of ours
    argv = json.loads((tmp_path / "lc" / "argv.json").read_text())
    assert argv[argv.index("--repack") + 1] == "0"
    r = json.loads(out.read_text())
    assert r["llama_cpp"]["tg_tok_s"] == FAKE_TG
    assert r["ratio_vs_llama_cpp"] == pytest.approx(r["engine_decode_tok_s"] / FAKE_TG)
    assert "RESULT_LLAMA_CPP llama_cpp_tg_tok_s=40.0" in capsys.readouterr().out


def test_llama_cpp_needs_the_gguf_file(tiny_model, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="gguf"):
        main(["latency", "--model", str(tiny_model("llama")), "--output-len", "4", "--num-requests", "1",
              "--skip-baseline", "--llama-cpp", str(_fake_build(tmp_path))])
    with pytest.raises(SystemExit, match="gguf"):  # the anchor must be a GGUF too
        main(["latency", "--model", str(tiny_model("llama")), "--output-len", "4", "--num-requests", "1",
              "--skip-baseline", "--llama-cpp", str(_fake_build(tmp_path / "b")),
              "--llama-cpp-model", str(tiny_model("llama"))])


def test_a_directory_runs_beside_the_gguf_llama_bench_is_given(tiny_model, tmp_path: Path) -> None:
    """A float32 directory against llama.cpp's F32 GGUF of the same weights: --llama-cpp-model."""
    f32 = write_gguf(tiny_model("llama"), tmp_path / "f32.gguf", "F32")
    out = tmp_path / "latency.json"
    rc = main(
        [
            "latency",
            "--model",
            str(tiny_model("llama")),
            "--dtype",
            "float32",
            "--prompt-len",
            "8",
            "--output-len",
            "4",
            "--num-requests",
            "1",
            "--kv-cache-tokens",
            "1024",
            "--skip-baseline",
            "--llama-cpp",
            str(_fake_build(tmp_path / "lc")),
            "--llama-cpp-model",
            str(f32),
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    argv = json.loads((tmp_path / "lc" / "argv.json").read_text())
    assert argv[argv.index("-m") + 1] == str(f32)
    r = json.loads(out.read_text())
    assert r["llama_cpp_model"] == str(f32) and r["ratio_vs_llama_cpp"] == pytest.approx(
        r["engine_decode_tok_s"] / FAKE_TG)


def _fake_server(root: Path, crash_without_no_repack: bool) -> Path:
    """bin/llama-server answering /health on its --port; killed by SIGSEGV at start unless --no-repack is
    given (as llama.cpp 0c1e570's AMX path did on a Sapphire Rapids guest), when asked to."""
    exe = root / "bin" / "llama-server"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(f"""#!/usr/bin/env python3
import http.server, json, os, signal, sys
a = sys.argv
with open({str(root / "starts.jsonl")!r}, "a") as f:
    f.write(json.dumps(a[1:]) + "\\n")
if {crash_without_no_repack!r} and "--no-repack" not in a:
    os.kill(os.getpid(), signal.SIGSEGV)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(a[a.index("--port") + 1])), H).serve_forever()
""")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return root


@pytest.mark.parametrize("crashes", [False, True])
def test_llama_server_that_crashes_at_start_serves_with_no_repack(tmp_path: Path, capsys, crashes: bool) -> None:
    """A llama-server killed by SIGSEGV while starting is started once more with --no-repack (said on stdout),
    and the timed starts of server_start then pass it; one that starts is left with its own flags."""
    import urllib.request

    from tandem.benchmarks.llama_cpp import llama_server
    from tandem.benchmarks.server_start import learn_flags, llama_command, time_to_ready

    build = _fake_server(tmp_path, crashes)
    with llama_server(build, "m.gguf", 4, 128, 2) as url:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            assert r.status == 200
    starts = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    assert ["--no-repack" in s for s in starts] == ([False, True] if crashes else [False])
    assert ("--no-repack" in capsys.readouterr().out) == crashes
    learn_flags(build, "m.gguf", 2)
    times = time_to_ready(lambda p: llama_command(build, "m.gguf", p, 2), repeats=2)
    assert len(times) == 2 and all(0 < t < 30 for t in times)
    starts = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    assert all(("--no-repack" in s) == crashes for s in starts[-3:])


def test_llama_bench_killed_by_sigsegv_runs_again_without_repacking(tmp_path: Path, capsys) -> None:
    """A llama-bench killed by SIGSEGV (0c1e570's AMX products on a Sapphire Rapids guest) runs once more with
    --repack 0, said on stdout and in the result; any other failure is an error."""
    build = _fake_build(tmp_path)
    exe = find_binary(build, "llama-bench")
    exe.write_text(exe.read_text().replace("import json, sys\n", "import json, os, signal, sys\n"
                                           "if '--repack' not in sys.argv: os.kill(os.getpid(), signal.SIGSEGV)\n"))
    r = llama_bench(build, "m.gguf", 512, 0, threads=2)
    assert r["pp_tok_s"] == 500.0 and r["repack"] is False
    assert json.loads((tmp_path / "argv.json").read_text())[-2:] == ["--repack", "0"]
    assert "--repack 0" in capsys.readouterr().out
    exe.write_text(exe.read_text().replace("import json, os, signal, sys\n", "import json, os, signal, sys\n"
                                           "sys.exit(3)\n"))
    with pytest.raises(RuntimeError, match="llama-bench failed \\(3\\)"):
        llama_bench(build, "m.gguf", 512, 0, threads=2)


def test_both_layouts_keep_llama_cpps_faster_run(tmp_path: Path) -> None:
    """both_layouts: llama-bench also with --repack 0, the faster run kept (here the file's layout)."""
    build = _fake_build(tmp_path)
    exe = find_binary(build, "llama-bench")
    exe.write_text(exe.read_text().replace(f'"avg_ts": {FAKE_TG}',
                                           f'"avg_ts": {FAKE_TG} * (2 if "--repack" in a else 1)'))
    r = llama_bench(build, "m.gguf", 0, 32, threads=2, both_layouts=True)
    assert r["tg_tok_s"] == 2 * FAKE_TG and r["repack"] is False
    assert llama_bench(build, "m.gguf", 0, 32, threads=2)["tg_tok_s"] == FAKE_TG

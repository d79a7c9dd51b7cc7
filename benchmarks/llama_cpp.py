"""llama.cpp beside tandem in one command: `--llama-cpp DIR` on `tandem bench latency` and `bench serve`.

DIR is a llama.cpp build (its `llama-bench` and `llama-server` in DIR, DIR/bin or DIR/build-*/bin); it is a
benchmark's anchor only, never a dependency. The latency benchmark runs `llama-bench -p 0 -n OUTPUT_LEN` on
the same .gguf with the same threads and prints its tg tok/s beside tandem's decode rate; the serve
benchmark starts `llama-server` on the same file and sends it the same requests as tandem's server.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median


def find_binary(build: Path, name: str) -> Path:
    """`name` in a llama.cpp build directory (DIR, DIR/bin, DIR/build*/bin); FileNotFoundError otherwise."""
    for cand in (build / name, build / "bin" / name, *sorted(build.glob(f"build*/bin/{name}"))):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"no {name} under {build} (looked in ., bin/ and build*/bin/)")


def llama_bench(build: Path, gguf: str, prompt_len: int, gen_len: int, threads: int, reps: int = 3,
                extra: tuple[str, ...] = (), both_layouts: bool = False) -> dict:
    """llama-bench's pp and tg rates on `gguf`: {"pp_tok_s", "tg_tok_s", "tg_std", "build", "repack"}; a rate
    is None when its length is 0. extra: more llama-bench flags (e.g. `--repack 0`). A run killed by SIGSEGV
    runs again with `--repack 0` (printed; "repack": False in the result): 0c1e570's AMX path crashes on
    products of more than one row on the Sapphire Rapids guest it was measured on. both_layouts: also run
    with `--repack 0` and keep the faster run (tg where it is measured, else pp): a build's repacked layout
    is not always its faster one (measured here: an AVX-512 build's repacked Q4_0 at batch 1 at half the
    rate of its file layout), and the comparison is against llama.cpp's best."""
    first = _llama_bench(build, gguf, prompt_len, gen_len, threads, reps, extra)
    if not both_layouts or not first["repack"]:
        return first
    other = _llama_bench(build, gguf, prompt_len, gen_len, threads, reps, (*extra, "--repack", "0"))
    key = "tg_tok_s" if gen_len else "pp_tok_s"
    return other if (other[key] or 0.0) > (first[key] or 0.0) else first


def _llama_bench(build: Path, gguf: str, prompt_len: int, gen_len: int, threads: int, reps: int,
                 extra: tuple[str, ...]) -> dict:
    exe = find_binary(build, "llama-bench")
    cmd = [str(exe), "-m", gguf, "-p", str(prompt_len), "-n", str(gen_len), "-t", str(threads), "-r", str(reps),
           "-o", "json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    repack = "--repack" not in extra
    if proc.returncode == -signal.SIGSEGV and repack:
        print("llama-bench crashed (SIGSEGV): running it again with --repack 0", flush=True)
        repack = False
        proc = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    rows = json.loads(proc.stdout)
    out: dict = {"pp_tok_s": None, "tg_tok_s": None, "tg_std": None, "build": None, "repack": repack}
    for r in rows:
        out["build"] = r.get("build_commit")
        if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            out["tg_tok_s"], out["tg_std"] = float(r["avg_ts"]), float(r.get("stddev_ts", 0.0))
        elif r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            out["pp_tok_s"] = float(r["avg_ts"])
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Builds whose llama-server crashed at its first product with repacked weights (llama.cpp 0c1e570's AMX path
# segfaults on products of more than one row on the Sapphire Rapids KVM guest it was measured on, as in
# llama_bench): they serve with --no-repack from then on, and say so.
_NO_REPACK: set[Path] = set()


def server_flags(build: Path, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """extra, plus --no-repack where this build's llama-server is known to crash without it."""
    return (*extra, "--no-repack") if build in _NO_REPACK and "--no-repack" not in extra else extra


@contextmanager
def llama_server(build: Path, gguf: str, parallel: int, ctx_per_slot: int, threads: int,
                 extra: tuple[str, ...] = (), timeout_s: float = 300.0) -> Iterator[str]:
    """A llama-server on 127.0.0.1 serving `gguf` with `parallel` slots (extra: more of its flags); yields its
    base URL, stops it after. A server killed by SIGSEGV while starting is started again with --no-repack
    (printed), once per build."""
    while True:
        port = _free_port()
        flags = server_flags(build, extra)
        cmd = [str(find_binary(build, "llama-server")), "-m", gguf, "-np", str(parallel), "-c",
               str(parallel * ctx_per_slot), "--cont-batching", "-t", str(threads), "--host", "127.0.0.1",
               "--port", str(port), *flags]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            if _wait_ready(proc, url, timeout_s, build, flags):
                yield url
                return
        finally:
            stop(proc)


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after grace_s; returns once it has exited."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, build: Path, flags: tuple[str, ...]) -> bool:
    """True once /health answers 200; False when it crashed with SIGSEGV and should start again with
    --no-repack; raises on any other exit or after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            if proc.returncode == -signal.SIGSEGV and "--no-repack" not in flags:
                print("llama-server crashed (SIGSEGV) at start: serving with --no-repack", flush=True)
                _NO_REPACK.add(build)
                return False
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {proc.stderr.read()[-500:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"llama-server not ready after {timeout_s}s")
        time.sleep(0.5)


def ratio_line(name: str, ours: float | None, theirs: float | None, higher_is_better: bool = True) -> str:
    """'name: tandem X vs llama.cpp Y = Z x' (Z > 1: tandem better, whichever way the figure runs)."""
    if not ours or not theirs:
        return f"{name}: tandem {ours} vs llama.cpp {theirs}"
    r = ours / theirs if higher_is_better else theirs / ours
    return f"{name}: tandem {ours:.1f} vs llama.cpp {theirs:.1f} = {r:.2f}x"


def tpot_median(results: list[dict]) -> float | None:
    vals = [r["median_tpot_ms"] for r in results if r.get("median_tpot_ms")]
    return median(vals) if vals else None

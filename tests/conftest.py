"""Shared fixtures: seeded tiny models made once per session, and engines launched through the client."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARCHS = ("llama", "qwen2", "qwen3")


def slow_cache_dir() -> Path:
    """Where the tests keep what is slow to make and depends only on its inputs' hashes (transformers
    references, the converted SmolLM2): outside the checkout, so a fresh clone on the same machine (CI's)
    reuses it. TANDEM_TEST_CACHE moves it; deleting it only costs time."""
    root = os.environ.get("TANDEM_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem", "tests"
    )
    return Path(root)


def pytest_configure(config: pytest.Config) -> None:
    from tests.reference import CACHE_ENV

    if not os.environ.get(CACHE_ENV):
        os.environ[CACHE_ENV] = str(slow_cache_dir() / "ref")


@pytest.fixture(scope="session", autouse=True)
def gguf_metadata_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """GGUF metadata files (protocol/gguf_metadata.py) go to a session directory, not the user's cache,
    unless TANDEM_CACHE_DIR is set. Engines started by the tests inherit the variable."""
    from tandem.protocol.gguf_metadata import CACHE_ENV

    if not os.environ.get(CACHE_ENV):
        os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("tandem-cache"))


@pytest.fixture(scope="session")
def c_kernels() -> None:
    """Every C kernel built and loaded (tests/c_kernels.py): its absence fails the test that needs it."""
    from tests.c_kernels import check_built

    check_built()


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _model(root: Path, arch: str, size: str = "tiny", **kw: object) -> Path:
    from tandem.launch.make_model import make_model

    name = f"{arch}-{size}" + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
    out = root / name
    if not (out / "config.json").exists():
        make_model(arch, size, out, seed=0, **kw)  # type: ignore[arg-type]
    return out


@pytest.fixture(scope="session")
def tiny_model(model_root: Path):  # a factory
    def get(arch: str = "llama", **kw: object) -> Path:
        return _model(model_root, arch, **kw)

    return get


@pytest.fixture(scope="session")
def qwen3(tiny_model) -> Path:
    """The tiny Qwen3 the scripted HTTP tests render templates with (think markers, tool-call blocks)."""
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def tok(qwen3: Path):
    from tandem.protocol.tokenizer_loader import load_tokenizer

    return load_tokenizer(qwen3)


def check_idle_engine(client) -> None:
    """Every scenario ends here: nothing running, every request ended, no KV slot leaked."""
    import time

    # A step may still be in flight after the last request ended (its overrun is dropped): wait for it.
    deadline = time.monotonic() + 10
    st = client.stats()
    while st.inflight_steps and time.monotonic() < deadline:
        time.sleep(0.05)
        st = client.stats()
    assert st.integrity == "ok", st.integrity
    assert st.running == 0 and st.waiting == 0 and st.inflight_steps == 0, st
    assert st.kv_cache_locked == 0, "a finished request still locks the prefix cache"
    assert st.kv_free + st.kv_cached == st.kv_pool_size, f"KV leak: {st.kv_free} free + {st.kv_cached} cached"
    assert st.frontend_pending == 0, st


@pytest.fixture
def launch_client() -> Iterator:
    from tandem import Client

    clients: list = []

    def launch(model: Path, **opts: object) -> Client:
        # The tests compare against float32 references and across batch shapes, which only the float32 CPU
        # kernels keep bit for bit: pinned, since --dtype auto is bf16 on AMX / AVX512-BF16 CPUs.
        opts.setdefault("dtype", "float32")
        # and a quantized GGUF's exact float32 products, not the default's int8 activations (llama.cpp's)
        opts.setdefault("cpu_int8_activations", False)
        opts.setdefault("kv_cache_tokens", 8192)
        opts.setdefault("max_running_requests", 64)
        c = Client.launch(str(model), **opts)
        clients.append(c)
        return c

    yield launch
    for c in clients:
        c.close()

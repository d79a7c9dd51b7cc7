"""One import name, `tandem`, wherever Python starts: the repository root (where `python -m` and pytest put
the checkout on sys.path beside folders named `kernels`, `scheduler`, ...) or anywhere else. Hugging Face's
`kernels`, which transformers imports at start, is never shadowed by ours."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

IMPORTS = """
import kernels, transformers.models.llama.modeling_llama, tandem
import tandem.kernels.ops, tandem.worker.model_runner
from tandem import AsyncClient, Client, EmbedParams, EngineDeadError, SamplingParams
assert hasattr(kernels, "CUDAProperties") and "site-packages" in kernels.__file__, kernels.__file__
assert Path(tandem.kernels.ops.__file__).resolve() == Path(REPO, "kernels", "ops.py"), tandem.kernels.ops.__file__
assert Client.__module__ == "tandem.frontend.client.client" and SamplingParams.__module__.startswith("tandem.")
top = {m.split(".")[0] for m in sys.modules}
ours = {"frontend", "scheduler", "worker", "detokenizer", "protocol", "launch", "benchmarks"}
assert not top & ours, top & ours  # nothing of ours was imported under a top-level name
"""


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_hf_kernels_transformers_and_tandem_import_together(where: str, tmp_path: Path) -> None:
    cwd = REPO if where == "root" else tmp_path
    script = f"import sys\nfrom pathlib import Path\nREPO = {str(REPO)!r}\n" + IMPORTS
    r = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_public_api_is_one_import() -> None:
    import tandem
    from tandem.frontend.client import AsyncClient, Client
    from tandem.protocol import errors
    from tandem.protocol.embed_params import EmbedParams
    from tandem.protocol.sampling_params import SamplingParams

    assert (tandem.Client, tandem.AsyncClient, tandem.SamplingParams, tandem.EmbedParams) == (
        Client, AsyncClient, SamplingParams, EmbedParams)
    for name in (
        "TandemError",
        "InvalidRequestError",
        "RequestFailedError",
        "OverloadedError",
        "EngineDeadError",
    ):
        assert getattr(tandem, name) is getattr(errors, name) and name in tandem.__all__
    with pytest.raises(AttributeError):
        tandem.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_python_m_tandem_generates_from_any_directory(where: str, tiny_model, tmp_path: Path) -> None:
    """`python -m tandem` is the `tandem` command; its engine's processes (spawned with `-m`, so with the
    working directory on sys.path) start from the repository root as from anywhere."""
    cwd = REPO if where == "root" else tmp_path
    r = subprocess.run(
        [sys.executable, "-m", "tandem", "generate", "--model", str(tiny_model("llama")), "--kv-cache-tokens",
         "1024", "--max-tokens", "8", "Hello"],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no generated text"

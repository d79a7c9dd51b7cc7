"""An API fuzzer nobody here wrote (schemathesis) against a served engine, from the server's own OpenAPI
document: no 5xx, schema-violating input rejected with the API's typed error, every status, content type
and body as documented. The operator route is fuzzed too, with the inference key only: it must refuse
every call (an open /drain let the fuzzer stop the server), and the engine serves on, whole, after it.
Deterministic (one seed), bounded (examples per operation), loopback only."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx
import pytest

from tandem import Client
from tests.conftest import check_idle_engine
from tests.served import Served

KEY, ADMIN, NAME = "sk-fuzz", "admin-fuzz", "tiny"
CHECKS = (
    "not_a_server_error",
    "negative_data_rejection",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
)
pytestmark = pytest.mark.slow  # ~25 s of fuzzing: the slower tier keeps make test under its 10 minutes
EXAMPLES = 25  # per operation, per phase: ~4,000 cases in about a minute here


def test_schemathesis_finds_nothing_and_cannot_stop_the_server(tiny_model, tmp_path: Path) -> None:
    served = Served(
        tiny_model("llama"),
        "--api-key",
        KEY,
        "--admin-api-key",
        ADMIN,
        "--served-model-name",
        NAME,
        "--max-model-len",
        "128",
        "--kv-cache-tokens",
        "4096",
    ).ready()
    try:
        operations = sum(len(ops) for ops in httpx.get(served.url + "/openapi.json").json()["paths"].values())
        assert operations >= 20
        run = subprocess.run(
            [
                str(Path(sys.executable).parent / "schemathesis"),
                "run",
                served.url + "/openapi.json",
                "-H",
                f"Authorization: Bearer {KEY}",
                "--checks",
                ",".join(CHECKS),
                "--max-examples",
                str(EXAMPLES),
                "--seed",
                "0",
                "--workers",
                "1",
                "--request-timeout",
                "60",
                "--generation-database",
                "none",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-6000:]
        tested = re.search(r"Tested: (\d+)", out)
        cases = re.search(r"(\d+) generated, (\d+) passed", out)
        assert tested and int(tested[1]) == operations, out[-3000:]  # every route, /drain included
        assert cases and int(cases[1]) == int(cases[2]) >= 1000, out[-3000:]
        # The fuzzer never drained it: still serving, nothing left running, no KV leaked.
        assert httpx.get(served.url + "/health").status_code == 200
        r = httpx.post(
            served.url + "/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
            json={"model": NAME, "prompt": "after the fuzzer", "max_tokens": 3, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        with Client(served.endpoint) as client:
            check_idle_engine(client)
    finally:
        assert served.close() == 0

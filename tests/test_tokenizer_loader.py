"""The frontend's tokenizer: the class a model's tokenizer_config.json names, loaded without torch when that
is the plain tokenizer.json class, and the same tokenizer AutoTokenizer gives."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.protocol.tokenizer_loader import load_tokenizer

TEXTS = ["Hello world", "  leading spaces and\ttabs\n", "中文和 emoji 🙂", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_plain_class_loads_like_autotokenizer(tiny_model, arch: str) -> None:
    from transformers import AutoTokenizer

    model = tiny_model(arch)
    ours, auto = load_tokenizer(model), AutoTokenizer.from_pretrained(str(model))
    assert type(ours) is type(auto)
    for t in TEXTS:
        assert ours(t).input_ids == auto(t).input_ids
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (
        auto.eos_token_id, auto.bos_token_id, auto.all_special_ids)


def test_plain_class_does_not_import_torch(tiny_model) -> None:
    """The frontend and HTTP processes need no torch: importing it cost ~2 s of every engine start."""
    code = ("import sys; from tandem.protocol.tokenizer_loader import load_tokenizer; "
            f"load_tokenizer({str(tiny_model('llama'))!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1])
    assert out.stdout.strip() == "False", out.stderr


def test_other_classes_go_through_autotokenizer(tiny_model, tmp_path: Path) -> None:
    """A named class that is not the plain one (here GPT2's) is resolved by AutoTokenizer, as before."""
    src = tiny_model("llama")
    for f in ("tokenizer.json", "config.json"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert type(tok).__name__ == "GPT2Tokenizer"
    assert tok("Hello world").input_ids == load_tokenizer(src)("Hello world").input_ids


def test_the_launcher_and_its_spawn_targets_import_no_torch() -> None:
    """The launcher imports each process's entry function to spawn it: none may pull in torch, transformers
    or xgrammar (the worker's failed-step module once did, ~1 s before any process started)."""
    code = (
        "import sys; import tandem.launch.serve, tandem.launch.launcher; "
        "from tandem.worker.process import run_worker; from tandem.scheduler.process import run_scheduler; "
        "from tandem.frontend.server.process import run_frontend; from tandem.frontend.http.process import run_http; "
        "from tandem.detokenizer.process import run_detokenizer; "
        "print(sorted(m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

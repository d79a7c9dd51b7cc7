"""A Gemma 3 GGUF text file with llama.cpp's multimodal projector file (`--mmproj`), both written by
llama.cpp's own converter from a random-weight checkpoint, reads images as transformers reads the
checkpoint: the same greedy tokens and logprobs with 0, 1 and 3 images. The checkpoint is first made what
the files can say: every layer sliding (the converter writes no layer pattern; llama.cpp's default, a
global layer every sixth, has none in three layers), the vocabulary the converter keeps, and the projection
matrix in float16 (the converter's type for it)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor, Gemma3ForConditionalGeneration

from tandem import Client
from tandem.benchmarks.llama_convert import find_converter
from tests.conftest import check_idle_engine
from tests.test_vision_engine import PICS, _template_form, conversation

pytestmark = pytest.mark.slow
N = 10


def _representable(src, out):
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + len(tok["added_tokens"])  # the converter's rows of token_embd
    text = cfg["text_config"]
    text["layer_types"] = ["sliding_attention"] * text["num_hidden_layers"]
    text["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(cfg))
    w = load_file(out / "model.safetensors")
    w["language_model.model.embed_tokens.weight"] = w["language_model.model.embed_tokens.weight"][:vocab].clone()
    p = "multi_modal_projector.mm_input_projection_weight"
    w[p] = w[p].half().float()
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _convert(src, out, mmproj: bool):
    import subprocess
    import sys

    from tandem.benchmarks.llama_convert import _DRIVER

    args = [sys.executable, "-c", _DRIVER, str(find_converter()), str(src), "--outtype", "f32", "--outfile", str(out)]
    r = subprocess.run(args + (["--mmproj"] if mmproj else []), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and out.is_file(), r.stderr[-2000:]
    return out


def test_a_gguf_text_file_and_its_projector_read_images_as_transformers_does(tiny_model, tmp_path) -> None:
    hf_dir = _representable(tiny_model("gemma3_vision"), tmp_path / "hf")
    text = _convert(hf_dir, tmp_path / "text.gguf", mmproj=False)
    proj = _convert(hf_dir, tmp_path / "mmproj.gguf", mmproj=True)
    proc = AutoProcessor.from_pretrained(hf_dir)
    ref = Gemma3ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    cap = ref.config.get_text_config().final_logit_softcapping
    with Client.launch(str(text), mmproj=str(proj), dtype="float32") as c:
        for k in (0, 1, 3):
            msgs = conversation(PICS[:k])
            prompt = proc.apply_chat_template(_template_form(msgs), tokenize=False, add_generation_prompt=True)
            inp = proc(text=prompt, images=PICS[:k] or None, return_tensors="pt", add_special_tokens=False)
            with torch.no_grad():
                g = ref.generate(**inp, max_new_tokens=N, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            want = g.sequences[0, inp["input_ids"].shape[1]:].tolist()
            lps = [torch.log_softmax(torch.tanh(lg[0] / cap) * cap, -1)[t].item() for lg, t in zip(g.logits, want)]
            got = c.generate(msgs, {"max_tokens": N, "temperature": 0, "ignore_eos": True, "logprobs": 0})
            assert got.prompt_tokens == inp["input_ids"].shape[1]
            assert got.token_ids == want, k
            np.testing.assert_allclose(got.logprobs.logprobs, lps, atol=1e-4)
        check_idle_engine(c)

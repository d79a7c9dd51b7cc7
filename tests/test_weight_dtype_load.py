"""Float weights loaded straight into the dtype the C kernels keep them in (worker/loader.py): the same
bits as loading float32 and casting after (pack_cpu_weights' old path), for GGUF float files read from their
mapping and for a safetensors directory, with the float32 table never made."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.worker.layers import PackableLinear
from tandem.worker.loader import load_model
from tests.c_kernels import needs_c_kernels
from tests.gguf_files import write_gguf

pytestmark = needs_c_kernels


def _linears(m: torch.nn.Module) -> dict[str, PackableLinear]:
    return {n: x for n, x in m.named_modules() if isinstance(x, PackableLinear)}


@pytest.mark.parametrize(("source", "weight_dtype"), [
    ("F32", torch.bfloat16),  # values bf16 cannot hold: the copy must round as .to() does
    ("BF16", torch.bfloat16),
    ("F16", torch.float16),
    ("F32", torch.float16),
    ("dir", torch.bfloat16),
])
def test_loaded_in_the_weight_dtype_as_cast_after(tiny_model, tmp_path: Path, source: str,
                                                 weight_dtype: torch.dtype) -> None:
    src = tiny_model("llama")
    path = src
    if source != "dir":
        path = tmp_path / f"llama-{source}.gguf"
        write_gguf(src, path, source)
    cast_after = load_model(str(path), torch.float32, "cpu")
    cast_after.pack_cpu_weights(weight_dtype)
    direct = load_model(str(path), torch.float32, "cpu", weight_dtype=weight_dtype)
    before = _linears(direct)
    assert before and all(x.weight.dtype == weight_dtype for x in before.values())  # no float32 table
    direct.pack_cpu_weights(weight_dtype)
    after, ref = _linears(direct), _linears(cast_after)
    assert after.keys() == ref.keys()
    for name, x in after.items():
        y = ref[name]
        assert x.weight.dtype == y.weight.dtype == weight_dtype, name
        assert torch.equal(x.weight.view(torch.int16), y.weight.view(torch.int16)), name
        assert x.dense is not None and torch.equal(x.dense.data, y.dense.data), name
    h, g = direct.lm_head or direct.model.embed_tokens, cast_after.lm_head or cast_after.model.embed_tokens
    assert torch.equal(h.head_dense.data, g.head_dense.data)

"""Qwen2.5-VL's images through the engine (Client.launch, float32) on a random-weight checkpoint, against
transformers' Qwen2_5_VLForConditionalGeneration: dynamic resolution (images of three sizes give 6, 8 and
10 tokens), multimodal RoPE positions (the text after an image runs behind its index, decode too), chunk
boundaries inside images (attended causally, so a chunk may end anywhere), the encoder budget, async off,
and the images' KV from the prefix cache, every sequence and logprob equal."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration

from tandem import Client
from tandem.frontend.image_prompt import ImagePrompter
from tandem.protocol.errors import InvalidRequestError
from tandem.worker.encoder_cache import image_pixels
from tests.conftest import check_idle_engine

N = 12


def picture(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


PICS = [picture(1, 40, 30), picture(2, 56, 28), picture(3, 30, 70)]


def conversation(images: list[Image.Image]) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": "Look:"}]
    for im in images:
        parts += [{"type": "image", "image": im}, {"type": "text", "text": "and"}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]}]


def template_form(msgs: list[dict]) -> list[dict]:
    return [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
            for m in msgs]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen2_5_vl")


@pytest.fixture(scope="module")
def references(model):
    """transformers' greedy tokens and logprobs, given the prompt ids, pixel rows and grids the processor's
    parts make (its whole processor needs torchvision, which this venv lacks)."""
    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    prompter = ImagePrompter(str(model))
    out = {}
    for k in (0, 1, 3):
        ids, items = prompter.prompt(template_form(conversation(PICS[:k])), PICS[:k])
        t = torch.tensor([ids])
        kw = {}
        if items:
            kw = {"pixel_values": torch.cat([image_pixels(im) for im in items]),
                  "image_grid_thw": torch.tensor([im.grid for im in items]),
                  "mm_token_type_ids": (t == prompter.image_token_id).int()}
        with torch.no_grad():
            g = ref.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=N, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **kw)
        toks = g.sequences[0, len(ids):].tolist()
        out[k] = (toks, [torch.log_softmax(lg[0], -1)[x].item() for lg, x in zip(g.logits, toks)],
                  [im.length for im in items])
    assert out[3][2] == [6, 8, 10]  # three sizes, three token counts
    return out


@pytest.mark.parametrize("options", [{}, {"chunked_prefill_tokens": 5, "async_scheduling": False,
                                          "encoder_tokens_per_step": 6}], ids=["whole", "chunked-sync"])
def test_greedy_parity_with_transformers_with_0_1_and_3_images(model, references, options) -> None:
    with Client.launch(str(model), dtype="float32", **options) as c:
        for again in (False, True):
            for k, (toks, lps, _) in references.items():
                got = c.generate(conversation(PICS[:k]), {"max_tokens": N, "temperature": 0, "ignore_eos": True,
                                                          "logprobs": 0})
                assert got.token_ids == toks, (k, again)
                np.testing.assert_allclose(got.logprobs.logprobs, lps, atol=1e-4, err_msg=f"{k} images")
                if again and k:
                    assert got.cached_tokens == got.prompt_tokens - 1  # the images' KV came back
        check_idle_engine(c)


def test_the_processor_parts_refuse_images_without_places(model) -> None:
    p = ImagePrompter(str(model))
    with pytest.raises(InvalidRequestError, match="do not fit the messages"):
        p.prompt([{"role": "user", "content": [{"type": "text", "text": "no place"}]}], [PICS[0]])


def test_an_images_kv_comes_back_from_the_host_tier(model, references) -> None:
    """A device pool too small to keep the first prompt's KV beside the others': it moves to the host tier,
    keyed by the images' digests, and comes back for the same prompt (never for other pictures)."""
    sp = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
    with Client.launch(str(model), dtype="float32", kv_cache_tokens=96, host_kv_tokens=4096,
                       debug_integrity=True) as c:
        assert c.generate(conversation(PICS[:3]), sp).token_ids == references[3][0]
        others = [list(reversed(PICS)), [PICS[2]], [PICS[1], PICS[0]]]  # the same pictures, other places
        for pics in others:
            c.generate(conversation(pics), sp)
        before = c.stats().host_hit_tokens
        again = c.generate(conversation(PICS[:3]), sp)
        assert again.token_ids == references[3][0]
        assert c.stats().host_hit_tokens > before and again.cached_tokens > 0
        check_idle_engine(c)


@pytest.mark.slow
def test_greedy_parity_with_two_tensor_parallel_ranks_and_images(model, references) -> None:
    with Client.launch(str(model), dtype="float32", tp_size=2) as c:
        for k, (toks, lps, _) in references.items():
            got = c.generate(conversation(PICS[:k]), {"max_tokens": N, "temperature": 0, "ignore_eos": True,
                                                      "logprobs": 0})
            assert got.token_ids == toks, k
            np.testing.assert_allclose(got.logprobs.logprobs, lps, atol=1e-4)
        check_idle_engine(c)

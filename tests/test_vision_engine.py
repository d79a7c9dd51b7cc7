"""Images through the engine (Client.launch, float32) on a random-weight Gemma 3 with its vision tower,
against transformers' Gemma3ForConditionalGeneration on the same checkpoint: prompts with 0, 1 and 3 images
of different sizes give the same greedy tokens and the same logprobs (which the images' two-way attention
moves: a causal mask is off by 5e-2), whole, chunked with chunk boundaries that fall inside images, and with
async scheduling off; an image's KV comes back from the prefix cache for the next turn (only what follows
is prefilled) and never for another image with the same text."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Gemma3ForConditionalGeneration

from tandem import Client
from tests.conftest import check_idle_engine

N = 12


def picture(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


PICS = [picture(1, 40, 30), picture(2, 28, 28), picture(3, 100, 64)]


def conversation(images: list[Image.Image], text: str = "what?") -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": "Look:"}]
    for im in images:
        parts += [{"type": "image", "image": im}, {"type": "text", "text": "and"}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _template_form(msgs: list[dict]) -> list[dict]:
    return [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
            for m in msgs]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gemma3_vision")


@pytest.fixture(scope="module")
def references(model):
    """Per prompt: transformers' greedy tokens and their logprobs (its logits soft-capped as the model's
    config says: generate's output_logits are taken before the cap)."""
    proc = AutoProcessor.from_pretrained(model)
    ref = Gemma3ForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    cap = ref.config.get_text_config().final_logit_softcapping
    out = {}
    for k in (0, 1, 3):
        msgs = conversation(PICS[:k])
        text = proc.apply_chat_template(_template_form(msgs), tokenize=False, add_generation_prompt=True)
        inp = proc(text=text, images=PICS[:k] or None, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            g = ref.generate(**inp, max_new_tokens=N, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        toks = g.sequences[0, inp["input_ids"].shape[1]:].tolist()
        lps = [torch.log_softmax(torch.tanh(lg[0] / cap) * cap, -1)[t].item() for lg, t in zip(g.logits, toks)]
        out[k] = (toks, lps, inp["input_ids"].shape[1])
    return out


def _check(c: Client, references: dict) -> None:
    for k, (toks, lps, n_prompt) in references.items():
        got = c.generate(conversation(PICS[:k]), {"max_tokens": N, "temperature": 0, "ignore_eos": True,
                                                  "logprobs": 0})
        assert got.prompt_tokens == n_prompt
        assert got.token_ids == toks, k
        np.testing.assert_allclose(got.logprobs.logprobs, lps, atol=1e-4, err_msg=f"{k} images")


@pytest.mark.parametrize("options", [{}, {"chunked_prefill_tokens": 7, "async_scheduling": False,
                                      "encoder_tokens_per_step": 4}],
                         ids=["whole", "chunked-sync"])
def test_greedy_parity_with_transformers_with_0_1_and_3_images(model, references, options) -> None:
    with Client.launch(str(model), dtype="float32", **options) as c:
        _check(c, references)
        _check(c, references)  # again: the images' KV from the prefix cache
        check_idle_engine(c)


def test_the_same_image_reuses_its_kv_and_another_image_never_does(model) -> None:
    sp = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with Client.launch(str(model), dtype="float32") as c:
        first = c.generate(conversation([PICS[0]], "what is it?"), sp)
        prefilled = c.stats().prefill_tokens
        turn2 = conversation([PICS[0]], "what is it?") + [
            {"role": "assistant", "content": [{"type": "text", "text": first.text}]},
            {"role": "user", "content": [{"type": "text", "text": "and then?"}]}]
        second = c.generate(turn2, sp)
        # everything up to the reply's last token came from the cache: the image's KV with it
        assert second.cached_tokens >= first.prompt_tokens
        assert c.stats().prefill_tokens - prefilled == second.prompt_tokens - second.cached_tokens
        assert c.stats().images_encoded == 1  # the image's KV came back: not encoded again
        # the same picture after other text: its KV is not a prefix, its encoding is kept
        c.generate([{"role": "user", "content": [{"type": "text", "text": "Other words first."},
                                                 {"type": "image", "image": PICS[0]}]}], sp)
        assert c.stats().images_encoded == 1
        other = c.generate(conversation([PICS[1]], "what is it?"), sp)
        image_at = _ids(model, [PICS[1]]).index(IMAGE_TOKEN)
        assert other.cached_tokens <= image_at  # the same text before the image; nothing from the image on
        assert c.stats().images_encoded == 2
        check_idle_engine(c)


IMAGE_TOKEN = 1025  # the tiny preset's <image_soft_token>


def _ids(model, images: list[Image.Image]) -> list[int]:
    from tandem.frontend.image_prompt import ImagePrompter

    msgs = _template_form(conversation(images, "what is it?"))
    return ImagePrompter(str(model)).prompt(msgs, images)[0]


def test_retracted_image_requests_come_back_with_their_images(model, references) -> None:
    """A KV pool too small for the batch: requests are retracted and prefilled again, images and all."""
    from tandem.frontend.image_prompt import ImagePrompter
    from tandem.protocol.image_item import ImagePrompt

    prompter = ImagePrompter(str(model))
    ks = (3, 1, 3, 0, 1, 3, 3, 1)
    # made here first, so that all arrive at once (the client would make each as it sends it)
    prompts = [ImagePrompt(*prompter.prompt(_template_form(conversation(PICS[:k])), PICS[:k])) for k in ks]
    sp = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
    with Client.launch(str(model), dtype="float32", kv_cache_tokens=128, prefix_cache=False) as c:
        outs = c.generate_batch(prompts, sp, progress=False)
        assert c.stats().retractions > 0
        for k, out in zip(ks, outs, strict=True):
            assert out.token_ids == references[k][0], k
        check_idle_engine(c)


@pytest.mark.slow
def test_greedy_parity_with_two_tensor_parallel_ranks(model, references) -> None:
    with Client.launch(str(model), dtype="float32", tp_size=2) as c:
        _check(c, references)
        check_idle_engine(c)


def test_a_session_continues_a_turn_with_images_as_the_whole_conversation_runs(model) -> None:
    from tandem.frontend.image_prompt import ImagePrompter
    from tandem.protocol.image_item import ImagePrompt

    sp = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = conversation([PICS[0], PICS[2]], "what is it?")
    ids1, items1 = ImagePrompter(str(model)).prompt(_template_form(first), [PICS[0], PICS[2]])
    follow = [7, 8, 9, 10]
    with Client.launch(str(model), dtype="float32") as c:
        with c.open_session(4096) as s:
            t1 = s.generate(first, sp)
            prefilled = c.stats().prefill_tokens
            t2 = s.generate(follow, sp)
            # the turn's KV held, images and all: only its last token (sampled, never computed) and the new ones
            assert c.stats().prefill_tokens - prefilled == 1 + len(follow)
        whole = ImagePrompt(ids1 + t1.token_ids + follow, items1)
        assert c.generate(whole, sp).token_ids == t2.token_ids
        check_idle_engine(c)

"""The socket-free parts of images: the frontend's check of a prompt's images (and the digest it computes
itself), the prefix cache's key for them, where a prefill chunk may end, the worker's encoder cache and which
batch rows take which encoder output, and decoding an image (every way it can be bad)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tandem.frontend.image_prompt import ImageLimits, ImagePrompter, open_image
from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.image_item import ImageItem, check_images, image_digest, key_token
from tandem.protocol.messages import ScheduledReq
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.req import Req
from tandem.scheduler.step_plan import StepPlan
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.image_rows import EncoderCache, attach_images
from tandem.worker.request_state import RequestState

IMG = 9  # the image token in these prompts


def item(offset: int, length: int, seed: int = 0, shape: tuple[int, ...] = (3, 2, 2)) -> ImageItem:
    px = np.random.default_rng(seed).random(shape, dtype=np.float32)
    return ImageItem(offset, length, list(shape), px.tobytes())


def test_the_frontend_checks_images_against_the_prompt_and_digests_them_itself() -> None:
    ids = [1, IMG, IMG, 2, IMG, IMG, IMG, 3]
    a, b = item(1, 2, seed=1), item(4, 3, seed=2)
    lying = ImageItem(a.offset, a.length, a.shape, a.pixels, digest=image_digest(b))
    out = check_images(ids, [lying, b], IMG)
    assert out[0].digest == image_digest(a) != image_digest(b) == out[1].digest  # a client's digest is ignored
    bad = [
        ([item(1, 2), item(4, 2)], "do not match"),  # one image token left without an image
        ([item(4, 3), item(1, 2)], "out of order"),
        ([item(0, 2), item(4, 3)], "not all the image token"),
        ([ImageItem(1, 2, [3, 2, 2], b"\0" * 7), item(4, 3)], "bytes of pixels"),
        ([item(1, 2), item(4, 5)], "outside the prompt"),
    ]
    for images, words in bad:
        with pytest.raises(InvalidRequestError, match=words) as e:
            check_images(ids, images, IMG)
        assert e.value.code == ErrorCode.IMAGE
    with pytest.raises(InvalidRequestError, match="text only"):
        check_images(ids, [a, b], None)
    with pytest.raises(InvalidRequestError, match="no image came"):
        check_images(ids, [], IMG)
    assert check_images([1, 2], [], None) == []


def _req(ids: list[int], images: list[ImageItem], bidirectional: bool = True) -> Req:
    return Req("r", ids, SamplingParams(), frozenset(), 4, images=check_images(ids, images, IMG),
               images_bidirectional=bidirectional)


def test_the_prefix_key_tells_images_apart_and_a_chunk_never_ends_inside_an_image() -> None:
    ids = [1, 2, IMG, IMG, IMG, IMG, 3, 4, IMG, IMG, 5]
    r1 = _req(ids, [item(2, 4, seed=1), item(8, 2, seed=2)])
    r2 = _req(ids, [item(2, 4, seed=1), item(8, 2, seed=3)])
    assert r1.fill_ids == r2.fill_ids == ids  # the tokens themselves are the model's
    k1, k2 = r1.key_ids, r2.key_ids
    assert k1[:8] == k2[:8] and k1[8:10] != k2[8:10] and k1[10:] == k2[10:]
    assert k1[2] == key_token(r1.images[0].digest) < 0 and set(k1[2:6]) == {k1[2]}
    # from 0: 3 tokens would end inside the first image: stop before it; 7 ends after it: as asked
    assert r1.chunk_end(3) == 2 and r1.chunk_end(7) == 7 and r1.chunk_end(9) == 8
    r1.num_computed_tokens = 4  # a cached prefix that ends inside the image: go through its end
    assert r1.chunk_end(1) == 2
    causal = _req(ids, [item(2, 4, seed=1), item(8, 2, seed=2)], bidirectional=False)
    assert causal.chunk_end(3) == 3  # a causal model's chunk may end anywhere


def test_a_step_encodes_images_within_its_budget_and_one_too_large_alone() -> None:
    ids = [1, IMG, IMG, IMG, 2, IMG, IMG, IMG, 3, IMG, IMG, IMG, 4]
    images = [item(1, 3, seed=1), item(5, 3, seed=2), item(9, 3, seed=3)]
    plan = StepPlan(budget=100, prefill_cap=100, encoder_cap=6)
    r = _req(ids, images, bidirectional=False)
    assert plan.fit_images(r, 13) == 9 and plan.encoder_used == 6  # two images fit; the chunk stops at the third
    other = _req(ids, images, bidirectional=False)
    assert plan.fit_images(other, 13) == 1  # the budget is spent: only the text before its first image
    alone = StepPlan(budget=100, prefill_cap=100, encoder_cap=2)
    big = _req(ids, images)
    assert alone.fit_images(big, 13) == 1 and alone.encoder_used == 0  # the text before it
    big.num_computed_tokens = 1
    alone = StepPlan(budget=100, prefill_cap=100, encoder_cap=2)
    assert alone.fit_images(big, 12) == 4 and alone.encoder_used == 3  # larger than the budget: alone
    assert alone.fit_images(_req(ids, images), 13) == 1
    assert StepPlan(budget=100, prefill_cap=100).fit_images(_req(ids, images), 13) == 13  # no cap


def test_the_encoder_runs_once_per_image_and_its_outputs_fill_their_rows() -> None:
    calls: list[int] = []

    def encode(items: list[ImageItem]) -> list[torch.Tensor]:
        calls.append(len(items))
        return [torch.full((im.length, 2), float(im.offset)) + torch.arange(im.length)[:, None] for im in items]

    cache = EncoderCache(encode, budget_bytes=1 << 20)
    st = RequestState(4, 32, torch.device("cpu"))
    a = check_images([0, IMG, IMG, IMG, 0], [item(1, 3, seed=1)], IMG)
    st.images[2] = a
    st.images[3] = check_images([IMG, IMG, IMG, 0], [item(0, 3, seed=1)], IMG)  # the same picture elsewhere
    # row 2 computes positions 2..4 (1 is cached: the image started before), row 3 positions 0..1, row 1 none
    batch = ForwardBatch.from_lists([0] * 6, [0] * 6, [2, 3, 1], [5, 2, 7], [3, 2, 1])
    sched = [ScheduledReq(r, n, 0, [], True) for r, n in ((2, 3), (3, 2), (1, 1))]
    attach_images(batch, sched, st, cache, bidirectional=True)
    assert batch.image_rows.tolist() == [0, 1, 3, 4]
    # one encoding (both rows hold one digest), its tokens 1..2 for row 2 and 0..1 for row 3
    assert calls == [1] and cache.encoded == 1
    assert batch.image_embeds[:, 0].tolist() == [2.0, 3.0, 1.0, 2.0]
    assert batch.image_spans == [[(1, 4)], [(0, 3)], []]
    attach_images(batch, sched, st, cache, bidirectional=False)
    assert calls == [1]  # kept: not encoded again


def test_the_encoder_cache_keeps_its_budget_least_recently_used_first() -> None:
    cache = EncoderCache(lambda items: [torch.zeros(im.length, 256) for im in items], budget_bytes=3 * 1024)
    imgs = [check_images([IMG], [item(0, 1, seed=s)], IMG)[0] for s in range(4)]
    for im in imgs[:3]:
        cache.get([im])
    cache.get([imgs[0]])  # used again: the oldest is now imgs[1]
    cache.get([imgs[3]])
    assert list(cache.entries) == [imgs[2].digest, imgs[0].digest, imgs[3].digest]
    assert cache.bytes <= cache.budget and cache.encoded == 4


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_bad_image_is_a_typed_error_before_the_model_sees_it(tiny_model) -> None:
    good = _png(40, 30)
    assert open_image(good).size == (40, 30)
    for data, words in ((b"plain text", "not an image"), (good[: len(good) // 2], "cannot be decoded"),
                        (b"", "not an image")):
        with pytest.raises(InvalidRequestError, match=words) as e:
            open_image(data)
        assert e.value.code == ErrorCode.IMAGE
    p = ImagePrompter(str(tiny_model("gemma3_vision")), ImageLimits(per_prompt=1, pixels=2000))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(InvalidRequestError, match="over the limit of 2000 pixels"):
        p.prompt(msgs, [_png(60, 60)])
    with pytest.raises(InvalidRequestError, match="limit is 1"):
        p.prompt(msgs, [good, good])
    with pytest.raises(InvalidRequestError, match="do not fit the messages"):
        p.prompt([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], [good])
    ids, items = p.prompt(msgs, [good])
    assert [ids[i] for i in range(items[0].offset, items[0].offset + items[0].length)] == [p.image_token_id] * 4
    with pytest.raises(InvalidRequestError, match="text only"):
        ImagePrompter(str(tiny_model("llama"))).prompt(msgs, [good])


def test_requests_behind_an_image_past_the_encoder_budget_go_on_and_everything_ends() -> None:
    from tandem.protocol.engine_config import EngineConfig
    from tandem.protocol.messages import TokenizedRequest
    from tandem.protocol.model_info import ModelInfo
    from tandem.scheduler.scheduler import Scheduler
    from tests.fake_worker import VOCAB, FakeWorker, expected_output
    from tests.test_scheduler_core import run

    cfg = EngineConfig(model="x", max_num_batched_tokens=256, encoder_tokens_per_step=3, async_scheduling=False)
    info = ModelInfo(vocab_size=VOCAB, max_model_len=512, eos_token_ids=[0], architecture="fake",
                     image_token_id=IMG, images_bidirectional=True)
    sched, worker = Scheduler(cfg, info, 4096), FakeWorker(4096)
    prompts = {"a": [1, IMG, IMG, IMG, 2], "b": [IMG, IMG, IMG, 4], "c": [5, 6, 7]}
    for rid, ids in prompts.items():
        images = [item(ids.index(IMG), 3, seed=ord(rid))] if IMG in ids else []
        sched.add_request(TokenizedRequest(rid, ids, SamplingParams(max_tokens=3, ignore_eos=True),
                                           images=check_images(ids, images, IMG)))
    step = sched.schedule()
    counts = {sched.reqs[r].rid: s.num_tokens for s in step.scheduled for r in sched.reqs
              if sched.reqs[r].req_pool_idx == s.req_pool_idx}
    # a's image takes the step's encoder budget; b, which begins with an image, waits; c is not held back
    assert counts == {"a": 5, "c": 3}
    sched.commit(worker.execute(step))
    outputs, _ = run(sched, worker, 1)
    assert outputs == {rid: expected_output(ids, 3) for rid, ids in prompts.items()}


def test_a_projector_option_that_is_not_one_is_a_one_line_error(tiny_model, tmp_path) -> None:
    from tandem.protocol.errors import ModelLoadError
    from tandem.protocol.mmproj import projector_model_dir
    from tests.gguf_files import write_gguf

    text = write_gguf(tiny_model("gemma3"), tmp_path / "text.gguf", "F32")
    with pytest.raises(ModelLoadError, match="not a Gemma 3 that reads images"):  # no image tokens
        projector_model_dir(text, text)
    with pytest.raises(ModelLoadError, match="no such file"):
        projector_model_dir(text, tmp_path / "missing.gguf")

"""The socket-free parts of images: the frontend's check of a prompt's images (and the digest it computes
itself), the prefix cache's key for them, where a prefill chunk may end, the worker's encoder cache (an
encoding run in pieces) and which batch rows take which encoder output, and decoding an image (every way it
can be bad)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tandem.frontend.image_prompt import ImageLimits, ImagePrompter, open_image
from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.image_item import ImageItem, check_images, image_digest, key_token
from tandem.protocol.messages import EncodeWork, ScheduledReq
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.req import Req
from tandem.worker.encoder_cache import EncoderCache
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.image_rows import attach_images
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


def _encoder(calls: list[str], pieces: int = 3):
    """A stand-in encoder of `pieces` pieces: image -> rows offset + 0, 1, ... (calls: the images started)."""
    def stages(im: ImageItem):
        calls.append(im.digest)
        for _ in range(pieces - 1):
            yield
        return torch.full((im.length, 2), float(im.offset)) + torch.arange(im.length)[:, None]

    return stages


def test_the_encoder_runs_once_per_image_and_its_outputs_fill_their_rows() -> None:
    calls: list[str] = []
    cache = EncoderCache(_encoder(calls), budget_bytes=1 << 20)
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
    assert calls == [a[0].digest] and cache.encoded == 1
    assert batch.image_embeds[:, 0].tolist() == [2.0, 3.0, 1.0, 2.0]
    assert batch.image_spans == [[(1, 4)], [(0, 3)], []]
    attach_images(batch, sched, st, cache, bidirectional=False)
    assert calls == [a[0].digest]  # kept: not encoded again


def test_an_encoding_runs_in_pieces_and_one_left_unfinished_is_finished_when_needed() -> None:
    calls: list[str] = []
    cache = EncoderCache(_encoder(calls, pieces=3))
    a, b, c = (check_images([IMG, IMG], [item(0, 2, seed=s)], IMG)[0] for s in (1, 2, 3))
    assert cache.run([EncodeWork(a.digest, 1, a), EncodeWork(b.digest, 2, b)]) == []
    assert set(cache.partial) == {a.digest, b.digest} and cache.encoded == 0
    assert cache.run([EncodeWork(b.digest, 1), EncodeWork(c.digest, 1)]) == []  # c: never started, no pixels
    assert b.digest in cache.entries and cache.encoded == 1 and c.digest not in cache.partial
    assert cache.run([EncodeWork(b.digest, 1, b)]) == [b.digest]  # kept: the scheduler may stop sending it
    out = cache.get([a, c])  # a's rest, and all of c, now
    assert out[a.digest][:, 0].tolist() == [0.0, 1.0] and cache.encoded == 3 and not cache.partial
    assert calls == [a.digest, b.digest, c.digest]
    cache.run([EncodeWork(d.digest, 1, d) for d in [check_images([IMG], [item(0, 1, seed=4)], IMG)[0]]])
    cache.drop(list(cache.partial))
    assert not cache.partial and cache.encoded == 3


def test_an_encoding_that_raises_is_not_kept_half_done() -> None:
    fail = [True]

    def stages(im: ImageItem):
        yield
        if fail[0]:
            raise RuntimeError("out of memory")
        return torch.zeros(im.length, 2)

    cache = EncoderCache(stages)
    a = check_images([IMG], [item(0, 1, seed=1)], IMG)[0]
    cache.run([EncodeWork(a.digest, 1, a)])
    with pytest.raises(RuntimeError, match="out of memory"):
        cache.run([EncodeWork(a.digest, 1)])
    assert not cache.partial and not cache.entries
    fail[0] = False
    assert cache.get([a])[a.digest].shape == (1, 2) and cache.encoded == 1


def test_the_encoder_cache_keeps_its_budget_least_recently_used_first() -> None:
    calls: list[str] = []
    cache = EncoderCache(_encoder(calls), budget_bytes=3 * 8)  # an image of 1 token: 2 floats, 8 bytes
    imgs = [check_images([IMG], [item(0, 1, seed=s)], IMG)[0] for s in range(4)]
    for im in imgs[:3]:
        cache.get([im])
    cache.get([imgs[0]])  # used again: the oldest is now imgs[1]
    cache.get([imgs[3]])
    assert list(cache.entries) == [imgs[2].digest, imgs[0].digest, imgs[3].digest]
    assert cache.bytes <= cache.budget and cache.encoded == 4 and len(calls) == 4


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


def test_a_projector_option_that_is_not_one_is_a_one_line_error(tiny_model, tmp_path) -> None:
    from tandem.protocol.errors import ModelLoadError
    from tandem.protocol.mmproj import projector_model_dir
    from tests.gguf_files import write_gguf

    text = write_gguf(tiny_model("gemma3"), tmp_path / "text.gguf", "F32")
    with pytest.raises(ModelLoadError, match="not a Gemma 3 that reads images"):  # no image tokens
        projector_model_dir(text, text)
    with pytest.raises(ModelLoadError, match="no such file"):
        projector_model_dir(text, tmp_path / "missing.gguf")

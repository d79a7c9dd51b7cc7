"""Image encoding spread over steps (scheduler/image_encoding.py) against the fake worker, which checks that
no step computes an image's tokens before all of its encoder's pieces ran, that an encoding is continued
only after it was started (with its pixels) and never past its layers."""
from __future__ import annotations

import pytest

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.image_item import check_images
from tandem.protocol.messages import AbortRequest, TokenizedRequest
from tandem.protocol.model_info import ModelInfo
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.image_encoding import ImageEncoding
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.step_driver import StepDriver
from tests.fake_worker import VOCAB, FakeWorker, expected_output
from tests.test_image_items import IMG, _req, item
from tests.test_scheduler_core import run

LAYERS = 4


def _engine(budget: int, depth: int = 1, slots: int = 4096, max_running: int = 64):
    cfg = EngineConfig(model="x", max_num_batched_tokens=256, encoder_tokens_per_step=budget,
                       async_scheduling=depth == 2, max_running_requests=max_running)
    info = ModelInfo(vocab_size=VOCAB, max_model_len=512, eos_token_ids=[0], architecture="fake",
                     image_token_id=IMG, images_bidirectional=True, image_encoder_pieces=LAYERS)
    return Scheduler(cfg, info, slots), FakeWorker(slots, encoder_layers=LAYERS)


def _add(sched: Scheduler, rid: str, ids: list[int], seeds: list[int], max_tokens: int = 3) -> None:
    offsets = [i for i, t in enumerate(ids) if t == IMG and (i == 0 or ids[i - 1] != IMG)]
    lengths = [next((j for j in range(o, len(ids)) if ids[j] != IMG), len(ids)) - o for o in offsets]
    images = [item(o, n, seed=s) for o, n, s in zip(offsets, lengths, seeds, strict=True)]
    sched.add_request(TokenizedRequest(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                       images=check_images(ids, images, IMG)))


def _cost(so, lengths: dict[str, int]) -> int:
    """The step's encoding in image tokens through one layer."""
    return sum(w.pieces * lengths[w.digest] for w in so.encode)


def test_a_chunk_stops_before_an_image_not_yet_encoded() -> None:
    ids = [1, 2, IMG, IMG, IMG, 3, IMG, IMG, 4]
    r = _req(ids, [item(2, 3, seed=1), item(6, 2, seed=2)], bidirectional=False)
    first = r.images[0].digest
    assert r.chunk_end(9, lambda im: False) == 2  # the text before the first image
    assert r.chunk_end(9, lambda im: im.digest == first) == 6  # through the first, up to the second
    assert r.chunk_end(9, lambda im: True) == r.chunk_end(9) == 9
    r.num_computed_tokens = 3  # inside the first image (its KV came from the cache): it is not waited for
    assert r.chunk_end(6, lambda im: False) == 3


def test_pieces_go_to_encodings_in_progress_first_within_the_budget() -> None:
    enc = ImageEncoding(LAYERS, 1, budget=6)
    a = _req([1, IMG, IMG, IMG, 2], [item(1, 3, seed=1)])
    b = _req([IMG, IMG, IMG, 2], [item(0, 3, seed=2)])
    work = enc.plan([a], [b], max_running=8)
    # a's image two layers (3 tokens each: the budget of 6); b's none yet
    assert [(w.digest, w.pieces, w.image is not None) for w in work] == [(a.images[0].digest, 2, True)]
    work = enc.plan([a], [b], max_running=8)
    assert [(w.digest, w.pieces, w.image) for w in work] == [(a.images[0].digest, 2, None)]
    assert enc.ready(a.images[0]) and not enc.ready(b.images[0])
    assert [(w.digest, w.pieces) for w in enc.plan([a], [b], 8)] == [(b.images[0].digest, 2)]
    # a new request whose image is already being encoded shares it; one not admissible yet waits its turn
    c = _req([5, IMG, IMG, IMG], [item(1, 3, seed=2)])
    d = _req([IMG, IMG, IMG], [item(0, 3, seed=4)])
    assert [(w.digest, w.pieces) for w in enc.plan([a], [c, d, b], max_running=2)] == [(b.images[0].digest, 2)]
    # only the waiting requests admission may take next (at least the first): d is behind c
    assert enc.ready(c.images[0]) and enc.plan([a], [c, d], max_running=2) == []
    assert enc.plan([a], [d], max_running=1)[0].digest == d.images[0].digest


def test_a_piece_larger_than_the_budget_runs_alone_and_unneeded_encodings_are_dropped() -> None:
    enc = ImageEncoding(LAYERS, 1, budget=2)
    big = _req([1, IMG, IMG, IMG, 2], [item(1, 3, seed=1)])
    small = _req([1, IMG, 2], [item(1, 1, seed=2)])
    assert [(w.pieces, w.image is not None) for w in enc.plan([big, small], [], 8)] == [(1, True)]
    work = enc.plan([big, small], [], 8)  # in progress first, alone again
    assert [w.pieces for w in work] == [1] and enc.take_drops() == []
    work = enc.plan([small], [], 8)  # big is gone (it ended): its encoding in progress is dropped
    assert enc.take_drops() == [big.images[0].digest] and [w.pieces for w in work] == [2]
    enc.kept([small.images[0].digest])  # the worker had it already: ready without its other pieces
    assert enc.ready(small.images[0]) and enc.plan([small], [], 8) == []
    # a layer of 3 pieces (its k and v, two blocks of patches): a piece costs a third of the image's tokens
    cut = ImageEncoding(2 * 3, 3, budget=2)
    big = _req([IMG] * 6, [item(0, 6, seed=3)])
    assert cut.cost(big.images[0]) == 2 and [w.pieces for w in cut.plan([], [big], 8)] == [1]


@pytest.mark.parametrize("depth", [1, 2])
def test_requests_wait_for_their_images_while_text_goes_on_and_everything_ends(depth: int) -> None:
    sched, worker = _engine(budget=6, depth=depth)
    prompts = {
        "a": ([1, IMG, IMG, IMG, 2, IMG, IMG, 3], [1, 2]),
        "b": ([IMG, IMG, IMG, 4], [3]),  # begins with its image: admitted once it is encoded
        "same": ([7, IMG, IMG, IMG, 8], [3]),  # b's picture: encoded once for both
        "c": ([5, 6, 7], []),
    }
    for rid, (ids, seeds) in prompts.items():
        _add(sched, rid, ids, seeds)
    lengths = {im.digest: im.length for r in sched.reqs.values() for im in r.images}
    step = sched.schedule()
    rows = {r.req_pool_idx: rid for rid, r in sched.reqs.items()}
    assert {rows[s.req_pool_idx]: s.num_tokens for s in step.scheduled} == {"a": 1, "same": 1, "c": 3}
    assert _cost(step, lengths) <= 6
    sched.commit(worker.execute(step))
    outputs, ends = run(sched, worker, depth)
    assert outputs == {rid: expected_output(ids, 3) for rid, (ids, _) in prompts.items()}
    assert all(e[0] == "length" for e in ends.values())
    assert max(_cost(so, lengths) for so in worker.steps) <= 6  # every step within the encoder budget
    pieces: dict[str, int] = {}
    for so in worker.steps:
        for w in so.encode:
            pieces[w.digest] = pieces.get(w.digest, 0) + w.pieces
    assert sorted(pieces.values()) == [LAYERS] * 3  # three pictures, each encoded once
    assert any(not so.scheduled and so.encode for so in worker.steps)  # steps of encoding only


def test_an_abort_mid_encoding_drops_it_and_nothing_is_left() -> None:
    sched, worker = _engine(budget=3)
    _add(sched, "img", [1, IMG, IMG, IMG, 2], [1])
    _add(sched, "txt", [3, 4], [])
    driver = StepDriver(sched, 1)
    for msg in driver.pump():
        driver.on_result(worker.execute(msg))
    assert 0 < worker.encoded[sched.reqs["img"].images[0].digest] < LAYERS
    driver.on_request(AbortRequest("img"))
    outputs, ends = run(sched, worker, 1)
    assert ends["img"][0] == "abort" and outputs["txt"] == expected_output([3, 4], 3)
    assert worker.encoded == {} and sched.encoding.sent == {}
    assert any(so.encode_drop for so in worker.steps)

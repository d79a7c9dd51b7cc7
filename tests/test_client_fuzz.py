"""Fuzz the client socket: 10,000 random and structurally-near-valid frames from a stranger while a Client's
requests are in flight. The valid requests get the same tokens, and the engine serves at the end."""
from __future__ import annotations

import threading

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem import Client, SamplingParams
from tandem.frontend.client.request_encoding import build_request
from tandem.protocol.codec import encode
from tests.conftest import check_idle_engine
from tests.reference import assert_equal_or_near_tie
from tests.test_e2e_scheduling import GREEDY

EXAMPLES, FRAMES_PER_EXAMPLE = 200, 50  # 10,000 frames

_VALID = encode(build_request([5, 6, 7], {"max_tokens": 3, "temperature": 0.0}, "valid-template"))

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
_params = st.one_of(
    st.fixed_dictionaries(
        {"max_tokens": st.integers(-2, 6)},
        optional={"temperature": st.floats(-1, 3), "stop": st.lists(st.text(max_size=4), max_size=3),
                  "top_k": st.integers(-3, 5), "seed": st.integers(-1, 2**64 - 1), "bogus": _values},
    ),
    _values,
)
_near_valid = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["generate", "abort", "stats", "stats_request", "outputs", "error", "nope", ""]),
        "rid": st.one_of(
            st.text(min_size=1, max_size=12).map(lambda s: "fz-" + s), st.text(max_size=300), _values
        ),
    },
    optional={
        "text": st.one_of(st.text(max_size=24), _values),
        "token_ids": st.one_of(st.lists(st.integers(-5, 1100), max_size=8), _values),
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system", "x"]), "content": st.text(max_size=12)}
                ),
                max_size=3,
            ),
            _values,
        ),
        "params": _params,
    },
).map(msgspec.msgpack.encode)
_mutated = st.one_of(
    st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)).map(
        lambda t: _VALID[: t[0]] + bytes([t[1]]) + _VALID[t[0] + 1 :]),
    st.integers(0, len(_VALID) - 1).map(lambda n: _VALID[:n]),
)
_message = st.one_of(st.binary(max_size=64), _near_valid, _mutated)
_frames = st.one_of(_message.map(lambda m: [m]), st.lists(_message, min_size=2, max_size=3))


def _rids(frames: list[bytes]) -> set[str]:
    out = set()
    for f in frames:
        try:
            rid = msgspec.msgpack.decode(f, type=dict).get("rid")
        except (msgspec.DecodeError, AttributeError):
            continue
        if isinstance(rid, str) and rid:
            out.add(rid)
    return out


def _fuzz_batches() -> list[list[list[bytes]]]:
    """Hypothesis draws the frames up front, so the engine sees them back to back."""
    batches: list[list[list[bytes]]] = []

    @settings(max_examples=EXAMPLES, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(_frames, min_size=FRAMES_PER_EXAMPLE, max_size=FRAMES_PER_EXAMPLE))
    def draw(batch: list[list[bytes]]) -> None:
        batches.append(batch)

    draw()
    return batches


@pytest.mark.slow  # ~9 s: the fast tier (`make test`) keeps under its 10 minutes
def test_fuzzed_client_socket_never_disturbs_valid_requests(tiny_model) -> None:
    model = tiny_model("llama")
    batches = _fuzz_batches()
    assert sum(map(len, batches)) == EXAMPLES * FRAMES_PER_EXAMPLE
    with Client.launch(str(model), dtype="float32", kv_cache_tokens=16384, max_running_requests=128) as c:
        prompts = [[3 + i, 40 + 3 * i, 7, 9 + i] for i in range(6)]
        params = SamplingParams(max_tokens=16, **GREEDY)
        want = [c.generate(p, params).token_ids for p in prompts]
        got: list[tuple[int, list[int]]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def valid_traffic() -> None:
            try:
                while not stop.is_set():
                    for i, comp in enumerate(c.generate_batch(prompts, params, progress=False)):
                        got.append((i, comp.token_ids))
            except BaseException as e:  # the main thread reports it
                errors.append(e)

        traffic = threading.Thread(target=valid_traffic, daemon=True)
        traffic.start()
        ctx = zmq.Context()
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(c.endpoint)
        try:
            for batch in batches:
                for frames in batch:
                    stranger.send_multipart(frames)
                # What the stranger started by luck (a valid request) it stops again: only its own rids.
                for rid in set().union(*map(_rids, batch)):
                    stranger.send(msgspec.msgpack.encode({"type": "abort", "rid": rid}))
                while stranger.poll(0):
                    stranger.recv()
            served = len(got)
            while len(got) < served + len(prompts) and traffic.is_alive():  # valid requests still served
                if stranger.poll(50):
                    stranger.recv()
        finally:
            stop.set()
            traffic.join(120)
            stranger.close(0)
            ctx.term()
        assert not traffic.is_alive() and not errors, errors
        for i, tokens in got:
            assert_equal_or_near_tie(model, prompts[i], tokens, want[i])
        check_idle_engine(c)
        assert [c.generate(p, params).token_ids for p in prompts] == want

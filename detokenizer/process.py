"""The detokenizer process: token deltas in, text deltas out, one IncrementalDecoder per request."""
from __future__ import annotations

import os

import zmq
from tokenizers import Tokenizer

from tandem.detokenizer.incremental import IncrementalDecoder
from tandem.detokenizer.stop_holdback import StopHoldBack
from tandem.protocol.child import reporting_startup, start_child
from tandem.protocol.codec import detok_in_decoder, encode
from tandem.protocol.ipc import make_socket
from tandem.protocol.lora_messages import LoraReply
from tandem.protocol.messages import (
    DetokRegister,
    EmbeddingBatch,
    EngineStats,
    OutputBatch,
    Ready,
    RequestError,
    RequestOutput,
    SessionReply,
    TokenBatch,
)
from tandem.protocol.tokenizer_loader import load_fast_tokenizer


class _Stream:
    """One request's text: incremental decode, held back where a stop string may begin, cut where the
    scheduler's stop says."""

    def __init__(self, tokenizer: Tokenizer, msg: DetokRegister) -> None:
        self.decoder = IncrementalDecoder(tokenizer, msg.prompt_tail, msg.skip_special_tokens)
        self.hold = StopHoldBack(msg.stop) if msg.stop else None

    def push(self, ids: list[int], finished: bool, stop_cut: int) -> str:
        text = self.decoder.push(ids) if ids else ""
        if finished:
            text += self.decoder.flush()
        if self.hold is None:
            return text[: len(text) - stop_cut] if stop_cut else text
        return self.hold.finish(text, stop_cut) if finished else self.hold.feed(text)


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}

    def register(self, msg: DetokRegister) -> None:
        self.streams[msg.rid] = _Stream(self.tokenizer, msg)

    def process(self, batch: TokenBatch) -> OutputBatch:
        outs: list[RequestOutput] = []
        for d in batch.deltas:
            stream = self.streams.get(d.rid)
            if stream is None:
                continue  # never registered (failed early): nothing to say
            text = stream.push(d.token_ids, d.finished, d.stop_cut)
            if d.finished:
                del self.streams[d.rid]
            outs.append(RequestOutput(d.rid, text, d.token_ids, d.final, d.logprobs, d.prompt_logprobs,
                                      d.load))
        return OutputBatch(outs)

    def drop(self, rid: str) -> None:
        self.streams.pop(rid, None)


def run_detokenizer(cfg_bytes: bytes, ep_bytes: bytes) -> None:
    cfg, ep, ctx, launcher = start_child(cfg_bytes, ep_bytes)
    with reporting_startup(launcher, "detokenizer"):
        detok = Detokenizer(load_fast_tokenizer(cfg.model))
        inbox = make_socket(ctx, zmq.PULL, ep.detok_in, bind=True)
        frontend = make_socket(ctx, zmq.PUSH, ep.frontend_in, bind=False)
        launcher.send(encode(Ready("detokenizer", 0, f"pid={os.getpid()}")))
    decode = detok_in_decoder()
    while True:
        msg = decode(inbox.recv())
        if isinstance(msg, DetokRegister):
            detok.register(msg)
        elif isinstance(msg, TokenBatch):
            out = detok.process(msg)
            if out.outputs:
                frontend.send(encode(out))
        elif isinstance(msg, RequestError):
            detok.drop(msg.rid)
            frontend.send(encode(msg))
        elif isinstance(msg, (EngineStats, SessionReply, LoraReply, EmbeddingBatch)):  # passed on as they are
            frontend.send(encode(msg))

"""The frontend process: clients in (ROUTER), tokenize and validate, route outputs back by request id."""
from __future__ import annotations

from collections import defaultdict

import msgspec
import zmq

from frontend.validation import check_prompt, decode_params, tokenize_prompt
from protocol.child import reporting_startup, start_child
from protocol.codec import client_decoder, encode, frontend_in_decoder
from protocol.errors import InvalidRequestError
from protocol.ipc import make_socket
from protocol.messages import (
    AbortReq,
    AbortRequest,
    EngineStats,
    GenerateRequest,
    OutputBatch,
    Ready,
    RequestError,
    RequestFailed,
    RequestOutput,
    StatsRequest,
    TokenizedRequest,
)
from protocol.model_info import read_model_info


def run_frontend(cfg_bytes: bytes, ep_bytes: bytes) -> None:
    cfg, ep, ctx, launcher = start_child(cfg_bytes, ep_bytes)
    with reporting_startup(launcher, "frontend"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        info = read_model_info(cfg.model, cfg.max_model_len)
        clients = make_socket(ctx, zmq.ROUTER, ep.client, bind=True)
        inbox = make_socket(ctx, zmq.PULL, ep.frontend_in, bind=True)
        scheduler = make_socket(ctx, zmq.PUSH, ep.scheduler_in, bind=False)
        launcher.send(encode(Ready("frontend", 0, ep.client)))
    Frontend(tokenizer, info, clients, inbox, scheduler).run()


class Frontend:
    def __init__(self, tokenizer, info, clients: zmq.Socket, inbox: zmq.Socket, scheduler: zmq.Socket) -> None:  # noqa: ANN001
        self.tokenizer = tokenizer
        self.info = info
        self.clients, self.inbox, self.scheduler = clients, inbox, scheduler
        self.owner: dict[str, bytes] = {}  # rid -> client identity
        self.stats_owner: dict[str, bytes] = {}
        self.decode_client = client_decoder()
        self.decode_inbox = frontend_in_decoder()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.inbox, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self.clients in events:
                while True:
                    try:
                        ident, data = self.clients.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.on_client(ident, data)
            if self.inbox in events:
                while True:
                    try:
                        data = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.on_engine(self.decode_inbox(data))

    def on_client(self, ident: bytes, data: bytes) -> None:
        try:
            msg = self.decode_client(data)
        except msgspec.ValidationError as e:
            # Can't know the rid of an undecodable message; answer with an empty one.
            self.clients.send_multipart([ident, encode(RequestError("", "invalid_request.malformed", str(e)))])
            return
        if isinstance(msg, AbortRequest):
            if msg.rid in self.owner:
                self.scheduler.send(encode(AbortReq(msg.rid)))
            return
        if isinstance(msg, StatsRequest):
            self.stats_owner[msg.rid] = ident
            self.scheduler.send(encode(msg))
            return
        assert isinstance(msg, GenerateRequest)
        try:
            if msg.rid in self.owner:
                raise InvalidRequestError(f"request id {msg.rid!r} is already in flight", "invalid_request.duplicate_rid")
            params = decode_params(msg.params)
            ids = tokenize_prompt(msg, self.tokenizer)
            check_prompt(ids, params, self.info)
        except InvalidRequestError as e:
            self.clients.send_multipart([ident, encode(RequestError(msg.rid, e.code, e.message))])
            return
        self.owner[msg.rid] = ident
        self.scheduler.send(encode(TokenizedRequest(msg.rid, ids, params)))

    def on_engine(self, msg: OutputBatch | RequestFailed | EngineStats) -> None:
        if isinstance(msg, EngineStats):
            ident = self.stats_owner.pop(msg.rid, None)
            if ident is not None:
                msg.frontend_pending = len(self.owner)
                self.clients.send_multipart([ident, encode(msg)])
            return
        if isinstance(msg, RequestFailed):
            ident = self.owner.pop(msg.rid, None)
            if ident is not None:
                self.clients.send_multipart([ident, encode(RequestError(msg.rid, msg.code, msg.message))])
            return
        by_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for out in msg.outputs:
            ident = self.owner.get(out.rid)
            if ident is None:
                continue
            by_client[ident].append(out)
            if out.finished:
                del self.owner[out.rid]
        for ident, outs in by_client.items():
            self.clients.send_multipart([ident, encode(OutputBatch(outs))])




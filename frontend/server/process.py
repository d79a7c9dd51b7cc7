"""The frontend process: clients in (ROUTER), tokenize and validate, route outputs back by request id.

Nothing a client sends can stop it: every frame passes one guard (client_frames.py), and a client that
stops reading (its pipe reaches the high-water mark) or is gone has its requests aborted rather than
buffered without bound.
"""
from __future__ import annotations

import logging
import sys
import traceback
from collections import defaultdict

import zmq

from tandem.frontend.server.client_frames import BadFrames, ClientFrames
from tandem.frontend.server.validation import (
    check_embed,
    check_prompt,
    decode_embed_params,
    decode_params,
    tokenize_prompt,
)
from tandem.protocol.child import reporting_startup, start_child
from tandem.protocol.codec import encode, frontend_in_decoder
from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.image_item import check_images
from tandem.protocol.ipc import make_socket, ready_frames, ready_multipart
from tandem.protocol.lora_messages import LoadLora, LoraReply, UnloadLora
from tandem.protocol.messages import (
    AbortRequest,
    ClientMsg,
    CloseSession,
    EmbeddingBatch,
    EmbedRequest,
    EngineStats,
    EngineStopping,
    FrontendMsg,
    GenerateRequest,
    OpenSession,
    OutputBatch,
    Ready,
    RequestError,
    SessionReply,
    StatsRequest,
    TokenizedRequest,
)
from tandem.protocol.model_info import read_model_info
from tandem.protocol.sampling_params import SamplingParams
from tandem.protocol.stop_messages import Drain, Drained, DrainRequest
from tandem.protocol.tokenizer_loader import load_tokenizer

log = logging.getLogger("tandem.frontend")

# Messages queued to one client before it counts as not reading (each is one step's outputs for it).
CLIENT_SND_HWM = 10_000
CLIENT_RCV_HWM = 10_000
# How long the last answers (the reason the engine stops) may take to reach the clients on the way down.
FAREWELL_LINGER_MS = 2000


def run_frontend(cfg_bytes: bytes, ep_bytes: bytes) -> None:
    cfg, ep, ctx, launcher = start_child(cfg_bytes, ep_bytes)
    logging.basicConfig(stream=sys.stderr, format="%(name)s: %(message)s")
    with reporting_startup(launcher, "frontend"):
        tokenizer = load_tokenizer(cfg.model)
        info = read_model_info(cfg.model, cfg.max_model_len)
        clients = make_socket(ctx, zmq.ROUTER, ep.client, bind=True)
        clients.setsockopt(zmq.SNDHWM, CLIENT_SND_HWM)
        # a flooding client waits, the frontend's memory doesn't grow
        clients.setsockopt(zmq.RCVHWM, CLIENT_RCV_HWM)
        clients.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished client raises instead of dropping
        inbox = make_socket(ctx, zmq.PULL, ep.frontend_in, bind=True)
        scheduler = make_socket(ctx, zmq.PUSH, ep.scheduler_in, bind=False)
        launcher.send(encode(Ready("frontend", 0, ep.client)))
    Frontend(tokenizer, info, clients, inbox, scheduler, ClientFrames(cfg.max_request_bytes), launcher).run()
    clients.setsockopt(zmq.LINGER, FAREWELL_LINGER_MS)
    ctx.destroy()  # closes each socket with its own linger: the farewell errors are delivered


class Frontend:
    def __init__(
        self, tokenizer, info, clients: zmq.Socket, inbox: zmq.Socket, scheduler: zmq.Socket,
        frames: ClientFrames, launcher: zmq.Socket | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.clients, self.inbox, self.scheduler = clients, inbox, scheduler
        self.frames = frames
        self.owner: dict[str, bytes] = {}  # rid -> client identity
        # Ids are owned here (the scheduler trusts them unique): a gone client's stay in use until they end.
        self.ending: set[str] = set()
        self.query_owner: dict[str, bytes] = {}  # stats and session calls: rid -> client identity
        self.decode_inbox = frontend_in_decoder()
        self.stopping = False
        self.launcher = launcher  # told when a client asks for a drain, and when a drain is done
        self.draining = ""  # why, while the engine drains: new requests are refused
        self._drained_told = False

    def run(self) -> None:
        """Serve until the launcher says the engine stops."""
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.inbox, zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll())
            if self.clients in events:
                for frames in ready_multipart(self.clients):
                    self.on_client_frames(frames)
            if self.inbox in events and not self.stopping:
                for data in ready_frames(self.inbox):
                    self.on_engine(self.decode_inbox(data))
                    if self.stopping:
                        break

    # ---- from clients ----------------------------------------------------------------------------
    def on_client_frames(self, frames: list[bytes]) -> None:
        parsed = self.frames.parse(frames)
        if isinstance(parsed, BadFrames):
            self.on_bad_frames(parsed)
            return
        ident, msg = parsed
        try:
            self.on_client(ident, msg)
        except Exception as e:  # one request's surprise must not stop the engine
            log.error("request %r failed in the frontend:\n%s", msg.rid, traceback.format_exc())
            if isinstance(msg, (GenerateRequest, EmbedRequest)) and msg.rid not in self.owner:
                self.to_client(
                    ident, RequestError(msg.rid, ErrorCode.FRONTEND_FAILED, f"{type(e).__name__}: {e}")
                )

    def on_bad_frames(self, bad: BadFrames) -> None:
        log.warning("dropped a bad client message (%s: %s)", bad.code, bad.message[:200])
        if bad.answerable and bad.rid not in self.owner:  # never fail someone's in-flight request
            assert bad.ident is not None and bad.rid is not None
            self.to_client(bad.ident, RequestError(bad.rid, bad.code, bad.message))

    def on_client(self, ident: bytes, msg: ClientMsg) -> None:
        if isinstance(msg, AbortRequest):
            if self.owner.get(msg.rid) == ident:  # only the client that submitted a request may abort it
                self.scheduler.send(encode(AbortRequest(msg.rid)))
            return
        if isinstance(msg, DrainRequest):
            self.start_drain(msg.reason)
            self.to_launcher(msg)  # it keeps the drain's clock and ends it
            msg = StatsRequest(msg.rid)  # the answer: the stats, showing the drain
        if isinstance(msg, (StatsRequest, OpenSession, CloseSession, LoadLora, UnloadLora)):  # answered there
            self.query_owner[msg.rid] = ident
            self.scheduler.send(encode(msg))
            return
        if self.draining:
            why = f"the engine is draining ({self.draining}) and takes no new requests"
            self.to_client(ident, RequestError(msg.rid, ErrorCode.DRAINING, why))
            return
        try:
            if msg.rid in self.owner or msg.rid in self.ending:
                raise InvalidRequestError(
                    f"request id {msg.rid!r} is already in flight", ErrorCode.DUPLICATE_RID
                )
            if isinstance(msg, EmbedRequest):
                embed = decode_embed_params(msg.params)
                ids = tokenize_prompt(msg, self.tokenizer)
                check_embed(ids, embed, self.info)
                req = TokenizedRequest(msg.rid, ids, SamplingParams(), msg.priority, embed=embed)
            else:
                params = decode_params(msg.params)
                ids = tokenize_prompt(msg, self.tokenizer)
                check_prompt(ids, params, self.info)
                if msg.images and msg.token_ids is None:
                    why = "images come with token_ids (frontend/image_prompt.py makes both)"
                    raise InvalidRequestError(why, ErrorCode.IMAGE)
                images = check_images(ids, msg.images, self.info.image_token_id)
                req = TokenizedRequest(msg.rid, ids, params, msg.priority, msg.session_params, images=images,
                                       lora=msg.lora)
        except InvalidRequestError as e:
            self.to_client(ident, RequestError(msg.rid, e.code, e.message))
            return
        self.owner[msg.rid] = ident
        self.scheduler.send(encode(req))

    # ---- from the engine -------------------------------------------------------------------------
    def on_engine(
        self,
        msg: OutputBatch
        | EmbeddingBatch
        | RequestError
        | EngineStats
        | EngineStopping
        | SessionReply
        | Drain,
    ) -> None:
        if isinstance(msg, EngineStopping):
            self.farewell(msg.reason, msg.code)
            return
        if isinstance(msg, Drain):
            self.start_drain(msg.reason)
            return
        if isinstance(msg, (EngineStats, SessionReply, LoraReply)):
            ident = self.query_owner.pop(msg.rid, None)
            if ident is not None:
                if isinstance(msg, EngineStats):
                    msg.frontend_pending = len(self.owner)
                    msg.draining = self.draining
                self.to_client(ident, msg)
            return
        if isinstance(msg, RequestError):
            self.ending.discard(msg.rid)
            ident = self.owner.pop(msg.rid, None) or self.query_owner.pop(msg.rid, None)
            if ident is not None:
                self.to_client(ident, msg)
            self.check_drained()
            return
        by_client: dict[bytes, list] = defaultdict(list)
        for out in msg.outputs:
            if out.finished:
                self.ending.discard(out.rid)
            ident = self.owner.get(out.rid)
            if ident is None:
                continue
            by_client[ident].append(out)
            if out.finished:
                del self.owner[out.rid]
        for ident, outs in by_client.items():
            self.to_client(ident, type(msg)(outs))
        self.check_drained()

    def start_drain(self, reason: str) -> None:
        if not self.draining:
            self.draining = reason
            log.warning("draining (%s): new requests are refused", reason)
        self.check_drained()

    def check_drained(self) -> None:
        """While draining, the launcher hears once that no request is left (aborts of gone clients
        included)."""
        if self.draining and not self._drained_told and not self.owner and not self.ending:
            self._drained_told = True
            self.to_launcher(Drained())

    def to_launcher(self, msg: Drained | DrainRequest) -> None:
        if self.launcher is not None:
            self.launcher.send(encode(msg))

    def farewell(self, reason: str, code: str = ErrorCode.ENGINE_DEAD) -> None:
        """The engine is stopping: every waiting call gets the reason, then the frontend stops."""
        for rid, ident in [*self.owner.items(), *self.query_owner.items()]:
            self.to_client(ident, RequestError(rid, code, reason))
        self.owner.clear()
        self.ending.clear()
        self.query_owner.clear()
        self.stopping = True

    # ---- to clients ------------------------------------------------------------------------------
    def to_client(self, ident: bytes, msg: FrontendMsg) -> None:
        try:
            self.clients.send_multipart([ident, encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            self.drop_client(ident, f"stopped reading ({CLIENT_SND_HWM} messages queued)")
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.drop_client(ident, "disconnected")

    def drop_client(self, ident: bytes, why: str) -> None:
        """Nothing runs for nobody: a client that is gone or not reading has its requests aborted."""
        rids = [rid for rid, who in self.owner.items() if who == ident]
        if rids:
            log.warning("client %s %s: aborting its %d request(s)", ident.hex(), why, len(rids))
        for rid in rids:
            del self.owner[rid]
            self.ending.add(rid)
            self.scheduler.send(encode(AbortRequest(rid)))
        for rid in [rid for rid, who in self.query_owner.items() if who == ident]:
            del self.query_owner[rid]



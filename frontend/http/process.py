"""The HTTP process: an AsyncClient of the frontend behind uvicorn (uvloop), one of `tandem serve`'s
processes.

It binds its socket itself, so that port 0 picks a free port, and reports the URL in its Ready record.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket

from tandem.frontend.http.image_sources import MediaPolicy
from tandem.frontend.image_prompt import ImageLimits, ImagePrompter
from tandem.protocol.child import reporting_startup, start_child
from tandem.protocol.codec import encode
from tandem.protocol.messages import Ready
from tandem.protocol.serve_config import ServeConfig

GRACEFUL_SHUTDOWN_S = 2


def run_http(cfg_bytes: bytes, ep_bytes: bytes, serve_bytes: bytes) -> None:
    cfg, ep, _, launcher = start_child(cfg_bytes, ep_bytes)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    scfg, model = ServeConfig.decode(serve_bytes), cfg.model
    with reporting_startup(launcher, "http"):
        import uvicorn
        import uvloop

        from tandem.frontend.client.async_client import AsyncClient
        from tandem.frontend.http.app import create_app
        from tandem.frontend.http.limits import DoorLimits
        from tandem.frontend.http.metrics import Metrics
        from tandem.frontend.http.response_store import ResponseStore
        from tandem.frontend.http.state import ServerState
        from tandem.frontend.reasoning_parser import template_style
        from tandem.protocol.model_info import read_model_info
        from tandem.protocol.tokenizer_loader import load_tokenizer

        tokenizer = load_tokenizer(model)
        info = read_model_info(model, cfg.max_model_len)
        sock = socket.socket(socket.AF_INET6 if ":" in scfg.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((scfg.host, scfg.port))
        port = sock.getsockname()[1]
    name = scfg.served_model_name or os.path.basename(os.path.normpath(model))
    host = f"[{scfg.host}]" if ":" in scfg.host else scfg.host

    async def main() -> None:
        # Started beside the engine's processes, so the frontend may bind late: the launcher's own bound.
        client = AsyncClient(ep.client, connect_timeout_s=cfg.startup_timeout_s)
        reasoning = scfg.reasoning_parser
        if reasoning == "auto":
            reasoning = template_style(getattr(tokenizer, "chat_template", None))
        st = ServerState(client, tokenizer, info, model, name, Metrics(name), scfg.api_key, reasoning,
                         ResponseStore(scfg.response_store), admin_api_key=scfg.admin_api_key,
                         prompter=ImagePrompter(model, ImageLimits(scfg.limit_mm_per_prompt,
                                                                   scfg.max_image_pixels)),
                         media=MediaPolicy(tuple(d.lower() for d in scfg.allowed_media_domains),
                                           scfg.allowed_local_media_path))
        app = DoorLimits(create_app(st), cfg.max_request_bytes, scfg.max_concurrent_requests)
        server = _server_class()(uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        ))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            launcher.send(encode(Ready("http", 0, f"http://{host}:{port}")))
        try:
            await task
        finally:
            await client.close()

    uvloop.run(main())


def _server_class() -> type:
    import uvicorn  # lazily: the launcher imports this module

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            # Ctrl-C reaches every process of the group: the launcher drains the engine and then stops
            # this one with SIGTERM, which uvicorn handles (a graceful shutdown of GRACEFUL_SHUTDOWN_S).
            if sig != signal.SIGINT:
                super().handle_exit(sig, frame)  # type: ignore[arg-type]

    return Server

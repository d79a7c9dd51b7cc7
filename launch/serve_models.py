"""`tandem serve` with several models: one HTTP server in this process routes each request by its `model`
to that model's own `tandem serve` (a child on a localhost port, behind a key only this process knows),
started on the model's first request and stopped after its keep-alive (frontend/router/model_pool.py).

Each child is owned as the Python client owns its engine: it stops when this process dies, however it dies.
SIGTERM or Ctrl-C: new requests are refused, running ones get up to --drain-timeout-s, then every child
stops."""
from __future__ import annotations

import asyncio
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tandem.frontend.client.engine_process import start_served_process, stop_engine_process
from tandem.launch.model_names import resolve_model
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.model_fit import check_model_fits
from tandem.protocol.model_spec import ModelSpec, parse_keep_alive
from tandem.protocol.serve_announcements import HTTP_PREFIX
from tandem.protocol.serve_config import ServeConfig

REAP_EVERY_S = 1.0


@dataclass
class ServedEngine:
    url: str
    proc: subprocess.Popen

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def stop(self) -> None:
        await asyncio.to_thread(stop_engine_process, self.proc)


def child_serve_argv(scfg: ServeConfig, name: str, key: str) -> list[str]:
    """The serve flags of one model's child: localhost, any port, the router's own key, and the options
    every model's server shares."""
    # `=`: a key may begin with "-", which argparse would take for a flag
    argv = ["--host", "127.0.0.1", "--port", "0", f"--api-key={key}", "--served-model-name", name,
            "--max-concurrent-requests", str(scfg.max_concurrent_requests),
            "--response-store", str(scfg.response_store)]
    if scfg.reasoning_parser is not None:
        argv += ["--reasoning-parser", scfg.reasoning_parser]
    for d in scfg.allowed_media_domains:
        argv += ["--allowed-media-domains", d]
    if scfg.allowed_local_media_path is not None:
        argv += ["--allowed-local-media-path", scfg.allowed_local_media_path]
    return argv + ["--limit-mm-per-prompt", str(scfg.limit_mm_per_prompt),
                   "--max-image-pixels", str(scfg.max_image_pixels)]


class EngineStarter:
    """Starts a model's child with the command line's engine options under the model's own. prepare() comes
    first, before the pool unloads anything for it: the path resolved (a known name pulled when absent) and
    the configuration checked against the model."""

    def __init__(self, base: dict[str, object], scfg: ServeConfig, key: str) -> None:
        self.base, self.scfg, self.key = base, scfg, key
        self._configs: dict[str, EngineConfig] = {}

    def _config(self, spec: ModelSpec) -> EngineConfig:
        cfg = EngineConfig.from_options(resolve_model(spec.model), **{**self.base, **spec.options})
        check_model_fits(cfg)
        return cfg

    async def prepare(self, spec: ModelSpec) -> int:
        """Checks the model can start; returns its weights' size on disk (what it will hold, roughly)."""
        cfg = self._configs[spec.name] = await asyncio.to_thread(self._config, spec)
        return _disk_size(Path(cfg.model))

    async def __call__(self, spec: ModelSpec) -> ServedEngine:
        cfg = self._configs.pop(spec.name, None) or await asyncio.to_thread(self._config, spec)
        proc, url = await asyncio.to_thread(start_served_process, cfg,
                                            child_serve_argv(self.scfg, spec.name, self.key))
        return ServedEngine(url, proc)


def _disk_size(p: Path) -> int:
    p = p.resolve()
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin"))


def _on_disk(spec: ModelSpec) -> str | None:
    try:
        return resolve_model(spec.model, pull_missing=False)
    except ValueError:
        return None


def _version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown"


def serve_models(specs: list[ModelSpec], base: EngineConfig, scfg: ServeConfig) -> int:
    import uvicorn
    import uvloop

    from tandem.frontend.http.limits import DoorLimits
    from tandem.frontend.router.app import create_router_app
    from tandem.frontend.router.model_pool import ModelPool
    from tandem.frontend.router.proxy import Proxy
    from tandem.frontend.router.router_state import RouterState

    key = secrets.token_urlsafe(24)
    options = {k: v for k, v in base.options().items()}
    sock = socket.socket(socket.AF_INET6 if ":" in scfg.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((scfg.host, scfg.port))
    except OSError as e:
        print(f"tandem serve: cannot listen on {scfg.host}:{scfg.port}: {e}", file=sys.stderr, flush=True)
        return 1
    host = f"[{scfg.host}]" if ":" in scfg.host else scfg.host
    url = f"http://{host}:{sock.getsockname()[1]}"

    # uvicorn handles SIGTERM/SIGINT while it serves (a graceful shutdown) and raises the signal again once
    # it is done: this handler takes that one, so the children are stopped below rather than the process
    # killed by the default action.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)

    async def main() -> None:
        starter = EngineStarter(options, scfg, key)
        pool = ModelPool(specs, scfg.max_loaded_models, parse_keep_alive(scfg.keep_alive), starter,
                         prepare=starter.prepare, memory_budget=None if scfg.max_loaded_memory_gb is None
                         else int(scfg.max_loaded_memory_gb * 1e9))
        rs = RouterState(pool, Proxy(key), _version(), _on_disk, scfg.api_key, scfg.reasoning_parser,
                         scfg.admin_api_key)
        app = DoorLimits(create_router_app(rs), base.max_request_bytes, scfg.max_concurrent_requests)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=int(base.drain_timeout_s)))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)

        async def reap() -> None:
            while True:
                await asyncio.sleep(REAP_EVERY_S)
                for name in await pool.reap():
                    print(f"tandem: unloaded {name}", file=sys.stderr, flush=True)

        reaper = asyncio.create_task(reap())
        pinned = asyncio.create_task(pool.load_pinned())
        if server.started:
            names = ", ".join(s.name + (" (pinned)" if s.pinned else "") for s in specs)
            print(f"tandem: serving {len(specs)} models: {names}; each loads on its first request",
                  file=sys.stderr, flush=True)
            print(f"{HTTP_PREFIX}{url}", flush=True)
        try:
            await task
        finally:
            reaper.cancel()
            pinned.cancel()
            await pool.close()
            await rs.close()

    uvloop.run(main())
    return 0

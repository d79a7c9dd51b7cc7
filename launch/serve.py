"""`tandem serve`: run the engine until a signal or the death of any process."""
from __future__ import annotations

import signal
import sys

from launch.launcher import EngineStartError, Launcher
from protocol.engine_config import EngineConfig

READY_PREFIX = "tandem: ready at "
PROCESS_PREFIX = "tandem: process "


def serve(cfg: EngineConfig) -> int:
    launcher = Launcher(cfg)
    stopping = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["signal"] = signum  # type: ignore[assignment]
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        endpoint = launcher.start()
    except EngineStartError as e:
        print(f"tandem: engine failed to start: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        launcher.stop()
        return 0
    for p in launcher.procs:
        print(f"{PROCESS_PREFIX}{p.name} {p.pid}", flush=True)
    if cfg.node_rank == 0:
        print(f"{READY_PREFIX}{endpoint}", flush=True)
    else:
        print(f"tandem: node {cfg.node_rank} workers ready (clients connect to node 0)", flush=True)
    try:
        dead = None
        while dead is None:
            dead = launcher.wait(1.0)
        print(f"tandem: {dead.name} exited with code {dead.exitcode}; stopping the engine", file=sys.stderr, flush=True)
        launcher.stop()
        return 1
    except KeyboardInterrupt:
        launcher.stop()
        return 0

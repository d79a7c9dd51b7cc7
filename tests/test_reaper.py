"""The launcher's reaper: a grandchild orphaned by its parent's death comes back to the launcher (its
subreaper) and is ended and reaped with the rest. Run in a fresh interpreter: the test process itself must
not become a subreaper."""
from __future__ import annotations

import subprocess
import sys

import psutil

_SCRIPT = """
import os, subprocess, sys
import psutil
from tandem.launch.reaper import become_subreaper, reap_descendants

become_subreaper()
sleeper = "import time; time.sleep(600)"
middle = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {sleeper!r}]); print(p.pid, flush=True)"],
                          stdout=subprocess.PIPE, text=True)
orphan = int(middle.stdout.readline())
middle.wait()  # its parent is gone: the orphan is ours now, not init's
print("adopted", psutil.Process(orphan).ppid() == os.getpid(), flush=True)
reap_descendants(2.0)
print("left", psutil.pid_exists(orphan), orphan, flush=True)
"""


def test_an_orphaned_grandchild_is_adopted_and_reaped() -> None:
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == "adopted True", r.stdout
    _, exists, pid = lines[1].split()
    assert exists == "False" and not psutil.pid_exists(int(pid))

"""System helpers of the emulated cluster: commands that must work, processes that must end."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


class ClusterError(RuntimeError):
    """Building, using or removing the emulated cluster failed; the message says how."""


def sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a system command; raise ``ClusterError`` naming it and its output on failure."""
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ClusterError(f"{cmd[0]} is not installed (Debian: apt-get install iproute2 "
                           f"util-linux)") from None
    if check and result.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed ({result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()}")
    return result


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise ClusterError(f"{what} needs root: it creates network namespaces, links and "
                           f"cgroups (run it with sudo)")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it holds no namespace or cgroup)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def kill_all(pids: list[int], grace: float = 2.0) -> list[int]:
    """SIGTERM ``pids``, SIGKILL what is left after ``grace`` s; the pids still alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if alive(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            break
    return pids

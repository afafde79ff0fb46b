"""What the benchmarks record about the host and the code besides their timings.

    commit()        the code measured: HEAD's short hash, ``+dirty`` when the
                    measured sources (npukv_store/, native/, bench/) differ from it
    facts()         hostname, kernel release and CPU count: the report header's
    cpu_ticks()     (all, steal) jiffies since boot, for steal_share()
    steal_share()   the hypervisor's share of the CPU time between two ticks

A VM's vCPUs are not always its own: the hypervisor may run other guests on
them ("steal" in /proc/stat). The store reads and writes with several threads,
so a run with steal measures a smaller machine than one without; each
benchmark records the share over its run so results can be compared fairly.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from typing import Any

from bench import ROOT

#: What a benchmark measures: a change in any of these makes the commit dirty.
MEASURED = ("npukv_store", "native", "bench")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def _head_from_files() -> str:
    """HEAD's commit read from .git itself, where no git program runs (a
    bare device machine)."""
    git = ROOT / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:7]
        ref = head[5:]
        if (git / ref).exists():
            return (git / ref).read_text().strip()[:7]
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:7]
    except OSError:
        pass
    return "unknown"


def commit() -> str:
    """HEAD's short hash, plus ``+dirty`` when the measured sources have
    uncommitted changes: call it when the run starts (the code this process
    imported)."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return _head_from_files()
    return head + ("+dirty" if _git("status", "--porcelain", *MEASURED) else "")


def facts() -> dict[str, Any]:
    """The host part of a report's header."""
    return {
        "host": socket.gethostname(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
    }


def cpu_ticks() -> tuple[int, int] | None:
    """(all, steal) jiffies of every CPU since boot; None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields), fields[7] if len(fields) > 7 else 0


def steal_share(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float:
    """The share of CPU time the hypervisor gave to others between two
    ``cpu_ticks``: 0.4 means a two-thread read got 1.2 cores. -1 where it
    cannot be read."""
    if start is None or end is None or end[0] <= start[0]:
        return -1.0
    return round((end[1] - start[1]) / (end[0] - start[0]), 4)

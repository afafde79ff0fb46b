"""What the benchmarks record about the host besides their timings.

A VM's vCPUs are not always its own: the hypervisor may run other guests on
them ("steal" in /proc/stat). The store reads and writes with several threads,
so a run with steal measures a smaller machine than one without; each
benchmark records the share over its run so results can be compared fairly.
"""

from __future__ import annotations


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

"""Facts of this machine's CPU that decide which vLLM backends run here."""

from __future__ import annotations


def cpu_has_amx() -> bool:
    """Whether the CPU has AMX (``amx_tile`` in /proc/cpuinfo's flags): vLLM's
    AMX_MLA backend and its DeepSeek-V4 kernels need it."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(
                line.startswith("flags") and "amx_tile" in line.split() for line in f
            )
    except OSError:
        return False

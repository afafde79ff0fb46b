"""A test's timeout scaled to the machine it runs on.

pyproject.toml gives every test 300 s (pytest-timeout's ``timeout``). The
end-to-end runs spend it in vLLM's CPU forward passes, which share the
machine's cores: on a 2-core machine that is busy with other work (a
parallel suite) the same runs take a few times longer, and a fixed 300 s
fails a test that is only slow, not stuck. :func:`scaled_timeout` keeps
the base on an idle machine of 4 cores or more and multiplies it by how
short of that the machine is, capped so that a hung run still fails.
tests/conftest.py applies it to every end-to-end and power-loss test.
"""

from __future__ import annotations

import os

#: cores the base budgets were set on (the runs' vLLM uses a few threads)
BASE_CORES = 4
#: the most a budget is stretched: a hung run still fails, in an hour at most
MAX_SCALE = 4.0


def machine_scale() -> float:
    """How much slower than the base this machine may run a CPU-bound test
    now: (cores short of BASE_CORES) x (runnable load per core, from the
    1-minute load average, above 1), between 1 and MAX_SCALE."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        load = 0.0
    scale = max(1.0, BASE_CORES / cores) * max(1.0, load / cores)
    return min(MAX_SCALE, scale)


def scaled_timeout(base_s: float) -> int:
    """``base_s`` for pytest.mark.timeout, stretched by :func:`machine_scale`
    (tests/conftest.py computes it as each machine-bound test starts)."""
    return int(base_s * machine_scale())

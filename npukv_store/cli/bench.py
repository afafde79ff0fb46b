"""``npukv bench NAME [args]``: the benchmarks of a source checkout.

Runs in: the ``npukv`` process, which runs ``python -m bench NAME [args]`` with
its own interpreter and passes the exit code through.

The benchmarks are a package of the repository (``bench/``, beside
``tests/``), not of the wheel: they need vLLM, Mooncake and the test models,
which a user of the store does not install. Where this ``npukv_store`` is
imported from a checkout (an editable install), that checkout's ``bench/`` runs;
from an installed wheel the command says in one line what to run instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from npukv_store.errors import NpuKVError

#: The repository this package was imported from, when it is a checkout.
CHECKOUT = Path(__file__).resolve().parents[2]


class NoBenchmarks(NpuKVError):
    """The benchmarks are not where this ``npukv`` runs from (exit 2)."""


def checkout_bench() -> Path | None:
    """The checkout holding a ``bench`` package beside this package, or None
    (an installed wheel: site-packages is no checkout, and has no setup.cfg
    even where another distribution installs a ``bench``)."""
    marks = (CHECKOUT / "setup.cfg", CHECKOUT / "bench" / "__main__.py")
    return CHECKOUT if all(mark.is_file() for mark in marks) else None


def run(argv: Sequence[str]) -> int:
    """``python -m bench ARGV...`` (NAME and its arguments; none: the list) of
    the checkout, in this directory, so that the arguments' paths stay the
    caller's; its exit code, 128 + N for a signal.

    Raises:
        NoBenchmarks: no checkout's ``bench`` package to run.
    """
    checkout = checkout_bench()
    if checkout is None:
        raise NoBenchmarks(
            "the benchmarks are not in an installed wheel; from a source "
            "checkout of npukv_store run `python -m bench NAME [args]` "
            "(`python -m bench` lists them)"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(checkout), *filter(None, [env.get("PYTHONPATH")])]
    )
    try:
        code = subprocess.run(
            [sys.executable, "-m", "bench", *argv], env=env, check=False
        ).returncode
    except KeyboardInterrupt:
        return 130
    return code if code >= 0 else 128 - code  # killed by a signal: 128 + signal

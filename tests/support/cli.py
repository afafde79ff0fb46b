"""The ``npukv`` command as a child process, the way an operator runs it
beside live servers."""

from __future__ import annotations

import subprocess
import sys


def npukv(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m npukv_store.cli ARGS``: its exit code, stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "npukv_store.cli", *args],
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip

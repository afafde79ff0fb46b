"""Start-up helpers both sides of the connector share.

Runs in: the EngineCore process (scheduler side) and every vLLM Worker process
(worker side), while the connector is constructed.

    unusable_cache_dir() - one line saying why the store could not be opened
"""

from __future__ import annotations

import os


def unusable_cache_dir(cache_dir: str, exc: BaseException) -> str:
    """One line saying why the store could not be opened in ``cache_dir``
    (read-only, not a directory, foreign files, another format version, ...):
    the connector then turns off and vLLM serves on, as for an unsupported
    setup. Bad configuration values never get here: they stop start-up in
    StoreConfig, before any store is opened."""
    path = os.path.abspath(cache_dir)
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"cache_dir {path}: {exc.strerror}{where}; expected a writable directory"
    found = str(exc).removeprefix("cache_dir: ") or type(exc).__name__
    return f"cache_dir {path}: {found}"

"""The connector's tests need vLLM and torch (``pip install .[vllm]``): every
module here imports npukv_store.connector, whose ``__init__`` imports vLLM.

Without them each module is reported skipped, with the reason, here rather
than by an importorskip header in every module (``pytest.importorskip`` at a
conftest's top level would be a collection error, not a skip).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

MISSING = [name for name in ("torch", "vllm") if importlib.util.find_spec(name) is None]


class _SkippedModule(pytest.Module):
    """A test module that is not imported: it needs what is MISSING."""

    def collect(self):
        pytest.skip(
            f"the connector's tests need {' and '.join(MISSING)} (pip install .[vllm])"
        )


def pytest_pycollect_makemodule(
    module_path: Path, parent: pytest.Collector
) -> pytest.Module | None:
    if MISSING:
        return _SkippedModule.from_parent(parent, path=module_path)
    return None

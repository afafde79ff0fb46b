"""The connector with a fault injected into both roles' start-up, for the
end-to-end test that vLLM serves on (tests/e2e/test_startup.py).

vLLM loads it by module path (``python -m bench.harness.vllm_run --connector
npukv-startup-fault``) and finds the class by its usual name; importing this
module replaces, in the connector's module, the two sides it starts with
callables that raise, as a bug or an unforeseen vLLM would.
"""

from __future__ import annotations

from typing import Any

from npukv_store.connector import connector as _connector


def _fail_to_start(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected start-up fault")


_connector.SchedulerSide = _fail_to_start  # type: ignore[assignment,misc]
_connector.WorkerSide = _fail_to_start  # type: ignore[assignment,misc]

NPUKVStoreConnector = _connector.NPUKVStoreConnector

#!/usr/bin/env bash
# The README's test command. On a fresh machine it creates .venv, installs the
# package with its [test] extras (building the C extension with -Werror), runs
# ruff, mypy and stubtest (npukv_store/_native.pyi against the built module),
# then pytest: unit, integration and the quick forms of the multi-process and
# SIGKILL stress tests; then the store-level tests again on the pure-Python
# twin (NPUKV_NATIVE=0, about a minute). Idempotent; exits non-zero on any
# failure. Extra arguments go to the first pytest run (e.g.
# `bash scripts/test.sh -m stress`).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/setup_env.sh

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== stubtest"; "$PY" -m mypy.stubtest npukv_store._native
echo "== pytest"
"$PY" -m pytest -q "$@"
# The twin is picked only at import, so the store runs on it only in a process
# started with NPUKV_NATIVE=0 (the native-only cases skip there).
echo "== pytest on the twin (NPUKV_NATIVE=0)"
NPUKV_NATIVE=0 "$PY" -m pytest -q \
    tests/unit/test_native.py tests/unit/test_copy.py tests/unit/test_device.py \
    tests/unit/test_store.py tests/unit/test_format.py tests/unit/test_writer.py \
    tests/read tests/integration/test_engine.py tests/integration/test_bad_input.py

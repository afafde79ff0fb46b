#!/usr/bin/env bash
# The README's test command. On a fresh machine it creates .venv, installs the
# package with its [test] extras (building the C extension with -Werror), runs
# ruff and mypy, then pytest: unit, integration and the quick forms of the
# multi-process and SIGKILL stress tests. Idempotent; exits non-zero on any failure.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m stress`).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
# torch first and pinned: this version is on local disk here, and a bare `torch`
# requirement would otherwise pull a multi-GB CUDA build.
if ! "$PY" -c 'import torch' 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e '.[test]'
"$PY" -c 'import npukv_store._native'

echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"
"$PY" -m pytest -q "$@"

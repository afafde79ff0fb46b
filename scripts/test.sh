#!/usr/bin/env bash
# The README's test command. On a fresh machine it creates .venv, installs the
# package with its [test] extras (building the C extension with -Werror), runs
# ruff and mypy, then pytest: unit, integration and the quick forms of the
# multi-process and SIGKILL stress tests. Idempotent; exits non-zero on any failure.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m stress`).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/setup_env.sh

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"
"$PY" -m pytest -q "$@"

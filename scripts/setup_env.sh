# Sourced by scripts/test.sh and scripts/demo.sh: create .venv when missing and
# install the package with its [test] extras (building the C extension).
# Idempotent. Leaves PY pointing at the venv's python.
PYTHON=${PYTHON:-python3}
# The xxhash C header lets the extension verify checksums without the GIL.
# Best effort: without it the build still works and a Python twin is used.
if [ ! -f /usr/include/xxhash.h ] && command -v apt-get >/dev/null \
        && [ "$(id -u)" = 0 ]; then
    { apt-get install -y -qq libxxhash-dev || { apt-get update -qq \
        && apt-get install -y -qq libxxhash-dev; }; } >/dev/null 2>&1 \
        || echo "note: libxxhash-dev not installed; checksums use the Python twin"
fi
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

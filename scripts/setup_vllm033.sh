# Sourced by scripts/test.sh (after scripts/setup_env.sh): the vLLM 0.33 lane's
# venv, .venv-vllm033, for the connector's unit tests only (no engine runs:
# vLLM 0.33 has no CPU build). PyPI's vllm 0.33.0 wheel (CUDA; pins
# torch==2.14.0) goes in with --no-deps over the CPU torch 2.13.0 of .venv,
# with only those of its requirements that importing vLLM's connector API, KV
# cache specs and metrics needs (versions as the wheel's Requires-Dist says).
# Idempotent. Leaves PY033 pointing at the venv's python.
#
# The package is installed editable and shares the one C extension of the
# source tree, as in scripts/setup_vllm023.sh.
PY033=.venv-vllm033/bin/python
if [ ! -x "$PY033" ]; then
    "${PYTHON:-python3}" -m venv .venv-vllm033
fi
# (the installed version, from its metadata: importing vLLM takes seconds)
if ! "$PY033" -c 'import importlib.metadata as m, sys; sys.exit(not m.version("vllm").startswith("0.33."))' 2>/dev/null; then
    _v033_dl=$(mktemp -d)
    # torch pinned to the CPU build: nothing below may pull the CUDA one
    echo "torch==2.13.0" >"$_v033_dl/pin.txt"
    "$PY033" -m pip install -q -c "$_v033_dl/pin.txt" torch==2.13.0 packaging
    "$PY033" -m pip download -q --no-deps vllm==0.33.0 -d "$_v033_dl"
    "$PY033" - "$_v033_dl"/vllm-0.33.0-*.whl >"$_v033_dl/reqs.txt" <<'PYEOF'
import sys, zipfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
# what `import npukv_store.connector` and the connector's unit tests import
# from vLLM needs (found by importing, one ModuleNotFoundError at a time)
NEEDED = {
    "cachetools", "cbor2", "cloudpickle", "fastapi", "huggingface-hub",
    "llguidance", "msgspec", "openai", "oss-harmony", "partial-json-parser",
    "pillow", "py-cpuinfo", "pybase64", "pydantic", "pyyaml", "pyzmq", "regex",
    "requests", "transformers", "xgrammar",
}
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if canonicalize_name(req.name) not in NEEDED:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
    "$PY033" -m pip install -q --no-warn-conflicts -c "$_v033_dl/pin.txt" -r "$_v033_dl/reqs.txt"
    "$PY033" -m pip install -q --no-warn-conflicts --no-deps "$_v033_dl"/vllm-0.33.0-*.whl
    rm -rf "$_v033_dl"
    unset _v033_dl
fi
_v033_stamp=$(cat setup.py setup.cfg pyproject.toml | cksum)
if [ "$(cat .venv-vllm033/.npukv-install 2>/dev/null)" != "$_v033_stamp" ] ||
    ! "$PY033" -c 'import npukv_store._native' 2>/dev/null; then
    "$PY033" -m pip install -q --no-warn-conflicts -e '.[test]'
    echo "$_v033_stamp" >.venv-vllm033/.npukv-install
fi
unset _v033_stamp
# The connector's tests skip where vLLM does not import: fail here instead,
# with the error (vLLM's import chatter only then).
if ! _v033_err=$("$PY033" -c 'import npukv_store._native, npukv_store.connector' 2>&1); then
    printf '%s\n' "$_v033_err" >&2
    unset _v033_err
    false
fi
unset _v033_err

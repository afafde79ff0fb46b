# Sourced by scripts/test.sh (after scripts/setup_env.sh): the vLLM 0.33 lane's
# venv, .venv-vllm033, for the connector's unit tests only (no engine runs:
# vLLM 0.33 has no CPU build). Idempotent. Leaves PY033 pointing at the venv's
# python.
#
# An overlay on .venv, not a venv of its own: PyPI's vllm 0.33.0 wheel (CUDA;
# pins torch==2.14.0) goes in with --no-deps, and a .pth file then adds
# .venv's site-packages behind it (site.addsitedir, so that .venv's own .pth
# files, the editable npukv_store among them, apply too). `import vllm` finds
# 0.33 first; torch 2.13 (CPU), pytest and vLLM's other requirements come from
# .venv, as 0.32 pins them, which is what importing vLLM's connector API, KV
# cache specs and metrics needs. 30 s instead of the 3.5 min of a venv filled
# from PyPI.
PY033=.venv-vllm033/bin/python
if [ ! -x "$PY033" ]; then
    "${PYTHON:-python3}" -m venv .venv-vllm033
fi
_v033_own=$("$PY033" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
_v033_main=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "import site; site.addsitedir('$_v033_main')" >"$_v033_own/zz-npukv-main-venv.pth"
# (the installed version, from its metadata: importing vLLM takes seconds)
if ! "$PY033" -c 'import importlib.metadata as m, sys; sys.exit(not m.version("vllm").startswith("0.33."))' 2>/dev/null; then
    _v033_dl=$(mktemp -d)
    "$PY033" -m pip download -q --no-deps vllm==0.33.0 -d "$_v033_dl"
    "$PY033" -m pip install -q --no-warn-conflicts --no-deps "$_v033_dl"/vllm-0.33.0-*.whl
    rm -rf "$_v033_dl"
    unset _v033_dl
fi
unset _v033_own _v033_main
# The connector's tests skip where vLLM does not import: fail here instead,
# with the error (vLLM's import chatter only then).
if ! _v033_err=$("$PY033" -c '
import sys, vllm
import npukv_store._native, npukv_store.connector
if not vllm.__version__.startswith("0.33."):
    sys.exit(f".venv-vllm033 imports vLLM {vllm.__version__} from {vllm.__file__}, expected 0.33")
' 2>&1); then
    printf '%s\n' "$_v033_err" >&2
    unset _v033_err
    false
fi
unset _v033_err

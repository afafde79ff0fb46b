# Sourced by scripts/test.sh (after scripts/setup_env.sh): the vLLM 0.34 lane's
# venv, .venv-vllm034, for the connector's unit tests only (no engine runs:
# vLLM 0.34 has no CPU build). Idempotent. Leaves PY034 pointing at the venv's
# python.
#
# An overlay on .venv, not a venv of its own: PyPI's vllm 0.34.0 wheel (CUDA;
# pins torch==2.14.0) goes in with --no-deps, and a .pth file then adds
# .venv's site-packages behind it (site.addsitedir, so that .venv's own .pth
# files, the editable npukv_store among them, apply too). `import vllm` finds
# 0.34 first; torch 2.13 (CPU), pytest and vLLM's other requirements come from
# .venv, as 0.32 pins them, which is what importing vLLM's connector API, KV
# cache specs, scheduler and metrics needs. 0.34's Requires-Dist asks more of
# a few (huggingface_hub>=2.0, filelock>=4.2.4, pillow>=13: .venv's meet
# them), and for orjson (the OpenAI server's) and CUDA kernels (flashinfer,
# tilelang, cutlass-dsl, ...), which no import here reaches. 30 s instead of
# the 3.5 min of a venv filled from PyPI.
PY034=.venv-vllm034/bin/python
if [ ! -x "$PY034" ]; then
    "${PYTHON:-python3}" -m venv .venv-vllm034
fi
_v034_own=$("$PY034" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
_v034_main=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "import site; site.addsitedir('$_v034_main')" >"$_v034_own/zz-npukv-main-venv.pth"
# (the installed version, from its metadata: importing vLLM takes seconds)
if ! "$PY034" -c 'import importlib.metadata as m, sys; sys.exit(not m.version("vllm").startswith("0.34."))' 2>/dev/null; then
    _v034_dl=$(mktemp -d)
    "$PY034" -m pip download -q --no-deps vllm==0.34.0 -d "$_v034_dl"
    "$PY034" -m pip install -q --no-warn-conflicts --no-deps "$_v034_dl"/vllm-0.34.0-*.whl
    rm -rf "$_v034_dl"
    unset _v034_dl
fi
unset _v034_own _v034_main
# The connector's tests skip where vLLM does not import: fail here instead,
# with the error (vLLM's import chatter only then).
if ! _v034_err=$("$PY034" -c '
import sys, vllm
import npukv_store._native, npukv_store.connector
if not vllm.__version__.startswith("0.34."):
    sys.exit(f".venv-vllm034 imports vLLM {vllm.__version__} from {vllm.__file__}, expected 0.34")
' 2>&1); then
    printf '%s\n' "$_v034_err" >&2
    unset _v034_err
    false
fi
unset _v034_err

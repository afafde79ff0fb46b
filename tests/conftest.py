"""Shared fixtures: a tiny namespace, a store per test, and check() at teardown;
the end-to-end tests' work directory with a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from npukv_store import KVStore, NamespaceSpec, StoreConfig
from tests.support.blocks import tiny_spec
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

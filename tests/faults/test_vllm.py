"""Faults in real vLLM (CPU build, a tiny random Llama; bench/harness/runs.py):
a read-only cache directory, failing reads, a SIGKILL in the middle of a save
followed by a restart, a ring that does not fit /dev/shm. Each run's greedy
tokens must equal a no-connector baseline (a prompt that differs counts as
wrong KV served), and where one error line is promised the log holds it and
no traceback. Full form only (``pytest -m faults``): each run takes 10-20 s.
"""

from __future__ import annotations

import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from npukv_store import KVStore
from npukv_store.testing import faults as io_faults
from tests.support import faults
from tests.support.chunks import tmp_files
from tests.support.faults import SMALL

pytest.importorskip(
    "vllm", reason="the vLLM fault kinds need vLLM (pip install .[vllm])"
)

from bench.harness import runs  # noqa: E402

pytestmark = pytest.mark.e2e
OFF_LINE = "npukv_store: the connector is off"
TRACEBACK = "Traceback (most recent call last)"


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in (201, 300)]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def baseline(work: Path) -> list[list[int]]:
    report = runs.run(work, "baseline", PROMPTS, model=work / "model",
                      args=("--no-prefix-caching",))  # fmt: skip
    return runs.tokens(report)


@pytest.fixture(scope="module")
def stored(work: Path, baseline: list[list[int]]) -> Path:
    cache = work / "stored"
    report = runs.run(work, "store", PROMPTS, model=work / "model", cache_dir=cache)
    assert runs.tokens(report) == baseline
    return cache


def _tokens_match(fault, report: dict, baseline: list[list[int]], name: str) -> None:
    got = runs.tokens(report)
    wrong = sum(a != b for a, b in zip(got, baseline, strict=True))
    fault.wrong(wrong, f"{name}: {wrong} prompt(s) gave other tokens than baseline")


def _copy_cold(source: Path, dest: Path) -> Path:
    """A copy of a cache directory whose chunk pages are not in the page cache
    (so loads read through the I/O engine, where NPUKV_FAULTS acts)."""
    shutil.copytree(source, dest)
    faults.drop_page_cache(faults.chunk_paths(dest))
    return dest


@pytest.mark.fault("vllm-read-only-cache-dir")
def test_vllm_with_a_read_only_cache_dir(fault, work, baseline, stored):
    for trial in fault.trials(1, 1):
        cache = _copy_cold(stored, work / f"ro{trial}")
        with faults.read_only(cache):
            name = f"read_only{trial}"
            proc = runs.start(work, name, PROMPTS, model=work / "model",
                              cache_dir=cache)  # fmt: skip
            rc = runs.wait(proc)
        log = (work / f"{name}.log").read_text(errors="replace")
        fault.process(name, rc, log)
        if rc != 0:
            return
        report = runs.finish(work, name, proc)
        _tokens_match(fault, report, baseline, name)
        lines = [line for line in log.splitlines() if OFF_LINE in line]
        assert len(lines) == 1, lines
        for needed in ("cache_dir", str(cache), "Read-only file system"):
            assert needed in lines[0], lines[0]


@pytest.mark.fault("vllm-read-eio")
def test_vllm_loads_that_fail_are_recomputed(fault, work, baseline, stored,
                                            monkeypatch):  # fmt: skip
    for trial in fault.trials(1, 1):
        cache = _copy_cold(stored, work / f"eio{trial}")
        monkeypatch.setenv(io_faults.ENV, "read:eio")  # the child inherits it
        name = f"read_eio{trial}"
        proc = runs.start(work, name, PROMPTS, model=work / "model", cache_dir=cache)
        monkeypatch.delenv(io_faults.ENV)
        rc = runs.wait(proc)
        log = (work / f"{name}.log").read_text(errors="replace")
        fault.process(name, rc, log)
        if rc != 0:
            return
        report = runs.finish(work, name, proc)
        _tokens_match(fault, report, baseline, name)
        assert sum(runs.external(report)) > 0, "no stored prefix was claimed"
        assert re.search(r"blocks failed to load", log), "no failed load was logged"


CHUNK_TMP = re.compile(r"^\d+-[0-9a-f]{16}\.tmp$")


@pytest.mark.fault("vllm-sigkill-mid-save")
def test_vllm_killed_mid_save_then_restarted(fault, work, baseline, monkeypatch):
    for trial in fault.trials(1, 2):
        cache = work / f"killed{trial}"
        monkeypatch.setenv(io_faults.ENV, "write:slow:ms=4000")
        name = f"killed{trial}"
        proc = runs.start(work, name, PROMPTS, model=work / "model", cache_dir=cache)
        monkeypatch.delenv(io_faults.ENV)
        tmp = cache / "tmp"
        deadline = time.monotonic() + 300
        with runs.reaping(proc):
            while proc.poll() is None and time.monotonic() < deadline:
                if tmp.is_dir() and any(CHUNK_TMP.match(n.name) for n in tmp.iterdir()):
                    break  # the writer is inside a chunk write
                time.sleep(0.05)
            assert proc.poll() is None, "the run ended before its writer started"
            time.sleep(random.uniform(0.0, 1.5))
            proc.send_signal(signal.SIGKILL)
            rc = proc.wait(timeout=60)
        log = (work / f"{name}.log").read_text(errors="replace")
        fault.process(name, rc, log, expect_rc=-signal.SIGKILL)
        assert any(CHUNK_TMP.match(n.name) for n in tmp.iterdir()), "no tmp left"
        again = f"restarted{trial}"
        proc = runs.start(work, again, PROMPTS, model=work / "model", cache_dir=cache)
        rc = runs.wait(proc)
        log = (work / f"{again}.log").read_text(errors="replace")
        fault.process(again, rc, log)
        if rc != 0:
            return
        _tokens_match(fault, runs.finish(work, again, proc), baseline, again)
        cfg = faults.config(cache)
        with KVStore(cfg, SMALL) as store:  # recovery ran before
            assert store.check(verify_data=True) == []
        assert tmp_files(str(cache)) == []


@pytest.mark.fault("vllm-ring-larger-than-shm")
def test_vllm_with_a_ring_larger_than_dev_shm(fault, work, baseline):
    too_large = shutil.disk_usage("/dev/shm").total + (1 << 30)
    for trial in fault.trials(1, 1):
        name = f"big_ring{trial}"
        extra = {"ring_size": too_large}
        proc = runs.start(work, name, PROMPTS, model=work / "model",
                          cache_dir=work / name, extra=extra)  # fmt: skip
        rc = runs.wait(proc)
        log = (work / f"{name}.log").read_text(errors="replace")
        fault.process(name, rc, log, clean=True)
        if rc != 0:
            return
        _tokens_match(fault, runs.finish(work, name, proc), baseline, name)
        lines = [line for line in log.splitlines() if OFF_LINE in line]
        assert lines, "the connector did not say it is off"
        assert all("ring_size" in line for line in lines), lines

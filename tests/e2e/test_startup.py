"""A connector that cannot start never stops vLLM: real vLLM (CPU build) with
a fault injected into both roles' start-up (tests/support/startup_fault.py)
serves the baseline's tokens, with one error line, on every lane's vLLM."""

from __future__ import annotations

import random

import pytest

from bench.harness.runs import build_model, external, run, tokens

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (pip install .[vllm])")
pytestmark = pytest.mark.e2e


def test_an_exception_in_both_constructors_leaves_vllm_serving(tmp_path):
    model = build_model(tmp_path / "model")
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 500) for _ in range(120)] for _ in range(2)]
    baseline = run(tmp_path, "baseline", prompts, model=model)
    faulty = run(
        tmp_path, "faulty", prompts, model=model, cache_dir=tmp_path / "cache",
        connector="npukv-startup-fault",
    )  # fmt: skip
    assert tokens(faulty) == tokens(baseline)
    assert external(faulty) == [0, 0]
    lines = [ln for ln in faulty["log"].splitlines() if "connector is off" in ln]
    assert len(lines) == 1, lines  # both roles run in this one process
    assert "injected start-up fault" in lines[0]
    assert "ERROR" in lines[0]
    assert "Traceback" not in faulty["log"]
    assert not (tmp_path / "cache").exists()

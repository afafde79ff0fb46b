"""The maintenance job against the cache directory of a live vLLM process.

One vLLM process (the connector on, decode blocks saved too, so that every
step's save is a small chunk) serves prompts and then their repeats, which it
loads from the store, while ``scripts/compact.py`` runs again and again on its
directory. Every output must equal the no-connector baseline; compaction must
really have rewritten chunks while vLLM ran; a second process then loads every
prompt from the compacted directory, with the same outputs. Finally every
operator command works on the directory vLLM left behind.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.harness import runs
from tests.support.cli import npukv

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (pip install .[vllm])")
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
# vLLM's own prefix cache off, ours loading anyway (the tiny Llama's CPU
# backend continues a prefill exactly): every repeat is a load from our store.
ARGS = ("--no-prefix-caching",)
EXTRA = {"save_decode": True, "load_without_prefix_caching": True}


def _prompts() -> list[list[int]]:
    rng = random.Random(14)
    shared = [rng.randrange(3, 2048) for _ in range(96)]
    prompts = []
    for i in range(12):
        own = [rng.randrange(3, 2048) for _ in range(rng.randrange(40, 200))]
        prompts.append((shared if i % 2 else []) + own)
    return prompts


def _compact(cache: Path) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compact.py"), str(cache), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    summary: dict[str, object] = json.loads(done.stdout)
    return summary


def test_compaction_while_vllm_serves_keeps_every_output(tmp_path):
    model = runs.build_model(tmp_path / "model")
    prompts = _prompts()
    served = prompts + prompts  # the repeats load what the first pass saved
    baseline = runs.finish(
        tmp_path, "baseline",
        runs.start(tmp_path, "baseline", served, model=model, args=ARGS,
                   max_tokens=24),
    )  # fmt: skip
    cache = tmp_path / "cache"
    proc = runs.start(
        tmp_path, "live", served, model=model, cache_dir=cache, extra=EXTRA,
        args=ARGS, max_tokens=24,
    )  # fmt: skip
    during = []
    with runs.reaping(proc):
        while proc.poll() is None:
            if (cache / "NPUKV_STORE").exists():
                summary = _compact(cache)
                if proc.poll() is None:  # the run ended while vLLM still ran
                    during.append(summary)
            time.sleep(0.1)
        live = runs.finish(tmp_path, "live", proc)
    expected = [r["tokens"] for r in baseline["results"]]
    assert [r["tokens"] for r in live["results"]] == expected
    rewritten = sum(int(s["rewritten"]) for s in during)  # type: ignore[call-overload]
    print(f"compaction runs during serving: {len(during)}, rewrote {rewritten}")
    assert rewritten > 0, during
    loaded = [r["external_tokens"] for r in live["results"][len(prompts) :]]
    assert sum(loaded) > 0, loaded

    after = runs.finish(
        tmp_path, "after",
        runs.start(tmp_path, "after", prompts, model=model, cache_dir=cache,
                   extra=EXTRA, args=ARGS, max_tokens=24),
    )  # fmt: skip
    assert [r["tokens"] for r in after["results"]] == expected[: len(prompts)]
    for tokens, result in zip(prompts, after["results"], strict=True):
        full = (len(tokens) - 1) // BLOCK * BLOCK  # the last token is computed
        assert result["external_tokens"] == full

    # Every operator command on the directory vLLM left behind.
    stats = json.loads(npukv("stats", str(cache), "--json").stdout)
    assert stats["chunks"] >= 1
    assert stats["blocks"] > 0
    (namespace,) = stats["namespaces"]
    for args in (
        ("stats", str(cache)),
        ("inspect", str(cache), namespace),
        ("verify", str(cache)),
        ("verify", str(cache), "--fast", "--fix"),
        ("gc", str(cache)),
        ("compact", str(cache), "--verify"),
        ("rebuild-index", str(cache)),
        ("verify", str(cache)),
    ):
        done = npukv(*args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr

"""End to end on real vLLM (CPU build): greedy tokens with the connector must
equal a no-connector baseline, whatever the store holds.

Every vLLM run is a separate process (bench/harness/runs.py) on a tiny
random-weight Llama built locally. vLLM's prefix cache is on in the runs with
the connector, as in production; each run's prompts share at most the blocks
a test means to hit locally. Most runs use VLLM_ENABLE_V1_MULTIPROCESSING=0
(about 20 s each); one uses vLLM's default multi-process mode, where the
scheduler-side and worker-side connectors live in different processes, as
users run it.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import runs

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (pip install .[vllm])")

BLOCK = 32
pytestmark = pytest.mark.e2e


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    p1 = [rng.randrange(3, 2048) for _ in range(201)]
    p2 = p1[:150] + [rng.randrange(3, 2048) for _ in range(60)]  # shares 4 blocks
    p3 = [rng.randrange(3, 2048) for _ in range(300)]
    return {"p1": p1, "p2": p2, "p3": p3}


PROMPTS = _prompts()


def _expected_hit(tokens: list[int]) -> int:
    return (len(tokens) - 1) // BLOCK * BLOCK  # the last token is always computed


def harness(
    work: Path,
    name: str,
    prompts: list[str],
    *,
    cache_dir: Path | None = None,
    extra: dict[str, object] | None = None,
    args: tuple[str, ...] = (),
    multiprocess: bool = False,
    wait: bool = True,
    max_tokens: int = 8,
) -> subprocess.Popen[bytes] | dict[str, object]:
    """Run one vLLM process over the named prompts; returns its report (or
    the process when ``wait`` is False)."""
    proc = runs.start(
        work, name, [PROMPTS[p] for p in prompts], model=work / "model",
        cache_dir=cache_dir, extra=extra, args=args, multiprocess=multiprocess,
        max_tokens=max_tokens,
    )  # fmt: skip
    return runs.finish(work, name, proc) if wait else proc


_finish = runs.finish


@pytest.fixture(scope="module")
def baseline(work: Path) -> dict[str, list[int]]:
    # no prefix cache: the reference computes every prompt from scratch
    report = harness(
        work, "baseline", ["p1", "p2", "p3"], args=("--no-prefix-caching",)
    )
    results = report["results"]  # type: ignore[index]
    assert all(r["num_cached_tokens"] == 0 for r in results)
    return {p: r["tokens"] for p, r in zip(["p1", "p2", "p3"], results, strict=True)}


@pytest.fixture(scope="module")
def stored(work: Path, baseline: dict[str, list[int]]) -> Path:
    """A cache directory filled by one vLLM process (layerwise on)."""
    cache = work / "cache"
    report = harness(work, "store", ["p1", "p3"], cache_dir=cache,
                     extra={"layerwise": "on"})  # fmt: skip
    results = report["results"]  # type: ignore[index]
    assert [r["tokens"] for r in results] == [baseline["p1"], baseline["p3"]]
    assert all(r["num_cached_tokens"] == 0 for r in results)
    return cache


def _check_hits(report: dict[str, object], baseline: dict[str, list[int]],
                names: list[str], hits: list[int]) -> None:  # fmt: skip
    results = report["results"]  # type: ignore[index]
    for name, result, hit in zip(names, results, hits, strict=True):
        assert result["tokens"] == baseline[name], f"{name}: tokens differ"
        assert result["num_cached_tokens"] == hit, f"{name}: external hit"


# the module's first test: its budget also pays for the baseline and
# stored fixtures' vLLM runs, which take the 300 s default on a busy 2-core host
def test_store_then_load_in_another_process_bulk_mode(work, baseline, stored):
    """Second process, layerwise off: a partial prefix hit of 4 blocks for p2
    (it shares 150 tokens with p1), then p1, whose 4 first blocks are now in
    vLLM's own prefix cache: the connector loads only the rest, and p3."""
    report = harness(work, "load_off", ["p2", "p1", "p3"], cache_dir=stored,
                     extra={"layerwise": "off"})  # fmt: skip
    hits = [4 * BLOCK, _expected_hit(PROMPTS["p1"]), _expected_hit(PROMPTS["p3"])]
    _check_hits(report, baseline, ["p2", "p1", "p3"], hits)
    assert runs.external(report) == [4 * BLOCK, hits[1] - 4 * BLOCK, hits[2]]


def test_load_layerwise_on(work, baseline, stored):
    report = harness(work, "load_on", ["p3", "p1"], cache_dir=stored,
                     extra={"layerwise": "on", "prefetch_depth": 1})  # fmt: skip
    hits = [_expected_hit(PROMPTS["p3"]), _expected_hit(PROMPTS["p1"])]
    _check_hits(report, baseline, ["p3", "p1"], hits)


def test_auto_mode_without_layer_hooks_is_correct(work, baseline, stored):
    """A platform whose attention never calls the layer hooks: auto must stay
    in bulk mode and still load correctly."""
    report = harness(
        work, "auto_nohooks", ["p1", "p3"], cache_dir=stored,
        extra={"layerwise": "auto"}, args=("--no-layer-hooks",),
    )  # fmt: skip
    hits = [_expected_hit(PROMPTS["p1"]), _expected_hit(PROMPTS["p3"])]
    _check_hits(report, baseline, ["p1", "p3"], hits)
    assert "layerwise on" not in report["log"]


def test_layerwise_on_without_hooks_recomputes(work, baseline, stored):
    """layerwise=on on such a platform must not serve half-loaded KV: the
    blocks are reported as load errors and recomputed."""
    report = harness(work, "on_nohooks", ["p1"], cache_dir=stored,
                     extra={"layerwise": "on"}, args=("--no-layer-hooks",))  # fmt: skip
    assert report["results"][0]["tokens"] == baseline["p1"]  # type: ignore[index]
    assert "load hook was skipped" in report["log"]


def test_auto_on_an_accelerator_falls_back_when_hooks_stop(work, baseline, stored):
    """auto's accelerator branch (the CPU backend pretends to be an NPU): the
    warm-up's hooks turn layerwise on; then the platform stops calling them
    mid-run, so the next load's layers are never waited on. Those blocks must
    be reported and recomputed, and the worker must fall back to bulk loads,
    which serve the prompt after it."""
    report = harness(
        work, "auto_drop", ["p1", "p3"], cache_dir=stored, extra={"layerwise": "auto"},
        args=("--pretend-accelerator", "--drop-hooks-after-warmup"),
    )  # fmt: skip
    log = report["log"]
    assert "layer hooks fire for every layer: layerwise on" in log
    assert log.count("load hook was skipped") == 1
    results = report["results"]  # type: ignore[index]
    assert [r["tokens"] for r in results] == [baseline["p1"], baseline["p3"]]
    assert results[1]["num_cached_tokens"] == _expected_hit(PROMPTS["p3"])


def test_default_multiprocess_mode(work, baseline, stored):
    report = harness(work, "load_mp", ["p1"], cache_dir=stored, multiprocess=True)
    _check_hits(report, baseline, ["p1"], [_expected_hit(PROMPTS["p1"])])


def test_corrupt_chunks_are_recomputed(work, baseline, stored):
    cache = work / "corrupt"
    assert runs.corrupt_copy(stored, cache)
    report = harness(work, "corrupt", ["p1", "p3"], cache_dir=cache,
                     extra={"layerwise": "off"})  # fmt: skip
    results = report["results"]  # type: ignore[index]
    assert [r["tokens"] for r in results] == [baseline["p1"], baseline["p3"]]
    assert "failed to load" in report["log"]


def test_two_vllm_processes_share_one_directory(work, baseline):
    cache = work / "shared"
    first = harness(work, "twin_a", ["p1", "p3", "p2"], cache_dir=cache, wait=False)
    with runs.reaping(first):
        second = harness(work, "twin_b", ["p3", "p2", "p1"], cache_dir=cache,
                         wait=False)  # fmt: skip
        with runs.reaping(second):
            reports = [_finish(work, "twin_a", first), _finish(work, "twin_b", second)]  # type: ignore[arg-type]
    for report, names in zip(
        reports, [["p1", "p3", "p2"], ["p3", "p2", "p1"]], strict=False
    ):
        results = report["results"]  # type: ignore[index]
        assert [r["tokens"] for r in results] == [baseline[n] for n in names]
    verify = subprocess.run(
        [sys.executable, "-m", "npukv_store.cli", "verify", str(cache)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = harness(work, "after_twins", ["p2"], cache_dir=cache)
    _check_hits(report, baseline, ["p2"], [_expected_hit(PROMPTS["p2"])])


def test_save_decode_stores_generated_blocks(work):
    """With save_decode the blocks generated by a finished request are saved
    (its blocks stay allocated until the save's copies are done), so a follow-up
    prompt that contains the answer hits them too."""
    cache = work / "decode"
    first = harness(work, "decode_a", ["p1"], cache_dir=cache,
                    extra={"save_decode": True}, max_tokens=70)  # fmt: skip
    answer = first["results"][0]["tokens"]  # type: ignore[index]
    assert len(answer) == 70
    PROMPTS["p1_answer"] = PROMPTS["p1"] + answer  # 271 tokens
    reference = harness(work, "decode_ref", ["p1_answer"])
    again = harness(work, "decode_b", ["p1_answer"], cache_dir=cache)
    result = again["results"][0]  # type: ignore[index]
    assert result["tokens"] == reference["results"][0]["tokens"]  # type: ignore[index]
    # 270 of the 271 tokens were computed in the first run: 8 full blocks,
    # 6 of the prompt and 2 generated
    assert result["num_cached_tokens"] == 8 * BLOCK

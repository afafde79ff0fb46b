"""DeepSeek V4 end to end on real vLLM (CPU build): the tiny random-weight V4
of bench/harness/tiny_models.py (a sliding-window layer, a compressed one
with the indexer, a heavily compressed one; bfloat16).

vLLM 0.32 runs V4 on CPU only with AMX: its sparse-MLA and indexer backends
are AMX kernels (blocks of 256, prefix caching on). Without AMX it stops at
start-up, in the weights' post-processing (cpu_sparse.py's
``_capture_and_pack``: ``torch.ops._C.convert_weight_packed`` is missing from
the AVX2 kernel library), so the test is skipped there.

DeepSeek V4 is refused by name until an AMX machine proves a byte-exact load:
its compressed MLA keeps one KV row per ``tokens_per_state`` tokens, and its
groups have several block sizes. This test proves vLLM serves on with the
baseline's tokens: the connector turns itself off at start-up with one line
and loads nothing. tests/connector/test_deepseek_v4_specs.py checks the same
refusal on vLLM's real V4 groups on any CPU.
"""

from __future__ import annotations

import random

import pytest

from bench.harness.runs import build_model, external, run, tokens
from tests.support.cpu import cpu_has_amx

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (pip install .[vllm])")
pytestmark = pytest.mark.e2e

#: the first group the connector refuses (group by group, before it compares
#: block sizes): the compressed MLA and indexer caches
REFUSAL = (
    "KV cache group 3 is MLAAttentionSpec (3 layer(s), e.g. "
    "model.layers.1.attn.indexer.k_cache): tokens_per_state=4, expected 1"
)


def _prompts() -> dict[str, list[int]]:
    """A (600 tokens), B (A's first 300, then its own), C (unrelated)."""
    rng = random.Random(41)

    def draw(n: int) -> list[int]:
        return [rng.randrange(4, 2999) for _ in range(n)]

    a = draw(600)
    return {"A": a, "B": a[:300] + draw(300), "C": draw(600)}


@pytest.mark.skipif(
    not cpu_has_amx(),
    reason="vLLM's CPU DeepSeek-V4 backends (sparse MLA, indexer) need a CPU with "
    "AMX (amx_tile is not in /proc/cpuinfo's flags here)",
)
def test_deepseek_v4_is_refused_and_vllm_serves_baseline_tokens(tmp_path):
    """DeepSeek V4 is refused by name until an AMX machine proves a
    byte-exact load; this test proves vLLM serves on with baseline tokens:
    a baseline without the connector over [A, B], a store run over [A, C],
    a load run over [A, B]; the connector is off in both with one line naming
    the compressed MLA group, loads nothing, and the tokens are the
    baseline's."""
    model = build_model(tmp_path / "model", "deepseek_v4")
    p, cache = _prompts(), tmp_path / "cache"
    baseline = run(tmp_path, "baseline", [p["A"], p["B"]], model=model)
    store = run(tmp_path, "store", [p["A"], p["C"]], model=model, cache_dir=cache)
    load = run(tmp_path, "load", [p["A"], p["B"]], model=model, cache_dir=cache)
    assert "prefix caching to be disabled" not in baseline["log"]
    for report in (store, load):
        off = [
            line for line in report["log"].splitlines() if "connector is off" in line
        ]
        assert len(off) == 1, off
        assert "the connector is off" in off[0], off[0]
        assert REFUSAL in off[0], off[0]
    assert external(load) == [0, 0]  # nothing loaded
    assert tokens(load) == tokens(baseline)

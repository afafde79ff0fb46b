"""Served smoke test, for the vLLM lanes that test_serve.py's long stages do not
run on (scripts/test.sh: the vLLM 0.23 lane): vLLM's real OpenAI server (CPU
build) with the connector answers 32 requests in flight at once with the
reference server's (no connector) tokens, cold and then warm, and the warm
round loads from the store.

The two servers boot side by side (start-up is mostly imports); the reference
answers the prompts and stops before the connector's server takes traffic.
Between the rounds the connector's server empties vLLM's own prefix cache
(the endpoint VLLM_SERVER_DEV_MODE adds), so that the warm round's prefixes
can only come from the store.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import pytest

pytest.importorskip("vllm", reason="served end-to-end tests need vLLM (.[vllm])")
pytest.importorskip("aiohttp", reason="the served tests' client needs aiohttp")

from bench.harness import runs  # noqa: E402
from bench.harness import serve as sh  # noqa: E402
from tests.support.served import check_outputs  # noqa: E402

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
REQUESTS = 32  # all in flight at once
PROMPTS = sh.build_prompts(REQUESTS, seed=4)


def _send(server: sh.Server) -> list[sh.Result]:
    return sh.complete(
        server.url, server.model, PROMPTS, max_tokens=MAX_TOKENS, concurrency=REQUESTS
    )


def _reset_prefix_cache(server: sh.Server, timeout_s: float = 60.0) -> None:
    """Empty vLLM's prefix cache. vLLM refuses while blocks are held (a save in
    flight keeps its request's blocks until a step reports it done, and its
    endpoint answers 200 either way): on a refusal, a short request runs a
    step, and we ask again."""
    done = "Successfully reset prefix cache"  # EngineCore's log line
    before = server.log_text().count(done)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            server.url + "/reset_prefix_cache", method="POST"
        )
        urllib.request.urlopen(request, timeout=30).close()
        if server.log_text().count(done) > before:
            return
        sh.complete(server.url, server.model, [[5, 6, 7]], max_tokens=1, concurrency=1)
        time.sleep(0.5)
    pytest.fail(
        f"vLLM did not reset its prefix cache in {timeout_s} s:\n{server.log_tail()}"
    )


def _counters(server: sh.Server) -> dict[str, float]:
    metrics = server.metrics()
    names = (
        "npukv_hit_tokens", "npukv_loaded_bytes", "npukv_saved_bytes",
        "external_prefix_cache_hits",
    )  # fmt: skip
    return {name: metrics[f"vllm:{name}_total"] for name in names}


@pytest.mark.timeout(900)
def test_served_outputs_equal_the_reference_cold_and_warm(tmp_path):
    import vllm

    model = runs.build_model(tmp_path / "model")
    reference_server = sh.Server(model, log_path=tmp_path / "reference.log")
    server = sh.Server(
        model, connector="npukv", cache_dir=tmp_path / "cache",
        # load every hit: the default policy may recompute this tiny model's hits
        extra={"load_policy": "always"}, log_path=tmp_path / "npukv.log",
        env={"VLLM_SERVER_DEV_MODE": "1"},  # for /reset_prefix_cache
    )  # fmt: skip
    try:
        for s in (reference_server, server):
            s.start(wait=False)
        for s in (reference_server, server):
            s.wait_ready()
        with reference_server:
            results = _send(reference_server)
        failed = [r for r in results if not r.ok or len(r.tokens) != MAX_TOKENS]
        assert not failed, f"reference server: {len(failed)} bad results: {failed[:3]}"
        reference = {tuple(p): r.tokens for p, r in zip(PROMPTS, results, strict=True)}

        counters: list[dict[str, Any]] = [_counters(server)]
        check_outputs(
            f"vLLM {vllm.__version__}, cold round", _send(server), PROMPTS, reference
        )
        counters.append(_counters(server))
        _reset_prefix_cache(server)
        check_outputs(
            f"vLLM {vllm.__version__}, warm round", _send(server), PROMPTS, reference
        )
        counters.append(_counters(server))
    finally:
        reference_server.stop()
        server.stop()
    before, cold, warm = counters
    assert cold["npukv_saved_bytes"] > before["npukv_saved_bytes"], (
        f"cold round saved nothing: {before} -> {cold}\n{server.log_tail()}"
    )
    assert warm["npukv_loaded_bytes"] > cold["npukv_loaded_bytes"], (
        f"warm round loaded nothing: {cold} -> {warm}\n{server.log_tail()}"
    )
    # vLLM's own count of the tokens the connector supplied, and ours (on 0.23
    # the scheduler's counters reach /metrics a step late: docs/metrics.md)
    hits = {
        name: warm[name] - cold[name]
        for name in ("npukv_hit_tokens", "external_prefix_cache_hits")
    }
    assert any(v > 0 for v in hits.values()), f"warm round: no hits: {cold} -> {warm}"

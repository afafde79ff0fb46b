"""Served end to end: vLLM's real OpenAI server (CPU build) with the connector,
under concurrent traffic, preemption, client cancellations, a restart and two
servers on one directory (bench/harness/serve.py).

Every output is compared with a reference server's (no connector) for the same
prompt: greedy decoding of the tiny random Llama is deterministic, whatever
the batch a request lands in. Servers are shared by the tests of one stage:

    reference + A   booted side by side; the reference answers every prompt
                    of the file, then stops. A (KV cache of 48 blocks, so that
                    vLLM preempts) serves three rounds of the same 256 prompts
                    at once: a cold round, then two warm ones; it stops as
                    vLLM does by default, killing its workers.
    B + C           booted side by side on A's directory after A stopped: B is
                    the restart; C reads slowly (NPUKV_FAULTS read:slow) for
                    the cancellations; then both serve at once, and stop
                    gracefully (--shutdown-timeout).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="served end-to-end tests need vLLM (.[vllm])")
pytest.importorskip("aiohttp", reason="the served tests' client needs aiohttp")

from bench.harness import serve as sh  # noqa: E402
from tests.support.served import Reference, check_outputs  # noqa: E402

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
ROUND = 256  # requests per round, all in flight at once
SMALL_KV_BLOCKS = 48  # 1,536 tokens: vLLM must preempt under ROUND requests
SLOW_READ_MS = 300  # C's store reads: cancellations land while loads run
MAIN = sh.build_prompts(ROUND, seed=1)  # A's rounds, B's and C's warm traffic
SHARED = sh.build_prompts(128, seed=2)  # new to both B and C, sent to both at once
FRESH = sh.build_prompts(48, seed=3)  # new to C: saves run in its cancel round


def _serve(work: Path, name: str, **kw: Any) -> sh.Server:
    return sh.Server(work / "model", log_path=work / f"{name}.log", **kw)


#: A and C load every hit: the load policy's default (auto) recomputes hits it
#: measures as slower to load than to compute, which for this tiny model on
#: this CPU (and C's slow reads) it does within a round, and these tests are
#: about what loads do. B, the restart, runs the default policy.
LOAD_EVERY_HIT = {"load_policy": "always"}


def _boot(*servers: sh.Server) -> None:
    """Start servers side by side (start-up is mostly imports: ~30 s each)."""
    try:
        for server in servers:
            server.start(wait=False)
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise


def _send(server: sh.Server, prompts: list[list[int]], **kw: Any) -> list[sh.Result]:
    kw.setdefault("concurrency", ROUND)
    return sh.complete(server.url, server.model, prompts, max_tokens=MAX_TOKENS, **kw)


def _claims(cache: Path) -> int:
    stats = sh.run_npukv("stats", str(cache), "--json")
    assert stats.returncode == 0, stats.stdout + stats.stderr
    # "claims" is absent when the directory keeps none
    return int(json.loads(stats.stdout).get("claims", 0))


def _wait_flushed(server: sh.Server, cache: Path, timeout_s: float = 90.0) -> None:
    """Poll until the server has no request left (the cancelled ones are gone
    from its scheduler), its ring holds nothing and the directory no save
    claim. The gauges are reported on a step: each poll sends one small
    request so that a step runs."""
    deadline = time.monotonic() + timeout_s
    found: dict[str, float] = {}
    while time.monotonic() < deadline:
        _send(server, [MAIN[0][:8]], concurrency=1)
        metrics = server.metrics()
        found = {
            name: metrics[name]
            for name in (
                "vllm:npukv_ring_used_bytes", "vllm:num_requests_running",
                "vllm:num_requests_waiting",
            )
        }  # fmt: skip
        found["save claims in the directory"] = _claims(cache)
        if not any(found.values()):
            return
        time.sleep(1.0)
    pytest.fail(f"not flushed after {timeout_s} s: found {found}, expected all 0")


def _counters(metrics: sh.Metrics) -> dict[str, float]:
    """The counters these tests follow, by their names less "vllm:" and "_total"."""
    names = (
        "npukv_lookup_tokens", "npukv_hit_tokens", "npukv_loaded_bytes",
        "npukv_saved_bytes", "npukv_saved_blocks", "external_prefix_cache_hits",
        "num_preemptions",
    )  # fmt: skip
    return {name: metrics[f"vllm:{name}_total"] for name in names}


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def reference_and_a(work: Path):
    """The reference outputs of every prompt of the file, and server A
    (connector, small KV cache) booted alongside the reference server."""
    reference_server = _serve(work, "reference")
    # A stops as vLLM does by default: its workers are killed, like a crash
    a = _serve(
        work, "a", connector="npukv", cache_dir=work / "cache",
        extra=LOAD_EVERY_HIT, num_gpu_blocks_override=SMALL_KV_BLOCKS,
        shutdown_timeout_s=0,
    )  # fmt: skip
    _boot(reference_server, a)
    try:
        prompts = MAIN + SHARED + FRESH
        with reference_server:
            results = _send(reference_server, prompts, concurrency=64)
            # the comparisons below assume that a request's output does not
            # depend on the batch it lands in: check it on smaller batches
            again = _send(reference_server, MAIN[:64], concurrency=4)
        failed = [r for r in results if not r.ok or len(r.tokens) != MAX_TOKENS]
        assert not failed, f"reference server: {len(failed)} bad results: {failed[:3]}"
        reference = {tuple(p): r.tokens for p, r in zip(prompts, results, strict=True)}
        check_outputs("reference server, 4 at a time", again, MAIN[:64], reference)
        yield reference, a
    finally:
        a.stop()


@pytest.fixture(scope="module")
def reference(reference_and_a) -> Reference:
    return reference_and_a[0]


@pytest.fixture(scope="module")
def a_rounds(reference_and_a) -> dict[str, Any]:
    """Three rounds of the same ROUND prompts on A, all in flight at once:
    their results, A's metrics before and after each, and A's RSS and open
    fds after rounds 1 and 3."""
    _, a = reference_and_a
    out: dict[str, Any] = {"results": [], "metrics": [a.metrics()], "usage": []}
    for _ in range(3):
        out["results"].append(_send(a, MAIN))
        out["metrics"].append(a.metrics())
        out["usage"].append((a.rss_bytes(), a.open_fds()))
    return out


@pytest.fixture(scope="module")
def b_and_c(work: Path, reference_and_a, a_rounds):
    """B and C on A's directory, booted side by side once A has stopped; C
    reads slowly."""
    _, a = reference_and_a
    assert a.stop() is not None
    b = _serve(work, "b", connector="npukv", cache_dir=work / "cache")
    c = _serve(
        work, "c", connector="npukv", cache_dir=work / "cache", extra=LOAD_EVERY_HIT,
        env={"NPUKV_FAULTS": f"read:slow:ms={SLOW_READ_MS}"},
    )  # fmt: skip
    _boot(b, c)
    try:
        yield b, c
    finally:
        b.stop()
        c.stop()


# --------------------------------------------------------------------- tests


@pytest.mark.timeout(600)
def test_256_concurrent_requests_with_preemption(reference, a_rounds):
    """256 requests at once through a KV cache of 48 blocks: vLLM preempts,
    and every output of all three rounds equals the reference."""
    for n, results in enumerate(a_rounds["results"], 1):
        check_outputs(f"A round {n}", results, MAIN, reference)
    preempted = [_counters(m)["num_preemptions"] for m in a_rounds["metrics"]]
    assert preempted[1] > 0, (
        f"vllm:num_preemptions_total after the cold round: found {preempted[1]}, "
        f"expected > 0 with {SMALL_KV_BLOCKS} KV blocks"
    )


def test_npukv_metrics_follow_the_traffic(a_rounds):
    """The cold round looks prompts up and saves; the warm rounds load."""
    before, cold, warm = (_counters(m) for m in a_rounds["metrics"][:3])
    prompt_tokens = sum(map(len, MAIN))
    looked_up = cold["npukv_lookup_tokens"] - before["npukv_lookup_tokens"]
    assert looked_up >= prompt_tokens, (
        f"cold round: lookup_tokens grew by {looked_up}, expected at least the "
        f"{prompt_tokens} prompt tokens sent ({before} -> {cold})"
    )
    for name in ("npukv_saved_bytes", "npukv_saved_blocks"):
        assert cold[name] > before[name], f"cold round: {name} {before} -> {cold}"
    for name in ("npukv_hit_tokens", "npukv_loaded_bytes"):
        assert warm[name] > cold[name], f"warm round: {name} {cold} -> {warm}"
    # everything was stored in the cold round: a warm round saves nothing new
    assert warm["npukv_saved_bytes"] == cold["npukv_saved_bytes"], (cold, warm)
    # vLLM leaves out the hits of requests preempted before; we count them all
    hits, vllm_hits = warm["npukv_hit_tokens"], warm["external_prefix_cache_hits"]
    assert hits >= vllm_hits, f"warm round: {warm}"


def test_no_leaks_over_three_rounds(a_rounds):
    """RSS and open fds of A's process tree grow by at most 10% from the end
    of round 1 to the end of round 3."""
    (rss1, fds1), _, (rss3, fds3) = a_rounds["usage"]
    assert rss3 <= rss1 * 1.10, (
        f"RSS of the server's processes: {rss1:,} B after round 1, {rss3:,} B "
        "after round 3 (more than 10% growth)"
    )
    assert fds3 <= fds1 * 1.10, (
        f"open fds of the server's processes: {fds1} after round 1, {fds3} after "
        "round 3 (more than 10% growth)"
    )


@pytest.mark.timeout(600)
def test_restart_loads_what_the_first_server_saved(reference, b_and_c):
    """B, a fresh process on A's directory, hits what A stored (vLLM counts
    external hits) and serves the reference outputs. Its load policy is the
    default: it loads the first hits (nothing measured yet), and counts a
    decision per hit."""
    b, _ = b_and_c
    prompts = MAIN[:128]
    check_outputs("B (restart)", _send(b, prompts), prompts, reference)
    metrics = b.metrics()
    decisions = {
        d: metrics.labelled("vllm:npukv_load_decisions_total", decision=d)
        for d in ("load", "shorter", "recompute", "probe")
    }
    assert decisions["load"] >= 1, decisions
    m = _counters(metrics)
    assert m["external_prefix_cache_hits"] > 0, (
        "restart: vllm:external_prefix_cache_hits_total is 0, expected hits on "
        f"the blocks the first server saved ({m})"
    )
    # no preemption in B's large KV cache: both count the same hits
    assert m["num_preemptions"] == 0, m
    assert m["npukv_hit_tokens"] == m["external_prefix_cache_hits"], m


def _cancel_plan() -> tuple[list[list[int]], list[int], list[float]]:
    """C's cancel round: stored prompts (C loads them, slowly) interleaved
    with fresh ones (C saves them); about 10% cancelled, most of them
    stored prompts of two blocks or more, after 0.05 to 1.5 s."""
    stored, fresh = MAIN[:112], FRESH[:32]
    prompts: list[list[int]] = []
    for i, prompt in enumerate(stored):
        prompts.append(prompt)
        if i % 4 == 3 and fresh:
            prompts.append(fresh.pop(0))
    loading = [i for i, p in enumerate(prompts) if p in MAIN and len(p) > 64]
    saving = [i for i, p in enumerate(prompts) if p not in MAIN and len(p) > 64]
    cancel = sorted(loading[::6][:11] + saving[::5][:4])
    delays = [0.05 + 0.1 * (k % 15) for k in range(len(cancel))]
    return prompts, cancel, delays


@pytest.mark.timeout(600)
def test_client_cancellations_leak_nothing(work, reference, b_and_c):
    """About 10% of C's requests are aborted mid-flight by the client, many
    while C's slow loads run. C then serves every prompt of the round again
    (the cancelled ones too) with the reference outputs, and once idle holds
    no ring space and the directory no save claim."""
    _, c = b_and_c
    prompts, cancel, delays = _cancel_plan()
    before = _counters(c.metrics())
    results = _send(c, prompts, cancel=cancel, cancel_after_s=delays)
    after = _counters(c.metrics())
    check_outputs("C (cancel round, not cancelled)", results, prompts, reference)
    cancelled = [r for r in results if r.cancelled]
    assert len(cancelled) >= len(cancel) // 2, (
        f"only {len(cancelled)} of the {len(cancel)} planned cancellations "
        f"landed before their request finished (delays {delays})"
    )
    assert any(not r.tokens for r in cancelled), (
        "no request was cancelled before its first token (during its prefill or "
        f"load): {[(r.index, len(r.tokens)) for r in cancelled]}"
    )
    grew = after["npukv_loaded_bytes"] - before["npukv_loaded_bytes"]
    assert grew > 0, f"C loaded nothing in the cancel round: {before} -> {after}"
    again = _send(c, prompts + MAIN[112:])
    check_outputs("C (after the cancel round)", again, prompts + MAIN[112:], reference)
    _wait_flushed(c, work / "cache")


@pytest.mark.timeout(600)
def test_two_servers_at_once_on_one_directory(work, reference, b_and_c):
    """B and C serve the same new prompts at the same time (in opposite
    orders: both save the same blocks at once), each with the reference
    outputs; idle, they leave no claim, and the stopped directory verifies."""
    b, c = b_and_c
    first, second = SHARED, SHARED[::-1]

    async def both() -> list[list[sh.Result]]:
        return list(
            await asyncio.gather(
                sh.run_requests(b.url, b.model, first, max_tokens=MAX_TOKENS,
                                concurrency=64),
                sh.run_requests(c.url, c.model, second, max_tokens=MAX_TOKENS,
                                concurrency=64),
            )
        )  # fmt: skip

    on_b, on_c = asyncio.run(both())
    check_outputs("B (two servers at once)", on_b, first, reference)
    check_outputs("C (two servers at once)", on_c, second, reference)
    _wait_flushed(b, work / "cache")
    _wait_flushed(c, work / "cache")
    b.stop()
    c.stop()
    verify = sh.run_npukv("verify", str(work / "cache"))
    assert verify.returncode == 0, (
        f"npukv verify after two servers: exit {verify.returncode}, expected 0:\n"
        f"{verify.stdout}{verify.stderr}"
    )

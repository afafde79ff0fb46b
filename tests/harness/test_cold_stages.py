"""bench/cold_hit.py's analysis on a synthetic trace, no vLLM: spans grouped
into issue 41's stages (each span's own time, a wait on the request's thread
charged to the work it waited for), CPU summed over threads with children's
CPU taken out, the untraced remainder, and the ratio keys and targets."""

from __future__ import annotations

import json

import pytest

from bench.harness import cold_geometry
from bench.harness.cold_geometry import QUICK, REFERENCE, ColdGeometry
from bench.harness.cold_stages import (
    STAGES,
    TARGET_OVER_FLOOR,
    UNTRACED,
    hits,
    ratio_keys,
    stage_table,
    summarise_stages,
)

MS = 1e-3


def span(label, tid, start_ms, end_ms, cpu_ms):
    """A trace span as the tracer dumps it (label, thread, start s, end s,
    major faults, CPU ns)."""
    return [label, tid, start_ms * MS, end_ms * MS, 0, int(cpu_ms * 1e6)]


def window(start_ms, end_ms, main_cpu_ms, process_cpu_ms):
    return {
        "t0": start_ms * MS, "t1": end_ms * MS, "tid": 1,
        "main_cpu_ms": main_cpu_ms, "process_cpu_ms": process_cpu_ms,
    }  # fmt: skip


#: one 100 ms request on thread 1; verifiers on threads 2 and 3
SPANS = [
    span("engine.step", 1, 1, 95, 50),
    span("conn.get_num_new_matched_tokens", 1, 2, 4, 2),
    span("ours.keys", 1, 2, 3, 1),
    span("conn.build_connector_meta", 1, 5, 6, 1),
    span("conn.start_load_kv", 1, 10, 50, 5),
    span("reader.read_layers", 1, 12, 48, 3),  # waits for threads 2 and 3
    span("runner._model_forward", 1, 60, 90, 30),
    span("engine.reap", 2, 13, 18, 0.5),
    span("verify.check_layer", 2, 20, 30, 10),
    span("verify.check_layer", 3, 25, 35, 10),
]


def table_of(spans=SPANS, main_cpu=60.0, process_cpu=100.0):
    trace = {"spans": spans, "windows": [window(0, 100, main_cpu, process_cpu)]}
    return stage_table(trace, trace["windows"][0])


def test_wall_on_the_request_thread_adds_up_to_the_ttft():
    rows = table_of()
    wall = {k: rows[k]["wall_ms"] for k, _ in STAGES}
    assert wall["lookup"] == pytest.approx(2)
    assert wall["metadata"] == pytest.approx(1)
    # start_load_kv's own 4 ms, and the 16 ms of read_layers' wait during
    # which no traced thread ran
    assert wall["plan"] == pytest.approx(20)
    assert wall["io"] == pytest.approx(5)  # the wait while thread 2 reaped
    assert wall["verify"] == pytest.approx(15)  # while 2 and 3 verified
    assert wall["vllm_forward"] == pytest.approx(30)
    assert wall["vllm"] == pytest.approx(27)  # engine.step's own, outside it
    assert sum(wall.values()) == pytest.approx(rows["total"]["wall_ms"]) == 100


def test_cpu_is_exclusive_and_summed_over_threads():
    rows = table_of()
    cpu = {k: rows[k]["cpu_ms"] for k, _ in STAGES}
    assert cpu["lookup"] == pytest.approx(2)  # keys 1 + the hook's own 1
    assert cpu["plan"] == pytest.approx(5)  # start_load_kv's own 2 + 3
    assert cpu["verify"] == pytest.approx(20)  # two threads, 10 each
    assert cpu["io"] == pytest.approx(0.5)
    # engine.step's own 12 and the request thread's 10 outside every span
    assert cpu["vllm"] == pytest.approx(22)
    assert rows[UNTRACED]["cpu_ms"] == pytest.approx(100 - 70.5 - 10)
    assert sum(r["cpu_ms"] for k, r in rows.items() if k != "total") == (
        pytest.approx(rows["total"]["cpu_ms"])
    )
    assert rows["verify"]["other_wall_ms"] == pytest.approx(20)
    assert rows["io"]["other_wall_ms"] == pytest.approx(5)


def test_unlabelled_spans_take_their_parents_stage_and_old_traces_load():
    spans = [
        [*s[:5]]  # a trace from before the tracer kept CPU time
        for s in [
            span("example.found_match", 1, 10, 20, 0),
            span("os.path.exists", 1, 11, 19, 0),
            span("llm.add_request", 1, 30, 40, 0),
            span("conn.wait_for_save", 1, 50, 60, 0),
            span("device.copy_runs", 1, 52, 58, 0),  # the save's d2h copy
        ]
    ]
    rows = table_of(spans, main_cpu=5.0, process_cpu=5.0)
    assert rows["lookup"]["wall_ms"] == pytest.approx(10)
    assert rows["hooks"]["wall_ms"] == pytest.approx(10)
    assert rows["h2d"]["wall_ms"] == 0
    assert rows["vllm"]["wall_ms"] == pytest.approx(80)
    assert rows["vllm"]["cpu_ms"] == pytest.approx(5)


def test_summary_takes_the_median_prompt_and_its_cpu():
    trace = {
        "spans": SPANS,
        "windows": [
            window(-500, -480, 1, 2),  # the warm-up: not timed
            window(0, 100, 60, 100),
            window(200, 230, 20, 40),
            window(300, 500, 90, 300),
        ],
    }
    found = summarise_stages(trace, [1, 2, 3])
    assert found["ttft_ms"] == [100, 30, 200]
    assert found["ttft_median_ms"] == 100
    assert found["cpu_median_ms"] == 100
    assert found["median_prompt"] == 0
    assert found["stages"]["verify"]["wall_ms"] == pytest.approx(15)


def test_ratio_keys_and_the_full_hits_targets():
    def row(ttft, cpu):
        return {"ttft_median_ms": ttft, "cpu_median_ms": cpu, "stages": {"x": ttft}}

    results = {
        2000: {
            "full": {"ours": row(150, 300), "floor": row(100, 120)},
            "partial": {"ours": row(500, 900), "floor": row(200, 450)},
        },
        16000: {"full": {"ours": row(800, 1000), "floor": row(500, 600)}},
    }
    keys, targets = ratio_keys(results)
    assert keys["ttft_over_floor_2000_full"] == 1.5
    assert keys["floor_ttft_ms_2000_full"] == 100
    assert keys["ttft_ms_2000_partial"] == 500
    assert keys["ttft_over_floor_2000_partial"] == 2.5
    assert keys["cpu_ms_2000_full"] == 300
    assert keys["cpu_over_floor_2000_full"] == 2.5
    assert keys["ttft_over_floor_16000_full"] == 1.6
    assert set(targets) == {"ttft_over_floor_2000_full", "ttft_over_floor_16000_full"}
    assert targets["ttft_over_floor_2000_full"] == {
        "measured": 1.5, "limit": TARGET_OVER_FLOOR, "met": True,
    }  # fmt: skip
    assert targets["ttft_over_floor_16000_full"]["met"] is False
    nested = hits(results)
    assert nested["2000"]["partial"]["ttft_over_floor"] == 2.5
    assert nested["2000"]["full"]["floor_cpu_ms"] == 120
    assert nested["16000"]["full"]["stages"] == {
        "ours": {"x": 800}, "floor": {"x": 500},
    }  # fmt: skip


def test_geometry_prompts_halves_and_timed_windows(tmp_path, monkeypatch):
    monkeypatch.setattr(cold_geometry, "ensure_model", lambda *a: None)
    geos = cold_geometry.cold_geometry(tmp_path, REFERENCE, [2000, 1000], 2)
    geo = geos[0]
    assert (geo.tokens, geo.half, geo.stored_tokens_per_prompt) == (2000, 960, 1984)
    assert geo.warmup_tokens == 64 + 16  # whole blocks, then a full hit's tail
    read = lambda name: json.loads((geo.work / name).read_text())  # noqa: E731
    prompts = read("prompts.json")
    assert [len(p) for p in prompts] == [2000, 2000]
    assert read("halves.json") == [p[:960] for p in prompts]
    warm_half, warm_full, *timed = read("partial.json")
    assert warm_full[:960] == warm_half
    assert len(warm_full) == 2000
    assert timed == prompts
    floor = read("floor_partial.json")
    assert floor[2:] == [prompts[0][:960], prompts[0], prompts[1][:960], prompts[1]]
    # harness warm-up twice, the warm pair, then two (half, prompt) pairs
    assert geo.timed(2 + 2 + 4, pairs=True) == [5, 7]
    assert geo.timed(2 + 2 + 2, pairs=False) == [4, 5]
    floor = geo.floor()
    assert floor[floor.index("--block-size") + 1] == "64"
    assert floor[floor.index("--dtype") + 1] == "float32"
    assert "--prefix-caching" in floor
    quick = ColdGeometry(tmp_path, tmp_path / "model", QUICK, 1000, 3)
    assert quick.block == 32  # --quick: bench vllm --quick's geometry
    assert quick.stored_tokens_per_prompt == 992

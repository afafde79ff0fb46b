"""Tune ``auto`` admission (issue 39) on the trace benchmark's simulations.

For each trace and capacity (fractions of its unique blocks) this runs
bench/harness/trace_sim.py's LRU, write-on-second-sight (unbounded ghost),
OPT, and the store's admission rules (``simulate_auto``) in policy ``auto``
and ``second_sight`` (the directory's bounded ghost), and checks issue 39's
targets for ``auto``:

    hit      >= 0.95 x max(LRU, second sight) at every capacity,
             >= 1.5 x LRU at the smallest (1%)
    written  <= LRU's at every capacity, <= 0.3 x LRU's up to 5%

``--grid name=v1,v2 ...`` runs every combination of AdmissionTuning fields
(the reference policies once per trace and capacity) and ranks them by the
targets held, then by the worst hit over max(LRU, second sight).
``--variant`` tries a rule change that admission.py does not have (see
_Variant; ``perwrite`` is the one that held the most targets).

Run: ``python -m bench.harness.tune_admission [--quick] [--trace PATH ...]
[--capacities 0.01,...] [--grid ghost_per_block=4,16 margin=0,0.05]
[--variant perwrite] [--bounded]``.
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import fields, replace
from typing import Any

from bench.harness.trace_gen import GenParams, calibrate, generate, read_trace
from bench.harness.trace_sim import Chain, SimResult, _Admission, _lru, simulate
from npukv_store.store.admission import (
    AdmissionTuning,
    Mode,
    admitted_run,
    choose_mode,
    trim,
)

REFERENCES = ("lru", "second_sight", "opt")
HIT_OVER_BEST = 0.95
HIT_OVER_LRU_SMALLEST = 1.5
WRITTEN_OVER_LRU_SMALL = 0.3
SMALL = 0.05  # capacities up to this fraction must write <= 0.3 x LRU


class _Variant(_Admission):
    """Rule changes under trial (``--variant``), not the store's rules:
    ``prefix``: a shadow's hits in a request count only up to its first
    miss among the request's sampled blocks (a prefix-closed cache hits no
    deeper), and write-all's shadow touches a chain deepest first (as the
    LRU does); ``hyst``: the mode in force changes to ALL only past
    ``margin`` and back only under ``margin / 2`` (hysteresis); ``perwrite``:
    ALL only while write-all's extra hits over second sight's are more than
    ``margin`` times its extra writes (the shadows count their writes)."""

    def __init__(
        self,
        capacity: int,
        tuning: AdmissionTuning,
        result: SimResult,
        variants: set[str],
    ) -> None:
        super().__init__(capacity, "auto", tuning, result)
        self.variants = variants
        self.mode = Mode.ALL
        self.writes_all = self.writes_ss = 0.0

    def _ask_chain(self, keys: list[int]) -> None:
        sh, sc = self.shadow, self.scores
        all_ok = ss_ok = True
        for key in keys:
            if key in sh.every:
                sc.hits_all += all_ok
            else:
                all_ok = False
            if key in sh.second:
                sc.hits_second_sight += ss_ok
                sh.second.push(key)
            elif sh.ghost.discard(key):
                ss_ok = False
                sh.second.push(key)
                trim(sh.second, sh.capacity)
            else:
                ss_ok = False
                sh.ghost.push(key)
                trim(sh.ghost, sh.ghost_limit)
            sc.asks += 1
            if sc.asks >= self.tuning.window * sh.capacity:
                sc.hits_all /= 2
                sc.hits_second_sight /= 2
                sc.asks /= 2
        for key in reversed(keys):
            sh.every.push(key)
        trim(sh.every, sh.capacity)

    def _ask_counting(self, keys: list[int]) -> None:
        sh, sc = self.shadow, self.scores
        for key in keys:
            self.writes_all += key not in sh.every
            self.writes_ss += key not in sh.second and key in sh.ghost
            asks = sc.asks
            sh.ask(key, sc)
            if sc.asks < asks + 1:  # the scores halved
                self.writes_all /= 2
                self.writes_ss /= 2

    def _mode(self) -> Mode:
        sc, t = self.scores, self.tuning
        if "perwrite" in self.variants:
            if sc.hits_all == 0 and sc.hits_second_sight == 0:
                return Mode.SECOND_SIGHT
            gain = sc.hits_all - sc.hits_second_sight
            cost = self.writes_all - self.writes_ss
            return Mode.ALL if gain > t.margin * max(cost, 1.0) else Mode.SECOND_SIGHT
        if "hyst" not in self.variants:
            return choose_mode("auto", sc, 1.0, t)
        if sc.hits_all == 0 and sc.hits_second_sight == 0:
            return Mode.ALL
        if self.mode is Mode.ALL:
            if sc.hits_all < (1 + t.margin / 2) * sc.hits_second_sight:
                self.mode = Mode.SECOND_SIGHT
        elif sc.hits_all > (1 + t.margin) * sc.hits_second_sight:
            self.mode = Mode.ALL
        self.writes_all = self.writes_ss = 0.0
        return self.mode

    def __call__(self, chain: Chain, hit: int, limit: int) -> int:
        keys = [self._prefix(block) for block in chain]
        sampled = [k for k in keys if k < self.threshold]
        if "prefix" in self.variants:
            self._ask_chain(sampled)
        elif "perwrite" in self.variants:
            self._ask_counting(sampled)
        else:
            for key in sampled:
                self.shadow.ask(key, self.scores)
        save = keys[hit:limit]
        if not save:
            return hit
        r, ghost = self.result, self.ghost
        mode = self._mode()
        r.modes[mode.name] = r.modes.get(mode.name, 0) + 1
        r.lost_hits += sum(key in ghost for key in save)
        n = admitted_run(mode, save, ghost.__contains__)
        for key in save[:n]:
            ghost.discard(key)
        for key in save[n:]:
            ghost.push(key)
        trim(ghost, self.ghost_limit)
        r.declined += len(save) - n
        return hit + n


def simulate_variant(
    chains: list[list[int]],
    cap: int,
    lengths: list[int | None],
    tuning: AdmissionTuning,
    variants: set[str],
) -> SimResult:
    if not variants:
        return simulate("auto", chains, cap, lengths, tuning=tuning)
    result = SimResult("auto+" + "+".join(sorted(variants)), cap)
    admit = _Variant(cap, tuning, result, variants)
    return _lru(chains, cap, result, admit, lengths, False, None)


def load(source: str) -> tuple[list[list[int]], list[int | None]]:
    """``quick`` (bench/trace.py --quick's generated trace) or a path."""
    if source == "quick":
        params = calibrate(GenParams(requests=4_000))
        requests = generate(replace(params, single_use=None))
    else:
        requests = read_trace(source)
    return [list(r.hash_ids) for r in requests], [r.input_length for r in requests]


def targets(fraction: float, smallest: bool, row: dict[str, SimResult]) -> list[str]:
    """The targets ``auto`` misses in ``row`` (empty: all hold)."""
    lru, ss, auto = row["lru"], row["second_sight"], row["auto"]
    missed = []
    if auto.hit_ratio < HIT_OVER_BEST * max(lru.hit_ratio, ss.hit_ratio):
        missed.append("hit>=.95best")
    if smallest and auto.hit_ratio < HIT_OVER_LRU_SMALLEST * lru.hit_ratio:
        missed.append("hit>=1.5lru")
    if auto.written_blocks > lru.written_blocks:
        missed.append("w<=lru")
    if (
        fraction <= SMALL + 1e-9
        and auto.written_blocks > WRITTEN_OVER_LRU_SMALL * lru.written_blocks
    ):
        missed.append("w<=.3lru")
    return missed


def cell(r: SimResult) -> str:
    return f"{r.hit_ratio:.3f} / {r.written_ratio:.3f}"


def run_trace(
    source: str,
    fractions: list[float],
    tunings: list[AdmissionTuning],
    bounded: bool,
    variants: set[str],
) -> list[dict[str, Any]]:
    begin = time.perf_counter()
    chains, lengths = load(source)
    unique = len({b for chain in chains for b in chain})
    refs = {}
    for f in fractions:
        cap = max(1, round(f * unique))
        refs[f] = {p: simulate(p, chains, cap, lengths) for p in REFERENCES}
        if bounded:
            refs[f]["second_sight_bounded"] = simulate(
                "second_sight_bounded", chains, cap, lengths
            )
    print(
        f"\n## {source}: {len(chains)} requests, {unique} unique blocks "
        f"(references {time.perf_counter() - begin:.0f} s)"
    )
    out: list[dict[str, Any]] = []
    for tuning in tunings:
        rows = []
        for f in fractions:
            cap = max(1, round(f * unique))
            row = dict(refs[f])
            row["auto"] = simulate_variant(chains, cap, lengths, tuning, variants)
            rows.append((f, cap, row, targets(f, f == fractions[0], row)))
        missed = sum(len(m) for *_, m in rows)
        worst = min(
            r["auto"].hit_ratio / max(r["lru"].hit_ratio, r["second_sight"].hit_ratio)
            for _, _, r, _ in rows
        )
        out.append({"tuning": tuning, "missed": missed, "worst": worst, "rows": rows})
    out.sort(key=lambda o: (o["missed"], -o["worst"]))
    for o in out:
        print(f"\n{o['tuning']}: {o['missed']} targets missed, worst {o['worst']:.3f}")
        head = "| cap | blocks | LRU | second sight | auto | OPT hit |"
        if bounded:
            head += " ss bounded |"
        print(head + " auto modes (ALL/SS) | lost | missed |")
        for f, cap, row, miss in o["rows"]:
            auto = row["auto"]
            line = (
                f"| {f:.2f} | {cap} | {cell(row['lru'])} | "
                f"{cell(row['second_sight'])} | {cell(auto)} | "
                f"{row['opt'].hit_ratio:.3f} |"
            )
            if bounded:
                line += f" {cell(row['second_sight_bounded'])} |"
            modes = f"{auto.modes.get('ALL', 0)}/{auto.modes.get('SECOND_SIGHT', 0)}"
            print(f"{line} {modes} | {auto.lost_hits} | {' '.join(miss) or 'ok'} |")
    print(f"({time.perf_counter() - begin:.0f} s)")
    return out


def parse_grid(specs: list[str]) -> list[AdmissionTuning]:
    names = {f.name: f.type for f in fields(AdmissionTuning)}
    axes = []
    for spec in specs:
        name, _, values = spec.partition("=")
        if name not in names:
            raise SystemExit(f"unknown AdmissionTuning field {name!r}")
        kind = str(names[name])
        cast: Any = int if "int" in kind else float
        if "bool" in kind:
            cast = lambda v: v.strip().lower() in ("1", "true", "yes")  # noqa: E731
        axes.append([(name, cast(v)) for v in values.split(",")])
    combos: list[dict[str, Any]] = [dict(c) for c in itertools.product(*axes)]
    return [AdmissionTuning(**combo) for combo in combos]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the generated trace")
    parser.add_argument("--trace", action="append", default=[], help="a trace file")
    parser.add_argument("--capacities", default="0.01,0.02,0.05,0.10,0.25")
    parser.add_argument("--grid", nargs="*", default=[], help="field=v1,v2 ...")
    parser.add_argument(
        "--bounded", action="store_true", help="also second sight, bounded ghost"
    )
    parser.add_argument(
        "--variant", action="append", default=[], choices=("prefix", "hyst", "perwrite")
    )
    args = parser.parse_args(argv)
    fractions = [float(f) for f in args.capacities.split(",") if f.strip()]
    sources = (["quick"] if args.quick else []) + args.trace
    tunings = parse_grid(args.grid)
    for source in sources or ["quick"]:
        run_trace(source, fractions, tunings, args.bounded, set(args.variant))


if __name__ == "__main__":
    main()

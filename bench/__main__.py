"""``python -m bench``: run the benchmark cells, print a table, write bench/results.json."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import (
    bulk_door,
    coldstart,
    common,
    drain,
    enqueue,
    growth,
    latency,
    peer,
    providers,
    retention,
    throughput,
    wal,
)

SECTIONS = (
    "throughput",
    "receipt",
    "wal",
    "providers",
    "drain",
    "growth",
    "latency",
    "enqueue",
    "bulk_door",
    "retention",
    "coldstart",
)
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results.json"


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas: {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected positive numbers")
    return values


def _sections(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {sorted(unknown)}; pick from {SECTIONS}"
        )
    return chosen


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="The relay against a raw-SQL baseline on the same Postgres, in the same run.",
    )
    p.add_argument("--rows", type=int, default=20_000, help="pending rows per throughput cell")
    p.add_argument(
        "--batches", type=_ints, default=[10, 100, 1000], help="batch sizes, e.g. 10,100"
    )
    p.add_argument("--workers", type=_ints, default=[1, 4], help="worker process counts, e.g. 1,4")
    p.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="runs of each throughput cell, baseline and relay alternating; the best counts",
    )
    p.add_argument("--only", type=_sections, default=list(SECTIONS), help=f"sections: {SECTIONS}")
    p.add_argument("--wal-rows", type=int, default=10_000, help="rows per WAL cell")
    p.add_argument(
        "--provider-latencies",
        type=_ints,
        default=[20, 100],
        help="milliseconds per provider call, e.g. 20,100",
    )
    p.add_argument("--provider-rows", type=int, default=2_000, help="rows per provider cell")
    p.add_argument(
        "--drain-rows", type=int, default=100_000, help="backlog drained through the simulator"
    )
    p.add_argument("--growth-pending", type=int, default=10_000)
    p.add_argument("--growth-settled", type=int, default=1_000_000)
    p.add_argument("--growth-busy", type=int, default=200_000, help="rows of a busy day's churn")
    p.add_argument("--growth-samples", type=int, default=300, help="claims timed per table")
    p.add_argument("--latency-rate", type=float, default=100.0, help="messages per second")
    p.add_argument("--latency-seconds", type=float, default=10.0)
    p.add_argument("--enqueue-rows", type=int, default=20_000)
    p.add_argument("--enqueue-per-tx", type=int, default=100)
    p.add_argument(
        "--retention-settled",
        type=int,
        default=200_000,
        help="settled rows a retention cell prunes",
    )
    p.add_argument("--coldstart-repeats", type=int, default=3)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the JSON")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a seconds-long smoke run: few rows, batch 100, 1 worker, small growth",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rows = min(args.rows, 500)
        args.batches = [100] if args.batches == [10, 100, 1000] else args.batches
        args.workers = [1] if args.workers == [1, 4] else args.workers
        args.growth_pending = min(args.growth_pending, 300)
        args.growth_settled = min(args.growth_settled, 2_000)
        args.growth_busy = min(args.growth_busy, 1_000)
        args.growth_samples = min(args.growth_samples, 10)
        args.latency_seconds = min(args.latency_seconds, 2.0)
        args.latency_rate = min(args.latency_rate, 50.0)
        args.enqueue_rows = min(args.enqueue_rows, 300)
        args.coldstart_repeats = 1
        args.wal_rows = min(args.wal_rows, 300)
        args.provider_rows = min(args.provider_rows, 200)
        args.drain_rows = min(args.drain_rows, 300)
        args.retention_settled = min(args.retention_settled, 2_000)
        args.repeat = 1
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every chosen section; returns the list of cells."""
    server = common.server_url()
    dbs = common.Databases(server)
    cells: list[dict[str, Any]] = [
        {
            "name": "meta",
            "command": "make bench  # python -m bench " + " ".join(sys.argv[1:]),
            "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": args.rows,
        }
    ]
    try:
        dbs.prepare_template()
        if "throughput" in args.only:
            cells += _throughput(dbs, args)
        if "wal" in args.only:
            log("wal: WAL bytes and transactions per message, on a private embedded Postgres ...")
            cells += wal.run(args.wal_rows)
        if "providers" in args.only:
            cells += _providers(dbs, args)
        if "drain" in args.only:
            with dbs.fresh("drain") as url:
                log(f"drain: {args.drain_rows} rows through the Lambda simulator ...")
                cells.append({"name": "drain", **drain.run(url, args.drain_rows, 50)})
        if "receipt" in args.only:
            cells += _receipt(dbs, args)
        if "growth" in args.only:
            cells += _growth(dbs, args)
        if "latency" in args.only:
            with dbs.fresh("latency") as url:
                log("latency: producer + dispatcher loop ...")
                cells.append(
                    {
                        "name": "latency",
                        **latency.run(
                            url,
                            args.latency_rate,
                            args.latency_seconds,
                            warmup=min(1.0, args.latency_seconds / 4),
                        ),
                    }
                )
        if "enqueue" in args.only:
            cells += _enqueue(dbs, args)
        if "bulk_door" in args.only:
            log("bulk_door: outbox_enqueue_many's own checks against 0020's door ...")
            rounds = 12 if args.quick else bulk_door.ROUNDS
            cells.append({"name": "bulk_door", **bulk_door.run(rounds)})
        if "retention" in args.only:
            cells += _retention(dbs, args)
        if "coldstart" in args.only:
            cells += _coldstart(dbs, args)
    finally:
        dbs.close()
    return cells


KINDS = ("baseline", "protocol", "relay", "worker", "pgqueuer")


def _drain_once(dbs: common.Databases, kind: str, batch: int, workers: int, rows: int) -> Any:
    with dbs.fresh(f"{kind}_{batch}_{workers}") as url:
        if kind == "pgqueuer":
            peer.seed(url, rows)
            result = peer.run_cell(url, batch, workers)
            left = peer.remaining_jobs(url)
            if left or result["rows"] != rows:
                raise RuntimeError(f"pgqueuer did not drain every job: {left} left")
            return result
        common.seed_pending(url, rows)
        result = throughput.run_cell(url, kind, batch, workers)
        left = common.count_status(url)
        if left.get("delivered", 0) != rows:
            raise RuntimeError(f"{kind} cell did not deliver every row: {left}")
        return result


def _throughput(dbs: common.Databases, args: argparse.Namespace) -> list[dict[str, Any]]:
    kinds = [k for k in KINDS if k != "pgqueuer" or peer.available()]
    if "pgqueuer" not in kinds:
        log("throughput: pgqueuer not installed (pip install -e '.[bench]'): its column is empty")
    cells = []
    for workers in args.workers:
        for batch in args.batches:
            measured: dict[str, dict[str, Any]] = {}
            for run_no in range(args.repeat):
                for kind in kinds:
                    log(f"throughput: {kind} batch={batch} workers={workers} run {run_no + 1}")
                    result = _drain_once(dbs, kind, batch, workers, args.rows)
                    # Best of the runs: interference from other work only ever slows a run.
                    best = measured.get(kind)
                    if best is None or result["rows_per_s"] > best["rows_per_s"]:
                        measured[kind] = result
            relay, base = measured["relay"], measured["baseline"]
            rate = {k: m["rows_per_s"] for k, m in measured.items()}
            log(
                "  "
                + ", ".join(f"{k} {v:.0f}/s" for k, v in rate.items())
                + f"; relay/baseline {rate['relay'] / rate['baseline']:.2f}"
            )
            # CPU per 100 rows, the kind's own processes + the rest of the
            # machine (Postgres): where both cores are busy, the sum decides.
            cpu = {
                k: [m.get("client_cpu_ms_per_100"), m.get("rest_cpu_ms_per_100")]
                for k, m in measured.items()
            }
            log(
                "  CPU ms per 100 rows, own + rest of the machine: "
                + ", ".join(
                    f"{k} {c:.1f} + {r:.1f}" for k, (c, r) in cpu.items() if None not in (c, r)
                )
            )
            cell: dict[str, Any] = {
                "name": "throughput",
                "batch": batch,
                "workers": workers,
                "rows_per_s": round(rate["relay"], 1),
                "baseline_rows_per_s": round(rate["baseline"], 1),
                "ratio": round(rate["relay"] / rate["baseline"], 3),
                "protocol_rows_per_s": round(rate["protocol"], 1),
                "relay_vs_protocol": round(rate["relay"] / rate["protocol"], 3),
                "worker_rows_per_s": round(rate["worker"], 1),
                "rows": args.rows,
                "runs": args.repeat,
                "statements_per_batch": round(relay["statements_per_batch"], 2),
                "round_trips_per_batch": round(relay["round_trips_per_batch"], 2),
                "worker_statements_per_batch": round(measured["worker"]["statements_per_batch"], 2),
                "baseline_statements_per_batch": round(base["statements_per_batch"], 2),
                "baseline_round_trips_per_batch": round(base["round_trips_per_batch"], 2),
                "cpu_ms_per_100_rows": cpu,
            }
            if "pgqueuer" in rate:
                cell["pgqueuer_rows_per_s"] = round(rate["pgqueuer"], 1)
                cell["worker_vs_pgqueuer"] = round(rate["worker"] / rate["pgqueuer"], 3)
            cells.append(cell)
    # Scaling: rows/s with the most workers over rows/s with one, relay and baseline.
    by_key = {(c["batch"], c["workers"]): c for c in cells}
    lo, hi = min(args.workers), max(args.workers)
    if hi > lo:
        for batch in args.batches:
            one, many = by_key[(batch, lo)], by_key[(batch, hi)]
            relay_scale = many["rows_per_s"] / one["rows_per_s"]
            base_scale = many["baseline_rows_per_s"] / one["baseline_rows_per_s"]
            cells.append(
                {
                    "name": "scaling",
                    "batch": batch,
                    "workers": hi,
                    "relay_speedup": round(relay_scale, 3),
                    "baseline_speedup": round(base_scale, 3),
                    "ratio": round(relay_scale / base_scale, 3),
                }
            )
    return cells


def _retention(dbs: common.Databases, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Pruning a day of settled rows by dropping its partition against deleting
    them row by row, idle and beside a drain (bench.retention)."""
    cells = []
    # (a quick run prunes beside no drain: its few due rows would not last)
    for beside_drain in (False,) if args.quick else (False, True):
        for by_day in (True, False):
            log(
                f"retention: {args.retention_settled} rows, by day={by_day}, "
                f"beside a drain={beside_drain} ..."
            )
            with dbs.fresh(f"retention_{by_day}_{beside_drain}") as url:
                due = 1_000 if args.quick else 200_000
                cell = retention.cell(url, args.retention_settled, by_day, beside_drain, due)
                cells.append({"name": "retention", **cell})
    return cells


def _providers(dbs: common.Databases, args: argparse.Namespace) -> list[dict[str, Any]]:
    cells = []
    for latency_ms in args.provider_latencies:
        with dbs.fresh(f"provider_{latency_ms}") as url:
            log(f"providers: a {latency_ms} ms provider through one sender instance ...")
            cells.append({"name": "provider", **providers.run(url, args.provider_rows, latency_ms)})
    return cells


def _receipt(dbs: common.Databases, args: argparse.Namespace) -> list[dict[str, Any]]:
    """What the sender's compare-and-set receipt costs against the plain fenced
    read it replaced: the relay both ways, 1 worker, alternating, best of runs."""
    cells = []
    for batch in args.batches:
        measured: dict[str, dict[str, Any]] = {}
        for run_no in range(args.repeat):
            for kind in ("relay-read", "relay"):
                with dbs.fresh(f"receipt_{kind}_{batch}".replace("-", "_")) as url:
                    common.seed_pending(url, args.rows)
                    log(f"receipt: {kind} batch={batch} run {run_no + 1}")
                    result = throughput.run_cell(url, kind, batch, 1)
                    left = common.count_status(url)
                    if left.get("delivered", 0) != args.rows:
                        raise RuntimeError(f"{kind} cell did not deliver every row: {left}")
                best = measured.get(kind)
                if best is None or result["rows_per_s"] > best["rows_per_s"]:
                    measured[kind] = result
        receipt, read = measured["relay"], measured["relay-read"]
        log(
            f"  receipt {receipt['rows_per_s']:.0f}/s, fenced read {read['rows_per_s']:.0f}/s, "
            f"ratio {receipt['rows_per_s'] / read['rows_per_s']:.2f}"
        )
        cells.append(
            {
                "name": "receipt",
                "batch": batch,
                "workers": 1,
                "rows_per_s": round(receipt["rows_per_s"], 1),
                "fenced_read_rows_per_s": round(read["rows_per_s"], 1),
                "ratio": round(receipt["rows_per_s"] / read["rows_per_s"], 3),
                "statements_per_batch": round(receipt["statements_per_batch"], 2),
                "fenced_read_statements_per_batch": round(read["statements_per_batch"], 2),
                "round_trips_per_batch": round(receipt["round_trips_per_batch"], 2),
                "fenced_read_round_trips_per_batch": round(read["round_trips_per_batch"], 2),
            }
        )
    return cells


def _growth(dbs: common.Databases, args: argparse.Namespace) -> list[dict[str, Any]]:
    cells = []
    # grown: the busy day's dead rows left in place (no vacuum at all);
    # vacuumed: as the live partition's autovacuum would have left them.
    for table in ("fresh", "grown", "vacuumed"):
        with dbs.fresh(f"growth_{table}") as url:
            extra: dict[str, Any] = {}
            if table != "fresh":
                log(f"growth: {args.growth_settled} settled rows + {args.growth_busy} busy ...")
                extra = growth.grow(
                    url, args.growth_settled, args.growth_busy, autovacuum=table == "vacuumed"
                )
            log(f"growth: claim latency on the {table} table ...")
            figures = growth.measure(
                url, args.growth_pending, 100, args.growth_samples, vacuum=table == "fresh"
            )
            cells.append(
                {
                    "name": f"growth_{table}",
                    "pending": args.growth_pending,
                    "settled": args.growth_settled if table != "fresh" else 0,
                    "busy_day_rows": args.growth_busy if table != "fresh" else 0,
                    "batch": 100,
                    **figures,
                    **{k: round(v, 2) for k, v in extra.items()},
                }
            )
    fresh = cells[0]
    for grown in cells[1:3]:
        cells.append(
            {
                "name": "growth" if grown["name"] == "growth_grown" else "growth_vacuumed_ratio",
                "p50_ratio": _ratio(grown["p50_ms"], fresh["p50_ms"]),
                "p99_ratio": _ratio(grown["p99_ms"], fresh["p99_ms"]),
                # the grown table's drain against the fresh one's (issue 30)
                "drain_ratio": _ratio(grown["drain_rows_per_s"], fresh["drain_rows_per_s"]),
            }
        )
    return cells


def _ratio(value: float, against: float) -> float | None:
    return round(value / against, 3) if against else None


def _enqueue(dbs: common.Databases, args: argparse.Namespace) -> list[dict[str, Any]]:
    measured = {}
    for kind, fn in (("baseline", enqueue.baseline), ("relay", enqueue.relay)):
        with dbs.fresh(f"enqueue_{kind}") as url:
            log(f"enqueue: {kind} ...")
            measured[kind] = fn(url, args.enqueue_rows, args.enqueue_per_tx)
    return [
        {
            "name": "enqueue",
            "batch": args.enqueue_per_tx,
            "workers": 1,
            "rows_per_s": round(measured["relay"]["rows_per_s"], 1),
            "baseline_rows_per_s": round(measured["baseline"]["rows_per_s"], 1),
            "ratio": round(measured["relay"]["rows_per_s"] / measured["baseline"]["rows_per_s"], 3),
            "rows": args.enqueue_rows,
        }
    ]


def _coldstart(dbs: common.Databases, args: argparse.Namespace) -> list[dict[str, Any]]:
    log("cold start: importing each handler in fresh interpreters ...")
    with dbs.fresh("coldstart") as url:
        figures = coldstart.measure(url, args.coldstart_repeats)
    interpreter = coldstart.interpreter_start_s()
    return [
        {"name": "coldstart", **f, "interpreter_start_s": round(interpreter, 4)} for f in figures
    ]


def table(cells: list[dict[str, Any]]) -> str:
    lines = []
    for c in cells:
        name = c["name"]
        if name == "throughput":
            lines.append(
                f"{'throughput':<12} batch={c['batch']:<5} workers={c['workers']:<2} "
                f"relay={c['rows_per_s']:>9.0f}/s baseline={c['baseline_rows_per_s']:>9.0f}/s "
                f"ratio={c['ratio']:.2f} protocol={c['protocol_rows_per_s']:>9.0f}/s "
                f"relay/protocol={c['relay_vs_protocol']:.2f} "
                f"worker={c['worker_rows_per_s']:>9.0f}/s "
                f"pgqueuer={c.get('pgqueuer_rows_per_s', 0):>9.0f}/s "
                f"worker/pgqueuer={c.get('worker_vs_pgqueuer', 0):.2f}  "
                f"stmts/batch={c['statements_per_batch']:.1f} "
                f"round trips/batch={c['round_trips_per_batch']:.1f} "
                f"(baseline {c['baseline_round_trips_per_batch']:.1f})"
            )
        elif name == "wal":
            lines.append(
                f"{'wal':<12} {c['kind']:<9} {c['wal_bytes_per_message']:>8.0f} WAL bytes/msg "
                f"(x{c.get('wal_vs_baseline', 0):.2f} of baseline), "
                f"{c['statements_per_message']:.3f} statements/msg"
            )
        elif name == "provider":
            lines.append(
                f"{'provider':<12} {c['latency_ms']:>4} ms/call: {c['rows_per_s']:.0f} msg/s per "
                f"sender instance, bound {c['bound_rows_per_s']:.0f} "
                f"(send_concurrency {c['send_concurrency']} / latency): "
                f"{c['of_bound']:.2f} of the bound"
            )
        elif name == "drain":
            lines.append(
                f"{'drain':<12} {c['rows']} rows, reserved concurrency "
                f"{c['reserved_concurrency']}, {c['latency_ms']} ms provider: {c['seconds']:.1f} s "
                f"(ideal {c['ideal_seconds']:.1f} s, {c['of_bound']:.2f} of the bound), "
                f"{c['dropped_for_age']} events dropped for age, "
                f"{c['other_attempt_rows']} attempts not delivered"
            )
        elif name == "receipt":
            lines.append(
                f"{'receipt':<12} batch={c['batch']:<5} workers=1  "
                f"receipt={c['rows_per_s']:>9.0f}/s "
                f"fenced read={c['fenced_read_rows_per_s']:>9.0f}/s "
                f"ratio={c['ratio']:.2f}  stmts/batch={c['statements_per_batch']:.1f} "
                f"(fenced read {c['fenced_read_statements_per_batch']:.1f})"
            )
        elif name == "scaling":
            lines.append(
                f"{'scaling':<12} batch={c['batch']:<5} workers={c['workers']:<2} "
                f"relay x{c['relay_speedup']:.2f} baseline x{c['baseline_speedup']:.2f} "
                f"ratio={c['ratio']:.2f}"
            )
        elif name.startswith("growth_") and name != "growth_vacuumed_ratio":
            lines.append(
                f"{name:<12} pending={c['pending']} settled={c['settled']} "
                f"busy={c['busy_day_rows']} "
                f"claim p50={c['p50_ms']:.2f} ms p99={c['p99_ms']:.2f} ms "
                f"drain {c.get('drain_rows_per_s', 0):.0f} rows/s "
                f"(EXPLAIN: {c['plan_execution_ms']:.2f} ms, {c['plan_shared_buffers']} buffers)"
            )
        elif name in ("growth", "growth_vacuumed_ratio"):
            which = "grown" if name == "growth" else "vacuumed"
            lines.append(
                f"{'growth':<12} {which}/fresh p50 x{c['p50_ratio']} p99 x{c['p99_ratio']} "
                f"drain x{c.get('drain_ratio')}"
            )
        elif name == "latency":
            lines.append(
                f"{'latency':<12} {c['rate_per_s']:.0f} msg/s for {c['seconds']:.0f} s: "
                f"enqueue->delivered p50={c['p50_ms']:.0f} ms p99={c['p99_ms']:.0f} ms "
                f"({c['delivered']} delivered, {c['not_delivered']} not)"
            )
        elif name == "enqueue":
            lines.append(
                f"{'enqueue':<12} per tx={c['batch']:<5} enqueue_many={c['rows_per_s']:>9.0f}/s "
                f"raw INSERT={c['baseline_rows_per_s']:>9.0f}/s ratio={c['ratio']:.2f}"
            )
        elif name == "bulk_door":
            lines.append(
                f"{'bulk door':<12} 100 emails a call: 0021 {c['ms_per_call_head']:.2f} ms, "
                f"0020 {c['ms_per_call_0020']:.2f} ms, ratio={c['ratio']:.2f}"
            )
        elif name == "retention":
            during = c.get("drain_during_over_before")
            lines.append(
                f"{'retention':<12} {c['layout']:<7} {c['pruned']} rows in {c['seconds']:.2f} s"
                + (
                    f", the drain at {during} of its rate meanwhile"
                    if "drain_during_over_before" in c
                    else f", {c['wal_mb']} MB of WAL, history {c['history_mb_before']}"
                    f" -> {c['history_mb_after']} MB"
                )
            )
        elif name == "coldstart":
            lines.append(
                f"{'cold start':<12} {c['handler']:<11} import {c['import_s'] * 1000:.0f} ms "
                f"({c['modules']} modules; "
                f"interpreter start {c['interpreter_start_s'] * 1000:.0f} ms)"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = sys.stdout
    # The relay runs in this process too (growth, latency, enqueue): its JSON
    # log lines and metric blobs would bury the table.
    undo = common.quiet_process()
    started = time.monotonic()
    try:
        cells = run(args)
    finally:
        undo()
    cells[0]["seconds"] = round(time.monotonic() - started, 1)
    print(table(cells), file=out, flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(cells, indent=1) + "\n")
    log(f"wrote {args.output} ({cells[0]['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench.ab``: one throughput stepper of two code trees, A against B.

What a change is worth, measured the way bench/README.md reports it: each run
a fresh interpreter (its own imports, from its own tree) draining a fresh copy
of 20,000 due rows at one batch size, the variants alternating, round after
round. It prints every run, then per variant the best and the median rate and
the CPU time a message (``time.process_time``, all threads), which this
machine's load disturbs far less than the wall clock.

    git worktree add /tmp/before HEAD~1
    .venv/bin/python -m bench.ab --rounds 6 \\
        before=/tmp/before:relay after=.:relay protocol=.:protocol
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import common

_RUN = "RESULT "
_HARNESS = Path(__file__).resolve().parents[1]


def _run_one(kind: str, url: str, batch: int) -> None:
    """The child: drain ``url`` with ``kind``'s stepper from this tree; print one line."""
    from . import throughput

    common.quiet_process()
    step, close = throughput.STEPPERS[kind](url, batch)
    from outbox.runtime import cold_start_done  # this variant's own

    cold_start_done()  # as the bench's workers and the functions' cold starts do
    cpu, started, done = time.process_time(), time.monotonic(), 0
    while n := step():
        done += n
    wall, cpu = time.monotonic() - started, time.process_time() - cpu
    close()
    import outbox

    result = {
        "rows": done,
        "rows_per_s": done / wall,
        "cpu_us": cpu / max(done, 1) * 1e6,
        "relay": str(Path(outbox.__file__).parents[3]),  # the tree it ran
    }
    print(_RUN + json.dumps(result), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="*", help="label=TREE:KIND (KIND: a throughput stepper)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _run_one(args.child[0], args.child[1], args.batch)
        return 0
    if not args.variants:
        parser.error("name at least one variant, label=TREE:KIND")
    variants = []
    for spec in args.variants:
        label, _, rest = spec.partition("=")
        tree, _, kind = rest.rpartition(":")
        variants.append((label, Path(tree).resolve(), kind))
    databases = common.Databases(common.server_url())
    databases.prepare_template()
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in variants}
    try:
        for _ in range(args.rounds):
            for label, tree, kind in variants:
                with databases.fresh("ab") as url:
                    common.seed_pending(url, args.rows)
                    # The variant's relay, this tree's harness (its steppers).
                    paths = [tree / "layers/outbox", tree / "cli"]
                    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
                    command = [sys.executable, "-m", "bench.ab", "--batch", str(args.batch)]
                    child = subprocess.run(
                        [*command, "--child", kind, url],
                        env=env,
                        cwd=_HARNESS,
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    lines = [x for x in child.stderr.splitlines() if x.startswith(_RUN)]
                    if not lines:
                        sys.stderr.write(child.stderr[-3000:])
                        return 1
                    result = json.loads(lines[-1][len(_RUN) :])
                    if Path(result["relay"]) != tree:
                        sys.stderr.write(
                            f"{label}: ran the relay of {result['relay']}, not {tree}\n"
                        )
                        return 1
                    runs[label].append(result)
                    print(
                        f"{label:14} {result['rows_per_s']:8.0f} rows/s"
                        f"  {result['cpu_us']:5.1f} µs CPU a message",
                        flush=True,
                    )
    finally:
        databases.close()
    first = max(r["rows_per_s"] for r in runs[variants[0][0]])
    for label, results in runs.items():
        rates = [r["rows_per_s"] for r in results]
        cpus = [r["cpu_us"] for r in results]
        print(
            f"{label:14} best {max(rates):8.0f} ({max(rates) / first:.3f} of the first)"
            f"  median {statistics.median(rates):8.0f}"
            f"  CPU µs a message: min {min(cpus):5.1f} median {statistics.median(cpus):5.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

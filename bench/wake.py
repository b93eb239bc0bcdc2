"""``python -m bench.wake``: what wake on enqueue costs a producer, A/B.

The same producer loop (``outbox.enqueue`` in transactions of ``per_tx``
messages, on the producer's own plain SQLAlchemy engine) with nudges off and
on, alternating round after round on one fresh database. "On" points
``OUTBOX_DISPATCHER_FUNCTION`` at a Lambda endpoint on loopback that answers
202 as Lambda does, so the background thread really sends its coalesced
Invoke calls. Reported per variant: the median rate, the median CPU time per
transaction, of the producer's thread (``time.thread_time``: the hot path)
and of the whole process (``time.process_time``: the nudger's thread and its
Invoke calls included; the machine's load disturbs both far less than the
wall clock), and the Invoke calls made. bench/README.md quotes the ratios.
"""

from __future__ import annotations

import argparse
import http.server
import os
import statistics
import threading
import time
from typing import Any

import sqlalchemy as sa

from . import common


class _Lambda(http.server.BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).calls += 1
        self.send_response(202)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _round(
    engine: sa.Engine, payloads: list[dict[str, Any]], per_tx: int
) -> tuple[float, float, float]:
    """(messages a second, CPU seconds a transaction: the producer's thread, the
    whole process) of one pass over ``payloads``."""
    import outbox

    own, cpu, started = time.thread_time(), time.process_time(), time.perf_counter()
    transactions = 0
    for lo in range(0, len(payloads), per_tx):
        with engine.begin() as conn:
            for payload in payloads[lo : lo + per_tx]:
                outbox.enqueue(conn, common.CHANNEL, payload)
        transactions += 1
    elapsed = time.perf_counter() - started
    return (
        len(payloads) / elapsed,
        (time.thread_time() - own) / transactions,
        (time.process_time() - cpu) / transactions,
    )


def run(url: str, rows: int, per_tx: int, rounds: int) -> dict[str, dict[str, float]]:
    from outbox import wake

    common.register_channel()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Lambda)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ["AWS_ENDPOINT_URL_LAMBDA"] = f"http://127.0.0.1:{server.server_address[1]}"
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    engine = sa.create_engine(sa.engine.make_url(url).set(drivername="postgresql+pg8000"))
    payloads = [common.python_payload(i) for i in range(rows)]
    runs: dict[str, list[tuple[float, float, float]]] = {"off": [], "on": []}
    calls = {"off": 0, "on": 0}
    try:
        wake.configure(None)
        _round(engine, payloads[:per_tx], per_tx)  # warm: connection, validator
        for _ in range(rounds):
            for variant in ("off", "on"):
                wake.configure("outbox-bench-dispatcher" if variant == "on" else None)
                if variant == "on":  # a process makes its client once: not per round
                    wake.current()._client()  # type: ignore[union-attr]
                before = _Lambda.calls
                runs[variant].append(_round(engine, payloads, per_tx))
                nudger = wake.current()
                if nudger is not None:
                    nudger.close(timeout=10)
                calls[variant] += _Lambda.calls - before
    finally:
        wake.configure(None)
        engine.dispose()
        server.shutdown()
    return {
        variant: {
            "rows_per_s": statistics.median(m[0] for m in measured),
            "thread_cpu_us_per_tx": statistics.median(m[1] for m in measured) * 1e6,
            "cpu_us_per_tx": statistics.median(m[2] for m in measured) * 1e6,
            "invokes_per_round": calls[variant] / rounds,
        }
        for variant, measured in runs.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.wake", description=__doc__)
    p.add_argument("--rows", type=int, default=2_000, help="messages per round")
    p.add_argument("--per-tx", type=int, default=1, help="messages per transaction")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    undo = common.quiet_process()
    dbs = common.Databases(common.server_url())
    try:
        dbs.prepare_template()
        with dbs.fresh("wake") as url:
            result = run(url, args.rows, args.per_tx, args.rounds)
    finally:
        dbs.close()
        undo()
    off, on = result["off"], result["on"]
    print(f"{args.rows} messages, {args.per_tx} per transaction, {args.rounds} rounds (median)")
    for name, r in result.items():
        print(
            f"  nudges {name:<3}: {r['rows_per_s']:>8.0f} msg/s  "
            f"CPU/tx {r['thread_cpu_us_per_tx']:>7.0f} us producer thread, "
            f"{r['cpu_us_per_tx']:>7.0f} us process  {r['invokes_per_round']:>5.1f} Invoke/round"
        )
    print(
        f"  on/off: rate {on['rows_per_s'] / off['rows_per_s']:.2f}, CPU/tx producer thread "
        f"{on['thread_cpu_us_per_tx'] / off['thread_cpu_us_per_tx']:.2f}, "
        f"process {on['cpu_us_per_tx'] / off['cpu_us_per_tx']:.2f}"
    )


if __name__ == "__main__":
    main()

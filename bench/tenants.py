"""Tenants (issue 33): a noisy neighbour, and the claim's cost with many
tenants: ``python -m bench.tenants`` (``--quick`` for a smoke run).

* **noisy neighbour.** Tenant ``a`` holds ``--backlog`` due messages; one
  relay drains them (``store.claim`` at batch 100, then ``store.settle``, as
  ``outbox worker`` does with a channel that answers at once) while tenant
  ``b`` enqueues ``--b-messages`` messages spread over the drain. The figure
  is b's enqueue-to-delivered time (``settled_at - created_at``, the
  database's clock), p50 and p99, against the same messages enqueued on an
  idle relay, and a's drain rate against a's drain alone. The control cell
  gives b's messages to ``a`` itself: what every message of another
  customer waited before tenants (the whole backlog ahead of it).
* **noisy neighbour under Lambda's limits** (``--simulated``): the same
  through the Lambda simulator (tests/reliability/lambda_sim.py), the real
  dispatcher, senders and reaper with the channel function at
  ``--concurrency`` reserved environments and calls of ``--latency-ms``;
  cells: b on an idle relay, a alone, a with b.
* **many tenants.** The same drain of ``--rows`` due rows, held by one
  tenant and by ``--tenants`` tenants (their rows interleaved): the drain
  rate's ratio, each cell on a fresh database.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import sqlalchemy as sa

from . import common

BATCH = 100


def _database(admin: sa.Engine, name: str) -> tuple[str, sa.Engine]:
    from outbox import migrate

    with admin.connect() as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    url = common.url_for(common.server_url(), name)
    migrator = sa.create_engine(url, poolclass=sa.NullPool)
    migrate.upgrade(migrator)
    migrator.dispose()
    return url, common.engine_for(url)


def _seed(engine: sa.Engine, rows: int, tenants: int) -> None:
    """``rows`` due rows of tenants t0000..; tenant 'a' when ``tenants`` is 0."""
    tenant = "'a'" if tenants == 0 else f"'t' || lpad(CAST(mod(g, {tenants}) AS text), 4, '0')"
    with engine.connect() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload, available_at, tenant) "
                f"SELECT :channel, {common.payload_sql()}, now() - interval '1 second', {tenant} "
                "FROM generate_series(1, :rows) AS g"
            ),
            {"channel": common.CHANNEL, "rows": rows},
        )
        conn.execute(sa.text("VACUUM ANALYZE outbox_message_live"))


def _drain_once(engine: sa.Engine) -> int:
    from outbox import store

    with engine.begin() as conn:
        claims = store.claim(conn, BATCH, 120)
        if claims:
            store.settle(
                conn,
                [store.Settlement(c.id, c.claim_token, "delivered") for c in claims],
                store.Backoff(1, 60, 5),
            )
    return len(claims)


def _enqueue(engine: sa.Engine, tenant: str) -> int:
    import outbox

    with engine.begin() as conn:
        return outbox.enqueue(conn, common.CHANNEL, common.python_payload(1), tenant=tenant)


def _latencies(engine: sa.Engine, ids: list[int]) -> list[float]:
    with engine.connect() as conn:
        return [
            float(r[0])
            for r in conn.execute(
                sa.text(
                    "SELECT EXTRACT(EPOCH FROM settled_at - created_at) FROM outbox_message "
                    "WHERE id = ANY(CAST(:ids AS bigint[])) AND status = 'delivered'"
                ),
                {"ids": "{" + ",".join(map(str, ids)) + "}"},
            )
        ]


def _neighbour_cell(engine: sa.Engine, backlog: int, b_messages: int, b_tenant: str) -> dict:
    """Drain ``backlog`` rows of tenant a while ``b_tenant`` enqueues
    ``b_messages`` spread over the drain (every so many claims)."""
    if backlog:
        _seed(engine, backlog, 0)
    claims_between = max(1, backlog // BATCH // (b_messages + 1))
    ids: list[int] = []
    drained = claims = 0
    started = time.perf_counter()
    idle = 0
    while idle < 3 or len(ids) < b_messages:
        if len(ids) < b_messages and claims % claims_between == 0:
            ids.append(_enqueue(engine, b_tenant))
        n = _drain_once(engine)
        claims += 1
        drained += n
        if n == 0:
            idle += 1
            time.sleep(0.01)
        else:
            idle = 0
    elapsed = time.perf_counter() - started
    times = sorted(_latencies(engine, ids))
    return {
        "a_rows_per_s": (drained - len(ids)) / elapsed if backlog else None,
        "b_p50_ms": common.percentile(times, 50) * 1000,
        "b_p99_ms": common.percentile(times, 99) * 1000,
        "b_delivered": len(times),
    }


def _drain_rate(engine: sa.Engine, rows: int, tenants: int) -> float:
    _seed(engine, rows, tenants)
    started = time.perf_counter()
    drained = 0
    while True:
        n = _drain_once(engine)
        if n == 0:
            break
        drained += n
    return drained / (time.perf_counter() - started)


def _simulated_cell(
    url: str,
    backlog: int,
    b_messages: int,
    latency_ms: int,
    concurrency: int,
    max_in_flight: int | None = None,
) -> dict[str, Any]:
    """The noisy neighbour through the Lambda simulator (the real dispatcher,
    senders and reaper; the channel function at ``concurrency`` reserved
    environments, each sending ``send_concurrency`` calls of ``latency_ms``):
    tenant a's ``backlog`` due, tenant b's ``b_messages`` enqueued one by one,
    spread over the time a's backlog takes at the ideal rate. b's latency is
    ``settled_at - created_at`` (when the relay wrote its outcome, after the
    rest of its event), and ``b_sent_*`` from its enqueue's commit to the
    provider's acceptance (when its recipient gets it); a's rate is its rows over the time from the
    start (the database's clock) to its last row settled."""
    import threading

    import outbox

    from .drain import simulator

    lambda_sim, settings = simulator(
        channel_concurrency={"sim": concurrency},  # (lambda_sim.CHANNEL)
        channel_max_in_flight={} if max_in_flight is None else {"sim": max_in_flight},
    )
    from reliability.lambda_sim import Faults

    engine = common.engine_for(url, pool_size=concurrency + 6)
    try:
        # The simulator registers its channel when it starts; the rows are
        # enqueued before, through the same registration.
        from outbox import channels

        channels.register(lambda_sim.CHANNEL, lambda: lambda_sim.SimProvider(Faults(), 0))
        bound = concurrency * settings.send_concurrency / (latency_ms / 1000)
        span = max(backlog / bound, 2.0)  # a's drain at the ideal rate
        ids = lambda_sim.enqueue(engine, backlog) if backlog else []
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE outbox_message SET tenant = 'a'"))
            # Keeps the run going until b's last message is enqueued (the
            # simulator stops once every row it knows is final).
            ids.append(
                outbox.enqueue(conn, lambda_sim.CHANNEL, {"n": -1}, delay=span + 1, tenant="z")
            )
        with engine.connect() as conn:
            conn.execute(sa.text("VACUUM ANALYZE outbox_message_live"))
            conn.commit()
        b_ids: list[int] = []
        committed: dict[int, float] = {}  # b's ids: the monotonic time of the commit
        started: list[Any] = []
        sims: list[Any] = []

        def on_start(_sim: Any) -> None:
            sims.append(_sim)
            with engine.connect() as conn:
                started.append(conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one())

            def produce() -> None:
                for _ in range(b_messages):
                    time.sleep(span / (b_messages + 1))
                    with engine.begin() as conn:
                        b = outbox.enqueue(conn, lambda_sim.CHANNEL, {"n": -2}, tenant="b")
                    committed[b] = time.monotonic()
                    b_ids.append(b)
                    ids.append(b)

            threading.Thread(target=produce, daemon=True).start()

        report = lambda_sim.run(
            engine,
            settings,
            Faults(),
            ids=ids,
            concurrency=concurrency,
            latency_seconds=latency_ms / 1000,
            timeout_seconds=span * 6 + 60,
            on_start=on_start,
        )
        with engine.connect() as conn:
            a_done, a_seconds = conn.execute(
                sa.text(
                    "SELECT count(*), EXTRACT(EPOCH FROM max(settled_at) - :started)::float8 "
                    "FROM outbox_message WHERE tenant = 'a' AND status = 'delivered'"
                ),
                {"started": started[0]},
            ).one()
        times = sorted(_latencies(engine, b_ids))
        accepted: dict[int, float] = {}
        for send in sims[0].provider.sends if sims else []:
            if send.message_id in committed:
                accepted.setdefault(send.message_id, send.at)
        sent = sorted(accepted[i] - committed[i] for i in accepted)
    finally:
        engine.dispose()
    return {
        "b_sent_p50_ms": common.percentile(sent, 50) * 1000 if sent else None,
        "b_sent_p99_ms": common.percentile(sent, 99) * 1000 if sent else None,
        "a_rows_per_s": a_done / a_seconds if backlog and a_seconds else None,
        "a_of_ideal": a_done / a_seconds / bound if backlog and a_seconds else None,
        "b_p50_ms": common.percentile(times, 50) * 1000 if times else None,
        "b_p99_ms": common.percentile(times, 99) * 1000 if times else None,
        "b_delivered": len(times),
        "lost": len(report.lost),
        "dropped_for_age": len(report.record.dropped_for_age),
    }


def run_simulated(
    backlog: int,
    b_messages: int,
    latency_ms: int,
    concurrency: int,
    max_in_flight: int | None = None,
) -> dict[str, Any]:
    """The noisy neighbour under Lambda's limits: idle, a alone, a with b."""
    admin = sa.create_engine(common.server_url(), isolation_level="AUTOCOMMIT")
    names: list[str] = []
    result: dict[str, Any] = {
        "backlog": backlog,
        "b_messages": b_messages,
        "latency_ms": latency_ms,
        "reserved_concurrency": concurrency,
        "max_in_flight": max_in_flight,
    }
    try:
        for label, a_rows, b_rows in (
            ("idle", 0, b_messages),
            ("alone", backlog, 0),
            ("two_tenants", backlog, b_messages),
        ):
            name = f"bench_tenants_sim_{os.getpid()}_{label}"
            names.append(name)
            url, engine = _database(admin, name)
            engine.dispose()
            result[label] = _simulated_cell(
                url, a_rows, b_rows, latency_ms, concurrency, max_in_flight
            )
        result["b_p99_vs_idle"] = result["two_tenants"]["b_p99_ms"] / result["idle"]["b_p99_ms"]
        result["b_sent_p99_vs_idle"] = (
            result["two_tenants"]["b_sent_p99_ms"] / result["idle"]["b_sent_p99_ms"]
        )
        result["a_rate_vs_alone"] = (
            result["two_tenants"]["a_rows_per_s"] / result["alone"]["a_rows_per_s"]
        )
        return result
    finally:
        with admin.connect() as conn:
            for name in names:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


def run(backlog: int, b_messages: int, rows: int, tenants: int) -> dict[str, Any]:
    common.register_channel()
    admin = sa.create_engine(common.server_url(), isolation_level="AUTOCOMMIT")
    names: list[str] = []
    engines: list[sa.Engine] = []

    def fresh(label: str) -> sa.Engine:
        name = f"bench_tenants_{os.getpid()}_{label}"
        names.append(name)
        engine = _database(admin, name)[1]
        engines.append(engine)
        return engine

    try:
        result: dict[str, Any] = {}
        result["idle"] = _neighbour_cell(fresh("idle"), 0, b_messages, "b")
        result["alone"] = {"a_rows_per_s": _drain_rate(fresh("alone"), backlog, 0)}
        result["two_tenants"] = _neighbour_cell(fresh("two"), backlog, b_messages, "b")
        result["one_tenant_control"] = _neighbour_cell(fresh("one"), backlog, b_messages, "a")
        result["b_p99_vs_idle"] = result["two_tenants"]["b_p99_ms"] / result["idle"]["b_p99_ms"]
        result["a_rate_vs_alone"] = (
            result["two_tenants"]["a_rows_per_s"] / result["alone"]["a_rows_per_s"]
        )
        # (the control's loop does the same enqueues: the fair share's own cost)
        result["a_rate_vs_control"] = (
            result["two_tenants"]["a_rows_per_s"] / result["one_tenant_control"]["a_rows_per_s"]
        )
        one = _drain_rate(fresh("single"), rows, 0)
        many = _drain_rate(fresh("many"), rows, tenants)
        result["many_tenants"] = {
            "rows": rows,
            "tenants": tenants,
            "one_tenant_rows_per_s": one,
            "many_tenants_rows_per_s": many,
            "ratio": many / one,
        }
        return result
    finally:
        for engine in engines:
            engine.dispose()
        with admin.connect() as conn:
            for name in names:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--b-messages", type=int, default=10)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument(
        "--simulated",
        action="store_true",
        help="the noisy neighbour through the Lambda simulator instead",
    )
    parser.add_argument("--latency-ms", type=int, default=50, help="(--simulated) a call's time")
    parser.add_argument(
        "--concurrency", type=int, default=10, help="(--simulated) reserved environments"
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=None, help="(--simulated) CHANNEL_MAX_IN_FLIGHT"
    )
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    args = parser.parse_args()
    if args.quick:
        args.backlog, args.rows, args.tenants = 3000, 2000, 50
    if args.simulated:
        result = run_simulated(
            args.backlog, args.b_messages, args.latency_ms, args.concurrency, args.max_in_flight
        )
    else:
        result = run(args.backlog, args.b_messages, args.rows, args.tenants)
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()

"""The fault campaign: relay processes under kills, dropped connections,
statement timeouts and a misbehaving provider; then count what was lost and
what was duplicated.

    PYTHONPATH=tests .venv/bin/python -m reliability.campaign --iterations 10 --seconds 30

(or ``pytest -m slow tests/reliability``). Each run:

1. creates (or reuses) its own database, migrates it, installs the audit
   trigger and the ``rel_*`` tables (see harness.py), and enqueues messages
   whose payload carries a provider script (transient / permanent failure,
   throttling, exceptions, hangs past the deadline) plus random priorities,
   delays and ordering keys;
2. starts dispatchers, senders and reapers as separate processes
   (driver.py); each process has one kill point and SIGKILLs itself there
   with some probability; a killed process is restarted with the next point;
3. meanwhile a chaos thread terminates relay backends (pg_terminate_backend)
   and holds row locks longer than the database's statement_timeout;
4. stops the processes, then drains in-process: leases forced to expire
   (support.expire_leases), backoffs made due (support.make_due), reaper and
   dispatcher + sender until every message is terminal;
5. checks the invariants (``check``) and prints the counts.

Two calm runs (``mode``) aim one hostile input at the relay with no other
fault: ``poison`` seeds rows whose payloads the driver cannot decode (nested
past any recursion limit) or that break the payload limits, written past the
producer; ``drip`` sends some messages to a real receiver that drips its
answer a byte at a time. Both must show 0 sends for another's claim, 0 good
messages dead, the poisoned rows failed alone, and every process stopping
within its grace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

TESTS_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS_DIR))

import support  # noqa: E402
from outbox import channels, dispatcher, migrate, reaper, sender, store  # noqa: E402
from outbox.db import create_engine  # noqa: E402
from outbox.handoff import CallableInvoker  # noqa: E402
from outbox.relay_settings import DatabaseSettings  # noqa: E402
from reliability import driver, harness  # noqa: E402

STATEMENT_TIMEOUT_MS = 1000
LEASE_SECONDS = 3
BEHAVIOURS = ["transient", "permanent", "throttle", "error", "hang"]
BEHAVIOUR_WEIGHTS = [0.45, 0.06, 0.25, 0.14, 0.10]
MODES = ("chaos", "poison", "drip")
# How long after its end time each process may take to stop (calm runs): a
# sender finishes its batch (provider calls end at their deadline, inside the
# lease), the reaper outlives the senders by a lease and 2 s by design.
STOP_GRACE = {"dispatcher": 2.0, "sender": LEASE_SECONDS + 2.0, "reaper": LEASE_SECONDS + 4.5}


@dataclass
class RunReport:
    run: int
    seed: int
    mode: str = "chaos"
    messages: int = 0
    poisoned: int = 0
    slowest_stop: dict[str, float] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    kills: dict[str, int] = field(default_factory=dict)
    stalls: int = 0
    crashes: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    fault_events: dict[str, int] = field(default_factory=dict)
    terminated_backends: int = 0
    lock_holds: int = 0
    accepts: int = 0
    duplicates: int = 0
    duplicates_explained_by: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def line(self) -> str:
        return json.dumps(
            {k: v for k, v in self.__dict__.items() if k != "violations"}
            | {"violations": len(self.violations)},
            sort_keys=True,
            default=int,
        )


# --- database --------------------------------------------------------------


def create_database(server_url: str) -> str:
    name = f"outbox_rel_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        conn.execute(
            sa.text(f"ALTER DATABASE \"{name}\" SET statement_timeout = '{STATEMENT_TIMEOUT_MS}ms'")
        )
    admin.dispose()
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    engine = relay_engine(url)
    migrate.upgrade(engine)
    with engine.begin() as conn:
        for statement in harness.SCHEMA_SQL:
            conn.execute(sa.text(statement))
    engine.dispose()
    return url


def drop_database(server_url: str, url: str) -> None:
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        name = make_url(url).database
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def relay_engine(url: str) -> sa.Engine:
    return create_engine(DatabaseSettings(url=url, sslmode="disable"), pool_size=4)


# --- the run -----------------------------------------------------------------


def seed_messages(engine: sa.Engine, rng: random.Random, n: int, mode: str = "chaos") -> list[int]:
    import outbox

    messages = []
    for i in range(n):
        if mode == "drip":  # good messages: some meet the dripping receiver once or twice
            script = rng.choice([[], [], ["drip"], ["drip", "drip"], ["transient", "drip"]])
        elif mode == "poison":  # good messages, whatever the poisoned ones do
            script = rng.choice([[], [], ["transient"], ["throttle"]])
        else:
            script = [
                rng.choices(BEHAVIOURS, BEHAVIOUR_WEIGHTS)[0]
                for _ in range(rng.choice([0, 0, 1, 2, 3]))
            ]
        message: dict[str, Any] = {
            "channel": harness.CHANNEL,
            "payload": {"n": i, "script": script},
            "priority": rng.choice([0, 0, 0, 1, 5]),
        }
        if rng.random() < 0.3:
            message["ordering_key"] = f"key-{rng.randrange(4)}"
        if rng.random() < 0.2:
            message["delay"] = rng.uniform(0, 2)
        if rng.random() < 0.2 and mode == "chaos":
            message["max_attempts"] = rng.choice([2, 3])
        messages.append(message)
    with harness.FakeProviderRegistered(), engine.begin() as conn:
        return outbox.enqueue_many(conn, messages)


class Chaos(threading.Thread):
    """Drops relay connections and holds row locks past the statement timeout."""

    def __init__(self, url: str, rng: random.Random, report: RunReport) -> None:
        super().__init__(daemon=True)
        self.engine = sa.create_engine(
            url, isolation_level="AUTOCOMMIT", connect_args={"application_name": "rel-chaos"}
        )
        self.rng = rng
        self.report = report
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.2, 0.7)):
            try:
                if self.rng.random() < 0.6:
                    self.terminate_one()
                else:
                    self.hold_locks()
            except sa.exc.DBAPIError:
                pass
        self.engine.dispose()

    def terminate_one(self) -> None:
        with self.engine.connect() as conn:
            n = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM (SELECT pid FROM "
                    "pg_stat_activity WHERE datname = current_database() AND "
                    "application_name = 'outbox-relay' AND pid <> pg_backend_pid() "
                    # Mid-batch first: a backend running a statement or inside a transaction.
                    "ORDER BY state = 'idle', random() LIMIT 1) AS victim"
                )
            ).scalar_one()
        self.report.terminated_backends += int(n)

    def hold_locks(self) -> None:
        """Lock a few claimed rows for longer than the statement timeout: the
        settles that meet them time out."""
        with self.engine.connect() as conn, conn.begin():
            locked = conn.execute(
                sa.text(
                    "SELECT id FROM outbox_message WHERE status = 'claimed' "
                    "ORDER BY random() LIMIT 3 FOR UPDATE SKIP LOCKED"
                )
            ).all()
            if locked:
                self.report.lock_holds += 1
                # Idle in the transaction (no statement runs, so no timeout here).
                time.sleep(STATEMENT_TIMEOUT_MS / 1000 * 2)


# Rows no producer would write: nested past any Python's recursion limit (the
# driver cannot decode them), and past the payload limits (decodable, refused).
POISON = (
    '{"n": 0, "x": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"n": 0, "a": ' + '{"a": ' * 40 + "1" + "}" * 41,
)


def seed_poison(engine: sa.Engine, rng: random.Random, n: int) -> list[int]:
    """Poisoned rows among the good ones, written past the producer (raw SQL)."""
    with engine.begin() as conn:
        return [
            int(
                conn.execute(
                    sa.text(
                        "INSERT INTO outbox_message (channel, payload, priority) "
                        "VALUES (:c, CAST(:p AS jsonb), :prio) RETURNING id"
                    ),
                    {"c": harness.CHANNEL, "p": POISON[i % 2], "prio": rng.choice([0, 1, 5])},
                ).scalar_one()
            )
            for i in range(n)
        ]


def spawn(
    role: str,
    url: str,
    until: float,
    point: str | None,
    seed: int,
    log: Any,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")]),
            "REL_DB_URL": url,
            "REL_UNTIL": str(until),
            "REL_KILL_POINT": point or "",
            "REL_KILL_PROB": "0.3",
            "REL_SEED": str(seed),
            "REL_LEASE": str(LEASE_SECONDS),
            **(extra_env or {}),
        }
    )
    return subprocess.Popen(
        [sys.executable, "-m", "reliability.driver", role],
        env=env,
        stdout=log,
        stderr=log,
        cwd=str(TESTS_DIR.parent),
    )


ROTATION = {
    "dispatcher": [*harness.DISPATCHER_POINTS, None],
    "sender": [*harness.SENDER_POINTS, harness.STALL],
    "reaper": [None],
}


def run_processes(
    url: str,
    seconds: float,
    rng: random.Random,
    report: RunReport,
    log_path: Path,
    counts: dict[str, int],
    extra_env: dict[str, str] | None = None,
) -> None:
    calm = report.mode != "chaos"
    env = {**(extra_env or {}), **({"REL_CALM": "1"} if calm else {})}
    until = time.time() + seconds
    turn: Counter[str] = Counter()
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    with open(log_path, "ab") as log:

        def start(role: str) -> None:
            points = ROTATION[role]
            point = points[turn[role] % len(points)]
            turn[role] += 1
            procs.append((role, spawn(role, url, until, point, rng.randrange(1 << 30), log, env)))

        for role, n in counts.items():
            for _ in range(n):
                start(role)
        chaos = Chaos(url, rng, report)
        if not calm:
            chaos.start()
        try:
            while time.time() < until:
                time.sleep(0.1)
                for role, proc in list(procs):
                    if proc.poll() is not None:
                        procs.remove((role, proc))
                        if time.time() < until - 1.5:
                            start(role)
        finally:
            chaos.stop.set()
            if chaos.is_alive():
                chaos.join()
            # The processes stop by themselves at `until` and wait for hung
            # provider calls; a straggler is a harness failure.
            give_up = max(until, time.time()) + LEASE_SECONDS * 3 + 10
            running = list(procs)
            while running and time.time() < give_up:
                for role, proc in list(running):
                    if proc.poll() is not None:
                        running.remove((role, proc))
                        late = round(max(0.0, time.time() - until), 1)
                        report.slowest_stop[role] = max(report.slowest_stop.get(role, 0.0), late)
                time.sleep(0.05)
            for role, proc in running:
                proc.kill()
                proc.wait()
                report.violations.append(f"{role} process {proc.pid} did not stop")
            for role, late in report.slowest_stop.items():
                if calm and late > STOP_GRACE[role] + 0.5:
                    report.violations.append(
                        f"a {role} stopped {late} s after its end (grace {STOP_GRACE[role]} s)"
                    )


def drain(url: str, aux: sa.Engine) -> None:
    """Finish the work in-process, with no faults left: expire every lease,
    make every backoff due, reap, replay the leftover hand-offs, dispatch and send."""
    engine = relay_engine(url)
    recorder = harness.Recorder(aux)
    provider = harness.FakeProvider(recorder)
    undo = harness.install_wrappers(recorder, None, LEASE_SECONDS)
    saved = dict(channels._registry)
    channels.register(harness.CHANNEL, lambda: provider)
    relay = driver.settings(LEASE_SECONDS)

    def send(event: dict[str, Any]) -> None:
        pairs = harness.event_pairs(event)
        provider.tokens.update(pairs)
        # (hand-offs run concurrently here: every claim handed off so far is in flight)
        provider.in_flight = [*provider.in_flight, *pairs]
        sender.run(engine, event, relay, lambda: 30.0, channel_name=harness.CHANNEL)

    try:
        # Stale hand-offs left in the queue: replayed; a stale one changes nothing.
        while (event := harness.pop_event(aux)) is not None:
            send(event)
        invoker = CallableInvoker({harness.CHANNEL: send})
        for _ in range(200):
            support.expire_leases(engine)
            reaper.run(engine, relay, lambda: 10.0)
            support.make_due(engine)
            while dispatcher.dispatch_once(engine, invoker, relay).claimed:
                pass
            with engine.connect() as conn:
                left = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM outbox_message WHERE status IN ('pending', 'claimed')"
                    )
                ).scalar_one()
            if not left:
                break
        while provider.hanging:
            time.sleep(0.05)
    finally:
        undo()
        channels._registry.clear()
        channels._registry.update(saved)
        channels._instances.clear()
        engine.dispose()


def check(url: str, report: RunReport, default_max: int, poisoned: list[int] | None = None) -> None:
    """The invariants, each a query that lists the rows breaking it."""
    engine = sa.create_engine(url, connect_args={"application_name": "rel-check"})
    v = report.violations
    with engine.connect() as conn:

        def ids(sql: str, **params: Any) -> list[Any]:
            return [tuple(r) for r in conn.execute(sa.text(sql), params).all()]

        if bad := ids("SELECT message_id, token FROM rel_events WHERE kind = 'foreign_send'"):
            v.append(f"provider calls for a claim the hand-off did not hold: {bad}")
        if report.mode != "chaos":
            # Calm runs: nothing but the hostile input, so every good message
            # is delivered and every poisoned row failed alone, never sent.
            poison = store.array_literal(poisoned or [])
            if bad := ids(
                "SELECT id, status, last_error FROM outbox_message WHERE status <> 'delivered' "
                "AND id <> ALL(CAST(:p AS bigint[]))",
                p=poison,
            ):
                v.append(f"good messages not delivered: {bad}")
            if bad := ids(
                "SELECT id, status, last_error FROM outbox_message "
                "WHERE id = ANY(CAST(:p AS bigint[])) AND (status <> 'failed' "
                "OR last_error NOT LIKE 'invalid payload: payload%' OR EXISTS "
                "(SELECT 1 FROM rel_calls c WHERE c.message_id = outbox_message.id))",
                p=poison,
            ):
                v.append(f"poisoned rows not failed alone: {bad}")

        report.statuses = dict(
            conn.execute(
                sa.text("SELECT status, count(*) FROM outbox_message GROUP BY status")
            ).all()  # type: ignore[arg-type]
        )
        total = sum(report.statuses.values())
        if total != report.messages:
            v.append(f"lost messages: {report.messages} enqueued, {total} in the table")
        # Pending is allowed only for a row held behind a failed, dead or
        # expired row of its ordering key (it waits for an operator).
        if bad := ids(
            "SELECT m.id, m.status FROM outbox_message m WHERE m.status = 'claimed' "
            "OR (m.status = 'pending' AND NOT EXISTS (SELECT 1 FROM outbox_message f "
            "WHERE f.ordering_key = m.ordering_key AND f.id < m.id "
            "AND f.status IN ('failed', 'dead', 'expired')))"
        ):
            v.append(f"not terminal: {bad}")
        if bad := ids(
            "SELECT m.id, m.status, count(a.id) FROM outbox_message m LEFT JOIN outbox_attempt a "
            "ON a.message_id = m.id AND a.outcome = 'delivered' GROUP BY m.id, m.status "
            "HAVING count(a.id) <> CASE WHEN m.status = 'delivered' THEN 1 ELSE 0 END"
        ):
            v.append(f"delivered attempt rows != 1 per delivered message: {bad}")
        if bad := ids(
            "SELECT m.id FROM outbox_message m WHERE m.status = 'delivered' AND NOT EXISTS "
            "(SELECT 1 FROM rel_accepts p WHERE p.message_id = m.id)"
        ):
            v.append(f"delivered but never seen by the provider: {bad}")
        if bad := ids(
            "SELECT t.message_id FROM rel_transitions t WHERE t.new_status = 'delivered' AND "
            "NOT EXISTS (SELECT 1 FROM rel_accepts p WHERE p.token = t.old_token)"
        ):
            v.append(f"delivered by a claim whose send the provider never accepted: {bad}")
        # Stale writes: a writer holding a token other than the row's, or a
        # token-less writer (the reaper) taking a lease that had not expired.
        if bad := ids(
            "SELECT message_id, old_token, writer_token, new_status FROM rel_transitions "
            "WHERE writer_token IS DISTINCT FROM old_token AND "
            "(writer_token IS NOT NULL OR NOT lease_expired "
            "OR new_status NOT IN ('pending', 'dead', 'expired'))"
        ):
            v.append(f"writes with a stale claim token: {bad}")
        if bad := ids(
            "SELECT m.id, m.attempts, COALESCE(m.max_attempts, :d) FROM outbox_message m "
            "WHERE m.attempts > COALESCE(m.max_attempts, :d) OR m.attempts <> (SELECT count(*) "
            "FROM outbox_attempt a WHERE a.message_id = m.id "
            "AND a.outcome NOT IN ('deferred', 'not_started')) "
            "OR EXISTS (SELECT 1 FROM outbox_attempt a WHERE a.message_id = m.id "
            "AND a.attempt > COALESCE(m.max_attempts, :d))",
            d=default_max,
        ):
            v.append(f"attempts over the maximum or not matching the audit trail: {bad}")
        # Ordering keys: a successor is first sent only after its predecessor settled.
        if bad := ids(
            "WITH k AS (SELECT id, ordering_key, settled_at, lag(id) OVER w AS prev_id, "
            "lag(settled_at) OVER w AS prev_settled FROM outbox_message "
            "WHERE ordering_key IS NOT NULL WINDOW w AS (PARTITION BY ordering_key ORDER BY id)) "
            "SELECT k.id, k.prev_id FROM k WHERE k.prev_id IS NOT NULL AND EXISTS "
            "(SELECT 1 FROM rel_calls c WHERE c.message_id = k.id AND c.at < k.prev_settled)"
        ):
            v.append(f"ordering key overtaken: {bad}")

        # Duplicates: every accepted send that is not the one that settled the
        # row as delivered must be explained by a recorded cause for its token.
        unsettled = conn.execute(
            sa.text(
                "SELECT p.message_id, p.token, m.status FROM rel_accepts p "
                "JOIN outbox_message m ON m.id = p.message_id WHERE NOT EXISTS "
                "(SELECT 1 FROM rel_transitions t WHERE t.old_token = p.token "
                " AND t.new_status = 'delivered')"
            )
        ).all()
        report.accepts = conn.execute(sa.text("SELECT count(*) FROM rel_accepts")).scalar_one()
        explained: Counter[str] = Counter()
        for r in unsettled:
            kinds = [
                k
                for (k,) in conn.execute(
                    sa.text(
                        "SELECT DISTINCT kind FROM rel_events WHERE token = :t "
                        "AND kind = ANY(CAST(:kinds AS text[])) ORDER BY kind"
                    ),
                    {"t": str(r.token), "kinds": list(harness.EXPLAINS_DUPLICATE)},
                ).all()
            ]
            if not kinds:
                v.append(f"unexplained extra send of message {r.message_id} ({r.status})")
            else:
                explained[kinds[0]] += 1
        report.duplicates = conn.execute(
            sa.text(
                "SELECT COALESCE(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM rel_accepts p "
                "JOIN outbox_message m ON m.id = p.message_id WHERE m.status = 'delivered' "
                "GROUP BY p.message_id) AS x"
            )
        ).scalar_one()
        report.duplicates_explained_by = dict(explained)
        report.kills = dict(
            conn.execute(
                sa.text(
                    "SELECT kind, count(DISTINCT pid) FROM rel_events WHERE kind LIKE 'kill:%' "
                    "GROUP BY kind"
                )
            ).all()  # type: ignore[arg-type]
        )
        report.stalls = conn.execute(
            sa.text("SELECT count(DISTINCT batch) FROM rel_events WHERE kind = 'stall'")
        ).scalar_one()
        report.errors = dict(
            conn.execute(
                sa.text(
                    "SELECT substr(kind, 7), count(*) FROM rel_events WHERE kind LIKE 'error:%' "
                    "GROUP BY kind"
                )
            ).all()  # type: ignore[arg-type]
        )
        report.fault_events = dict(
            conn.execute(
                sa.text(
                    "SELECT kind, count(DISTINCT batch) FROM rel_events "
                    "WHERE kind IN ('abandoned', 'lease_lost', :timeout) GROUP BY kind"
                ),
                {"timeout": harness.INVOKE_TIMEOUT},
            ).all()  # type: ignore[arg-type]
        )
        # An Invoke that timed out after Lambda queued its event (harness
        # INVOKE_TIMEOUT): its sender may run it, so the dispatcher's release
        # must take back only claims no sender received. A claim both released
        # and sent under the same token was taken back from its sender: the
        # next claim sends the message again (0 such sends allowed).
        if bad := ids(
            "SELECT DISTINCT r.message_id FROM rel_events r "
            "JOIN rel_accepts p ON p.token = r.token AND p.message_id = r.message_id "
            "WHERE r.kind = :released",
            released=harness.RELEASED,
        ):
            v.append(f"a release took back a claim its sender had sent: {bad}")
        report.crashes = conn.execute(
            sa.text("SELECT count(DISTINCT batch) FROM rel_events WHERE kind = 'crash'")
        ).scalar_one()
        # The bound: duplicates only where a kill (or another recorded
        # loss of a settle) landed between send and settle, at most one each.
        causes = conn.execute(
            sa.text(
                "SELECT count(*) FROM (SELECT DISTINCT token FROM rel_events "
                "WHERE kind = ANY(CAST(:kinds AS text[]))) AS x"
            ),
            {"kinds": list(harness.EXPLAINS_DUPLICATE)},
        ).scalar_one()
        if report.duplicates > causes:
            v.append(f"{report.duplicates} duplicates but only {causes} claims lost a settle")
    engine.dispose()


def one_run(
    server_url: str,
    run: int,
    seed: int,
    *,
    seconds: float,
    messages: int,
    counts: dict[str, int],
    log_dir: Path,
    url: str | None = None,
    mode: str = "chaos",
) -> RunReport:
    from channel_support import drip_receiver

    assert mode in MODES, mode
    rng = random.Random(seed)
    report = RunReport(run=run, seed=seed, mode=mode, messages=messages)
    own = url is None
    url = url or create_database(server_url)
    aux = harness.aux_engine(url)
    stack = contextlib.ExitStack()
    try:
        with aux.connect() as conn:
            conn.execute(sa.text(harness.RESET_SQL))
        engine = relay_engine(url)
        seed_messages(engine, rng, messages, mode)
        poisoned = seed_poison(engine, rng, max(2, messages // 6)) if mode == "poison" else []
        report.poisoned = len(poisoned)
        report.messages += len(poisoned)
        engine.dispose()
        extra_env = {}
        if mode == "drip":
            # It outlasts the whole run: only the client's deadline ends a call.
            receiver = stack.enter_context(drip_receiver("headers", interval=0.2, lasts=600))
            extra_env["REL_DRIP_URL"] = receiver.url()
            os.environ["REL_DRIP_URL"] = receiver.url()  # for the drain, in this process
            stack.callback(os.environ.pop, "REL_DRIP_URL", None)
        log = log_dir / f"run-{run}.log"
        run_processes(url, seconds, rng, report, log, counts, extra_env)
        drain(url, aux)
        check(url, report, driver.settings(LEASE_SECONDS).max_attempts, poisoned)
    finally:
        stack.close()
        aux.dispose()
        if own:
            drop_database(server_url, url)
    return report


def campaign(
    server_url: str,
    iterations: int,
    *,
    seconds: float,
    messages: int,
    counts: dict[str, int] | None = None,
    seed: int | None = None,
    log_dir: Path | None = None,
    stop_when_covered: bool = False,
    out: Any = sys.stdout,
) -> list[RunReport]:
    """Run ``iterations`` runs on one database; print one line per run."""
    counts = counts or {"dispatcher": 2, "sender": 3, "reaper": 1}
    seed = random.randrange(1 << 30) if seed is None else seed
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"outbox-campaign-{seed}"
    log_dir.mkdir(parents=True, exist_ok=True)
    url = create_database(server_url)
    reports = []
    try:
        for run in range(iterations):
            report = one_run(
                server_url,
                run,
                seed + run,
                seconds=seconds,
                messages=messages,
                counts=counts,
                log_dir=log_dir,
                url=url,
            )
            print(f"campaign run {report.line()}", file=out, flush=True)
            for violation in report.violations:
                print(f"  VIOLATION {violation}", file=out, flush=True)
            reports.append(report)
            if stop_when_covered and not missing_points(reports):
                break
    finally:
        drop_database(server_url, url)
    return reports


# Faults besides the kill points that every campaign must have produced.
OTHER_FAULTS = (
    "statement_timeout",
    "connection_dropped",
    "abandoned",
    "lease_lost",
    harness.INVOKE_TIMEOUT,
)


def missing_points(reports: list[RunReport]) -> set[str]:
    """Kill points and fault kinds no run has hit yet."""
    seen = {k.removeprefix("kill:") for r in reports for k in r.kills}
    if any(r.stalls for r in reports):
        seen.add(harness.STALL)
    for r in reports:
        seen.update(kind.split(":", 1)[1] for kind in r.errors if ":" in kind)
        seen.update(r.fault_events)
    return (set(harness.ALL_POINTS) | set(OTHER_FAULTS)) - seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=30.0, help="fault phase per run")
    parser.add_argument("--messages", type=int, default=150)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--server-url",
        default=os.environ.get("DATABASE_URL", "postgresql+pg8000://postgres@127.0.0.1:5432/test"),
    )
    args = parser.parse_args()
    reports = campaign(
        args.server_url,
        args.iterations,
        seconds=args.seconds,
        messages=args.messages,
        seed=args.seed,
    )
    bad = sum(len(r.violations) for r in reports)
    print(
        f"campaign: {len(reports)} runs, {bad} violations, kill points and faults never hit: "
        f"{sorted(missing_points(reports)) or 'none'}"
    )
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()

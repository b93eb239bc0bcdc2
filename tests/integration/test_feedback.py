"""Provider feedback: SES bounce, complaint and delivery events, in the shapes
SNS and EventBridge deliver them (the recorded samples in events/), recorded
against a real Postgres."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import test_least_privilege

import outbox
from outbox import feedback, store
from support import EMAIL, LambdaContext, attempts, row

EVENTS = Path(__file__).resolve().parents[2] / "events"
# The fixture of a relay login user's engine, shared with the least-privilege tests.
relay_user = test_least_privilege.relay_user


def sample(name: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((EVENTS / f"{name}.json").read_text())
    return event


def ses_message(sns_event: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = json.loads(sns_event["Records"][0]["Sns"]["Message"])
    return message


def with_ses_message(sns_event: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    event = copy.deepcopy(sns_event)
    event["Records"][0]["Sns"]["Message"] = json.dumps(message)
    return event


# The recipient of the recorded samples in events/.
RECIPIENT = "recipient@example.com"


def delivered_email(engine: sa.Engine, provider_id: str, to: tuple[str, ...] = (RECIPIENT,)) -> int:
    """An email message to ``to``, sent and settled delivered with this SES
    message id, through the real claim and settle."""
    with engine.begin() as conn:
        mid = outbox.enqueue(
            conn,
            "email",
            {**EMAIL, "to": list(to)},
            dedupe_key=f"k-{provider_id}",
            ordering_key="customer-7",
        )
    with engine.begin() as conn:
        (claim,) = store.claim(conn, 10, 60, ["email"])
        assert claim.id == mid
        settled = store.settle(
            conn,
            [
                store.Settlement(
                    mid, claim.claim_token, "delivered", provider_message_id=provider_id
                )
            ],
            store.Backoff(1, 60, 5),
        )
    assert settled == {mid: "delivered"}
    return mid


def outcome_events(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT * FROM outbox_outcome_event ORDER BY id")).all()


def test_a_permanent_bounce_moves_delivered_to_bounced_exactly_once(engine: sa.Engine) -> None:
    event = sample("feedback-bounce")
    mid = delivered_email(engine, ses_message(event)["mail"]["messageId"])

    first = feedback.handle(engine, event)
    second = feedback.handle(engine, event)  # SNS delivered it again

    assert first.as_dict()["moved"] == {"bounced": 1} and first.recorded["bounced"] == 1
    assert second.repeated == 1 and not second.recorded and not second.moved
    with engine.connect() as conn:
        message, history = row(conn, mid), attempts(conn, mid)
    assert message.status == "bounced"
    assert [a.outcome for a in history] == ["delivered", "bounced"]
    bounce = history[-1]
    # The provider's reason, without the address the diagnostic code echoed.
    assert bounce.error == (
        "bounced: Permanent/General, 5.1.1 smtp; 550 5.1.1 <address>: "
        "Recipient address rejected: User unknown"
    )
    assert message.last_error == bounce.error and "@" not in bounce.error
    assert bounce.attempt == 1 and bounce.provider_message_id == message.provider_message_id
    (published,) = outcome_events(engine)  # one transition, one outcome event
    assert (published.message_id, published.status) == (mid, "bounced")


def test_a_complaint_moves_delivered_to_complained(engine: sa.Engine) -> None:
    event = sample("feedback-complaint")
    mid = delivered_email(engine, ses_message(event)["mail"]["messageId"])
    report = feedback.handle(engine, event)
    assert report.moved == {"complained": 1}
    with engine.connect() as conn:
        assert row(conn, mid).status == "complained"
        assert [(a.outcome, a.error) for a in attempts(conn, mid)][-1] == (
            "complained",
            "complained: abuse",
        )
    assert [e.status for e in outcome_events(engine)] == ["complained"]


def test_a_transient_bounce_and_a_delivery_add_an_attempt_row_only(engine: sa.Engine) -> None:
    bounce_event = sample("feedback-bounce")
    message = ses_message(bounce_event)
    message["bounce"].update(bounceType="Transient", bounceSubType="MailboxFull")
    message["bounce"]["bouncedRecipients"][0].update(
        status="4.2.2", diagnosticCode="smtp; 452 4.2.2 Mailbox full"
    )
    mid = delivered_email(engine, message["mail"]["messageId"])
    delivery = ses_message(sample("feedback-delivery"))
    delivery["mail"]["messageId"] = message["mail"]["messageId"]

    feedback.handle(engine, with_ses_message(bounce_event, message))
    feedback.handle(engine, with_ses_message(bounce_event, delivery))

    with engine.connect() as conn:
        assert row(conn, mid).status == "delivered"
        assert [(a.outcome, a.error) for a in attempts(conn, mid)] == [
            ("delivered", None),
            (
                "transient_bounce",
                "bounced: Transient/MailboxFull, 4.2.2 smtp; 452 4.2.2 Mailbox full",
            ),
            ("delivery_confirmed", "delivered: 250 2.6.0 Message received"),
        ]
    assert outcome_events(engine) == []  # no transition, no outcome event


def test_a_complaint_after_a_bounce_is_recorded_without_moving_the_message(
    engine: sa.Engine,
) -> None:
    bounce_event, complaint_event = sample("feedback-bounce"), sample("feedback-complaint")
    provider_id = ses_message(bounce_event)["mail"]["messageId"]
    mid = delivered_email(engine, provider_id)
    complaint = ses_message(complaint_event)
    complaint["mail"]["messageId"] = provider_id
    feedback.handle(engine, bounce_event)
    report = feedback.handle(engine, with_ses_message(complaint_event, complaint))
    assert report.recorded == {"complained": 1} and not report.moved
    with engine.connect() as conn:
        assert row(conn, mid).status == "bounced"
        assert [a.outcome for a in attempts(conn, mid)] == ["delivered", "bounced", "complained"]
    assert [e.status for e in outcome_events(engine)] == ["bounced"]


def test_the_eventbridge_shape_is_recorded_like_the_sns_one(engine: sa.Engine) -> None:
    event = sample("feedback-eventbridge-bounce")
    mid = delivered_email(engine, event["detail"]["mail"]["messageId"])
    assert feedback.handle(engine, event).moved == {"bounced": 1}
    # The same SES event through SNS is the same feedback: nothing new.
    assert feedback.handle(engine, sample("feedback-bounce")).repeated == 1
    with engine.connect() as conn:
        assert row(conn, mid).status == "bounced"
        assert [a.outcome for a in attempts(conn, mid)] == ["delivered", "bounced"]


@pytest.mark.parametrize(
    "event",
    [
        {},
        None,
        "not an event",
        {"Records": "nope"},
        {"Records": [{"EventSource": "aws:sns", "Sns": {"Message": "{oops"}}]},
        {"Records": [{"EventSource": "aws:sns", "Sns": {"Message": "[1, 2]"}}]},
        {"Records": [{"EventSource": "aws:sns", "Sns": {"Message": '{"eventType": "Bounce"}'}}]},
        {"Records": [None, 7, {"Sns": None}]},
        {"source": "aws.ses", "detail": {"eventType": "Bounce", "mail": {"messageId": 5}}},
    ],
)
def test_events_that_are_not_ses_feedback_are_counted_never_raised(
    engine: sa.Engine, event: Any
) -> None:
    mid = delivered_email(engine, "some-ses-id")
    report = feedback.handle(engine, event)
    assert report.unrecognized >= 1 and not report.recorded and not report.moved
    with engine.connect() as conn:
        assert row(conn, mid).status == "delivered" and len(attempts(conn, mid)) == 1


def test_unmatched_and_unrecorded_event_types_are_counted(engine: sa.Engine) -> None:
    bounce_event = sample("feedback-bounce")
    unknown = ses_message(bounce_event)
    unknown["mail"]["messageId"] = "no-such-message"
    send = {"eventType": "Send", "mail": unknown["mail"], "send": {}}
    event = {
        "Records": [
            with_ses_message(bounce_event, unknown)["Records"][0],
            with_ses_message(bounce_event, send)["Records"][0],
        ]
    }
    report = feedback.handle(engine, event)
    assert (report.received, report.unmatched, report.ignored) == (2, 1, 1)
    assert not report.recorded


def test_a_batch_is_recorded_by_two_statements(engine: sa.Engine) -> None:
    bounce_event = sample("feedback-bounce")
    records, ids = [], []
    for n in range(5):
        message = ses_message(bounce_event)
        message["mail"]["messageId"] = f"ses-{n}"
        message["bounce"]["feedbackId"] = f"fb-{n}"
        ids.append(delivered_email(engine, f"ses-{n}"))
        records.append(with_ses_message(bounce_event, message)["Records"][0])

    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        report = feedback.handle(engine, {"Records": records})
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert report.moved == {"bounced": 5}
    # the messages' locks, then the whole batch's record (invariant 7)
    ours = [s for s in statements if "outbox_" in s]
    assert ours == statements[-2:] and "FOR UPDATE" in ours[0]
    assert sum("outbox_attempt" in s for s in statements) == 1


def test_the_feedback_function_handler(engine: sa.Engine, relay_env: dict[str, str]) -> None:
    from test_email_end_to_end import load_handler

    event = sample("feedback-bounce")
    mid = delivered_email(engine, ses_message(event)["mail"]["messageId"])
    fn = load_handler("feedback")
    result = fn.handler(event, LambdaContext(10, "feedback"))
    assert result["moved"] == {"bounced": 1}
    with engine.connect() as conn:
        assert row(conn, mid).status == "bounced"


def test_the_same_bounce_delivered_concurrently_is_recorded_once(engine: sa.Engine) -> None:
    """SNS may deliver one event to two invocations at once: one attempt row, one
    transition, one outcome event, whichever commits first."""
    import threading

    event = sample("feedback-bounce")
    complaint_event = sample("feedback-complaint")
    provider_id = ses_message(event)["mail"]["messageId"]
    complaint = ses_message(complaint_event)
    complaint["mail"]["messageId"] = provider_id
    mid = delivered_email(engine, provider_id)
    events = [event] * 6 + [with_ses_message(complaint_event, complaint)] * 2
    start = threading.Barrier(len(events))
    reports: list[feedback.FeedbackReport] = []

    def deliver(e: dict[str, Any]) -> None:
        start.wait()
        reports.append(feedback.handle(engine, e))

    threads = [threading.Thread(target=deliver, args=(e,)) for e in events]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sum(sum(r.moved.values()) for r in reports) == 1  # one transition, bounce or complaint
    assert sum(r.repeated for r in reports) == len(events) - 2
    with engine.connect() as conn:
        final, history = row(conn, mid).status, attempts(conn, mid)
    assert sorted(a.outcome for a in history) == ["bounced", "complained", "delivered"]
    assert [e.status for e in outcome_events(engine)] == [final]
    assert final in ("bounced", "complained")


# --- refuse what cannot be matched precisely; per recipient; bounded ---------
# (issue 23, item 8: each of these failed on the feedback of 0.x)


def bounce_for(
    provider_id: str, *recipients: str, feedback_id: str = "fb-1", subtype: str = "General"
) -> dict[str, Any]:
    """The SNS bounce sample, about ``recipients`` of ``provider_id``."""
    event = sample("feedback-bounce")
    message = ses_message(event)
    message["mail"]["messageId"] = provider_id
    message["bounce"]["feedbackId"] = feedback_id
    message["bounce"]["bounceSubType"] = subtype
    message["bounce"]["bouncedRecipients"] = [
        {"emailAddress": r, "action": "failed", "status": "5.1.1",
         "diagnosticCode": f"smtp; 550 5.1.1 <{r}>: user unknown"}
        for r in recipients
    ]  # fmt: skip
    return with_ses_message(event, message)


def test_a_forged_bounce_naming_only_the_message_id_changes_nothing(engine: sa.Engine) -> None:
    mid = delivered_email(engine, "ses-forged")
    no_recipient = bounce_for("ses-forged")
    message = ses_message(no_recipient)
    del message["bounce"]["bouncedRecipients"]
    reports = [
        feedback.handle(engine, with_ses_message(no_recipient, message)),
        feedback.handle(engine, bounce_for("ses-forged", "someone.else@example.org")),
    ]
    assert (reports[0].unrecognized, reports[1].unmatched) == (1, 1)
    assert not any(r.recorded or r.moved for r in reports)
    with engine.connect() as conn:
        assert row(conn, mid).status == "delivered" and len(attempts(conn, mid)) == 1


def test_a_message_bounces_only_when_every_recipient_did(engine: sa.Engine) -> None:
    ada, bob = "ada@example.net", "Bob@Example.NET"
    mid = delivered_email(engine, "ses-two", to=(ada, bob))

    first = feedback.handle(engine, bounce_for("ses-two", ada))
    with engine.connect() as conn:
        after_one = row(conn, mid).status
        fingerprints = conn.execute(
            sa.text("SELECT outbox_fingerprint(:a) AS ada, outbox_fingerprint(:b) AS bob"),
            {"a": ada, "b": bob.lower()},
        ).one()
    second = feedback.handle(engine, bounce_for("ses-two", " bob@example.net", feedback_id="fb-2"))

    assert first.recorded == {"bounced": 1} and not first.moved and after_one == "delivered"
    assert second.moved == {"bounced": 1}
    with engine.connect() as conn:
        message, history = row(conn, mid), attempts(conn, mid)
    assert message.status == "bounced"
    # one attempt row per recipient, each naming only its recipient
    assert [(a.outcome, a.recipient_fingerprints) for a in history[1:]] == [
        ("bounced", [fingerprints.ada]),
        ("bounced", [fingerprints.bob]),
    ]
    assert [e.status for e in outcome_events(engine)] == ["bounced"]


def test_a_bounce_reason_keeps_no_local_part_or_name_of_its_recipient(engine: sa.Engine) -> None:
    # issue 31, item 8: the diagnostic codes remote servers write, in the forms
    # that kept the local part or the display name before
    ada = "Ada.Lovelace@example.com"
    codes = [
        "smtp; 550 5.1.1 ada.lovelace... User unknown",
        "smtp; 550 5.1.1 <ada.lovelace>: Recipient address rejected",
        'smtp; 550 5.1.1 "Ada Lovelace" <ada.lovelace@example.com>: mailbox unavailable',
        "smtp; 550 5.1.1 user ada.lovelace does not exist (Lovelace, Ada)",
    ]
    for n, code in enumerate(codes):
        mid = delivered_email(engine, f"ses-ada-{n}", to=(ada,))
        event = bounce_for(f"ses-ada-{n}", ada)
        message = ses_message(event)
        message["bounce"]["bouncedRecipients"][0]["diagnosticCode"] = code
        assert feedback.handle(engine, with_ses_message(event, message)).moved == {"bounced": 1}
        with engine.connect() as conn:
            stored = [row(conn, mid).last_error, attempts(conn, mid)[-1].error]
        for error in stored:
            assert error.startswith("bounced: Permanent/General, 5.1.1 smtp; 550 5.1.1 ")
            assert "ada" not in error.lower() and "lovelace" not in error.lower(), error
    published = [e.last_error for e in outcome_events(engine)]
    assert len(published) == len(codes)
    assert not any("lovelace" in (e or "").lower() for e in published)


def test_a_complaint_from_one_recipient_of_two_is_recorded_without_moving(
    engine: sa.Engine,
) -> None:
    mid = delivered_email(engine, "ses-c2", to=("ada@example.net", "bob@example.net"))
    complaint = ses_message(sample("feedback-complaint"))
    complaint["mail"]["messageId"] = "ses-c2"
    complaint["complaint"]["complainedRecipients"] = [{"emailAddress": "ada@example.net"}]
    report = feedback.handle(engine, with_ses_message(sample("feedback-complaint"), complaint))
    assert report.recorded == {"complained": 1} and not report.moved
    # the other recipient's bounce completes it: one complained, so complained
    assert feedback.handle(engine, bounce_for("ses-c2", "bob@example.net")).moved == {
        "complained": 1
    }
    with engine.connect() as conn:
        assert row(conn, mid).status == "complained"


def test_the_same_bounce_replayed_with_fresh_feedback_ids_is_recorded_once(
    engine: sa.Engine,
) -> None:
    mid = delivered_email(engine, "ses-replay")
    replays = [
        bounce_for("ses-replay", RECIPIENT, feedback_id=f"fresh-{n}")["Records"][0]
        for n in range(200)
    ]
    batch = feedback.handle(engine, {"Records": replays})
    again = feedback.handle(engine, bounce_for("ses-replay", RECIPIENT, feedback_id="fresh-x"))
    assert batch.recorded == {"bounced": 1} and batch.repeated == 199
    assert again.repeated == 1 and not again.recorded
    # another kind of notice from the same recipient is news, and recorded
    other = feedback.handle(engine, bounce_for("ses-replay", RECIPIENT, subtype="Suppressed"))
    assert other.recorded == {"bounced": 1}
    with engine.connect() as conn:
        assert [a.outcome for a in attempts(conn, mid)] == ["delivered", "bounced", "bounced"]


def test_an_oversized_or_too_deep_record_fails_alone(engine: sa.Engine) -> None:
    mid = delivered_email(engine, "ses-good")
    good = bounce_for("ses-good", RECIPIENT)["Records"][0]
    huge_id = bounce_for("ses-good", RECIPIENT, feedback_id="f" * 1_000_000)["Records"][0]
    deep = copy.deepcopy(good)
    deep["Sns"]["Message"] = "[" * 100_000 + "]" * 100_000
    deep_but_small = copy.deepcopy(good)
    message = ses_message(bounce_for("ses-good", RECIPIENT))
    nested: Any = "x"
    for _ in range(200):
        nested = {"n": nested}
    message["mail"]["tags"] = nested
    deep_but_small["Sns"]["Message"] = json.dumps(message)
    long_address = bounce_for("ses-good", "a" * 10_000 + "@example.com")["Records"][0]

    report = feedback.handle(
        engine, {"Records": [huge_id, deep, deep_but_small, long_address, good]}
    )

    assert (report.received, report.unrecognized) == (5, 4)
    assert report.recorded == {"bounced": 1} and report.moved == {"bounced": 1}
    with engine.connect() as conn:
        assert row(conn, mid).status == "bounced"


def test_two_recipients_bouncing_in_concurrent_invocations_move_the_message(
    engine: sa.Engine,
) -> None:
    import threading

    ada, bob = "ada@example.net", "bob@example.net"
    mid = delivered_email(engine, "ses-race", to=(ada, bob))
    start = threading.Barrier(2)
    reports: list[feedback.FeedbackReport] = []

    def deliver(address: str) -> None:
        start.wait()
        reports.append(feedback.handle(engine, bounce_for("ses-race", address)))

    threads = [threading.Thread(target=deliver, args=(a,)) for a in (ada, bob)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.recorded["bounced"] for r in reports) == 2
    assert sum(r.moved["bounced"] for r in reports) == 1
    with engine.connect() as conn:
        assert row(conn, mid).status == "bounced"


def test_the_feedback_statements_run_as_the_relay_user(
    engine: sa.Engine, relay_user: sa.Engine
) -> None:
    """The feedback function logs in as a relay user: its lock, the recipient's
    fingerprint and the record need no more than the relay role's grants."""
    mid = delivered_email(engine, "ses-least")
    report = feedback.handle(relay_user, bounce_for("ses-least", RECIPIENT))
    assert report.moved == {"bounced": 1}
    with engine.connect() as conn:
        assert row(conn, mid).status == "bounced"

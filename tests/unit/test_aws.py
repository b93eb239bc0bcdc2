"""The relay's AWS clients make one attempt per call, with their own timeouts."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from outbox import aws


@pytest.fixture(autouse=True)
def region(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def test_a_provider_client_makes_one_attempt_within_the_provider_read_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PROVIDER_READ_TIMEOUT_SECONDS", "7")
    config = aws.client("sqs").meta.config
    assert config.retries["total_max_attempts"] == 1
    assert (config.connect_timeout, config.read_timeout) == (3.0, 7.0)
    assert config.max_pool_connections == 32


def test_the_hand_off_client_makes_one_attempt_so_no_event_is_queued_twice() -> None:
    config = aws.lambda_client().meta.config
    assert config.retries["total_max_attempts"] == 1
    assert (config.connect_timeout, config.read_timeout) == (3.0, 10)
    assert config.max_pool_connections == 16


def test_the_nudge_client_is_in_the_region_of_the_function_it_names() -> None:
    client = aws.nudge_client("eu-west-1")
    assert client.meta.region_name == "eu-west-1"
    assert client.meta.config.retries["total_max_attempts"] == 1
    assert (client.meta.config.connect_timeout, client.meta.config.read_timeout) == (2, 5)


def test_a_client_made_on_first_use_is_made_once() -> None:
    events = aws.client_on_first_use("events")
    assert events() is events()


def error(code: str, status: int) -> ClientError:
    answer = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(answer, "Invoke")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("code", "status", "throttled"),
    [
        ("TooManyRequestsException", 429, True),
        ("SomethingNew", 429, True),
        ("TooManyRequestsException", 400, True),
        ("ThrottlingException", 400, False),  # not what Lambda's invoke answers
        ("ServiceException", 500, False),
    ],
)
def test_an_invoke_is_throttled_by_lambdas_code_or_a_429(
    code: str, status: int, throttled: bool
) -> None:
    assert aws.is_invoke_throttled(error(code, status)) is throttled


def test_errors_are_described_by_code_and_class_only() -> None:
    exc = error("AccessDenied", 403)
    assert aws.describe(exc) == "ClientError: AccessDenied"
    assert aws.describe(ValueError("secret text")) == "ValueError"
    assert aws.http_status(ValueError()) is None

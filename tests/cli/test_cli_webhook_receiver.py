"""The demo's local webhook receiver accepts only correctly signed requests
(Standard Webhooks), so the webhook channel's signatures are really checked."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from base64 import b64encode
from datetime import UTC, datetime

from standardwebhooks import Webhook

from outbox_cli.local import WebhookReceiver

SECRET = "whsec_" + b64encode(b"0123456789abcdef0123456789abcdef").decode()


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 - loopback
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_signed_requests_pass_and_anything_else_is_refused() -> None:
    receiver = WebhookReceiver(SECRET)
    try:
        body = json.dumps({"event": "order.shipped"}).encode()
        now = datetime.now(tz=UTC)
        signature = Webhook(SECRET).sign("msg_1", now, body.decode())
        headers = {
            "webhook-id": "msg_1",
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": signature,
            "content-type": "application/json",
        }
        assert post(receiver.url, body, headers) == 204
        assert post(receiver.url, body + b" ", headers) == 401  # body changed
        forged = Webhook("whsec_" + b64encode(b"x" * 32).decode()).sign("msg_1", now, body.decode())
        assert post(receiver.url, body, {**headers, "webhook-signature": forged}) == 401
        assert post(receiver.url, body, {"content-type": "application/json"}) == 401
        assert receiver.received == [{"event": "order.shipped"}] and receiver.rejected == 3
    finally:
        receiver.close()

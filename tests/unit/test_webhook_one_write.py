"""The webhook channel writes a request's header block and body in one send
(one TCP segment or TLS record, one wake-up of the receiver). The socket is a
recorder: what is counted is the writes the connection makes."""

from __future__ import annotations

from typing import Any

import pytest

from outbox.channels import webhook


class RecordingSocket:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def sendall(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def settimeout(self, seconds: float | None) -> None:
        pass


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
@pytest.mark.parametrize("body", [b'{"type":"t","data":{}}', b""], ids=["body", "empty"])
def test_a_request_goes_out_in_one_write(tls: bool, body: bytes) -> None:
    plain, secure = webhook._connection_classes()
    conn = (secure if tls else plain)("127.0.0.1", 9)
    sock = conn.sock = RecordingSocket()
    conn.request("POST", "/in", body=body, headers={"Host": "hooks.test", "webhook-id": "msg_1"})
    [write] = sock.writes
    assert write.startswith(b"POST /in HTTP/1.1\r\n")
    assert b"\r\nwebhook-id: msg_1\r\n" in write
    assert write.endswith(b"\r\n\r\n" + body)
    assert conn._head is None  # the next send is not held

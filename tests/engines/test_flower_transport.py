"""Which Flower error replies count as "the silo released nothing" and which as no answer: only
errors raised by the silo's own app before it replied. (Every chosen silo is charged its
planned events before the round is sent, whichever it is: tests/engines/test_remote.py.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from flwr.common.constant import ErrorCode

from silodp.engines.flower.transport import RECORD, GridTransport
from silodp.engines.remote import NoReply


class _Reply:
    def __init__(self, node: int, *, code: int | None = None, body: bytes = b"") -> None:
        self.metadata = SimpleNamespace(src_node_id=node)
        self.error = SimpleNamespace(code=code, reason=f"code {code}")
        self.content = {RECORD: {"body": body}}

    def has_error(self) -> bool:
        return self.error.code is not None


class _Grid:
    def __init__(self, replies: list[_Reply]) -> None:
        self.replies = replies
        self.sent: list[Any] = []

    def send_and_receive(self, messages: list[Any], timeout: float) -> list[_Reply]:
        self.sent = messages
        return self.replies


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (ErrorCode.LOAD_CLIENT_APP_EXCEPTION, "nothing"),
        (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "nothing"),
        (ErrorCode.UNKNOWN, "no answer"),
        (ErrorCode.MESSAGE_UNAVAILABLE, "no answer"),
        (ErrorCode.REPLY_MESSAGE_UNAVAILABLE, "no answer"),
        (ErrorCode.NODE_UNAVAILABLE, "no answer"),
        (ErrorCode.CLIENT_APP_CRASHED, "no answer"),
    ],
)
def test_only_an_app_that_raised_released_nothing(
    code: int, outcome: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a Flower Message needs a running ServerApp's context; the grid here is a stand-in
    monkeypatch.setattr(
        "silodp.engines.flower.transport.Message",
        lambda content, dst_node_id, **kw: SimpleNamespace(dst_node_id=dst_node_id, **kw),
    )
    grid = _Grid([_Reply(1, body=b"message"), _Reply(2, code=code)])
    out = GridTransport(grid).exchange({1: ("round", b"x"), 2: ("round", b"y")}, timeout=5.0)  # type: ignore[arg-type]
    assert out[1] == b"message"
    if outcome == "nothing":
        assert isinstance(out[2], str) and "failed" in out[2]
    else:  # a NoReply: the engine charges the silo's planned events, and says why
        assert isinstance(out[2], NoReply) and f"Flower error {int(code)}: code" in out[2]
    assert [m.dst_node_id for m in grid.sent] == [1, 2]

"""Which Flower error replies count as "the silo released nothing" and which as no answer: only
errors raised by the silo's own app before it replied. (Every chosen silo is charged its
planned events before the round is sent, whichever it is: tests/engines/test_remote.py.)"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from flwr.common.constant import ErrorCode

from silodp.engines.flower.transport import RECORD, GridTransport
from silodp.engines.remote import NoReply


class _Reply:
    def __init__(self, node: int, *, code: int | None = None, body: bytes = b"") -> None:
        self.metadata = SimpleNamespace(src_node_id=node, reply_to_message_id=f"to-{node}")
        self.error = SimpleNamespace(code=code, reason=f"code {code}")
        self.content = {RECORD: {"body": body}}

    def has_error(self) -> bool:
        return self.error.code is not None


class _Grid:
    """Holds ``replies``; the ``i``-th pull returns those listed for it in ``arrivals``
    (default: all at the first pull)."""

    def __init__(self, replies: list[_Reply], arrivals: list[list[int]] | None = None) -> None:
        self.replies = {r.metadata.src_node_id: r for r in replies}
        self.arrivals = arrivals if arrivals is not None else [list(self.replies)]
        self.sent: list[Any] = []
        self.pulls: list[tuple[float, set[str]]] = []

    def push_messages(self, messages: list[Any]) -> list[str]:
        self.sent = messages
        return [f"to-{m.dst_node_id}" for m in messages]

    def pull_messages(self, ids: set[str]) -> list[_Reply]:
        self.pulls.append((time.monotonic(), set(ids)))
        due = self.arrivals[len(self.pulls) - 1] if len(self.pulls) <= len(self.arrivals) else []
        return [self.replies[n] for n in due if f"to-{n}" in ids]


@pytest.fixture
def _plain_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    # a Flower Message needs a running ServerApp's context; the grid here is a stand-in
    monkeypatch.setattr(
        "silodp.engines.flower.transport.Message",
        lambda content, dst_node_id, **kw: SimpleNamespace(dst_node_id=dst_node_id, **kw),
    )


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
@pytest.mark.usefixtures("_plain_messages")
def test_only_an_app_that_raised_released_nothing(code: int, outcome: str) -> None:
    grid = _Grid([_Reply(1, body=b"message"), _Reply(2, code=code)])
    out = GridTransport(grid).exchange({1: ("round", b"x"), 2: ("round", b"y")}, timeout=5.0)  # type: ignore[arg-type]
    assert out[1] == b"message"
    if outcome == "nothing":
        assert isinstance(out[2], str) and "failed" in out[2]
    else:  # a NoReply: the engine charges the silo's planned events, and says why
        assert isinstance(out[2], NoReply) and f"Flower error {int(code)}: code" in out[2]
    assert [m.dst_node_id for m in grid.sent] == [1, 2]


@pytest.mark.usefixtures("_plain_messages")
def test_replies_are_pulled_every_pull_interval_until_all_are_in() -> None:
    grid = _Grid([_Reply(1, body=b"a"), _Reply(2, body=b"b")], arrivals=[[], [1], [], [2]])
    started = time.monotonic()
    out = GridTransport(grid, pull=0.05).exchange({1: ("t", b""), 2: ("t", b"")}, timeout=30)
    assert out == {1: b"a", 2: b"b"}
    # only the unanswered messages are asked for again, and the last reply ends the wait
    assert [ids for _, ids in grid.pulls] == [{"to-1", "to-2"}] * 2 + [{"to-2"}] * 2
    gaps = [b - a for (a, _), (b, _) in zip(grid.pulls, grid.pulls[1:], strict=False)]
    assert all(0.04 <= g < 1.0 for g in gaps), gaps  # not Flower's grid's 3 s
    assert time.monotonic() - started < 2


@pytest.mark.usefixtures("_plain_messages")
def test_a_node_silent_until_the_timeout_is_left_out() -> None:
    grid = _Grid([_Reply(1, body=b"a"), _Reply(2, body=b"b")], arrivals=[[1]])
    started = time.monotonic()
    out = GridTransport(grid, pull=0.05).exchange({1: ("t", b""), 2: ("t", b"")}, timeout=0.5)
    waited = time.monotonic() - started
    assert out == {1: b"a"}
    assert 0.5 <= waited < 1.5
    assert all(ids == {"to-2"} for _, ids in grid.pulls[1:])

"""The job consumer step across a broker reconnect: a message of a closed channel is never acked (kombu
raises on it), and closing the old channels after a connection loss raises nothing, though Celery has already
dropped the connection its own close would need."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery.bootsteps import RUN

from worker.consumer import job_consumer_step


class Channel:
    def __init__(self, dead: bool = False) -> None:
        self.dead = dead
        self.closed = False

    def close(self) -> None:
        if self.dead:
            raise AttributeError("'NoneType' object has no attribute 'hostname'")  # what kombu raises
        self.closed = True


class Message:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.acked = False

    def ack(self) -> None:
        if self.channel.dead:
            raise AttributeError("'NoneType' object has no attribute 'hostname'")
        self.acked = True


class Runner:
    def __init__(self) -> None:
        self.limits = {"interactive": 2}

    def has_room(self, queue: str) -> bool:
        return True


class DeadConsumer:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def cancel(self) -> None:
        raise ConnectionError("the broker went away")


def _step() -> Any:
    step_class = job_consumer_step(Runner(), grace_s=0.0, publish=lambda job_id, queue: None)  # type: ignore[arg-type]
    return step_class(SimpleNamespace(steps=[]))


def test_acks_of_a_closed_channel_are_skipped_and_the_open_channel_is_acked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    step = _step()
    old, new = Channel(dead=True), Channel()
    step._channels = {new}
    stale, fresh = Message(old), Message(new)

    step._ack_later(stale)
    step._ack_later(fresh)
    step._flush_acks()  # on the consumer's loop, which the hub would wake

    assert fresh.acked and not stale.acked
    assert "ack failed" not in caplog.text  # skipped, not attempted and failed


def test_a_reconnect_closes_the_old_channels_without_raising() -> None:
    step = _step()
    old = Channel(dead=True)
    step.consumers = [DeadConsumer(old)]
    step._channels = {old}
    after_connection_loss = SimpleNamespace(connection=None, blueprint=SimpleNamespace(state=RUN))

    step.stop(after_connection_loss)  # Celery's restart after a connection error

    assert step._channels == set()
    late = Message(old)
    step._ack_later(late)  # a job of the old channel ends later: nothing is attempted
    step._flush_acks()
    assert not late.acked

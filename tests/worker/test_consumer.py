"""The job consumer step: held messages start together (one claim) when their queue has room; across a
broker reconnect, a message of a closed channel is never acked (kombu raises on it), and closing the old
channels after a connection loss raises nothing, though Celery has already dropped the connection its own
close would need."""

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
    def __init__(self, channel: Channel, job_id: str = "job_x") -> None:
        self.channel = channel
        self.acked = False
        self.payload = {"job_id": job_id}
        self.delivery_info = {"routing_key": "interactive"}

    def ack(self) -> None:
        if self.channel.dead:
            raise AttributeError("'NoneType' object has no attribute 'hostname'")
        self.acked = True


class Runner:
    def __init__(self) -> None:
        self.limits = {"interactive": 2}
        self.free = 0  # jobs that may start now
        self.groups: list[list[str]] = []

    def room(self, queue: str) -> int:
        return self.free

    def run_many(self, requests: list[tuple[str, Any]]) -> list[bool]:
        self.groups.append([job_id for job_id, _ in requests])
        self.free -= len(requests)
        return [job_id != "job_gone" for job_id, _ in requests]


class DeadConsumer:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def cancel(self) -> None:
        raise ConnectionError("the broker went away")


def _step(runner: Runner | None = None) -> Any:
    step_class = job_consumer_step(runner or Runner(), grace_s=0.0,  # type: ignore[arg-type]
                                   publish=lambda job_id, queue: None)
    return step_class(SimpleNamespace(steps=[]))


def test_held_messages_start_together_when_room_opens_and_an_unclaimable_one_is_acked() -> None:
    runner = Runner()
    step = _step(runner)
    channel = Channel()
    step._channels = {channel}
    messages = [Message(channel, job_id) for job_id in ("job_a", "job_gone", "job_b")]
    for message in messages:
        step._on_message(message.payload, message)  # the queue is full: all three wait
    assert runner.groups == []

    runner.free = 2
    step._flush_acks()  # a job ended: its ack makes room, and the held ones start

    assert runner.groups == [["job_a", "job_gone"]]  # as many as fit, in one claim
    assert messages[1].acked and not messages[0].acked  # not ours to run: acked at once
    runner.free = 5
    step._flush_acks()
    assert runner.groups[-1] == ["job_b"]


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

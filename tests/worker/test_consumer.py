"""The job consumer step: held messages start together (one fair claim of as many jobs) when their queue has
room, and those the claim found nothing for are acked; a job that ends is followed by a pull, and the
messages of the jobs a pull started are acked without a claim; across a
broker reconnect, a message of a closed channel is never acked (kombu raises on it), and closing the old
channels after a connection loss raises nothing, though Celery has already dropped the connection its own
close would need."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery.bootsteps import RUN

from conveyor.worker.consumer import JobConsumerStep, JobFeed, worker_options


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
        self.claimable = ["job_x"]  # the queued jobs a claim finds, in fair order
        self.claims: list[int] = []  # jobs asked for, per claim
        self.on_dones: list[Any] = []

    def room(self, queue: str) -> int:
        return self.free

    def run_next(self, queue: str, on_dones: list[Any]) -> list[str]:
        self.claims.append(len(on_dones))
        started, self.claimable = self.claimable[:len(on_dones)], self.claimable[len(on_dones):]
        self.free -= len(started)
        self.on_dones += on_dones[:len(started)]
        return started


class DeadConsumer:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def cancel(self) -> None:
        raise ConnectionError("the broker went away")


def _step(runner: Runner | None = None) -> Any:
    feed = JobFeed(runner or Runner(), grace_s=0.0, publish=lambda job_id, queue: None)  # type: ignore[arg-type]
    return JobConsumerStep(SimpleNamespace(steps=[]), **worker_options(feed))


def test_held_messages_start_together_when_room_opens_and_those_without_a_job_are_acked() -> None:
    runner = Runner()
    step = _step(runner)
    channel = Channel()
    step._channels = {channel}
    messages = [Message(channel, job_id) for job_id in ("job_a", "job_b", "job_c")]
    for message in messages:
        step._on_message(message.payload, message)  # the queue is full: all three wait
    assert runner.claims == []

    runner.free = 2
    step._flush_acks()  # a job ended: its ack makes room, and the held ones start

    assert runner.claims == [2]  # as many as fit, in one claim
    assert messages[1].acked and not messages[0].acked  # the claim found one job: the other is acked
    runner.on_dones[0]()  # that job ends: its message is acked, and the last held one claims
    runner.claimable = ["job_y"]
    step._flush_acks()
    assert messages[0].acked and runner.claims[-1] == 1 and not messages[2].acked


def test_a_job_that_ends_with_no_message_held_is_followed_by_a_pull() -> None:
    runner = Runner()
    step = _step(runner)
    channel = Channel()
    step._channels = {channel}
    message = Message(channel)
    runner.free = 1
    step._on_message(message.payload, message)
    assert runner.claims == [1] and not message.acked

    runner.claimable, runner.free = ["job_y"], 1  # a tenant that was at its max_running may now start one
    runner.on_dones[0]()
    step._flush_acks()

    assert message.acked and runner.claims == [1, 1]  # the pull, with no message
    runner.free = 1
    runner.on_dones[1]()  # the pulled job ends: another pull (finding nothing now)
    step._flush_acks()
    assert runner.claims == [1, 1, 1]


def test_the_message_of_a_job_a_pull_started_is_acked_without_a_claim() -> None:
    runner = Runner()
    step = _step(runner)
    channel = Channel()
    step._channels = {channel}
    first = Message(channel, "job_x")
    runner.free = 1
    step._on_message(first.payload, first)  # claims job_x
    runner.claimable, runner.free = ["job_y", "job_z"], 2
    runner.on_dones[0]()
    step._flush_acks()  # job_x ended: the pull starts job_y and job_z, whose messages are still queued
    assert runner.claims == [1, 2]

    spare = Message(channel, "job_y")
    step._on_message(spare.payload, spare)
    assert spare.acked and runner.claims == [1, 2]  # no claim: job_y started without its message

    again = Message(channel, "job_y")  # a second message of the same job (a republish) claims as usual
    runner.free = 1
    step._on_message(again.payload, again)
    assert runner.claims == [1, 2, 1] and again.acked  # nothing left to claim for it


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

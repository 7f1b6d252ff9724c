"""A Celery consumer bootstep that feeds job messages to the JobRunner, each queue held to its own limit.

A Celery worker shares one prefetch window across all its queues, so a flood of documents could fill it and
keep interactive jobs out. On kombu's Redis transport QoS is per channel: this step opens one channel per job
queue with prefetch_count = that queue's max_running, and acknowledges a message only when its job has ended
(late ack), so each queue holds at most max_running unacknowledged jobs in this worker.

After a broker reconnect the new channels start with empty windows while jobs taken on the old ones still
run; messages beyond a queue's limit are then held here, unstarted, until those jobs end. A message of a
closed channel cannot be acknowledged (the broker already gave it back, or lost it with a restart): its job's
outcome is in the store, so a redelivery is dropped at claim, and the ack is skipped rather than attempted.

kombu channels are not thread-safe: jobs end on the runner's finisher thread, which only queues the message;
the ack itself runs on the consumer's event loop (hub.call_soon wakes it), or on the stopping thread.

Fair share (core/store/fair_share.py): a message only says that a job of its queue may be ready. The runner
claims the next jobs of the queue in fair order, whichever they are; a message that finds nothing it may
claim (every queued job is another's, already running, or of a tenant at its max_running) is acked at once.
So that a tenant held at its cap is not left without messages, each job that ends here is followed by a
pull: a claim with no message, when the queue has room and no held message would take it. A job started by
a pull leaves its own message in the broker with nothing to do: every queued job still has a message of its
own that no claim has used (a claim uses one message per job it starts, a pull none), so this worker
remembers the jobs it pulled, and a message naming one of them is acked at once, without a claim (a
message it does not recognise, its job pulled by another worker or forgotten, claims as usual).

Celery instantiates its steps itself, with the worker's options as keyword arguments: the worker is built
with `app.Worker(..., **worker_options(JobFeed(runner, ...)))` and JobConsumerStep reads its feed there.
"""

from __future__ import annotations

import logging
import queue as stdlib_queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import bootsteps
from celery.bootsteps import CLOSE
from kombu import Consumer
from kombu.message import Message

from conveyor.core.seams.broker import job_queue
from conveyor.core.seams.dispatch import Publish
from conveyor.worker.job_runner import JobRunner, RunnerStoppedError

log = logging.getLogger(__name__)

STORE_ERROR_BACKOFF_S = 1.0
PULL_MAX = 64  # jobs one pull claims at most
PULLED_MEMORY = 4096  # jobs started by pulls whose messages this worker waits for (the oldest are forgotten)
OPTION = "conveyor_jobs"  # the worker option (app.Worker(**{OPTION: JobFeed(...)})) Celery hands the step


@dataclass(frozen=True)
class JobFeed:
    """What the step feeds and how it stops: one channel per queue of `runner.limits`; at worker shutdown,
    the runner gets grace_s and requeued jobs go out through `publish`."""

    runner: JobRunner
    grace_s: float
    publish: Publish


def worker_options(feed: JobFeed) -> dict[str, JobFeed]:
    """The keyword arguments for app.Worker that hand `feed` to JobConsumerStep (Celery instantiates the
    step itself, with the worker's options as keyword arguments)."""
    return {OPTION: feed}


class JobConsumerStep(bootsteps.ConsumerStep):
    name = "conveyor.jobs"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        feed = kwargs.get(OPTION)
        if not isinstance(feed, JobFeed):
            raise ValueError(f"{OPTION}: build the worker with app.Worker(**worker_options(JobFeed(...))), "
                             f"got {feed!r}")
        self._runner = feed.runner
        self._grace_s = feed.grace_s
        self._publish = feed.publish
        self._limits = dict(feed.runner.limits)
        # Messages to ack, and queue names (a job started by a pull ended: pull again).
        self._acks: stdlib_queue.SimpleQueue[Message | str] = stdlib_queue.SimpleQueue()
        self._held: dict[str, deque[Message]] = {name: deque() for name in self._limits}
        self._hub: Any = None
        self._channels: set[Any] = set()  # the open channels: only their messages can be acked
        self._pulled: dict[str, None] = {}  # jobs started by pulls, oldest first: their messages are spare

    # --- Celery's calls ----------------------------------------------------------------------------------

    def start(self, c: Any) -> None:
        self._hub = c.hub
        for held in self._held.values():  # messages of a previous channel went back with it
            held.clear()
        self.consumers = [
            Consumer(c.connection.channel(), queues=[job_queue(name)], callbacks=[self._on_message],
                     accept=["json"], prefetch_count=limit)
            for name, limit in self._limits.items()
        ]
        self._channels = {consumer.channel for consumer in self.consumers}
        for consumer in self.consumers:
            consumer.consume()
        log.info("consuming job queues %s", self._limits)

    def stop(self, c: Any) -> None:
        if c.blueprint.state == CLOSE:  # worker shutdown, not a reconnect
            self._cancel_consumers()
            self._runner.shutdown(self._grace_s, self._publish, tick=self._flush_acks)
        self._flush_acks()
        self._close_channels(cancel=True)

    def shutdown(self, c: Any) -> None:
        self._close_channels(cancel=False)

    def _cancel_consumers(self) -> None:
        for consumer in self.consumers or []:
            try:
                consumer.cancel()
            except Exception:
                log.debug("cancel of consumer failed", exc_info=True)

    def _close_channels(self, cancel: bool) -> None:
        """Celery's own close passes its connection to kombu's error filter, and after a connection loss
        that connection is None (AttributeError 'connection_errors'); a dead channel raises anything."""
        for consumer in self.consumers or []:
            for action in ([consumer.cancel] if cancel else []) + [consumer.channel.close]:
                try:
                    action()
                except Exception as exc:
                    log.debug("closing a job channel: %s: %s", type(exc).__name__, exc)
        self._channels = set()

    # --- messages in -------------------------------------------------------------------------------------

    def _on_message(self, _body: Any, message: Message) -> None:
        queue = _queue_of(message)
        if queue not in self._held:
            log.error("dropping a message from unexpected queue %r", queue)
            message.ack()
            return
        if self._spare(message):
            self._ack(message)
            return
        self._held[queue].append(message)
        self._start_held(queue)

    def _spare(self, message: Message) -> bool:
        """Whether the message names a job a pull started here (it is then forgotten: a second message of
        the same job claims as usual)."""
        body = message.payload
        job_id = body.get("job_id") if isinstance(body, dict) else None
        if not isinstance(job_id, str) or job_id not in self._pulled:
            return False
        del self._pulled[job_id]
        return True

    def _start_held(self, queue: str) -> None:
        """Starts held messages while the queue is under its limit, claimed together: at once, normally
        (the channel's QoS already holds it there); after a reconnect, jobs taken on the old channel
        still count."""
        held = self._held[queue]
        room = self._runner.room(queue)
        if held and room:
            self._start([held.popleft() for _ in range(min(room, len(held)))])

    def _start(self, messages: list[Message]) -> None:
        """Claims as many jobs of the messages' queue as there are messages, in fair order; the messages
        beyond what started are acked at once (nothing was left to claim for them)."""
        tokens = _well_formed(messages)
        if not tokens:
            return
        try:
            started = len(self._runner.run_next(_queue_of(tokens[0]), [self._acker(m) for m in tokens]))
        except RunnerStoppedError:
            _requeue(tokens)
            return
        except Exception:
            log.exception("could not start %d job(s); messages returned to the queue", len(tokens))
            time.sleep(STORE_ERROR_BACKOFF_S)  # the store is likely down: do not spin on redelivery
            _requeue(tokens)
            return
        for message in tokens[started:]:
            message.ack()

    def _pull(self, queue: str) -> None:
        """After a job of `queue` ended here: claim what may now start (a tenant that was at its
        max_running may start another), without a message."""
        room = self._runner.room(queue)
        if room <= 0 or self._held[queue]:
            return
        try:
            started = self._runner.run_next(queue, [self._puller(queue) for _ in range(min(room, PULL_MAX))])
        except RunnerStoppedError:
            return
        except Exception as exc:  # the store is likely down; the next message or ended job tries again
            log.warning("pull of %s failed (%s: %s)", queue, type(exc).__name__, exc)
            return
        self._remember_pulled(started)

    def _remember_pulled(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self._pulled[job_id] = None
        while len(self._pulled) > PULLED_MEMORY:
            del self._pulled[next(iter(self._pulled))]

    # --- jobs ended: acks, on the consumer's event loop --------------------------------------------------

    def _puller(self, queue: str) -> Callable[[], None]:
        return lambda: self._ack_later(queue)

    def _acker(self, message: Message) -> Callable[[], None]:
        return lambda: self._ack_later(message)

    def _ack_later(self, message: Message | str) -> None:
        """On the runner's writer thread: queues the ack and wakes the event loop to do it."""
        self._acks.put(message)
        if self._hub is not None:
            self._hub.call_soon(self._flush_acks)

    def _flush_acks(self) -> None:
        ended = self._ack_queued()
        for queue in self._held:
            self._start_held(queue)
            if queue in ended:
                self._pull(queue)

    def _ack_queued(self) -> set[str]:
        """Acks every queued message; returns the queues a job ended in since the last flush."""
        ended: set[str] = set()
        while True:
            try:
                message = self._acks.get_nowait()
            except stdlib_queue.Empty:
                return ended
            if isinstance(message, str):
                ended.add(message)
            else:
                ended.add(_queue_of(message))
                self._ack(message)

    def _ack(self, message: Message) -> None:
        if message.channel not in self._channels:
            log.info("job message of a closed broker channel not acked (its outcome is stored)")
            return
        try:
            message.ack()
        except Exception as exc:  # the connection dropped since: the outcome is stored anyway
            log.warning("ack failed (%s: %s)", type(exc).__name__, exc)


def _queue_of(message: Message) -> str:
    return str(message.delivery_info.get("routing_key", ""))


def _well_formed(messages: list[Message]) -> list[Message]:
    """The messages that name a job; the others are acked (dropped)."""
    kept = []
    for message in messages:
        body = message.payload
        if isinstance(body, dict) and isinstance(body.get("job_id"), str):
            kept.append(message)
        else:
            log.error("dropping malformed job message %r", body)
            message.ack()
    return kept


def _requeue(messages: list[Message]) -> None:
    for message in messages:
        message.requeue()

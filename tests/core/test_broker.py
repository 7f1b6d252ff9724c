"""Publishers against real Redis: only the job id travels; a down broker raises (and the job stays
undispatched for the reconciler)."""

from __future__ import annotations

import base64
import json

import pytest
import redis
from kombu.exceptions import OperationalError

from conveyor.core.seams.broker import BrokerPublisher
from conveyor.core.settings import Settings
from conveyor.worker.in_process_queue import InProcessPublisher
from tests.support.live_server import SpareRedis

DEMO_MODEL = "/models/demo-model"  # lanes demo-model:interactive and demo-model:documents; need not exist


def test_broker_publisher_sends_only_the_job_id_to_the_named_queue(spare_redis: SpareRedis) -> None:
    spare_redis.start()  # a private server: queue depths here must not see other test runs' messages
    redis_url = spare_redis.url
    publisher = BrokerPublisher(Settings(broker_url=redis_url, model=DEMO_MODEL))
    assert publisher.ping()

    publisher.publish("job_a", "demo-model:documents")
    publisher.publish("job_b", "demo-model:documents")

    assert publisher.depth("demo-model:documents") == 2 and publisher.depth("demo-model:interactive") == 0
    raw = redis.Redis.from_url(redis_url).rpop("demo-model:documents")
    assert raw is not None
    envelope = json.loads(raw)
    assert envelope["properties"]["body_encoding"] == "base64"
    assert json.loads(base64.b64decode(envelope["body"])) == {"job_id": "job_a"}
    with pytest.raises(ValueError, match="lane"):
        publisher.publish("job_c", "documents")
    publisher.close()


def test_broker_publisher_raises_while_the_broker_is_down(spare_redis: SpareRedis) -> None:
    publisher = BrokerPublisher(Settings(broker_url=spare_redis.url, model=DEMO_MODEL))
    assert not publisher.ping()
    with pytest.raises(OperationalError):
        publisher.publish("job_a", "demo-model:interactive")


def test_in_process_publisher_keeps_one_fifo_per_queue() -> None:
    publisher = InProcessPublisher(["interactive", "documents"])
    publisher.publish("job_a", "documents")
    publisher.publish("job_b", "documents")
    assert publisher.depth("documents") == 2 and publisher.depth("interactive") == 0
    assert publisher.queues["documents"].get_nowait() == "job_a"
    with pytest.raises(ValueError, match="queue"):
        publisher.publish("job_c", "nonexistent")

"""WorkerServices: the one wiring of what runs next to an engine, started and stopped in one order, for the
Celery worker and the embedded runtime alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import conveyor.worker.services
from conveyor.worker.services import WorkerServices
from tests.support.service import RecordingPublisher


class Recorder:
    """Stands in for each service class; every start/stop/shutdown call lands in one shared log."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def part(self, name: str) -> Callable[..., Any]:
        log = self.log

        class Part:
            tokenizer = None
            engine = SimpleNamespace(max_model_len=2048)  # what the start-up limit check reads

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                log.append(f"{name}.init")
                self.limits: dict[str, int] = kwargs.get("limits", {})

            @classmethod
            def from_config(cls, config: Any) -> Any:
                log.append(f"{name}.load {config.model}")
                return cls()

            def start(self) -> None:
                log.append(f"{name}.start")

            def stop(self) -> None:
                log.append(f"{name}.stop")

            def shutdown(self, *args: Any) -> None:
                log.append(f"{name}.shutdown")

            def on_request_finished(self, listener: Any) -> None:  # the worker metrics observe the host
                pass

            def on_step_end(self, listener: Any) -> None:
                pass

        return Part


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    recorder = Recorder(calls)
    for attribute, name in [("Heartbeat", "heartbeat"), ("Reconciler", "reconciler"),
                            ("Promoter", "scheduler"), ("WebhookSender", "webhooks"), ("EngineHost", "host"),
                            ("JobRunner", "runner")]:
        monkeypatch.setattr(conveyor.worker.services, attribute, recorder.part(name))
    monkeypatch.setattr(conveyor.worker.services, "make_batch_runner",
                        lambda *args: recorder.part("batches")())
    return calls


def test_start_loads_the_engine_once_then_starts_every_service_and_stop_runs_in_the_documented_order(
    log: list[str], make_settings: Callable[..., Any], demo_model_dir: Path
) -> None:
    settings = make_settings(model=str(demo_model_dir), queues={"documents": {"max_running": 3}})
    services = WorkerServices(settings, sessions=None, broker=RecordingPublisher(),  # type: ignore[arg-type]
                              worker_id="w", tokens=None, republish_requeued=True)
    services.start()
    services.stop(grace_s=0.0)

    started = log[log.index(f"host.load {demo_model_dir}"):log.index("batches.start") + 1]
    assert [entry for entry in started if entry.endswith(".start")] == [
        "heartbeat.start", "runner.start", "reconciler.start", "scheduler.start", "webhooks.start",
        "batches.start"]
    assert [entry for entry in log if entry.endswith((".stop", ".shutdown"))] == [
        "batches.stop", "reconciler.stop", "scheduler.stop", "runner.shutdown", "webhooks.stop",
        "heartbeat.stop", "host.shutdown"]
    assert log.count(f"host.load {demo_model_dir}") == 1
    limits = services.runner.limits  # the per-lane hold: each of the model's queues' max_running
    assert limits == {"demo-model:interactive": settings.queues["interactive"].max_running,
                      "demo-model:documents": 3}


def test_a_worker_of_one_pool_takes_and_registers_only_its_queues(
    log: list[str], make_settings: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, demo_model_dir: Path,
) -> None:
    registered: list[list[str]] = []

    class Heartbeat:
        def __init__(self, sessions: Any, worker_id: str, queues: list[str], interval_s: float,
                     pace: Any = None) -> None:
            registered.append(queues)

        def start(self) -> None: ...

    monkeypatch.setattr(conveyor.worker.services, "Heartbeat", Heartbeat)
    settings = make_settings(model=str(demo_model_dir), broker_url="redis://127.0.0.1:1/0",
                             worker_queues="documents")
    services = WorkerServices(settings, sessions=None, broker=RecordingPublisher(),  # type: ignore[arg-type]
                              worker_id="w", tokens=None, republish_requeued=True)
    services.start()
    assert services.runner.limits == {"demo-model:documents": settings.queues["documents"].max_running}
    assert registered == [["demo-model:documents"]]


def test_the_heartbeat_publishes_the_engines_load_beside_its_pace() -> None:
    from conveyor.worker.services import engine_load

    stats = {"kv_blocks_used": 30, "kv_blocks_total": 120, "running": {"interactive": 2, "documents": 1},
             "waiting": {"interactive": 0, "documents": 4}, "preemptions_total": 5}
    assert engine_load(stats) == {"kv_used": 0.25, "running": 3.0, "waiting": 4.0, "preemptions": 5.0}
    assert engine_load({"kv_blocks_total": 0}) == {}  # an encoder has no KV cache

"""Embedded mode (`conveyor serve`): the engine's metrics and the job metrics on the server's one /metrics,
after jobs in both queues, a cancel and preemptions (a KV cache too small for two documents at once)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.settings import Settings
from conveyor.core.store.migrate import upgrade
from conveyor.worker.embedded import EmbeddedRuntime
from tests.support.metrics import (
    KV,
    Families,
    Scenario,
    check_api_counts,
    check_documented,
    check_engine_counts,
    engine_settled,
    parse,
    run_scenario,
    wait_for,
)
from tests.support.service import LOCAL_URL


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, prompt_tokenizer: PromptTokenizer
) -> Iterator[tuple[Scenario, Families]]:
    """One embedded app on SQLite, the scenario run through it, and its /metrics once the engine settled."""
    data = tmp_path_factory.mktemp("metrics-embedded")
    url = f"sqlite:///{data / 'conveyor.db'}"
    upgrade(url)
    settings = Settings(
        data_dir=data,
        database_url=url,
        model=str(demo_model_dir),
        auth_enabled=False,
        cancel_poll_s=0.05,
        dtype="float32",
        device="cpu",
        attention_backend="torch",
        **KV,
    )
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime)
    with TestClient(app, base_url=LOCAL_URL) as client:
        scenario = run_scenario(client)

        def scrape() -> Families:
            response = client.get("/metrics")
            assert response.status_code == 200, response.text
            return parse(response.text)

        wait_for(lambda: engine_settled(scrape(), scenario), "the engine to see every job end")
        yield scenario, scrape()


def test_one_metrics_endpoint_has_every_documented_metric(served: tuple[Scenario, Families]) -> None:
    check_documented(served[1], where={"worker", "api"})


def test_job_figures_add_up(served: tuple[Scenario, Families]) -> None:
    check_api_counts(served[1], served[0])


def test_engine_figures_add_up_with_preemptions(served: tuple[Scenario, Families]) -> None:
    check_engine_counts(served[1], served[0])

"""Two models behind one API, each with its own worker, on the suite's own PostgreSQL and Redis: killing one
model's worker leaves the other model's jobs flowing; the dead model's jobs wait, counted as its load by
/v1/scaling, and complete once a worker of that model returns. Each job is run by a worker of its model.

Real `conveyor api --config` (a two-model registry in TOML) and `conveyor worker --model` processes
(tests/support/fault_stack.py).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fault_stack import DEAD_AFTER_S, START_TIMEOUT_S, Proc, Stack, spawn
from tests.support.fault_store import SETTLE_S, wait_until
from tests.support.live_server import free_port

pytestmark = pytest.mark.faults

JOBS = 4  # per model and round
SCALING_WAIT_S = 4 * DEAD_AFTER_S  # the dead worker stops counting once its heartbeat is older than this


@dataclass(frozen=True)
class Registry:
    url: str  # the API serving it
    env: dict[str, str]  # what its processes run with: the same registry for the API and every worker


@pytest.fixture
def two_models(stack: Stack, tiny_model_dir: Callable[..., Path], tmp_path: Path) -> Iterator[Registry]:
    """`conveyor api` serving models `a` (a Llama-shaped one) and `b` (a Qwen2-shaped one), both of 2 layers:
    light to start and to run, as the test starts three workers."""
    config = tmp_path / "models.toml"
    a_dir = tiny_model_dir("LlamaForCausalLM")
    b_dir = tiny_model_dir("Qwen2ForCausalLM", vocab_size=640, seed=3)
    config.write_text(f'[models.a]\npath = "{a_dir}"\n[models.b]\npath = "{b_dir}"\n')
    port = free_port()
    env = stack.servers.env(tmp_path / "data", MODEL="", PORT=str(port), CONFIG_FILE=str(config))
    api = spawn("api-models", ["api"], env, stack.log_dir)
    stack.procs.append(api)  # killed at teardown with the workers
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers(url), "the two-model API to answer", START_TIMEOUT_S, also=api.check_alive)
    yield Registry(url, env)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_worker(stack: Stack, registry: Registry, model: str) -> Proc:
    proc = spawn(f"worker-{model}-{len(stack.procs)}", ["worker", "--model", model], registry.env,
                 stack.log_dir)
    stack.procs.append(proc)
    stack.wait_worker(proc)
    return proc


def submit(url: str, model: str, n: int) -> list[str]:
    ids = []
    for i in range(n):
        r = httpx.post(f"{url}/v1/jobs", json={"model": model, "prompt": f"{model} job {i}", "max_tokens": 4,
                                               "temperature": 0}, timeout=30)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    return ids


def finished(stack: Stack, ids: list[str]) -> bool:
    return all(job.status == "succeeded" for job in stack.store.jobs(ids).values())


def scaling(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/scaling", timeout=10)
    assert r.status_code == 200, r.text
    models: dict[str, Any] = r.json()["models"]
    return models


def test_one_models_dead_worker_stalls_only_its_own_jobs_until_it_returns(
        stack: Stack, two_models: Registry) -> None:
    url = two_models.url
    workers = {model: [start_worker(stack, two_models, model)] for model in ("a", "b")}
    first = {model: submit(url, model, JOBS) for model in ("a", "b")}
    wait_until(lambda: finished(stack, first["a"] + first["b"]), "both models' jobs", SETTLE_S)

    workers["b"][0].signal(signal.SIGKILL)
    assert workers["b"][0].wait_exit(30) != 0
    waiting = submit(url, "b", JOBS)
    flowing = submit(url, "a", JOBS)
    wait_until(lambda: finished(stack, flowing), "model a's jobs while b has no worker", SETTLE_S)
    assert all(job.status == "queued" for job in stack.store.jobs(waiting).values())
    wait_until(lambda: scaling(url)["b"]["queues"]["interactive"]["workers"] == 0,
               "b's dead worker to stop counting", SCALING_WAIT_S)
    assert scaling(url)["b"]["load"] == JOBS  # what the autoscaler starts b's workers on
    assert scaling(url)["a"] == {"load": 0, "queues": scaling(url)["a"]["queues"]}
    assert scaling(url)["a"]["queues"]["interactive"]["workers"] == 1

    workers["b"].append(start_worker(stack, two_models, "b"))
    wait_until(lambda: finished(stack, waiting), "b's waiting jobs once a worker of b is back", SETTLE_S)
    assert scaling(url)["b"]["load"] == 0

    for model, ids in (("a", first["a"] + flowing), ("b", first["b"] + waiting)):
        ran = {job.worker_id for job in stack.store.jobs(ids).values()}
        assert ran <= {proc.worker_id for proc in workers[model]}, (model, ran)
        assert {job.queue for job in stack.store.jobs(ids).values()} == {f"{model}:interactive"}
    listed = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["workers"]) for m in listed] == [("a", 1), ("b", 1)]

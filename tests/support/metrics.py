"""Shared by the metrics tests: the metric table of docs/operations/metrics.md (scrapes are checked on it),
one scenario that drives jobs through both queues with a cancel and preemptions, and the checks that the
figures add up. `Client` is anything with httpx's get/post (a TestClient or an httpx.Client)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from conveyor.core.protocol.service_tiers import goodput_tier

if TYPE_CHECKING:
    from conveyor.engine.llm_engine import LLMEngine

METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs/operations/metrics.md"
FINAL = ("succeeded", "failed", "cancelled", "expired")
WAIT_S = 180.0  # a hang guard, not a speed assertion
# Tiny KV cache: 8 blocks x 16 tokens. Two documents jobs of ~110 tokens each need 14 blocks together, so
# the engine must preempt while both run; each one alone fits (the engine refuses jobs that never could).
KV = dict(num_kv_blocks=8, block_size=16, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=256)
# Every job has a deadline far enough for a slow machine: the cancelled one is `missed`, the others `on_time`.
# One chat job asks for the priority tier: goodput is counted per tier, the others in the default one.
SHORT = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "deadline_s": 3600}
PRIORITY = {**SHORT, "service_tier": "priority"}
LONG = {"max_tokens": 100, "temperature": 0, "ignore_eos": True, "deadline_s": 3600}


class Client(Protocol):
    def get(self, url: str, **kwargs: Any) -> Any: ...

    def post(self, url: str, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Documented:
    name: str  # as PromQL names it (counters with `_total`)
    type: str  # counter | gauge | histogram
    labels: frozenset[str]
    where: str  # "worker" or "api"


def documented_metrics() -> list[Documented]:
    """Rows of the metric tables: | `name` | type | `label`, ... | where | meaning |."""
    rows = []
    for line in METRICS_PAGE.read_text().splitlines():
        match = re.match(r"\|\s*`(conveyor[:_][a-z0-9_:]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|\s*(\w+)\s*\|", line)
        if match:
            name, kind, labels, where = match.groups()
            rows.append(Documented(name, kind, frozenset(re.findall(r"`(\w+)`", labels)), where))
    assert len(rows) > 20, f"{METRICS_PAGE}: the metric table is missing"
    return rows


def family_name(doc: Documented) -> str:
    """The family name the exposition parser gives: a counter's without `_total`."""
    return doc.name.removesuffix("_total") if doc.type == "counter" else doc.name


Families = dict[str, Any]  # family name -> prometheus_client Metric


def parse(text: str) -> Families:
    return {f.name: f for f in text_string_to_metric_families(text)}


def check_documented(families: Families, where: set[str]) -> None:
    """Every documented metric of those places is exported with its type, and its samples carry exactly its
    labels (a histogram's buckets `le` too)."""
    for doc in documented_metrics():
        if doc.where not in where:
            continue
        family = families.get(family_name(doc))
        assert family is not None, f"{doc.name}: documented, not exported"
        assert family.type == doc.type, f"{doc.name}: exported as {family.type}, documented {doc.type}"
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = set(sample.labels) - {"le"}
            assert labels == doc.labels, f"{sample.name}: labels {labels}, documented {set(doc.labels)}"


def value(families: Families, sample_name: str, **labels: str) -> float:
    """The sum of a family's samples named `sample_name` whose labels include `labels`."""
    total = 0.0
    for family in families.values():
        for sample in family.samples:
            if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_for(predicate: Callable[[], bool], what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


@dataclass
class Scenario:
    """What run_scenario did: final statuses of its jobs by queue, how many of them started (reached the
    engine: a job cancelled while queued never does), and their attempts (a job handed back and redelivered
    may reach an engine once per attempt)."""

    statuses: dict[str, dict[str, str]]  # queue -> job id -> final status
    started: dict[str, int]
    attempts: dict[str, int]
    tiers: dict[str, str]  # job id -> goodput tier

    def engine_runs(self, queue: str, observed: float) -> bool:
        """Could the engine have seen `observed` of this queue's requests end? Each started job at least
        once, at most once per attempt."""
        return self.started[queue] <= observed <= self.attempts[queue]

    def finished(self, queue: str) -> int:
        return len(self.statuses[queue])

    def count(self, queue: str, status: str, tier: str | None = None) -> int:
        return sum(1 for job, s in self.statuses[queue].items()
                   if s == status and tier in (None, self.tiers[job]))

    def in_tier(self, queue: str, tier: str) -> int:
        return sum(1 for job in self.statuses[queue] if self.tiers[job] == tier)


def run_scenario(client: Client) -> Scenario:
    """Two short interactive jobs, two long documents jobs (preempted: the cache holds one), and a third
    documents job cancelled while it runs; returns when every one is final."""
    ids: dict[str, list[str]] = {"interactive": [], "documents": []}
    for i in range(2):
        ids["interactive"].append(_submit(client, "interactive", f"chat {i}", PRIORITY if i == 0 else SHORT))
    for i in range(2):
        ids["documents"].append(_submit(client, "documents", f"document {i}", LONG))
    doomed = _submit(client, "documents", "document to cancel", LONG)
    ids["documents"].append(doomed)
    wait_for(lambda: _job(client, doomed)["status"] != "queued", f"job {doomed} to start", poll_s=0.005)
    response = client.post(f"/v1/jobs/{doomed}/cancel")
    assert response.status_code in (200, 409), response.text  # 409: it had finished already
    statuses = {q: {j: _final_status(client, j) for j in js} for q, js in ids.items()}
    jobs = {q: [_job(client, j) for j in js] for q, js in ids.items()}
    started = {q: sum(1 for job in js if job["started_at"] is not None) for q, js in jobs.items()}
    attempts = {q: sum(job["attempts"] for job in js) for q, js in jobs.items()}
    assert statuses["documents"][doomed] == "cancelled", "the job to cancel finished first"
    tiers = {job["id"]: goodput_tier(job["service_tier"]) for js in jobs.values() for job in js}
    return Scenario(statuses, started, attempts, tiers)


def _submit(client: Client, queue: str, prompt: str, params: dict[str, Any]) -> str:
    response = client.post("/v1/jobs", json={"prompt": prompt, "queue": queue, **params})
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


def _job(client: Client, job_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


def _final_status(client: Client, job_id: str) -> str:
    wait_for(lambda: _job(client, job_id)["status"] in FINAL, f"job {job_id} to finish")
    status: str = _job(client, job_id)["status"]
    return status


def check_api_counts(families: Families, scenario: Scenario) -> None:
    """Per queue: outcomes add up to the finished jobs, and each job histogram counted every finished job
    once (time to first token: those that had one)."""
    for queue in scenario.statuses:
        finished = scenario.finished(queue)
        by_status = {s: value(families, "conveyor_job_outcomes_total", queue=queue, status=s) for s in FINAL}
        assert sum(by_status.values()) == finished, (queue, by_status)
        assert by_status == {s: scenario.count(queue, s) for s in FINAL}, (queue, by_status)
        for histogram in ("conveyor_job_e2e_seconds", "conveyor_job_queue_time_seconds"):
            assert value(families, f"{histogram}_count", queue=queue) == finished, (histogram, queue)
            assert value(families, f"{histogram}_bucket", queue=queue, le="+Inf") == finished, (
                histogram,
                queue,
            )
        assert 0 < value(families, "conveyor_job_time_to_first_token_seconds_count", queue=queue) <= finished
        for tier in ("default", "priority", "flex"):
            deadlines = {o: value(families, "conveyor_job_deadlines_total", queue=queue, tier=tier, outcome=o)
                         for o in ("on_time", "late", "missed")}
            delivered = scenario.count(queue, "succeeded", tier)
            expected = {"on_time": delivered, "late": 0, "missed": scenario.in_tier(queue, tier) - delivered}
            assert deadlines == expected, (queue, tier, deadlines)
        assert value(families, "conveyor_job_deadlines_total", queue=queue) == finished


def engine_settled(families: Families, scenario: Scenario) -> bool:
    """The engine has seen every job finish (a cancel reaches it a poll after the API recorded it)."""
    ended = {
        q: value(families, "conveyor:e2e_request_latency_seconds_count", queue=q) for q in scenario.statuses
    }
    in_engine = value(families, "conveyor:num_requests_running") + value(
        families, "conveyor:num_requests_waiting"
    )
    return in_engine == 0 and all(scenario.engine_runs(q, n) for q, n in ended.items())


def check_engine_counts(families: Families, scenario: Scenario) -> None:
    """Per queue: every job that started was observed when it ended in the engine (once per attempt at
    most); the cancelled one ended as an abort; preemptions happened."""
    for queue in scenario.statuses:
        ended = value(families, "conveyor:e2e_request_latency_seconds_count", queue=queue)
        assert scenario.engine_runs(queue, ended), (queue, ended, scenario)
        assert value(families, "conveyor:request_success_total", queue=queue) == ended
        assert value(families, "conveyor:num_requests_running", queue=queue) == 0
        assert value(families, "conveyor:prompt_tokens_total", queue=queue) > 0
    aborted = value(families, "conveyor:request_success_total", queue="documents", finished_reason="abort")
    assert aborted >= scenario.count("documents", "cancelled") == 1  # it was running when cancelled
    assert value(families, "conveyor:num_preemptions_total") > 0
    assert value(families, "conveyor:iteration_tokens_total_count") > 0
    assert value(families, "conveyor:engine_step_duration_seconds_count") > 0
    assert value(families, "conveyor:cold_start_seconds", phase="engine_ready") > 0


class StatsHost:
    """What WorkerMetrics reads of an EngineHost: its stats snapshot (the callbacks are not needed here)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def on_request_finished(self, callback: Callable[..., None]) -> None:
        del callback

    def on_step_end(self, callback: Callable[[], None]) -> None:
        del callback

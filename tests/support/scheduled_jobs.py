"""The scheduled-jobs fault check, shared by the embedded run and the PostgreSQL + Redis run: one job due per
second, a worker killed and restarted in the middle, then every job must have started in due order, none
before its time, none lost and none run twice."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta

import httpx

from conveyor.core.clock import utcnow
from conveyor.core.store.tables import Job

COUNT, SPACING_S, LEAD_S = 30, 1.0, 4.0


def submit_one_per_second(url: str, prefix: str) -> tuple[dict[str, str], datetime]:
    """COUNT jobs due LEAD_S from now and then one per SPACING_S, each with its own Idempotency-Key, submitted
    in due order; returns {key: job id} and the first due time."""
    first = utcnow() + timedelta(seconds=LEAD_S)
    accepted: dict[str, str] = {}
    with httpx.Client(base_url=url, timeout=30) as http:
        for i in range(COUNT):
            run_at = (first + timedelta(seconds=i * SPACING_S)).isoformat()
            key = f"{prefix}-{i}"
            answer = http.post("/v1/jobs", headers={"Idempotency-Key": key}, json={
                "prompt": f"{prefix} {i}: the river is calm", "max_tokens": 4, "ignore_eos": True,
                "temperature": 0, "run_at": run_at})
            assert answer.status_code == 202 and answer.json()["status"] == "scheduled", answer.text
            accepted[key] = answer.json()["id"]
    return accepted, first


def check_due_order(rows: dict[str, Job], accepted: dict[str, str], reran: set[str]) -> None:
    """Every job succeeded, none started before its run_at, and the first runs started in due order (a job
    the killed worker was running ran again later, so its start is left out of the order)."""
    by_due = sorted((rows[job_id] for job_id in accepted.values()), key=lambda job: (job.run_at, job.id))
    problems = [f"{job.id}: {job.status}" for job in by_due if job.status != "succeeded"]
    for job in by_due:
        assert job.run_at is not None and job.started_at is not None, job.id
        if job.started_at < job.run_at:
            problems.append(f"{job.id} started {job.started_at} before it was due {job.run_at}")
    firsts = [job for job in by_due if job.id not in reran]
    for earlier, later in itertools.pairwise(firsts):
        assert earlier.started_at is not None and later.started_at is not None
        if later.started_at < earlier.started_at:
            problems.append(f"{later.id} (due {later.run_at}) started at {later.started_at}, before "
                            f"{earlier.id} (due {earlier.run_at}) at {earlier.started_at}")
    assert not problems, "\n".join(problems)

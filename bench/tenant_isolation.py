"""Does one tenant's costly request slow another's? Timed over HTTP against a running service.

Tenant B (the victim) submits a group of short jobs and waits for them all, a few rounds alone, then a few
rounds while tenant A's costly job (a JSON schema of many optional integer properties, which takes seconds
to minutes to compile) is in the worker. The report is each round's wall time and A's job as it ended:

    python -m conveyor.bench.tenant_isolation --url http://127.0.0.1:8000 \
        --victim-key cvk_... --hostile-key cvk_...

Needs two API keys of different tenants (`conveyor keys create --tenant ...`). "One tenant's schema cannot
stall the others" in docs/guides/structured-outputs.md quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

WAIT_S = 30  # long poll per request


@dataclass(frozen=True)
class IsolationReport:
    alone_s: list[float]  # wall time of each round of the victim's jobs, nothing else submitted
    beside_s: list[float]  # the same while the hostile job is in the worker
    hostile: dict[str, Any]  # the hostile job as it ended

    def describe(self) -> str:
        error = self.hostile.get("error") or {}
        alone, beside = statistics.median(self.alone_s), statistics.median(self.beside_s)
        return (f"victim's jobs alone: median {alone:.3f} s {_rounded(self.alone_s)}; beside the costly job: "
                f"median {beside:.3f} s {_rounded(self.beside_s)}; costly job: {self.hostile['status']} "
                f"{error.get('code', '')} {error.get('message', '')}".rstrip())


def costly_schema(num_properties: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(num_properties)}}


def run(url: str, victim_key: str, hostile_key: str, *, jobs: int = 20, rounds: int = 3,
        properties: int = 1500) -> IsolationReport:
    with _client(url, victim_key) as victim, _client(url, hostile_key) as hostile:
        _warm(victim, hostile)
        alone = [_round(victim, jobs, f"alone {r}") for r in range(rounds)]
        costly = _submit(hostile, {"prompt": "The queue holds", "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "costly", "schema": costly_schema(properties)}}})
        time.sleep(0.3)  # claimed and compiling before the victim's next round
        beside = [_round(victim, jobs, f"beside {r}") for r in range(rounds)]
        return IsolationReport(alone, beside, _final(hostile, costly))


def _warm(victim: httpx.Client, hostile: httpx.Client) -> None:
    """One round and one small constrained job first: the engine and the grammar compiler are started."""
    small = {"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_object"}}
    _final(hostile, _submit(hostile, small))
    _round(victim, 1, "warm")


def _round(client: httpx.Client, jobs: int, tag: str) -> float:
    start = time.perf_counter()
    body = {"max_tokens": 4, "temperature": 0}
    ids = [_submit(client, {"prompt": f"{tag}: job {i}", **body}) for i in range(jobs)]
    ended = [_final(client, job_id) for job_id in ids]
    failed = [job for job in ended if job["status"] != "succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} of the victim's jobs did not succeed: {failed[0]}")
    return time.perf_counter() - start


def _submit(client: httpx.Client, body: dict[str, Any]) -> str:
    response = client.post("/v1/jobs", json=body)
    response.raise_for_status()
    return str(response.json()["id"])


def _final(client: httpx.Client, job_id: str) -> dict[str, Any]:
    while True:
        response = client.get(f"/v1/jobs/{job_id}", params={"wait": WAIT_S})
        response.raise_for_status()
        job: dict[str, Any] = response.json()
        if job["status"] not in ("queued", "running"):
            return job


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT_S + 30)


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.bench.tenant_isolation",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--url", required=True, help="the service's base URL")
    parser.add_argument("--victim-key", required=True, help="an API key of tenant B")
    parser.add_argument("--hostile-key", required=True, help="an API key of tenant A (another tenant)")
    parser.add_argument("--jobs", type=int, default=20, help="the victim's jobs per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--properties", type=int, default=1500, help="optional properties of A's schema")
    args = parser.parse_args(argv)
    report = run(args.url, args.victim_key, args.hostile_key, jobs=args.jobs, rounds=args.rounds,
                 properties=args.properties)
    print(report.describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

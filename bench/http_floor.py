"""The HTTP stack's floor: what one job's two requests cost the server with nothing behind them.

`python -m conveyor.bench.http_floor --port P` serves `POST /v1/jobs` and `GET /v1/jobs/{id}` on the
service's own stack (FastAPI; uvicorn with uvloop and httptools, access log off) with routes that validate a
small body and answer a finished job at once: no store, no queue, no engine. `conveyor bench --target http
--profile service --server-pid server=PID` against it measures the server CPU per job that the service cannot
go below while it answers each job over these two requests (docs/benchmarks/results.md, issue 32).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Response
from pydantic import BaseModel

FINISHED_JOB = (b'{"id":"%s","status":"succeeded","result":{"text":"x"},'
                b'"usage":{"prompt_tokens":1,"completion_tokens":1}}')


class JobRequest(BaseModel):
    """A few of POST /v1/jobs's fields, typed as the service types them."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    queue: str = "interactive"


def floor_app() -> FastAPI:
    app = FastAPI()
    ids: Iterator[int] = itertools.count()

    @app.post("/v1/jobs", status_code=202)
    async def submit(body: JobRequest) -> Response:
        content = b'{"id":"job_%d","status":"queued"}' % next(ids)
        return Response(content, status_code=202, media_type="application/json")

    @app.get("/v1/jobs/{job_id}")
    async def read(job_id: str, wait: float | None = None) -> Response:
        return Response(FINISHED_JOB % job_id.encode(), media_type="application/json")

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m conveyor.bench.http_floor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    uvicorn.run(floor_app(), host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
                access_log=False, log_level="warning")


if __name__ == "__main__":
    main()

"""The OpenAI-compatible routes in Celery mode, driven by the official `openai` SDK: the API (uvicorn on an
ephemeral port) publishes to Redis, a real `python -m conveyor.worker` subprocess runs the jobs on Postgres,
and streamed text travels back over Redis pub/sub on the job's channel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.api.token_subscriptions import RedisTokenStream
from conveyor.core.seams.broker import BrokerPublisher
from conveyor.core.settings import Settings
from tests.support.live_server import serving, wait_for
from tests.support.worker import LONG_JOB_TOKENS, WorkerProcesses, get_job, worker_env

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about block tables."}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}


def test_chat_plain_streamed_and_cancelled_through_celery_and_redis(
    pg_url: str, redis_url: str, sessions: sessionmaker[Session], worker_model_dir: Path,
    worker_procs: WorkerProcesses, tmp_path: Path,
) -> None:
    queues = {"interactive": {"max_output_tokens": LONG_JOB_TOKENS}}
    settings = Settings(data_dir=tmp_path, database_url=pg_url, broker_url=redis_url,
                        model=str(worker_model_dir), auth_enabled=False, queues=queues)
    publisher = BrokerPublisher(settings)
    app = create_app(settings, publisher=publisher, tokenizer=PromptTokenizer(worker_model_dir),
                     token_stream=RedisTokenStream(redis_url))
    worker_procs.start(worker_env(pg_url, redis_url, worker_model_dir, tmp_path))
    model = worker_model_dir.name
    try:
        with serving(app) as root:
            base = f"{root}/v1"
            client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
            whole = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
            job = get_job(sessions, whole.id.removeprefix("chatcmpl-"))
            assert job.status == "succeeded" and job.result_text == whole.choices[0].message.content
            assert whole.usage is not None and whole.usage.completion_tokens == 16

            chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                                         stream_options={"include_usage": True}, **GREEDY))
            deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
            assert len(deltas) >= 2, "text must arrive over Redis while the job runs, not only at the end"
            assert "".join(deltas) == whole.choices[0].message.content
            assert chunks[-1].usage is not None  # the same prompt again: it may find more of it cached
            details = {"prompt_tokens_details"}
            assert chunks[-1].usage.model_dump(exclude=details) == whole.usage.model_dump(exclude=details)

            long = {"max_tokens": LONG_JOB_TOKENS, "extra_body": {"ignore_eos": True}}
            stream = client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **long)
            first = next(c for c in stream if c.choices and c.choices[0].delta.content)
            stream.close()
            job_id = first.id.removeprefix("chatcmpl-")
            wait_for(lambda: get_job(sessions, job_id).status != "running", "the job to leave running",
                     timeout_s=60)
            assert get_job(sessions, job_id).status == "cancelled"

            _a_delayed_job_streams_its_text_as_delta_events(root, sessions)
    finally:
        publisher.close()


def _a_delayed_job_streams_its_text_as_delta_events(root: str, sessions: sessionmaker[Session]) -> None:
    """POST /v1/jobs with delay_s 3: scheduled, then published by the worker process's scheduler when due;
    its event stream (opened while it waits) carries its text as `event: delta` over Redis."""
    body = {"prompt": "The river is calm", "max_tokens": 64, "ignore_eos": True, "temperature": 0,
            "delay_s": 3}
    with httpx.Client(base_url=root, timeout=120) as http:
        job = http.post("/v1/jobs", json=body).json()
        assert job["status"] == "scheduled", job
        with http.stream("GET", f"/v1/jobs/{job['id']}/events") as events:
            lines = list(events.iter_lines())
    kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    deltas = [d["text"] for kind, d in zip(kinds, data, strict=True) if kind == "delta"]
    assert len(deltas) >= 8 and kinds[-1] == "job", kinds
    stored = get_job(sessions, job["id"])
    assert stored.status == "succeeded" and "".join(deltas) == stored.result_text
    assert stored.run_at is not None and stored.started_at is not None and stored.started_at >= stored.run_at

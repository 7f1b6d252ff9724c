"""OpenAI's `service_tier` and vLLM's `priority` through the official SDK on the embedded server: the tier is
echoed (plain and streamed) and becomes the job's priority (flex: also no default deadline); a batch line
echoes it too."""

from __future__ import annotations

from typing import Any

from test_openai_chat_sdk import (  # noqa: F401 (embedded: the module-scoped fixture)
    MESSAGES,
    Server,
    embedded,
    job_id_of,
)

from tests.support.openai_batches import run_batch

SHORT: dict[str, Any] = {"max_tokens": 2, "temperature": 0}


def test_the_tier_is_echoed_and_becomes_the_jobs_priority(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    for tier, priority in (("priority", -1), ("flex", 1), ("default", 0)):
        chat = client.chat.completions.create(model=embedded.model, messages=MESSAGES, service_tier=tier,
                                              **SHORT)
        assert chat.service_tier == tier
        job = embedded.job(job_id_of(chat.id))
        assert (job.priority, job.deadline_at) == (priority, None)
    explicit = client.completions.create(  # the SDK's completions call has no service_tier argument
        model=embedded.model, prompt="hi", **SHORT,
        extra_body={"service_tier": "flex", "priority": -4, "deadline_s": 60})
    job = embedded.job(job_id_of(explicit.id))
    assert explicit.model_extra["service_tier"] == "flex" and job.priority == -4  # type: ignore[index] and job.deadline_at is not None
    chunks = list(client.chat.completions.create(model=embedded.model, messages=MESSAGES, stream=True,
                                                 service_tier="priority", **SHORT))
    assert chunks and all(chunk.service_tier == "priority" for chunk in chunks)


def test_a_batch_line_echoes_its_tier(embedded: Server) -> None:  # noqa: F811
    body = {"model": embedded.model, "messages": MESSAGES, "service_tier": "flex", **SHORT}
    lines = [{"custom_id": "flex", "method": "POST", "url": "/v1/chat/completions", "body": body}]
    answers = run_batch(embedded.client(), lines, "/v1/chat/completions")
    assert answers.outputs["flex"]["service_tier"] == "flex"

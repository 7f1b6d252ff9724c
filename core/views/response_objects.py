"""A job submitted through POST /v1/responses shown as OpenAI's `response` object: by GET /v1/responses/{id},
the create call, its stream's events and its webhooks alike.

The response id is "resp_" + the job id (the job stays visible under /v1/jobs). Its status follows the job's:
scheduled and queued are `queued`, running `in_progress`, succeeded `completed` (or `incomplete` with reason
max_output_tokens when the answer hit its limit), failed and expired `failed` (with the job's error),
cancelled `cancelled`. The output is read from the answer as a chat answer is (core/views/tool_calls.py): a
`message` item with its `output_text` (and its logprobs when asked), then a `function_call` item per call.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from conveyor.core.lifecycle import CANCELLED, EXPIRED, FAILED, QUEUED, RUNNING, SCHEDULED, SUCCEEDED
from conveyor.core.model_adapters import job_model_id
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.store.tables import Job
from conveyor.core.views.openai_objects import token_logprobs
from conveyor.core.views.tool_calls import choice_seed, read_output

RESPONSE_PREFIX = "resp_"
STATUSES = {SCHEDULED: "queued", QUEUED: "queued", RUNNING: "in_progress", SUCCEEDED: "completed",
            FAILED: "failed", EXPIRED: "failed", CANCELLED: "cancelled"}
FINAL_STATUSES = ("completed", "incomplete", "failed", "cancelled")


def response_id(job_id: str) -> str:
    return RESPONSE_PREFIX + job_id


def job_id_of(response_id: str) -> str | None:
    """The job behind a response id, or None for an id that is not a response's."""
    return response_id.removeprefix(RESPONSE_PREFIX) if response_id.startswith(RESPONSE_PREFIX) else None


def item_id(job_id: str, kind: str, index: int) -> str:
    """A stable id for item `index` of a response (`msg_...`, `fc_...`): every read names it alike."""
    return f"{kind}_" + hashlib.sha256(f"{job_id}:{kind}:{index}".encode()).hexdigest()[:32]


def status_of(job: Job) -> str:
    if job.status == SUCCEEDED and job.finish_reason == "length":
        return "incomplete"
    return STATUSES[job.status]


def response_object(job: Job, *, status: str | None = None) -> dict[str, Any]:
    """The job as a `response`; `status` shows it as it was earlier (a stream's opening events)."""
    request = job.responses_request or {}
    shown = status or status_of(job)
    params = job.params or {}
    return {
        "id": response_id(job.id), "object": "response", "created_at": int(job.created_at.timestamp()),
        "status": shown, "background": bool(request.get("background")),
        "completed_at": _unix(job.finished_at) if shown == "completed" else None,
        "error": _error(job) if shown == "failed" else None,
        "incomplete_details": {"reason": "max_output_tokens"} if shown == "incomplete" else None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "model": job_model_id(job.queue, params),
        "output": output_items(job) if shown in ("completed", "incomplete") else [],
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "previous_response_id": request.get("previous_response_id"),
        "temperature": params.get("temperature"), "top_p": params.get("top_p"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": _tool_choice(request), "tools": request.get("tools") or [],
        "top_logprobs": request.get("top_logprobs"), "truncation": "disabled",
        "usage": usage(job) if shown in ("completed", "incomplete") else None,
        "metadata": job.meta or {}, "service_tier": job.service_tier or "default",
        "store": request.get("store", True), "reasoning": {"effort": None, "summary": None}, "user": None,
    }


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def _tool_choice(request: dict[str, Any]) -> str | dict[str, Any]:
    """As sent; unsent, OpenAI's default: auto with tools, none without."""
    choice: str | dict[str, Any] | None = request.get("tool_choice")
    if choice is None:
        return "auto" if request.get("tools") else "none"
    return choice


def _error(job: Job) -> dict[str, str]:
    code = job.error_code or ("queue_deadline_exceeded" if job.status == EXPIRED else "job_failed")
    return {"code": code, "message": job.error_message or f"job {job.id} {job.status}"}


@dataclass(frozen=True)
class OutputText:
    """An answer's text item: its id, text and (when asked) token logprobs."""

    id: str
    text: str
    logprobs: list[dict[str, Any]]


def output_items(job: Job) -> list[dict[str, Any]]:
    """The answer as output items: a message (when it has text), then a function_call per call."""
    read = read_output(job.result_text or "", ChatOptions.from_json(job.chat), choice_seed(job.id, 0))
    status = "incomplete" if job.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if read.content is not None:
        logprobs = token_logprobs(job.logprobs) if job.logprobs is not None and not read.tool_calls else []
        items.append(message_item(OutputText(item_id(job.id, "msg", 0), read.content, logprobs), status))
    for index, call in enumerate(read.tool_calls):
        items.append({"id": item_id(job.id, "fc", index), "type": "function_call", "status": "completed",
                      "call_id": call.id, "name": call.name, "arguments": call.arguments})
    return items


def message_item(text: OutputText, status: str) -> dict[str, Any]:
    return {"id": text.id, "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text)]}


def text_part(text: OutputText) -> dict[str, Any]:
    return {"type": "output_text", "text": text.text, "annotations": [], "logprobs": text.logprobs}


def usage(job: Job) -> dict[str, Any]:
    prompt, completion = job.prompt_tokens or 0, job.completion_tokens or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": job.cached_tokens or 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def input_item_list(job: Job) -> list[dict[str, Any]]:
    """This turn's input items, each with an id (its own when it was sent with one)."""
    items = (job.responses_request or {}).get("input", [])
    return [{"id": item.get("id") or item_id(job.id, "in", index), **item}
            for index, item in enumerate(items)]


def earlier_turns(job: Job) -> list[dict[str, Any]]:
    """The conversation a later turn continues (previous_response_id): this response's messages without
    its instructions, then its answer as an assistant message (with its tool calls)."""
    request = job.responses_request or {}
    messages = list(job.messages or [])
    if request.get("instructions") is not None:
        messages = messages[1:]
    read = read_output(job.result_text or "", ChatOptions.from_json(job.chat), choice_seed(job.id, 0))
    answer: dict[str, Any] = {"role": "assistant", "content": read.content}
    if read.tool_calls:
        answer["tool_calls"] = [call.as_openai() for call in read.tool_calls]
    return [*messages, answer]


def webhook_event_type(job: Job) -> str:
    """response.completed / .incomplete / .failed / .cancelled for a final job."""
    return "response." + status_of(job)

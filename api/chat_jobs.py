"""What every synchronous generation route shares, whichever client convention it speaks (OpenAI's chat and
completions, Anthropic's messages): the served model a request names, the job it submits on the `interactive`
queue (built by JobCreate, so it is judged as POST /v1/jobs judges it), and the generation result of the job
once it ended. Errors come in OpenAI's shape (api/openai_errors.py); other conventions translate them
(api/anthropic_errors.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from conveyor.api import openai_sync
from conveyor.api.deps import Services
from conveyor.api.openai_errors import OpenAIError, from_validation_error
from conveyor.api.openai_sync import JobOutcome
from conveyor.api.schemas.jobs import JobCreate
from conveyor.api.served_models import ServedModel
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.embedding_rules import task_problem
from conveyor.core.protocol.model_task import Task
from conveyor.core.protocol.openai_request import OpenAIRequest, Served
from conveyor.core.protocol.request_limits import RequestLimits, RequestSize, prompt_bytes_problem
from conveyor.core.settings import UnknownModelError
from conveyor.core.views.openai_objects import GenerationResult, PromptView

QUEUE = "interactive"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: as many as fit


def model_of(services: Services, model_id: str | None, param: str | None = "model", *,
             task: Task | None = None, tenant: str | None = None) -> ServedModel:
    """The served model a request names (none: the default); 404 for one not served (or an adapter the
    tenant may not use), and with `task`, 400 for one that serves the other kind of request, saying what it
    serves."""
    try:
        model = services.models.get(model_id, tenant)
    except UnknownModelError as exc:
        message = str(exc) if param else "The" + str(exc).removeprefix("model: the")  # no field to name
        raise OpenAIError(404, message, code="model_not_found", param=param) from None
    problem = task_problem(model.id, model.task, task) if task is not None else None
    if problem is not None:
        raise OpenAIError(400, problem.message, code=problem.code, param=problem.field)
    return model


def default_chat_max_tokens(model: ServedModel, messages: list[dict[str, Any]], options: ChatOptions) -> int:
    """OpenAI's chat default is "as many as fit": the queue's cap, within the served max_model_len."""
    queue = model.settings.queue(QUEUE)
    assert queue is not None, "the interactive queue is always configured"
    max_model_len = model.max_model_len()
    limits = RequestLimits.of_queue(QUEUE, queue, max_model_len)
    size = RequestSize(None, messages, None, template_bytes=options.template_bytes())
    if max_model_len is None or prompt_bytes_problem(size, limits) is not None:
        return queue.max_output_tokens  # too long to count: submit() refuses it without tokenizing
    try:
        prompt_tokens = model.tokenizer.count_messages(messages, options)
    except ValueError:  # no chat template: submit() refuses the request with the reason
        return queue.max_output_tokens
    return max(1, min(queue.max_output_tokens, max_model_len - prompt_tokens))


def served_of(model: ServedModel) -> Served:
    """What the request rules hold a request for `model` to (core/protocol/openai_request.py)."""
    served = Served.of(model.settings, model.tokenizer.chat_template)
    return served if model.lora is None else replace(served, models=(model.id, *served.models))


def job_create(
    model: ServedModel, body: OpenAIRequest, max_tokens: int | None, *,
    prompt: str | list[str] | list[int] | list[list[int]] | None = None,
    messages: list[dict[str, Any]] | None = None,
) -> JobCreate:
    """The job of the request: `prompt` as sent (JobCreate judges it by the same rules), or the messages."""
    if max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    try:
        return JobCreate.model_validate(dict(prompt=prompt, messages=messages, model=model.id, queue=QUEUE,
                                             max_tokens=max_tokens, **body.job_params()))
    except ValidationError as exc:
        raise from_validation_error(exc.errors()) from exc


def generation_result(outcome: JobOutcome, model: str, created: int, *, service_tier: str | None = None,
                      shown: PromptView | None = None) -> GenerationResult:
    """The succeeded job's result; any other end becomes the matching error."""
    if outcome.status != "succeeded":
        raise openai_sync.outcome_error(outcome)
    return GenerationResult(text=outcome.text or "", finish_reason=outcome.finish_reason or "stop",
                            prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
                            model=model, created=created, logprobs=outcome.logprobs,
                            cached_tokens=outcome.cached_tokens, draft_tokens=outcome.draft_tokens,
                            accepted_draft_tokens=outcome.accepted_draft_tokens,
                            chat=ChatOptions.from_json(outcome.chat),
                            job_id=outcome.job_id, choices=outcome.choices, prompt=outcome.prompt or "",
                            prompt_logprobs=outcome.prompt_logprobs, shown=shown or PromptView(),
                            service_tier=service_tier)

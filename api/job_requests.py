"""What differs between the kinds of job at submit (api/submit.py does the rest, the same for both): how a
body is judged before and after tokenizing, what it may write, and what the job stores. Each rule is core's
(core/protocol/request_limits.py for generation, core/protocol/embedding_rules.py for embeddings), answered
here as a 422 naming the field, or the item (`input[2]`)."""

from __future__ import annotations

from typing import Any, Protocol

from conveyor.api.admission import EMBEDDING_TOKENS, Reserved
from conveyor.api.errors import ApiError, problem_error, raise_problem
from conveyor.api.schemas.jobs import AnyJobCreate, EmbeddingJobCreate, JobCreate
from conveyor.api.served_models import ServedModel
from conveyor.core.protocol.chat_options import job_params
from conveyor.core.protocol.embedding_rules import (
    embedded_tokens,
    input_lengths,
    inputs_problem,
    lengths_problem,
    task_problem,
)
from conveyor.core.protocol.job_kinds import EMBEDDING
from conveyor.core.protocol.request_limits import (
    RequestLimits,
    RequestSize,
    prompt_sizes,
    size_problem,
    tokenizer_problem,
    tokens_problem,
)
from conveyor.core.settings import QueueSettings


class JobRequest(Protocol):
    """A job body as submit judges and stores it."""

    max_tokens: int  # what each choice may write
    choices: int
    reserved: Reserved  # what its tokens are, for a tokens-per-minute refusal

    def check(self) -> None:
        """The rules judged before tokenizing (an ApiError naming the field)."""

    def count_prompt_tokens(self) -> int:
        """The prompt's tokens, judged against the limits that need them (an ApiError naming the field)."""

    def job_fields(self) -> dict[str, Any]:
        """What the job stores of the request: jobs.NewJob's prompt, messages, params and the kind's own."""


def job_request(body: AnyJobCreate, served: ServedModel, queue: QueueSettings) -> JobRequest:
    if isinstance(body, EmbeddingJobCreate):
        return EmbeddingRequest(body, served)
    return GenerationRequest(body, served, queue)


class GenerationRequest:
    def __init__(self, body: JobCreate, served: ServedModel, queue: QueueSettings) -> None:
        self.body, self.served = body, served
        self.max_tokens, self.choices, self.reserved = body.max_tokens, body.choice_count(), Reserved()
        self.limits = RequestLimits.of_queue(body.queue, queue, served.max_model_len(), served.vocab_size())
        self.options = body.chat_options(served.tool_parser)
        self.prompts = body.prompts()
        # The lengths the request rules judge: each prompt (a sequence of its own in the engine), or the
        # messages as stored (with the tools and template variables the template adds); max_tokens and
        # min_tokens.
        self.sizes = [RequestSize(None, body.stored_messages(), body.max_tokens, body.min_tokens,
                                  self.options.template_bytes())]
        if self.prompts is not None:
            self.sizes = prompt_sizes(self.prompts, body.max_tokens, body.min_tokens)

    def check(self) -> None:
        raise_problem(task_problem(self.served.id, self.served.task, "generate"))
        if (self.body.prompt is None) == (self.body.messages is None):
            message = "prompt: exactly one of `prompt` or `messages` is required"
            raise ApiError(422, "invalid_request", message, "prompt")
        for size in self.sizes:
            raise_problem(size_problem(size, self.limits))

    def count_prompt_tokens(self) -> int:
        """Every prompt's tokens (each judged on its own): what the job's usage will say."""
        return sum(self._counted(size) for size in self.sizes)

    def _counted(self, size: RequestSize) -> int:
        tokenizer = self.served.tokenizer
        try:
            if size.messages is not None:
                prompt_tokens = tokenizer.count_messages(size.messages, self.options)
            elif size.token_ids is not None:
                prompt_tokens = len(size.token_ids)  # read as sent
            else:
                assert size.prompt is not None
                prompt_tokens = tokenizer.count_prompt(size.prompt)
        except ValueError as exc:
            raise problem_error(tokenizer_problem(size, exc)) from exc
        raise_problem(tokens_problem(size, prompt_tokens, self.limits))
        return prompt_tokens

    def job_fields(self) -> dict[str, Any]:
        chat = self.options.to_json() if self.body.messages is not None else None
        prompts = self.prompts
        stored = (prompts.stored_prompt(), prompts.stored_inputs()) if prompts is not None else (None, None)
        return dict(prompt=stored[0], inputs=stored[1], messages=self.body.stored_messages(), chat=chat,
                    params=job_params(self.body.sampling_params(), self.options))


class EmbeddingRequest:
    """One vector per input: nothing written (max_tokens 0), each input judged against the model."""

    max_tokens, choices, reserved = 0, 1, EMBEDDING_TOKENS

    def __init__(self, body: EmbeddingJobCreate, served: ServedModel) -> None:
        self.body, self.served = body, served
        self.inputs = body.inputs()
        self.limits = served.embedding_limits()

    def check(self) -> None:
        raise_problem(task_problem(self.served.id, self.served.task, "embed"))
        raise_problem(inputs_problem(self.inputs, self.body.dimensions, self.body.truncates(), self.limits))

    def count_prompt_tokens(self) -> int:
        """Text inputs tokenized as sentence-transformers does (the tokenizer's special tokens added)."""
        task, tokenizer = self.served.task, self.served.tokenizer
        lengths = input_lengths(self.inputs, lambda text: tokenizer.count_prompt(task.as_embedded(text)))
        raise_problem(lengths_problem(lengths, self.body.truncates(), self.limits))
        return embedded_tokens(lengths, self.body.truncates(), self.limits)

    def job_fields(self) -> dict[str, Any]:
        return dict(prompt=None, messages=None, params=self.body.job_params(), kind=EMBEDDING,
                    inputs=self.inputs)

"""A completion's prompts: OpenAI's `prompt` (a string, a list of strings, a list of token ids or a list of
token-id lists: core/protocol/text_or_token_ids.py), as /v1/completions, its batch lines and generation jobs
take it. Each prompt gets the request's `n` choices, numbered as OpenAI and vLLM number them: choice c of
prompt p is `index` p * n + c. A token-id prompt is read as sent: nothing is added to it (no BOS), so `echo`
shows exactly those tokens; the request rules hold each prompt to the model's vocabulary and to the queue's
prompt length (core/protocol/request_limits.py), naming it `prompt[i]` when several were sent.

NOTE: a request's prompts are one job, not a job each. One job keeps every guarantee a request has as it
stands: one request hash under its Idempotency-Key, one cancel (its client gone, DELETE) that stops every
prompt, one webhook and one batch line per request, one completion id naming one job, and fair share counting
the request as one claim whose prompts take their places in the queue's room as n choices do
(worker/queue_room.py). And the row stays readable by the previous release: one text prompt is stored as it
always was (the `prompt` column); token ids, or several prompts, go in `inputs` (the column an embedding job
keeps its texts or token ids in), which that release's reads ignore and its workers fail as an invalid
request (neither prompt nor messages) rather than run anything else; and no column is added, each prompt as
the worker read it (its text, its logprobs) being kept in its first choice (core/store/tables.py `choices`),
whose readers take the keys they know. What one job does not change: the queue tallies (migration 0016's
triggers) and the tokens-per-minute window count a queued job's output bound as max_tokens x n from its
params, one prompt's worth; submit's own admission counts every prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from conveyor.core.protocol.request_fields import NonEmptyText, TokenId
from conveyor.core.protocol.text_or_token_ids import TextOrTokenIds, as_items, is_listed, items_problem

FIELD = "prompt"
MAX_PROMPT_CHOICES = 2048  # prompts x n in one request: the engine requests of one job


def checked_prompt(value: object) -> object:
    """`prompt`'s validator: a list is judged item by item (`prompt[2]: must not be an empty string`) and by
    its length; one string is left to its type, as it always was."""
    if isinstance(value, str):
        return value
    problem = items_problem(FIELD, value)
    if problem is None and isinstance(value, list) and is_listed(value) and len(value) > MAX_PROMPT_CHOICES:
        problem = f"{FIELD}: {len(value)} prompts exceed the limit of {MAX_PROMPT_CHOICES} per request"
    if problem is not None:  # "prompt[2]: ..." names the item; the message keeps it (field_errors)
        raise PydanticCustomError("invalid_prompt", problem)
    return value


PromptField = Annotated[
    NonEmptyText | list[NonEmptyText] | list[TokenId] | list[list[TokenId]], BeforeValidator(checked_prompt)]


def choices_problem(prompts: int, n: int) -> tuple[str, str] | None:
    """(field, reason) when the prompts' n choices each are more than one job runs."""
    if prompts * n <= MAX_PROMPT_CHOICES:
        return None
    reason = f"{n} choices for each of {prompts} prompts exceed the limit of {MAX_PROMPT_CHOICES} a request"
    return "n", reason


@dataclass(frozen=True)
class Prompts:
    """A valid `prompt` as a list of prompts, each a text or token ids; `listed`: sent as a list of prompts,
    whose items a refusal names `prompt[i]` (a string or one list of token ids is named `prompt`)."""

    items: list[TextOrTokenIds]
    listed: bool = False

    @classmethod
    def of(cls, value: str | list[str] | list[int] | list[list[int]]) -> Prompts:
        return cls(as_items(value), is_listed(value))

    def name(self, index: int) -> str:
        return f"{FIELD}[{index}]" if self.listed else FIELD

    def is_one_text(self) -> bool:
        return len(self.items) == 1 and isinstance(self.items[0], str)

    def stored_prompt(self) -> str | None:
        """The job's `prompt` column: its one text prompt (as every release stores it), else None."""
        first = self.items[0]
        return first if self.is_one_text() and isinstance(first, str) else None

    def stored_inputs(self) -> list[TextOrTokenIds] | None:
        """The job's `inputs` column: its prompts when they are token ids or several, else None."""
        return None if self.is_one_text() else list(self.items)


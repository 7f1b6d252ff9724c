"""One set of rules for OpenAI request bodies: what /v1/chat/completions and /v1/completions accept, and what
a batch line's body may hold (S3 batches and OpenAI's /v1/batches), so the same body is accepted or refused,
naming the same field, on every path. The API validates requests with these models (api/routes/openai.py);
the batch line parser (worker/batches/lines.py) validates each line's body with them too.

Three steps, each refusing with a `Refusal` that names the field:
1. the pydantic models: types and bounds (core/protocol/request_fields.py), unknown fields refused;
2. `check_request`: the model served, fields sent but not supported (`n` > 1, `logit_bias`, ...), and the
   chat roles the model's chat template knows (`ChatRoles`);
3. `job_params`: the sent fields under the job's (engine's) names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from conveyor.core.protocol.chat_messages import ChatMessageIn, ChatRoles, plain_messages
from conveyor.core.protocol.chat_options import ChatOptions, ToolParser, chat_options, tool_parser_for
from conveyor.core.protocol.completion_prompts import PromptField, Prompts, choices_problem
from conveyor.core.protocol.field_errors import validation_message
from conveyor.core.protocol.job_params import JobParams
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.protocol.request_fields import (
    ChoiceCount,
    Count,
    DeadlineSeconds,
    Logprobs,
    MinP,
    MinTokens,
    NonEmptyText,
    OnDeadlineMiss,
    OpenAIPenalty,
    OpenAITemperature,
    OutputTokens,
    Priority,
    RepetitionPenalty,
    Seed,
    Stop,
    StopTokenIds,
    StoredJsonObject,
    StoredText,
    StrictFlag,
    TopK,
    TopP,
)
from conveyor.core.protocol.request_rules import output_problem
from conveyor.core.protocol.service_tiers import ServiceTier
from conveyor.core.protocol.structured_rules import (
    MAX_CHOICES,
    structured_from_response_format,
    structured_problem,
)
from conveyor.core.protocol.tools import ToolChoice, Tools
from conveyor.core.settings import Settings
from conveyor.core.views.openai_objects import PromptView

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
COMPLETIONS_MAX_LOGPROBS = 5  # OpenAI's limit for /v1/completions
STRUCTURED_FIELDS = ("response_format", "regex", "choice")
# vLLM's names for the same constraints: its structured_outputs object and the older guided_* fields.
VLLM_STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
# Fields a job takes under the same names that say where it stands in its queue, not how it samples.
QUEUE_FIELDS = ("priority", "deadline_s", "service_tier", "on_deadline_miss")
# Chat fields a job takes under the same names (api/schemas/jobs.py), kept out of the sampling params.
CHAT_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
               "continue_final_message", "chat_template_kwargs")
STREAMED_LOGPROBS = "logprobs are not supported with stream=true; send the request without streaming"
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
@dataclass(frozen=True)
class Served:
    """What this deployment serves: the names `model` may take (none: any, for parsers used without a
    deployment), its chat template's roles, and the parser its tool calls are read with."""

    models: tuple[str, ...] = ()
    roles: ChatRoles = field(default_factory=ChatRoles)
    tool_parser: ToolParser = "hermes"

    @classmethod
    def of(cls, settings: Settings, chat_template: object) -> Served:
        names = (settings.served_model_id(), *([settings.model] if settings.model else []))
        return cls(models=names, roles=ChatRoles.of_template(chat_template),
                   tool_parser=tool_parser_for(settings.tool_call_parser, chat_template))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictFlag | None = None
    continuous_usage_stats: StrictFlag | None = Field(
        None, description="vLLM's: with include_usage, every chunk carries the usage so far")


Regex = Annotated[str, Field(min_length=1)]
Choices = Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_CHOICES)]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one constraint of its kinds that the engine runs."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | None = Field(None, alias="json", description="a JSON Schema")
    json_object: StrictFlag | None = None
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: str | None = Field(None, description="refused: only JSON Schema, JSON, regex and choice run")

    def as_structured(self) -> dict[str, Any]:
        """The engine's structured form. ValueError: why this object cannot be one."""
        if self.grammar is not None:
            raise ValueError("grammar is not supported; use json, json_object, regex or choice")
        given = {"json_schema": self.json_, "json_object": self.json_object or None, "regex": self.regex,
                 "choice": self.choice}
        kinds = [kind for kind, value in given.items() if value is not None]
        if len(kinds) != 1:
            raise ValueError(f"set exactly one of json, json_object, regex, choice (got {len(kinds)})")
        return {kinds[0]: given[kinds[0]]}


class OpenAISampling(BaseModel):
    """Fields shared by both endpoints; None means "not sent" (OpenAI's defaults apply)."""

    model_config = ConfigDict(extra="forbid")

    model: NonEmptyText | None = Field(None, description="the served model (GET /v1/models); optional")
    max_tokens: OutputTokens | None = Field(None, description="0 only to score the prompt (echo with "
                                            "logprobs on completions, or prompt_logprobs)")
    temperature: OpenAITemperature | None = None
    top_p: TopP | None = None
    n: ChoiceCount | None = Field(None, description="choices from each prompt")
    stop: Stop | None = None
    seed: Seed | None = None
    stream: StrictFlag | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: OpenAIPenalty | None = None
    frequency_penalty: OpenAIPenalty | None = None
    logit_bias: dict[str, FiniteFloat] | None = Field(None, description="only empty")
    user: StoredText | None = Field(None, description="accepted and ignored")
    priority: Priority | None = Field(None, description="vLLM's: lower is served first (default 0)")
    deadline_s: DeadlineSeconds | None = None
    on_deadline_miss: OnDeadlineMiss | None = None
    service_tier: ServiceTier | None = Field(
        None, description="priority (ahead of the default tier), flex (spare capacity: after every other job "
        "of its queue, no default deadline), auto or default; echoed in the answer")
    # Engine extras (the SDK's extra_body)
    top_k: TopK | None = None
    min_p: MinP | None = None
    min_tokens: MinTokens | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: StrictFlag | None = None
    stop_token_ids: StopTokenIds | None = None
    prompt_logprobs: Logprobs | None = Field(
        None, description="vLLM's: each prompt token's logprob and this many alternatives (not with stream)")
    skip_special_tokens: StrictFlag | None = None
    include_stop_str_in_output: StrictFlag | None = None
    speculate: StrictFlag | None = Field(
        None, description="false: no speculative drafts for this request (default true, where its model "
        "speculates)")
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "json_schema", "json_schema": {"name", "schema"}}, json_object or text'
    )
    regex: Regex | None = Field(None, description="output matches this regex")
    choice: Choices | None = Field(None, description="output is exactly one of these strings")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's form of the same constraints: one of json, json_object, regex, choice")
    guided_json: dict[str, Any] | None = Field(None, description="vLLM's older name: a JSON Schema")
    guided_regex: Regex | None = Field(None, description="vLLM's older name for regex")
    guided_choice: Choices | None = Field(None, description="vLLM's older name for choice")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM sends it when both include_usage and continuous_usage_stats are set."""
        options = self.stream_options
        return self.include_usage() and bool(options and options.continuous_usage_stats)

    def refusal(self) -> Refusal | None:
        """A sent value Conveyor cannot honour (or that contradicts another), else None."""
        if self.logit_bias:
            return Refusal("unsupported", "logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            return Refusal("invalid", "stream_options", "stream_options is only allowed with stream=true")
        if self.prompt_logprobs is not None and self.stream:
            return Refusal("unsupported", "prompt_logprobs", STREAMED_LOGPROBS)
        problem = output_problem(self.requested_max_tokens(), self.n, self.scored_prompt())
        if problem is not None:
            return Refusal("invalid", *problem)
        return self._structured_refusal()

    def scored_prompt(self) -> int | None:
        """The alternatives per prompt token the job computes (its prompt_logprobs), or None."""
        return self.prompt_logprobs

    def prompt_view(self) -> PromptView:
        """What the answer shows of the prompt."""
        return PromptView(vllm_top_n=self.prompt_logprobs)

    def _structured_refusal(self) -> Refusal | None:
        names = (*STRUCTURED_FIELDS, *VLLM_STRUCTURED_FIELDS)
        sent = [name for name in names if getattr(self, name) is not None]
        if len(sent) > 1:
            message = f"send at most one of {', '.join(names)}; {sent[0]} is set too"
            return Refusal("invalid", sent[1], message)
        try:
            structured = self.structured()
        except ValueError as exc:
            return Refusal("invalid", sent[0], str(exc))
        problem = structured_problem(structured) if structured is not None else None
        return Refusal("invalid", sent[0], problem) if problem is not None else None

    def structured(self) -> dict[str, Any] | None:
        """The engine's structured-output form (a job's params["structured"]), or None. ValueError: why the
        response_format cannot be one."""
        if self.response_format is not None:
            return structured_from_response_format(self.response_format)
        if self.regex is not None or self.guided_regex is not None:
            return {"regex": self.regex or self.guided_regex}
        if self.choice is not None or self.guided_choice is not None:
            return {"choice": self.choice or self.guided_choice}
        if self.guided_json is not None:
            return {"json_schema": self.guided_json}
        return self.structured_outputs.as_structured() if self.structured_outputs is not None else None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def job_params(self) -> dict[str, Any]:
        """The sent sampling fields under the job's (engine's) names, structured-output fields as sent;
        unsent ones keep the job defaults. max_tokens is left to the caller (each path has its default)."""
        names = (*QUEUE_FIELDS, *_SAME_NAMED)
        params = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if params.get("n") == 1:
            del params["n"]  # one choice: the job's default, not stored
        if self.scored_prompt() is not None:
            params["prompt_logprobs"] = self.scored_prompt()
        return {**params, **self._structured_job_fields()}

    def _structured_job_fields(self) -> dict[str, Any]:
        """The structured-output constraint under the job's field names, vLLM's forms translated (refusal()
        has judged them before any job is built)."""
        sent = {name: getattr(self, name) for name in STRUCTURED_FIELDS if getattr(self, name) is not None}
        if sent or all(getattr(self, name) is None for name in VLLM_STRUCTURED_FIELDS):
            return sent
        structured = self.structured()
        assert structured is not None, "a vLLM structured field was sent"
        kind, value = next(iter(structured.items()))
        if kind == "json_schema":
            schema = {"name": "output", "schema": value}
            return {"response_format": {"type": "json_schema", "json_schema": schema}}
        if kind == "json_object":
            return {"response_format": {"type": "json_object"}}
        return {kind: value}


# The sampling fields both endpoints send under the job's own names (core/protocol/job_params.py); the rest
# are translated: max_tokens takes each path's default, prompt_logprobs echo's logprobs too, and logprobs is
# each endpoint's own.
_SAME_NAMED = tuple(name for name in JobParams.model_fields if name in OpenAISampling.model_fields
                    and name not in ("max_tokens", "prompt_logprobs"))


class ChatFields(BaseModel):
    """How a chat's messages are rendered and its answer read: OpenAI's tool fields and vLLM's template
    options, the same on /v1/chat/completions, batch lines and chat jobs (core/protocol/chat_options.py)."""

    tools: Tools | None = Field(None, description="functions the model may call, rendered by its template")
    tool_choice: ToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named function; required "
        "and a named function constrain the output to a call whose arguments follow the schema")
    parallel_tool_calls: StrictFlag | None = Field(None, description="false: at most one call")
    add_generation_prompt: StrictFlag | None = Field(
        None, description="vLLM's: end the prompt with the assistant turn's opening (default true, or false "
        "with continue_final_message)")
    continue_final_message: StrictFlag | None = Field(
        None, description="vLLM's: leave the last message open, and continue it")
    chat_template_kwargs: StoredJsonObject | None = Field(
        None, description="vLLM's: extra variables for the chat template (e.g. enable_thinking)")

    def chat_options(self, parser: ToolParser) -> ChatOptions:
        """How the messages are rendered and the answer read. ValueError "<field>: <reason>"."""
        return chat_options(
            tools=self.tools, tool_choice=self.tool_choice, parallel_tool_calls=self.parallel_tool_calls,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs, parser=parser)


class ChatCompletionCreate(OpenAISampling, ChatFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: OutputTokens | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Logprobs | None = None

    def refusal(self) -> Refusal | None:
        if self.top_logprobs is not None and not self.logprobs:
            return Refusal("invalid", "top_logprobs", "top_logprobs needs logprobs set to true")
        if self.logprobs and self.stream:
            return Refusal("unsupported", "logprobs", STREAMED_LOGPROBS)
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            return Refusal(
                "invalid", "max_completion_tokens", "max_tokens and max_completion_tokens disagree"
            )
        return self._chat_refusal() or super().refusal()

    def _chat_refusal(self) -> Refusal | None:
        try:
            options = self.chat_options("hermes")  # the parser changes nothing judged here
        except ValueError as exc:
            param, _, reason = str(exc).partition(": ")
            return Refusal("invalid", param, reason)
        structured = [name for name in (*STRUCTURED_FIELDS, *VLLM_STRUCTURED_FIELDS) if getattr(self, name)]
        if options.constrained and structured:
            return Refusal("invalid", structured[0], "cannot be set with tool_choice required or a named "
                           "function, which constrain the output to the call")
        return None

    def job_params(self) -> dict[str, Any]:
        """`logprobs: true` + `top_logprobs: n` is the engine's `logprobs: n` (0 alternatives by default);
        tools and template options as sent (a job takes them under the same names)."""
        params = super().job_params()
        if self.logprobs:
            params["logprobs"] = self.top_logprobs or 0
        for name in CHAT_FIELDS:
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        return params

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self, roles: ChatRoles) -> list[dict[str, Any]]:
        return plain_messages(self.messages, roles)


class CompletionCreate(OpenAISampling):
    prompt: PromptField = Field(
        description="a string, a list of strings, a list of token ids or a list of token-id lists: n choices "
        "for each prompt, `index` prompt * n + choice; token ids are read as sent (no BOS added)")
    logprobs: Annotated[int, Field(strict=True, ge=0, le=COMPLETIONS_MAX_LOGPROBS)] | None = None
    echo: StrictFlag | None = Field(None, description="the prompt before each choice's text (and, with "
                                    "logprobs, its tokens' logprobs, the first null)")
    suffix: StoredText | None = None
    best_of: Count | None = None

    def refusal(self) -> Refusal | None:
        too_many = choices_problem(len(self.prompts().items), self.n or 1)
        if too_many is not None:
            return Refusal("invalid", *too_many)
        checks = (
            ("logprobs", self.logprobs is not None and bool(self.stream), STREAMED_LOGPROBS),
            ("suffix", bool(self.suffix), "suffix is not supported"),
            ("best_of", self.best_of not in (None, 1), "only best_of=1 is supported"),
        )
        for param, bad, reason in checks:
            if bad:
                return Refusal("unsupported", param, reason)
        return super().refusal()

    def job_params(self) -> dict[str, Any]:
        params = super().job_params()
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        return params

    def scored_prompt(self) -> int | None:
        """vLLM's prompt_logprobs or echo's logprobs, the more alternatives; echo with max_tokens 0 scores
        the prompt too (the engine needs something to compute), showing none of it."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if not asked and self.echo and self.max_tokens == 0:
            asked = [0]
        return max(asked) if asked else None

    def prompt_view(self) -> PromptView:
        echoed = self.logprobs if self.echo else None
        return PromptView(echo=bool(self.echo), echo_top_n=echoed, vllm_top_n=self.prompt_logprobs)

    def prompts(self) -> Prompts:
        return Prompts.of(self.prompt)


OpenAIRequest = ChatCompletionCreate | CompletionCreate


def parse_body(endpoint: str, body: dict[str, Any]) -> OpenAIRequest:
    """A batch line's body validated as the synchronous route validates its request; Refusal naming the
    field otherwise."""
    model = ChatCompletionCreate if endpoint == CHAT else CompletionCreate
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        param, message = validation_message(exc.errors())
        raise Refusal("invalid", param, message.removeprefix(f"{param}: ") if param else message) from None


def check_request(body: OpenAIRequest, served: Served) -> None:
    """Refusal for a model that is not served or a field that cannot be honoured (chat roles: chat_messages
    checks them)."""
    check_model(body.model, served)
    refusal = body.refusal()
    if refusal is not None:
        raise refusal


def check_model(model: str | None, served: Served) -> None:
    """Refusal for a `model` this deployment does not serve (None: the default, always served)."""
    if model is not None and served.models and model not in served.models:
        raise Refusal("model_not_found", "model",
                      f"the model `{model}` does not exist; this server serves `{served.models[0]}`")

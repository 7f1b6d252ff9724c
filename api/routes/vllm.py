"""vLLM's server routes, where they have a meaning here, for clients written for vLLM's OpenAI-compatible
server: /health (can a worker take work now?), /version, /tokenize and /detokenize with the served model's
tokenizer and chat template. Errors come in OpenAI's shape, as vLLM sends them.

/health differs from /readyz on purpose: /readyz says this API can take jobs (a probe must not take the API
out of its Service while workers scale from zero), /health says jobs would run now, which is what a
benchmarking client checks before it starts.
"""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from conveyor.api.auth import WaitingTenant
from conveyor.api.chat_jobs import model_of
from conveyor.api.deps import ServicesDep
from conveyor.api.openai_errors import OpenAIError, OpenAIRoute, from_refusal
from conveyor.api.schemas.errors import openai_error_responses
from conveyor.api.schemas.vllm import (
    Detokenize,
    DetokenizeResponse,
    TokenizeChat,
    TokenizeCompletion,
    TokenizeResponse,
    Version,
)
from conveyor.api.served_models import ServedModel
from conveyor.core.clock import utcnow
from conveyor.core.protocol.chat_messages import ChatRoles, plain_messages
from conveyor.core.protocol.chat_options import chat_options
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.store import workers

router = APIRouter(tags=["vllm"], route_class=OpenAIRoute)
PACKAGE = "conveyor"


@router.get("/health", responses={200: {"description": "a worker can take work now"},
                                  503: {"description": "no live worker (jobs would wait queued)"}})
def health(services: ServicesDep) -> JSONResponse:
    with services.session_factory() as session:
        consumers = workers.live_workers_per_queue(
            session, now=utcnow(), dead_after_s=services.settings.worker_dead_after_s)
    if not consumers:
        return JSONResponse({"status": "unavailable", "detail": "no live worker: jobs would wait queued"},
                            status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/version", response_model=Version)
def version() -> Version:
    return Version(version=importlib.metadata.version(PACKAGE))


@router.post("/tokenize", response_model=TokenizeResponse, responses=openai_error_responses(400, 401, 404))
async def tokenize(body: TokenizeCompletion | TokenizeChat, services: ServicesDep,
                   tenant: WaitingTenant) -> TokenizeResponse:
    """The token ids of a prompt, or of chat messages rendered with the model's chat template (vLLM's
    request and response)."""
    model = model_of(services, body.model, tenant=tenant)
    ids = await run_in_threadpool(_token_ids, model, body)
    strings = None
    if body.return_token_strs:
        strings = await run_in_threadpool(model.tokenizer.token_strings, ids)
    return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len(), tokens=ids,
                            token_strs=strings)


@router.post("/detokenize", response_model=DetokenizeResponse,
             responses=openai_error_responses(400, 401, 404))
async def detokenize(body: Detokenize, services: ServicesDep, tenant: WaitingTenant) -> DetokenizeResponse:
    """The text of token ids (vLLM's request and response)."""
    model = model_of(services, body.model, tenant=tenant)
    vocab = model.tokenizer.vocab_size
    for index, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            message = f"tokens[{index}]: {token} is not a token id of the model (0..{vocab - 1})"
            raise OpenAIError(400, message, code="invalid_request", param=f"tokens[{index}]")
    return DetokenizeResponse(prompt=await run_in_threadpool(model.tokenizer.decode, body.tokens))


def _token_ids(model: ServedModel, body: TokenizeCompletion | TokenizeChat) -> list[int]:
    if isinstance(body, TokenizeCompletion):
        return model.tokenizer.encode_prompt(body.prompt, body.add_special_tokens)
    try:
        options = chat_options(
            tools=body.tools, tool_choice=None, parallel_tool_calls=None,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs, parser=model.tool_parser)
    except ValueError as exc:
        param, _, reason = str(exc).partition(": ")
        raise from_refusal(Refusal("invalid", param, reason)) from None
    try:
        messages = plain_messages(body.messages, ChatRoles.of_template(model.tokenizer.chat_template))
        return model.tokenizer.encode_chat(messages, options, body.add_special_tokens)
    except Refusal as refusal:
        raise from_refusal(refusal) from None
    except ValueError as exc:
        raise OpenAIError(400, str(exc), code="invalid_request", param="messages") from None

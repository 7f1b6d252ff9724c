"""POST /v1/embeddings, OpenAI's: one vector per input, answered when its job ends.

The request is a job of kind embedding on the `interactive` queue, submitted exactly like POST /v1/jobs with
`kind: "embedding"` (same rules, limits, quotas and 429s, same tenant), so it stays visible under /v1/jobs
(its id in the X-Conveyor-Job-Id header). A model that generates text refuses it with a 400 saying so.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from conveyor.api import openai_sync
from conveyor.api.auth import WaitingTenant
from conveyor.api.chat_jobs import QUEUE, model_of
from conveyor.api.deps import ServicesDep
from conveyor.api.openai_errors import OpenAIRoute, from_validation_error
from conveyor.api.schemas.errors import openai_error_responses
from conveyor.api.schemas.jobs import EmbeddingJobCreate
from conveyor.api.served_models import ServedModel
from conveyor.core.protocol.embedding_request import EmbeddingCreate, EmbeddingFields
from conveyor.core.protocol.job_kinds import EMBEDDING
from conveyor.core.seams.token_stream import TokenStream
from conveyor.core.views.embedding_objects import EmbeddingList, embedding_list

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)
RESPONSES = openai_error_responses(400, 401, 403, 404, 409, 413, 429, 504)


@router.post("/embeddings", response_model=EmbeddingList, responses=RESPONSES)
async def create_embeddings(body: EmbeddingCreate, request: Request, services: ServicesDep,
                            tenant: WaitingTenant) -> Response:
    """A vector per input, in the order given, with usage (the inputs' tokens)."""
    model = model_of(services, body.model, task="embed", tenant=tenant)
    stream: TokenStream | None = getattr(request.app.state, "token_stream", None)  # its end wakes the wait
    job = await openai_sync.start(services, stream, tenant, _job_create(model, body))
    outcome = await openai_sync.wait_outcome(services, tenant, job, request.is_disconnected)
    if outcome is None:
        return Response(status_code=499)  # nobody is listening; logged by the server only
    if outcome.status != "succeeded" or outcome.embeddings is None:
        raise openai_sync.outcome_error(outcome)
    answer = embedding_list(outcome.embeddings, body.encoding_format, model.id, outcome.prompt_tokens)
    return JSONResponse(answer, headers={"X-Conveyor-Job-Id": job.job_id})


def _job_create(model: ServedModel, body: EmbeddingCreate) -> EmbeddingJobCreate:
    fields = body.model_dump(include=set(EmbeddingFields.model_fields), exclude_none=True)
    try:
        return EmbeddingJobCreate.model_validate(dict(kind=EMBEDDING, model=model.id, queue=QUEUE, **fields,
                                                      **body.queue_params()))
    except ValidationError as exc:
        raise from_validation_error(exc.errors()) from exc

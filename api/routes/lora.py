"""Admin: LoRA adapters loaded and unloaded at run time, under vLLM's routes (`POST /v1/load_lora_adapter`,
`POST /v1/unload_lora_adapter`).

Loading stores the adapter (core/store/lora_adapters.py): the API serves its id from then on (within
RUNTIME_TTL_S on every API replica), and each worker of its base model reads it when a job first names it
(worker/adapters.py), so no process restarts. Unloading is refused while queued or running jobs run with
it: they finish, or are cancelled, first; the workers then drop it from their engines. Adapters declared in
the configuration are neither loaded nor unloaded here.

The routes take the admin token (conveyor.api.auth admin_authorized), never a tenant's key: an adapter
changes what every tenant may be served.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from conveyor.api.auth import admin_authorized
from conveyor.api.deps import Services, ServicesDep, SessionDep
from conveyor.api.errors import ApiError
from conveyor.api.schemas.errors import error_responses
from conveyor.api.schemas.lora import LoadLoraAdapter, LoraAdapterPublic, UnloadLoraAdapter
from conveyor.core.clock import utcnow
from conveyor.core.s3 import parse_s3_prefix_url
from conveyor.core.settings import UnknownModelError
from conveyor.core.store import lora_adapters
from conveyor.core.store.tables import LoraAdapter

admin_bearer = HTTPBearer(auto_error=False, scheme_name="AdminToken",
                          description="Authorization: Bearer <admin token> (CONVEYOR_ADMIN_TOKEN)")


def admin(request: Request, services: ServicesDep,
          _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(admin_bearer)]) -> None:
    """Refuses the request unless it carries the admin token; runs before any query."""
    if not admin_authorized(services.settings, request.headers.get("authorization")):
        raise ApiError(401, "unauthorized", "Authorization: the admin routes require the admin token as a "
                       "Bearer token", "Authorization", {"WWW-Authenticate": "Bearer"})


router = APIRouter(prefix="/v1", tags=["admin"], dependencies=[Depends(admin)])


@router.post("/load_lora_adapter", response_model=LoraAdapterPublic,
             responses=error_responses(401, 404, 409, 422))
def load_lora_adapter(body: LoadLoraAdapter, session: SessionDep, services: ServicesDep) -> LoraAdapterPublic:
    """Serves a PEFT adapter under `lora_name` on its base model's workers, without a restart."""
    base = _base_model(services, body.model)
    if not services.settings.for_model(base).lora_slots():
        message = (f"model: `{base}` has no LoRA slots (it declares no adapters and sets no max_loras); set "
                   "max_loras for it to load adapters at run time")
        raise ApiError(422, "invalid_request", message, "model")
    if services.models.is_taken(body.lora_name):
        raise ApiError(409, "conflict", f"lora_name: `{body.lora_name}` is already a model's or an adapter's "
                       "id", "lora_name")
    if body.lora_path.startswith("s3://"):
        try:
            parse_s3_prefix_url(body.lora_path)
        except ValueError as exc:
            raise ApiError(422, "invalid_request", f"lora_path: {exc}", "lora_path") from None
    try:
        row = lora_adapters.add(session, body.lora_name, base, body.lora_path, body.tenants, utcnow())
    except lora_adapters.AdapterExists as exc:
        raise ApiError(409, "conflict", str(exc), "lora_name") from None
    services.models.forget_runtime_adapters()
    return _public(row)


@router.post("/unload_lora_adapter", response_model=LoraAdapterPublic,
             responses=error_responses(401, 404, 409, 422))
def unload_lora_adapter(body: UnloadLoraAdapter, session: SessionDep, services: ServicesDep,
                        ) -> LoraAdapterPublic:
    """Stops serving an adapter loaded at run time; refused (409) while queued or running jobs use it."""
    name = body.lora_name
    if services.settings.adapter_base(name) is not None:
        raise ApiError(409, "conflict", f"lora_name: `{name}` is declared in the configuration; remove it "
                       "there (and restart its workers)", "lora_name")
    row = lora_adapters.get(session, name)
    if row is None:
        raise ApiError(404, "not_found", f"lora_name: no adapter `{name}` is loaded", "lora_name")
    held = lora_adapters.unfinished_jobs_naming(session, name)
    if held:
        raise ApiError(409, "conflict", f"lora_name: {held} queued or running job(s) run with `{name}`; "
                       "unload it once they finish, or cancel them first", "lora_name")
    public = _public(row)
    lora_adapters.remove(session, name)
    services.models.forget_runtime_adapters()
    return public


def _base_model(services: Services, asked: str | None) -> str:
    try:
        base = services.models.get(asked)
    except UnknownModelError as exc:
        raise ApiError(404, "model_not_found", str(exc), "model") from None
    if base.lora is not None:
        message = f"model: `{asked}` is an adapter; name its base model"
        raise ApiError(422, "invalid_request", message, "model")
    return base.id


def _public(row: LoraAdapter) -> LoraAdapterPublic:
    return LoraAdapterPublic(lora_name=row.name, model=row.model_id, lora_path=row.path, tenants=row.tenants)

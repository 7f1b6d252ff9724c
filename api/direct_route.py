"""Routes answered without FastAPI's generic dependency solver: the hot routes (a job's submit and its read).

FastAPI still builds such a route from its endpoint's signature: the OpenAPI document, the pydantic fields
that validate its path, query, header and body parameters (so the same errors, through the same handlers)
and the call of the endpoint. Only the solving differs. FastAPI's walks a tree of dependencies, about twenty
parameter sources per request whether the request has them or not, which cost a seventh of the embedded
server's CPU per job (docs/benchmarks/results.md); here a request reads the few sources its route declares,
and its dependencies come from PROVIDERS, in the order FastAPI solves them (so a 401 still comes before a
422).

A direct route's endpoint may take path, query and header parameters, one JSON body, the `Request`, and the
dependencies that PROVIDERS names; it answers a `Response`. Anything else is refused when the route is
built.
"""

from __future__ import annotations

import email.message
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi._compat import ModelField
from fastapi.dependencies.utils import request_body_to_args, request_params_to_args
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic_core import PydanticUndefined
from starlette.concurrency import run_in_threadpool

from conveyor.api.auth import bearer_scheme, current_tenant
from conveyor.api.deps import get_services, get_session, services_of

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])
Provider = Callable[[Request, AsyncExitStack], Awaitable[Any]]


async def _services(request: Request, _stack: AsyncExitStack) -> Any:
    return services_of(request)


async def _tenant(request: Request, _stack: AsyncExitStack) -> Any:
    return await current_tenant(services_of(request), await bearer_scheme(request))


async def _session(request: Request, stack: AsyncExitStack) -> Any:
    return await stack.enter_async_context(_session_scope(request))


_session_scope = asynccontextmanager(get_session)

PROVIDERS: dict[Callable[..., Any], Provider] = {
    get_services: _services,
    current_tenant: _tenant,
    get_session: _session,  # closed once the endpoint has answered
}


UNSUPPORTED = ("websocket_param_name", "http_connection_param_name", "response_param_name",
               "background_tasks_param_name", "security_scopes_param_name")


class DirectRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        return _handler(_effective(self))


def direct_route(router: APIRouter, path: str, *, methods: list[str], **options: Any,
                 ) -> Callable[[Endpoint], Endpoint]:
    """`@direct_route(router, path, methods=[...], ...)`: as `@router.api_route(...)`, as a DirectRoute."""
    def register(endpoint: Endpoint) -> Endpoint:
        router.add_api_route(path, endpoint, methods=methods, route_class_override=DirectRoute, **options)
        return endpoint
    return register


def _effective(route: APIRoute) -> APIRoute:
    """The route as included in its app (its router's prefix applied), when FastAPI builds that handler."""
    from fastapi.routing import _effective_route_context_var  # FastAPI's own hook for included routes

    context = _effective_route_context_var.get()
    if context is not None and context.original_route is route:
        return context  # type: ignore[no-any-return]
    return route


def _handler(route: APIRoute) -> Callable[[Request], Awaitable[Response]]:
    dependant = route.dependant
    call = dependant.call
    assert call is not None, "a route calls its endpoint"
    unknown = [sub.call for sub in dependant.dependencies if sub.call not in PROVIDERS]
    assert not unknown, f"{route.path}: a direct route's dependencies are PROVIDERS' only, not {unknown}"
    unsupported = [name for name in UNSUPPORTED if getattr(dependant, name) is not None]
    unsupported += ["cookie parameters"] if dependant.cookie_params else []
    assert not unsupported, f"{route.path}: a direct route takes none of {unsupported}"
    providers = [(sub.name, PROVIDERS[sub.call]) for sub in dependant.dependencies if sub.call is not None]
    params = [_reader(fields, source) for fields, source in (
        (dependant.path_params, _path), (dependant.query_params, _query), (dependant.header_params, _headers),
    ) if fields]
    body_field = route.body_field
    strict_content_type = bool(getattr(route.strict_content_type, "value", route.strict_content_type))
    request_name = dependant.request_param_name
    is_async = inspect.iscoroutinefunction(call)

    async def handle(request: Request) -> Response:
        async with AsyncExitStack() as stack:
            values: dict[str, Any] = {name: await provide(request, stack) for name, provide in providers}
            errors: list[Any] = []
            for read in params:
                found, problems = read(request)
                values.update(found)
                errors += problems
            body: Any = PydanticUndefined
            if body_field is not None:
                body = await _json_body(request, strict_content_type)
                found, problems = await request_body_to_args([body_field], body, embed_body_fields=False)
                values.update(found)
                errors += problems
            if errors:
                raise RequestValidationError(errors, body=None if body is PydanticUndefined else body)
            if request_name is not None:
                values[request_name] = request
            response = await call(**values) if is_async else await run_in_threadpool(call, **values)
        assert isinstance(response, Response), f"{route.path}: a direct route's endpoint answers a Response"
        return response

    return handle


Read = Callable[[Request], tuple[dict[str, Any], list[Any]]]
Source = Callable[[Request], Mapping[str, Any]]


def _reader(fields: list[ModelField], source: Source) -> Read:
    """Reads and validates one source's parameters with FastAPI's own function, except in the two common
    cases that need no validation: a path parameter of plain `str` (every path segment is one), and optional
    parameters none of which the request sent (each takes its default, as FastAPI gives it)."""
    if source is _path and all(_plain_str(field) for field in fields):
        return lambda request: ({field.name: request.path_params[field.alias] for field in fields}, [])
    names = {name for field in fields for name in (field.alias, field.name, field.name.replace("_", "-"))}
    defaults = all(not field.field_info.is_required() and field.field_info.default is None
                   for field in fields)  # the defaults are None: nothing to copy

    def read(request: Request) -> tuple[dict[str, Any], list[Any]]:
        received = source(request)
        if defaults and not any(name in received for name in names):
            return {field.name: None for field in fields}, []
        return request_params_to_args(fields, received)
    return read


def _plain_str(field: ModelField) -> bool:
    return field.field_info.annotation is str and not field.field_info.metadata


def _path(request: Request) -> Mapping[str, Any]:
    return request.path_params


def _query(request: Request) -> Mapping[str, Any]:
    return request.query_params


def _headers(request: Request) -> Mapping[str, Any]:
    return request.headers


async def _json_body(request: Request, strict_content_type: bool) -> Any:
    """The body as FastAPI reads it for a JSON body parameter: parsed when its content type is JSON (or
    absent, unless the route is strict), else the bytes (which then fail validation); absent when empty."""
    raw = await request.body()
    if not raw:
        return PydanticUndefined
    content_type = request.headers.get("content-type")
    if content_type is None:
        return raw if strict_content_type else _parsed(raw)
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    if message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json")):
        return _parsed(raw)
    return raw


def _parsed(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {},
                 "ctx": {"error": exc.msg}}
        raise RequestValidationError([error], body=exc.doc) from exc
    except (ValueError, RecursionError) as exc:  # over the digit limit, too deep, not UTF-8: as FastAPI
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc

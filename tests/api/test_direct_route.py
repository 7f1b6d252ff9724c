"""A DirectRoute answers as the same endpoint declared as a plain FastAPI route does: same values, same
errors (through the app's error handlers), same OpenAPI operation."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, Field

from conveyor.api.direct_route import direct_route
from conveyor.api.errors import install_error_handlers


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)


def echo(
    item: str, body: Body, request: Request,
    wait: Annotated[float | None, Query(gt=0, le=60, allow_inf_nan=False)] = None,
    key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    return JSONResponse({"item": item, "body": body.model_dump(), "wait": wait, "key": key,
                         "path": request.url.path})


def read(item: str, wait: Annotated[float | None, Query(gt=0)] = None) -> Response:
    return JSONResponse({"item": item, "wait": wait})


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    plain = APIRouter(prefix="/plain")
    plain.post("/{item}")(echo)
    plain.get("/{item}")(read)
    direct = APIRouter(prefix="/direct")
    direct_route(direct, "/{item}", methods=["POST"])(echo)
    direct_route(direct, "/{item}", methods=["GET"])(read)
    app.include_router(plain)
    app.include_router(direct)
    return TestClient(app)


JSON = {"content-type": "application/json"}
POSTS: list[dict[str, Any]] = [
    {"json": {"prompt": "hi"}},
    {"json": {"prompt": "hi", "max_tokens": 3}, "params": {"wait": "2.5"},
     "headers": {"Idempotency-Key": "k1"}},
    {"json": {"prompt": "hi"}, "headers": {"idempotency-key": "lower"}},
    {"json": {"prompt": ""}},
    {"json": {"prompt": "hi", "extra": 1}},
    {"json": ["not", "an", "object"]},
    {"content": b"{not json", "headers": JSON},
    {"content": b"", "headers": JSON},
    {"content": b'{"prompt": "hi"}', "headers": {"content-type": "text/plain"}},
    {"content": b'{"prompt": "hi"}'},
    {"content": b'{"prompt": "hi"}', "headers": {"content-type": "application/vnd.x+json; charset=utf-8"}},
    {"json": {"prompt": "hi"}, "params": {"wait": "0"}},
    {"json": {"prompt": "hi"}, "params": {"wait": "inf"}},
    {"json": {"prompt": "hi"}, "params": {"wait": "soon"}},
    {"json": {"prompt": "hi"}, "params": {"other": "1"}},
    {"content": b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "headers": JSON},
    {"content": b'{"prompt": "\xff\xfe"}', "headers": JSON},
    {"content": b"[" * 100_000, "headers": JSON},
]
GETS: list[dict[str, Any]] = [{}, {"params": {"wait": "3"}}, {"params": {"wait": "-1"}},
                              {"params": {"x": "y"}}]


@pytest.mark.parametrize("request_args", POSTS)
def test_a_post_is_answered_as_fastapi_answers_it(client: TestClient, request_args: dict[str, Any]) -> None:
    plain = client.post("/plain/a%20b", **request_args)
    direct = client.post("/direct/a%20b", **request_args)
    assert direct.status_code == plain.status_code
    assert _without_path(direct.json()) == _without_path(plain.json())


@pytest.mark.parametrize("request_args", GETS)
def test_a_get_is_answered_as_fastapi_answers_it(client: TestClient, request_args: dict[str, Any]) -> None:
    plain = client.get("/plain/item-1", **request_args)
    direct = client.get("/direct/item-1", **request_args)
    assert (direct.status_code, direct.json()) == (plain.status_code, plain.json())


def test_the_answers_compared_are_not_all_alike(client: TestClient) -> None:
    """The comparisons above cover both successes and each kind of refusal."""
    statuses = {client.post("/direct/x", **args).status_code for args in POSTS}
    assert statuses >= {200, 422}
    assert client.post("/direct/x", json={"prompt": "hi"}, params={"wait": "2"}).json()["wait"] == 2.0


def test_the_openapi_operations_are_the_same(client: TestClient) -> None:
    paths = client.app.openapi()["paths"]  # type: ignore[attr-defined]
    for method in ("post", "get"):
        plain, direct = paths["/plain/{item}"][method], paths["/direct/{item}"][method]
        for operation in (plain, direct):
            operation.pop("operationId")
            operation.pop("summary", None)
        assert direct == plain


def unknown() -> int:
    return 1


def unprovided(value: Annotated[int, Depends(unknown)]) -> Response:
    return Response()


def test_a_dependency_it_cannot_provide_is_refused_when_the_route_is_built() -> None:
    with pytest.raises(AssertionError, match="PROVIDERS"):
        direct_route(APIRouter(), "/x", methods=["GET"])(unprovided)


def _without_path(answer: Any) -> Any:
    """The answer without the request's own path (/plain/... or /direct/...)."""
    if not isinstance(answer, dict):
        return answer
    return {key: value for key, value in answer.items() if key != "path"}

"""The OpenAPI document, without the validation answers FastAPI invents.

FastAPI declares a 422 in its own shape (`HTTPValidationError`) on every route with a parameter unless the
route declares one itself. Conveyor's routes declare their 422s in Conveyor's error shape wherever a request
can fail validation; the OpenAI routes answer 400 in OpenAI's shape; and a route whose only parameters are
free-form path strings cannot fail validation at all. So the invented answers are untrue and are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")


def install_truthful_openapi(app: FastAPI) -> None:
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _without_invented_422s(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _without_invented_422s(schema: dict[str, Any]) -> dict[str, Any]:
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if "HTTPValidationError" in json.dumps(responses.get("422", {})):
                del responses["422"]
    components = schema.get("components", {}).get("schemas", {})
    for name in FASTAPI_VALIDATION_SCHEMAS:
        components.pop(name, None)
    return schema

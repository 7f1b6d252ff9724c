"""The HTTP API reference: every route of the app's OpenAPI document, and the document itself."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.cli.reference.markdown import cell
from conveyor.core.settings import Settings

HTTP_METHODS = ("get", "post", "put", "patch", "delete")


class _NoBroker:
    """The OpenAPI document depends on the routes and models only: nothing is published while it is built."""

    def publish(self, job_id: str, queue: str) -> None:
        raise AssertionError("nothing is published while the OpenAPI document is built")

    def ping(self) -> bool:
        return False


class _NoTokenizer(PromptTokenizer):
    """Building the OpenAPI document counts no tokens, so no model is loaded for it."""

    def __init__(self) -> None:
        pass


def openapi_document() -> dict[str, Any]:
    """The document /openapi.json serves (when the docs are on), from an app built on placeholders: an
    in-memory database nobody opens, no broker, no model."""
    with tempfile.TemporaryDirectory() as data_dir:
        settings = Settings(database_url="sqlite://", data_dir=Path(data_dir), auth_enabled=True,
                            metrics_token=SecretStr("unused"))
        app = create_app(settings, publisher=_NoBroker(), tokenizer=_NoTokenizer())
        return app.openapi()


def routes(document: dict[str, Any]) -> list[tuple[str, str]]:
    """(METHOD, path) of every operation, in the document's order."""
    return [(method.upper(), path) for path, item in document["paths"].items()
            for method in HTTP_METHODS if method in item]


def http_page(document: dict[str, Any]) -> str:
    lines = ["# HTTP API", "",
             f"Every route of the API, rendered from its OpenAPI document when this site was built"
             f" ([openapi.json](openapi.json), version {document['info'].get('version', '')}). A running"
             " service serves the same document and an interactive view at `/docs` when"
             " `CONVEYOR_DOCS_ENABLED` allows. The [jobs API guide](../guides/jobs-api.md) and"
             " [the OpenAI SDK guide](../guides/openai.md) show them in use.", "",
             "| method | path | what it does |", "|---|---|---|"]
    for method, path in routes(document):
        operation = document["paths"][path][method.lower()]
        lines.append(f"| {method} | `{path}` | {_summary(operation)} |")
    return "\n".join(lines) + "\n"


def _summary(operation: dict[str, Any]) -> str:
    text = operation.get("description") or operation.get("summary") or ""
    return cell(text.strip().split("\n\n")[0])

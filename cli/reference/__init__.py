"""The documentation's reference pages, rendered from the code: every setting (settings_page), every HTTP
route (http_page), every metric (metrics_page) and every CLI command (cli_page). The site's build hook
(docs/_hooks/reference_pages.py) adds them to the site each time it is built, so they cannot drift from the
code; tests/cli/test_reference.py checks that none is missing.
"""

from __future__ import annotations

import json

import typer

from conveyor.cli.reference.cli_page import cli_page
from conveyor.cli.reference.http_page import http_page, openapi_document
from conveyor.cli.reference.metrics_page import exported_metrics, metrics_page
from conveyor.cli.reference.settings_page import settings_page

SETTINGS_PAGE = "reference/settings.md"
HTTP_PAGE = "reference/http-api.md"
METRICS_PAGE = "reference/metrics.md"
OPENAPI_FILE = "reference/openapi.json"
CLI_PAGE = "reference/cli.md"


def pages(app: typer.Typer) -> dict[str, str]:
    """Path under docs/ -> content: every reference page, and the OpenAPI document the HTTP page links."""
    document = openapi_document()
    return {SETTINGS_PAGE: settings_page(), HTTP_PAGE: http_page(document),
            OPENAPI_FILE: json.dumps(document, indent=2), METRICS_PAGE: metrics_page(exported_metrics()),
            CLI_PAGE: cli_page(app)}

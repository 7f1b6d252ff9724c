"""MkDocs hook: adds the reference pages rendered from the code (cli/reference/) to every build."""

from __future__ import annotations

from typing import Any

from mkdocs.structure.files import File, Files

from conveyor.cli.main import app
from conveyor.cli.reference import pages


def on_files(files: Files, config: Any) -> Files:
    for path, markdown in pages(app).items():
        files.append(File.generated(config, path, content=markdown))
    return files

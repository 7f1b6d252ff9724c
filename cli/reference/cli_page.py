"""The CLI reference: every visible `conveyor` command with its `--help`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import typer
from typer.testing import CliRunner

HELP_WIDTH = 100


def cli_page(app: typer.Typer) -> str:
    runner = CliRunner()
    intro = "Every `conveyor` command with its `--help`, rendered from the code when this site was built."
    lines = ["# CLI", "", intro, ""]
    for path in command_paths(app):
        result = runner.invoke(app, [*path[1:], "--help"], prog_name=" ".join(path),
                               terminal_width=HELP_WIDTH, env={"COLUMNS": str(HELP_WIDTH), "NO_COLOR": "1"})
        assert result.exit_code == 0, f"{' '.join(path)} --help: {result.output}"
        lines += [f"## `{' '.join(path)}`", "", "```text", result.output.strip("\n"), "```", ""]
    return "\n".join(lines)


def command_paths(app: typer.Typer) -> list[tuple[str, ...]]:
    """("conveyor",), ("conveyor", "serve"), ("conveyor", "keys", "create"), ...: every visible command."""
    return [path for path, _ in _commands(typer.main.get_command(app), ("conveyor",))]


def _commands(command: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Typer's own click commands (it vendors click): a group is what has subcommands."""
    yield path, command
    if getattr(command, "commands", None):
        for name in sorted(command.commands):
            sub = command.commands[name]
            if not sub.hidden:
                yield from _commands(sub, (*path, name))

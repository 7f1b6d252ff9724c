"""Markdown pieces the reference pages share."""

from __future__ import annotations


def cell(text: str) -> str:
    """Text for one cell of a Markdown table: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")

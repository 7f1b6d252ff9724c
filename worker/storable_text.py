"""Text a job's run produces, as the store keeps it and its listeners see it: PostgreSQL text cannot hold NUL
(U+0000), which a random-weight model happily writes, so NUL becomes U+FFFD. One character for one, so the
pieces of a stream, each made storable, still join to the stored text."""

from __future__ import annotations


def storable(text: str) -> str:
    return text.replace("\x00", "\ufffd")

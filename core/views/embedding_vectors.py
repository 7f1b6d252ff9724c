"""Embedding vectors as the store keeps them and OpenAI's `encoding_format: base64` sends them: the vector's
float32 components, little-endian, base64-encoded. A quarter of the size of the JSON numbers, and exact: the
engine computes in float32 (or narrower), so nothing is lost by storing float32."""

from __future__ import annotations

import base64
import struct

FLOAT32_BYTES = 4


def encode_vector(vector: list[float]) -> str:
    """[d] floats -> base64 of d little-endian float32."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def decode_vector(encoded: str) -> list[float]:
    """encode_vector's inverse; ValueError for text that is not whole float32 components."""
    raw = base64.b64decode(encoded, validate=True)
    if len(raw) % FLOAT32_BYTES:
        raise ValueError(f"an embedding of {len(raw)} bytes is not a whole number of float32 components")
    return list(struct.unpack(f"<{len(raw) // FLOAT32_BYTES}f", raw))

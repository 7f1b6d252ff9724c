"""Per-request embedding parameters: the pooling counterpart of SamplingParams.

A request with PoolingParams is embedded, not continued: its input is computed once (prefill only), its
hidden states pooled into one vector (engine/pooling.py), and it finishes with that vector.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    # Keep only the first `dimensions` components (Matryoshka embeddings), then renormalise when normalising.
    # None: the whole vector. The engine checks it against the model's size (at most its hidden size).
    dimensions: int | None = None
    normalize: bool | None = None  # L2-normalise the vector; None: the model's default (engine/pooling.py)
    # An input longer than the model's maximum length: True cuts it to that length, keeping its start (as
    # sentence-transformers does); False refuses it (ValueError naming its length and the limit).
    truncate: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the offending field; what needs the model is checked by the engine."""
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            raise ValueError(f"dimensions must be None or an int >= 1, got {dims!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be None or a bool, got {self.normalize!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate must be a bool, got {self.truncate!r}")

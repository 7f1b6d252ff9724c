"""Speculative decoding as the bench counts it.

Per request: the tokens proposed for it and how many of them verification accepted, from its last
RequestOutput (`num_draft_tokens`, `num_accepted_tokens`: cumulative for the request). Per group: their sums
over every request of the group, whatever its end (a cancelled or failed request's drafts were verified all
the same), and the acceptance rate, accepted / drafted: None (shown "-") when nothing was drafted,
speculation off included. Every configuration gets the same three figures, so a decision sheet can ask for
`documents.acceptance_rate>=0.3` (a baseline without speculation has no rate: a missing figure).

Per run: the engine's own totals over the run (`LLMEngine.stats()["speculation"]` after minus before, since
the warm-up may draft), which name the method and count per request class.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from conveyor.bench.records import RequestRecord

if TYPE_CHECKING:  # the report imports this module: no torch for it
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.engine.outputs import RequestOutput

COUNTS = ("drafted_tokens", "accepted_tokens")


def acceptance_rate(drafted: int, accepted: int) -> float | None:
    return accepted / drafted if drafted else None


def output_counts(out: RequestOutput) -> tuple[int, int]:
    """(drafted, accepted) of one request so far, from its RequestOutput ((0, 0) with speculation off)."""
    return out.num_draft_tokens, out.num_accepted_tokens


def group_figures(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """drafted_tokens, accepted_tokens and acceptance_rate of a group's requests."""
    drafted = accepted = 0
    for r in records:
        drafted, accepted = drafted + r.drafted_tokens, accepted + r.accepted_tokens
    return {"drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": acceptance_rate(drafted, accepted)}


def engine_totals(engine: LLMEngine) -> dict[str, Any] | None:
    """The engine's speculation totals so far; None when off."""
    totals = engine.stats()["speculation"]
    return totals if isinstance(totals, dict) else None


def speculation_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's share of the engine's totals: method, drafted and accepted tokens, acceptance rate, and
    the counts per request class."""
    if after is None:
        return None
    start = before or {}
    counts = _minus(after, start)
    classes = {
        name: _minus(c, (start.get("per_class") or {}).get(name, {}))
        for name, c in (after.get("per_class") or {}).items()
    }
    return {"method": after.get("method"), **counts,
            "acceptance_rate": acceptance_rate(counts["drafted_tokens"], counts["accepted_tokens"]),
            "per_class": classes}


def _minus(after: dict[str, Any], before: dict[str, Any]) -> dict[str, int]:
    return {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in COUNTS}

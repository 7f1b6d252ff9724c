"""When a request stops, checked after each token it gets: a completed grammar, EOS, a stop token id, a stop
string (whose text is cut off), or max_tokens.

Before min_tokens only a completed grammar or max_tokens stop it (the sampler masks EOS until then).
"""

from __future__ import annotations

from conveyor.engine.outputs import FinishReason
from conveyor.engine.sequence import Sequence


def stop_reason(seq: Sequence, token: int, delta: str, eos_token_ids: frozenset[int]) -> FinishReason | None:
    """Why seq stops after `token` (already appended, its text `delta` added to seq.text), or None.
    A matched stop string is cut from seq.text here."""
    params = seq.params
    if seq.matcher is not None and seq.matcher.is_terminated():
        return "stop"  # the grammar is complete and its stop token (EOS) was sampled
    if seq.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if delta and truncate_at_stop_string(seq, len(delta)):
            return "stop"
    if seq.num_output_tokens >= params.max_tokens:
        return "length"
    return None


def truncate_at_stop_string(seq: Sequence, delta_len: int) -> bool:
    """Looks for a stop string ending in the newest text; cuts the text before it (after it, with
    include_stop_str_in_output). True if found."""
    stops = seq.params.stop_strings
    if not stops:
        return False
    # Only a match that overlaps the new text can be new.
    start = max(0, len(seq.text) - delta_len - max(len(s) for s in stops) + 1)
    hits = [(i, len(s)) for i, s in ((seq.text.find(s, start), s) for s in stops) if i >= 0]
    if not hits:
        return False
    at, length = min(hits)  # the earliest match; of two starting there, the shorter, as before
    seq.text = seq.text[: at + length if seq.params.include_stop_str_in_output else at]
    return True

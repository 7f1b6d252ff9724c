"""Prefix sharing in a shapes-only trace (core/traces.py): each generation job's prompt, as the model sees it,
becomes a chain of keyed hashes, one per full block of PREFIX_BLOCK_TOKENS token ids, so that a replay can
rebuild prompts that share exactly the leading blocks production's shared, with no text in the trace.

h_i = HMAC-SHA256(key, h_{i-1} + block i's ids), first 16 hex digits; h_0 is empty, h_{i-1} is the previous
hash as written (its 16 hex digits, ASCII) and each id is 4 bytes, big-endian. Two jobs of one export share
h_1..h_j exactly when their first j * PREFIX_BLOCK_TOKENS ids are equal (a chained hash names the whole
prefix, not one block: equal blocks after a difference hash apart). The key is the export's tenant key.

The ids come from the API's tokenizer for the job's model (api/prompt_tokenizer.py), the path submit counts
prompt tokens with: a `prompt` encoded with the tokenizer's special tokens, `messages` rendered with the
model's chat template and the job's stored chat options (tools, template variables), token ids as sent.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from conveyor.core.lanes import split_lane
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.job_kinds import EMBEDDING, GENERATION
from conveyor.core.store.trace_rows import TraceRow

PREFIX_BLOCK_TOKENS = 16  # the header's prefix_block_tokens; the engine's default KV block size
HASH_HEX_DIGITS = 16
ID_BYTES = 4  # a token id's bytes in a hashed block: any vocabulary below 2**32

# A job's prompt as the model sees it (token ids), or None when there is none to hash (the module doc).
PromptIds = Callable[[TraceRow], list[int] | None]


class PromptEncoder(Protocol):
    """What a model's prompt tokenizer does (api/prompt_tokenizer.py PromptTokenizer)."""

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]], options: ChatOptions,
                    add_special_tokens: bool = False) -> list[int]: ...


def prompt_ids_by_model(encoders: Mapping[str, PromptEncoder]) -> PromptIds:
    """PromptIds with each served model's encoder, by model id (a lane's model: an adapter's jobs wait in
    its base model's lanes and are tokenized as its base's). A job of a model no longer served has no
    tokenizer loaded: None."""
    def prompt_ids(row: TraceRow) -> list[int] | None:
        model, _ = split_lane(row.queue)
        encoder = encoders.get(model)
        return None if encoder is None else row_prompt_ids(row, encoder)

    return prompt_ids


def row_prompt_ids(row: TraceRow, encoder: PromptEncoder) -> list[int] | None:
    """The token ids of a generation job's prompt (of a completion with several prompts, the first: one
    engine sequence's prefix; the line's prompt_tokens still counts them all). None for an embedding job
    (its inputs are embedded whole, no prefix is cached), for a chat the template now refuses (the template
    or the model changed since: what production rendered can no longer be known), and for a row that holds
    no prompt."""
    if (row.kind or GENERATION) == EMBEDDING:
        return None
    try:
        if row.messages is not None:
            return encoder.encode_chat(list(row.messages), ChatOptions.from_json(row.chat))
        if row.prompt is not None:
            return encoder.encode_prompt(row.prompt)
    except ValueError:
        return None
    if row.inputs:
        first = row.inputs[0]
        return encoder.encode_prompt(first) if isinstance(first, str) else [int(token) for token in first]
    return None


def block_hashes(token_ids: Sequence[int], key: bytes) -> list[str]:
    """The chain of hashes of the full blocks of `token_ids` (a partial last block has none)."""
    chain: list[str] = []
    previous = b""
    for start in range(0, len(token_ids) - PREFIX_BLOCK_TOKENS + 1, PREFIX_BLOCK_TOKENS):
        ids = token_ids[start:start + PREFIX_BLOCK_TOKENS]
        block = b"".join(token.to_bytes(ID_BYTES, "big") for token in ids)
        digest = hmac.new(key, previous + block, hashlib.sha256).hexdigest()[:HASH_HEX_DIGITS]
        chain.append(digest)
        previous = digest.encode()
    return chain

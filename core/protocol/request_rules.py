"""What a request may carry into the store, shared by the API's schemas and the batch line parser (api/ and
worker/ may not import each other): text and JSON the store can hold and every reader can serve back, and
the request-shape limits both doors apply.

Why: PostgreSQL refuses NUL (U+0000) in text and NaN/Infinity in JSON; lone surrogates (JSON "\\udfff") are
not Unicode and cannot be encoded as UTF-8. SQLite stores all of them, and then every read that serialises
the row (GET, each list page holding it, its webhook) fails. So each such value is refused before anything is
stored, with a 4xx (or a failed batch line) naming it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # alternatives per generated token
# A job's priority (lower first, vLLM's meaning): a signed 32-bit integer, as the engine takes it
# (conveyor.engine.sequence.MAX_PRIORITY; core cannot import the engine, a test checks they agree).
MAX_PRIORITY = 2**31 - 1
# Choices per job (`n`): each is a sequence of its own in the engine, beside the queue's running jobs.
MAX_N = 16
MAX_JSON_DEPTH = 32  # nesting of stored JSON (metadata); deeper JSON would exhaust Python's recursion
# Digits of an integer literal read from a batch line before it is converted: no field takes more than 19
# (int64), so a longer one is refused unread (Python's own limit, 4,300 digits, raises mid-parse).
MAX_INT_DIGITS = 100
# A prompt's tokens each stand for at least one byte and rarely for more than a few: refusing a prompt over
# max_prompt_tokens * PROMPT_BYTES_PER_TOKEN UTF-8 bytes before tokenizing keeps a huge prompt from costing
# a full tokenization. Real text averages 2 to 6 bytes per token; only a prompt made mostly of very long
# repeated runs (e.g. kilobytes of spaces) could fit the token limit and still be refused by this bound.
PROMPT_BYTES_PER_TOKEN = 32
MAX_TTL_S = 365 * 86400.0  # a year of waiting for a worker (ttl, a queue's default_ttl_s): far from year 9999
MAX_TIMEOUT_S = 30 * 86400.0  # 30 days of running

NUL = "must not contain NUL (\\u0000) characters"
SURROGATE = "must be valid Unicode: lone surrogates such as \\udfff are not text"
NON_FINITE = "must be a finite number (not NaN or Infinity)"


def text_problem(text: str) -> str | None:
    """Why `text` cannot be stored, or None."""
    if "\x00" in text:
        return NUL
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return SURROGATE
    return None


def json_problem(value: object) -> str | None:
    """Why the JSON value `value` cannot be stored, as "<where>: <reason>", or None. Iterative, so no
    nesting can exhaust the stack before MAX_JSON_DEPTH refuses it."""
    for where, reason in _problems(value):
        return f"{where}: {reason}" if where else reason
    return None


def json_shape_problem(value: object, max_depth: int = MAX_JSON_DEPTH, max_nodes: int | None = None,
                       ) -> str | None:
    """Why `value` is too big for recursive code (json.dumps, jsonschema): "is nested deeper than <max_depth>
    levels" or "holds more than <max_nodes> objects and arrays"; None when it fits. Iterative, stopping at
    the first excess; depth is counted as json_problem counts it."""
    stack: list[tuple[object, int]] = [(value, 0)]
    nodes = 0
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        if depth >= max_depth:
            return f"is nested deeper than {max_depth} levels"
        nodes += 1
        if max_nodes is not None and nodes > max_nodes:
            return f"holds more than {max_nodes} objects and arrays"
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    return None


def _problems(value: object) -> Iterator[tuple[str, str]]:
    stack: list[tuple[str, object, int]] = [("", value, 0)]
    while stack:
        where, item, depth = stack.pop()
        if isinstance(item, (dict, list)) and depth >= MAX_JSON_DEPTH:
            yield where, f"nested deeper than {MAX_JSON_DEPTH} levels"
        elif isinstance(item, dict):
            for key, child in item.items():
                child_where = f"{where}[{json.dumps(key)}]"
                key_problem = text_problem(key) if isinstance(key, str) else "must be a string"
                if key_problem is not None:
                    yield child_where, f"the key {key_problem}"
                stack.append((child_where, child, depth + 1))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", child, depth + 1) for i, child in enumerate(item))
        else:
            problem = _scalar_problem(item)
            if problem is not None:
                yield where, problem


def _scalar_problem(item: object) -> str | None:
    if isinstance(item, str):
        return text_problem(item)
    if isinstance(item, float) and not math.isfinite(item):
        return NON_FINITE
    if item is None or isinstance(item, (bool, int, float)):
        return None
    return f"{type(item).__name__} is not a JSON value"


def utf8_length(text: str) -> int:
    """Bytes of `text` as UTF-8; text that cannot be encoded (lone surrogates) counts 3 bytes per unit."""
    return len(text.encode("utf-8", errors="surrogatepass"))


def output_problem(max_tokens: int | None, n: int | None, prompt_logprobs: int | None,
                   ) -> tuple[str, str] | None:
    """(field, reason) for an output that cannot be asked for: max_tokens 0 scores the prompt only, so it
    needs prompt_logprobs and leaves nothing to choose between."""
    if max_tokens != 0:
        return None
    if prompt_logprobs is None:
        return "max_tokens", "0 only scores the prompt: it needs prompt_logprobs (or echo with logprobs)"
    if n not in (None, 1):
        return "n", "max_tokens 0 generates nothing to choose between: send n=1"
    return None

"""Replay of a JSONL trace: hand-written, or exported from the service by `conveyor trace export` (its
header line skipped and recorded, one model's generation jobs replayed at their recorded lengths, with
their own deadlines and priorities; `trace_requests`). The format: docs/benchmarks/index.md.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from conveyor.bench.workload import LONG, SHORT, BenchRequest, Group, check_group_name

# A chat job's messages -> the prompt text the engine encodes, in the model's chat template (trace_chat.py).
ChatRenderer = Callable[[list[dict[str, Any]]], str]

TRACE_FORMAT = 1  # the exported trace format this bench reads (its header's "conveyor_trace")
HEADER_KEY = "conveyor_trace"  # the key that marks an exported trace's header line
HEADER_FIELDS = ("version", "exported_at", "since", "until", "jobs")  # what a report records of a header
EMBEDDING = "embedding"  # an exported job's kind that the generation bench does not replay
PREFIX_BLOCK_TOKENS = 16  # an exported trace's block of prefix_blocks when its header does not say
# The statuses whose output_tokens is the length the job needed: it ended by itself (a hand-written line has
# no status). A failed, expired, queued or running job's count says when it stopped, not what it asked for.
ENDED_BY_ITSELF = (None, "succeeded")


class SharedBlocks:
    """The token ids replayed for each hash of `prefix_blocks` (an exported line's prompt as a chain of
    hashes, one per full block of `block_tokens` ids): drawn from the vocabulary the first time a hash is
    seen, the same ids every later time, so lines that shared a prefix in production share it here."""

    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"prefix_block_tokens: need >= 1 tokens a block, got {block_tokens}")
        self.block_tokens = block_tokens
        self._ids: dict[str, list[int]] = {}

    @classmethod
    def of_header(cls, header: dict[str, Any] | None) -> SharedBlocks:
        return cls(int((header or {}).get("prefix_block_tokens") or PREFIX_BLOCK_TOKENS))

    def prompt(
        self, hashes: list[Any], length: int, rng: random.Random, vocab_ids: Sequence[int]
    ) -> list[int]:
        """`length` ids: each hash's block, then fresh ids for the tail past the last full block."""
        shared = len(hashes) * self.block_tokens
        if shared > length:
            raise ValueError(
                f"prefix_blocks: {len(hashes)} blocks of {self.block_tokens} tokens exceed "
                f"prompt_tokens {length}"
            )
        ids: list[int] = []
        for digest in hashes:
            if not isinstance(digest, str):
                raise ValueError(f"prefix_blocks: expected hashes (text), got {digest!r}")
            if digest not in self._ids:
                self._ids[digest] = [rng.choice(vocab_ids) for _ in range(self.block_tokens)]
            ids.extend(self._ids[digest])
        return ids + [rng.choice(vocab_ids) for _ in range(length - shared)]


@dataclass(frozen=True)
class TraceLines:
    """A trace's lines as the bench replays them: every request line of the model picked (a trace whose lines
    name no model or one model: all of them), less embedding jobs; and what was left out."""

    path: str
    header: dict[str, Any] | None  # an exported trace's first line; None for a hand-written trace
    model: str | None  # the model whose jobs are replayed; None when no line names one
    lines: list[tuple[int, dict[str, Any]]]  # (line number, object)
    embedding_skipped: int
    other_models_skipped: int

    def record(self) -> dict[str, Any]:
        """What a report's workload record says of the trace."""
        header = None if self.header is None else {k: self.header.get(k) for k in HEADER_FIELDS}
        return {
            "trace_header": header,
            "trace_model": self.model,
            "embedding_jobs_skipped": self.embedding_skipped,
            "other_model_jobs_skipped": self.other_models_skipped,
        }

    def describe(self) -> str:
        skipped = [
            f"{n} {what} skipped"
            for n, what in ((self.embedding_skipped, "embedding jobs"),
                            (self.other_models_skipped, "jobs of other models"))
            if n
        ]
        exported = f"exported {self.header.get('exported_at')}" if self.header else ""
        model = f"model {self.model}" if self.model else ""
        return ", ".join(x for x in (f"trace {self.path}", exported, model, *skipped) if x)


def read_trace_header(path: str | Path) -> dict[str, Any] | None:
    """An exported trace's header (its first line, the object with key "conveyor_trace"); None for a
    hand-written trace. Reads only up to the first non-blank line."""
    try:
        with Path(path).open() as f:
            first = next(((n, line) for n, line in enumerate(f, start=1) if line.strip()), None)
    except OSError as exc:
        raise ValueError(f"trace: cannot read {path}: {exc}") from exc
    if first is None:
        raise ValueError(f"trace {path}: no requests")
    obj = _json_object(first[1], path, first[0])
    return _checked_header(obj, path) if HEADER_KEY in obj else None


def trace_lines(path: str | Path, model: str | None = None) -> TraceLines:
    """The lines to replay. `model` picks one model's jobs; a trace whose lines name several models needs
    it (ValueError naming them), and it must be one of them."""
    header, lines = _trace_objects(path)
    models = list(dict.fromkeys(str(obj["model"]) for _, obj in lines if obj.get("model") is not None))
    picked = _pick_model(path, models, model)
    mine = [(n, obj) for n, obj in lines if obj.get("model") is None or str(obj["model"]) == picked]
    replayed = [(n, obj) for n, obj in mine if obj.get("kind") != EMBEDDING]
    if not replayed:
        which = f" of model {picked}" if picked else ""
        raise ValueError(f"trace {path}: no generation jobs{which} to replay")
    return TraceLines(
        path=str(path),
        header=header,
        model=picked,
        lines=replayed,
        embedding_skipped=len(mine) - len(replayed),
        other_models_skipped=len(lines) - len(mine),
    )


def _pick_model(path: str | Path, models: list[str], wanted: str | None) -> str | None:
    if wanted is not None:
        if wanted not in models:
            raise ValueError(
                f"trace_model (--trace-model): no job of model {wanted!r} in trace {path}; its models: "
                + (", ".join(models) or "none named")
            )
        return wanted
    if len(models) > 1:
        raise ValueError(
            f"trace {path}: jobs of several models ({', '.join(models)}); pick one with --trace-model"
        )
    return models[0] if models else None


def load_trace(
    path: str | Path,
    vocab_ids: Sequence[int],
    seed: int = 0,
    *,
    model: str | None = None,
    chat: ChatRenderer | None = None,
) -> list[BenchRequest]:
    """The requests of a trace (`trace_requests`); `model` picks one model's jobs as `trace_lines` does."""
    return trace_requests(trace_lines(path, model), vocab_ids, seed, chat)


def trace_requests(
    trace: TraceLines, vocab_ids: Sequence[int], seed: int = 0, chat: ChatRenderer | None = None
) -> list[BenchRequest]:
    """Hand-written lines: `arrival_s`, `group` (any group name), `max_tokens`, and `prompt` (text),
    `prompt_token_ids` or `prompt_tokens` (a length: ids are synthesised, seeded); optional `request_id`,
    `cancel_after_tokens`, `deadline_s`, `priority`. Exported lines (docs/benchmarks/index.md) add `n` (that
    many requests `ID#0`, `ID#1`, ... at the same arrival), `output_tokens` and `status` (the length
    replayed: `_trace_lengths`), `messages` (rendered by `chat`, the model's chat template), `prefix_blocks`
    (the synthesised ids share the blocks their hashes share: SharedBlocks). A recorded text wins over
    `prompt_tokens`. An exported trace's first replayed job arrives at 0.
    """
    rng = random.Random(seed)
    blocks = SharedBlocks.of_header(trace.header)
    requests = []
    for n, obj in trace.lines:
        try:
            requests.extend(_trace_requests(obj, n, rng, vocab_ids, chat, blocks))
        except (KeyError, TypeError, ValueError) as exc:
            detail = str(exc) if isinstance(exc, ValueError) else repr(exc)
            raise ValueError(f"trace {trace.path} line {n}: {detail}") from exc
    if trace.header is not None:  # offsets from the first replayed job: no idle lead-in for a model picked
        first = min(r.arrival_s for r in requests)
        requests = [replace(r, arrival_s=round(r.arrival_s - first, 6)) for r in requests]
    return sorted(requests, key=lambda r: (r.arrival_s, r.request_id))


def trace_groups(path: str | Path, model: str | None = None) -> list[Group]:
    """The groups a trace's replayed lines use, in order of first appearance. `interactive` and `documents`
    keep their standard deadline and priority; any other group starts with no deadline and priority 0."""
    standard = {g.name: g for g in (SHORT, LONG)}
    names: list[str] = []
    for n, obj in trace_lines(path, model).lines:
        name = check_group_name(obj.get("group"), f"trace {path} line {n}: group")
        if name not in names:
            names.append(name)
    return [standard.get(name, Group(name)) for name in names]


def _trace_objects(path: str | Path) -> tuple[dict[str, Any] | None, list[tuple[int, dict[str, Any]]]]:
    """(header or None, (line number, object) of every other non-blank line)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"trace: cannot read {path}: {exc}") from exc
    lines = [(n, _json_object(line, path, n)) for n, line in enumerate(text.splitlines(), start=1)
             if line.strip()]
    header = _checked_header(lines.pop(0)[1], path) if lines and HEADER_KEY in lines[0][1] else None
    stray = next((n for n, obj in lines if HEADER_KEY in obj), None)
    if stray is not None:
        raise ValueError(f"trace {path} line {stray}: a header ({HEADER_KEY!r}) is only the first line")
    if not lines:
        raise ValueError(f"trace {path}: no requests")
    return header, lines


def _json_object(line: str, path: str | Path, n: int) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"trace {path} line {n}: {exc!r}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"trace {path} line {n}: expected a JSON object, got {line[:80]!r}")
    return obj


def _checked_header(obj: dict[str, Any], path: str | Path) -> dict[str, Any]:
    if obj[HEADER_KEY] != TRACE_FORMAT:
        raise ValueError(
            f"trace {path}: {HEADER_KEY} {obj[HEADER_KEY]!r}: this bench reads format {TRACE_FORMAT}"
        )
    return obj


def _trace_requests(
    obj: dict[str, Any],
    n: int,
    rng: random.Random,
    vocab_ids: Sequence[int],
    chat: ChatRenderer | None,
    blocks: SharedBlocks,
) -> list[BenchRequest]:
    """One line's requests: one, or `n` choices of the same prompt."""
    group = check_group_name(obj.get("group"), f"trace line {n}: group")
    choices = 1 if obj.get("n") is None else int(obj["n"])
    if choices < 1:
        raise ValueError(f"n: need >= 1 choices, got {choices}")
    max_tokens, cancel = _trace_lengths(obj, choices)
    ids, text = _prompt(obj, rng, vocab_ids, chat, blocks)
    deadline, priority = obj.get("deadline_s"), obj.get("priority")
    request = BenchRequest(
        request_id=str(obj.get("request_id") or f"trace-{n:05d}"),
        group=group,
        arrival_s=float(obj.get("arrival_s") or 0.0),
        max_tokens=max_tokens,
        prompt_token_ids=ids,
        prompt=text,
        cancel_after_tokens=cancel,
        deadline_s=None if deadline is None else float(deadline),
        priority=None if priority is None else int(priority),
        model=None if obj.get("model") is None else str(obj["model"]),
    )
    if choices == 1:
        return [request]
    return [replace(request, request_id=f"{request.request_id}#{c}") for c in range(choices)]


def _trace_lengths(obj: dict[str, Any], choices: int) -> tuple[int, int | None]:
    """(max_tokens, cancel_after_tokens) per choice. A job that ended by itself with `output_tokens` known is
    replayed to exactly that many (split over its choices); a cancelled one runs to its recorded max_tokens
    and is cancelled after its recorded tokens; anything else does its recorded max_tokens."""
    recorded = int(obj["max_tokens"])
    cancel = obj.get("cancel_after_tokens")
    cancel_after = None if cancel is None else int(cancel)
    produced = obj.get("output_tokens")
    if produced is None:
        return recorded, cancel_after
    per_choice = max(1, math.ceil(int(produced) / choices))
    status = obj.get("status")
    if status == "cancelled":
        return recorded, per_choice if per_choice < recorded else None
    return (per_choice if status in ENDED_BY_ITSELF else recorded), cancel_after


def _prompt(
    obj: dict[str, Any],
    rng: random.Random,
    vocab_ids: Sequence[int],
    chat: ChatRenderer | None,
    blocks: SharedBlocks,
) -> tuple[list[int] | None, str | None]:
    """(token ids, text): the recorded ids or text when the line has them, else `prompt_tokens` ids drawn
    (after the shared blocks of its `prefix_blocks`, when it has some)."""
    if obj.get("prompt_token_ids") is not None:
        return [int(t) for t in obj["prompt_token_ids"]], None
    if obj.get("prompt") is not None:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"prompt: expected text, got {type(obj['prompt']).__name__}")
        return None, obj["prompt"]
    if obj.get("messages") is not None:
        if chat is None:
            raise ValueError("messages: a chat job's messages are rendered with --model's chat template")
        return None, chat(list(obj["messages"]))
    if obj.get("prompt_tokens") is not None:
        if not vocab_ids:
            raise ValueError("prompt_tokens: synthesised prompts need --model (its tokenizer's token ids)")
        hashes = obj.get("prefix_blocks") or []
        if not isinstance(hashes, list):
            raise ValueError(f"prefix_blocks: expected a list of hashes, got {type(hashes).__name__}")
        return blocks.prompt(hashes, int(obj["prompt_tokens"]), rng, vocab_ids), None
    raise ValueError("no prompt: give prompt, prompt_token_ids, messages or prompt_tokens")

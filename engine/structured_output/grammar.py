"""Compiles StructuredOutput constraints with xgrammar against the model's own tokenizer, and caches them.

xgrammar is the optional `structured` extra: this module is imported only by the first compile
(engine/structured_output/manager.py), never by `import engine`.

A constraint not seen before is first test-compiled in a child process under a hard time and memory limit
(engine/structured_output/probe.py), then compiled here; so a schema that would take minutes costs at most the
deadline, and fails its request alone (GrammarLimitError). EngineHost calls `compile` on a thread of its own
(engine/structured_output/compile_queue.py), never in the thread that submits or steps. The cache in front is
keyed by canonical JSON, so equal schemas from a thousand batch lines compile once (xgrammar keys by the exact
schema string); it is bounded by the bytes the compiled grammars hold, and it also remembers constraints that
failed, so a refused schema sent again is refused at once.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import xgrammar as xgr

from conveyor.engine.structured_output.constraint import StructuredOutput
from conveyor.engine.structured_output.probe import GrammarProbe

MAX_REFUSED = 1024  # refused constraints remembered (their messages only)


class GrammarCompiler:
    def __init__(
        self, hf_tokenizer: object, vocab_size: int, stop_token_ids: list[int], *,
        timeout_s: float | None = None, memory_bytes: int = 2**31, cache_bytes: int = 2**29,
    ) -> None:
        """timeout_s None: compile with no limit, in the calling thread only (no child process)."""
        # vocab_size from the model config: the embedding (and the logits) may be wider than the tokenizer.
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)  # type: ignore[arg-type]
        )
        # xgrammar's own cache would keep every grammar beyond ours: off.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._probe = GrammarProbe(info.serialize_json(), timeout_s, memory_bytes) if timeout_s else None
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()  # least recently used first
        self._cached_bytes = 0
        self._refused: OrderedDict[str, ValueError] = OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.num_compiles = 0  # cache misses, for tests and stats

    @property
    def num_cached_bytes(self) -> int:
        return self._cached_bytes

    def cached(self, structured: StructuredOutput) -> xgr.CompiledGrammar | None:
        """The compiled grammar if it is cached (no compile); raises the earlier refusal if it was refused."""
        key = structured.cache_key
        with self._lock:
            refused = self._refused.get(key)
            if refused is not None:
                raise type(refused)(str(refused))
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar; ValueError naming the field if xgrammar rejects the constraint,
        GrammarLimitError if it does not compile within the limits."""
        compiled = self.cached(structured)
        if compiled is not None:
            return compiled
        try:
            if self._probe is not None:
                self._probe.check(structured)  # outside the lock: a slow probe holds up no cache hit
            compiled = compile_structured(self._compiler, structured)
        except ValueError as exc:
            self._remember_refusal(structured.cache_key, exc)
            raise
        self._insert(structured.cache_key, compiled)
        return compiled

    def matcher(self, structured: StructuredOutput) -> xgr.GrammarMatcher:
        """A fresh grammar state for one request (compiling the constraint if need be)."""
        return xgr.GrammarMatcher(self.compile(structured))

    def close(self) -> None:
        """Stops the probe process; compiles after this fail."""
        if self._probe is not None:
            self._probe.close()

    def _insert(self, key: str, compiled: xgr.CompiledGrammar) -> None:
        size = compiled.memory_size_bytes
        with self._lock:
            self.num_compiles += 1
            if key in self._cache or size > self.cache_bytes:
                return  # cached meanwhile by another caller, or too big to keep: used once, not kept
            self._cache[key] = compiled
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.memory_size_bytes

    def _remember_refusal(self, key: str, error: ValueError) -> None:
        with self._lock:
            self._refused[key] = error
            while len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)


def xgrammar_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    """A fresh grammar state for one request."""
    return xgr.GrammarMatcher(compiled)


def compile_structured(compiler: xgr.GrammarCompiler, structured: StructuredOutput) -> xgr.CompiledGrammar:
    """One constraint compiled by `compiler` (here, or in the probe process); ValueError naming the field."""
    kind = structured.kind
    try:
        if kind == "json_schema":
            return compiler.compile_grammar(_json_schema_ebnf(structured.schema_dict()))
        if kind == "json_object":  # an object, as OpenAI's json_object means (the builtin allows arrays)
            return compiler.compile_grammar(_json_schema_ebnf({"type": "object"}))
        if kind == "regex":
            assert structured.regex is not None
            return compiler.compile_regex(structured.regex)
        assert structured.choice is not None
        return compiler.compile_grammar(_choice_ebnf(structured.choice))
    except (RuntimeError, ValueError) as exc:  # xgrammar raises RuntimeError for a bad grammar
        raise ValueError(f"structured.{kind} cannot be compiled: {exc}") from exc


def _json_schema_ebnf(schema: dict[str, object]) -> str:
    """The schema's grammar, compact (no free whitespace: a random or weak model would pad forever).

    NOTE: xgrammar 0.2.9 gets two things wrong in a string's characters, so we swap its two classes
    (_LOOSE_STRING_CHAR, _STRING_CHAR) for _STRICT_STRING_CHAR. (1) With maxLength/minLength its class lacks
    the control-character range, so raw U+0000-U+001F got through, and JSON parsers reject those. (2) Both
    accept the UTF-8 encoding of a surrogate (U+D800-U+DFFF, e.g. bytes ED A7 B9), which is not valid UTF-8:
    decoded, it becomes three U+FFFD, so a 24-character string came back 26 characters long.
    """
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    return ebnf.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR).replace(_STRING_CHAR, _STRICT_STRING_CHAR)


_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'  # a bounded string's character
_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'  # an unbounded one's
_STRICT_STRING_CHAR = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


def _choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b": EBNF string literals take JSON's escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

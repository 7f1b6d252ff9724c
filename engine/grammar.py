"""Compiles StructuredOutput constraints with xgrammar against the model's own tokenizer, and caches them.

Runs in the caller's thread (LLMEngine.make_sequence, which EngineHost.submit calls in the submitting
thread), so a slow schema never stalls the step loop. xgrammar's compiler is thread-safe; our cache in
front of it is keyed by canonical JSON so equal schemas from a thousand batch lines compile once (xgrammar
keys by the exact schema string).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import xgrammar as xgr

from engine.structured_output import StructuredOutput

MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    def __init__(self, hf_tokenizer: object, vocab_size: int, stop_token_ids: list[int]) -> None:
        # vocab_size from the model config: the embedding (and the logits) may be wider than the tokenizer.
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)  # type: ignore[arg-type]
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.num_compiles = 0  # cache misses, for tests and stats

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar; ValueError naming the field if xgrammar rejects the constraint."""
        key = structured.cache_key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(structured)  # outside the lock: other callers' schemas need not wait
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, structured: StructuredOutput) -> xgr.GrammarMatcher:
        """A fresh grammar state for one request."""
        return xgr.GrammarMatcher(self.compile(structured))

    def _compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        kind = structured.kind
        try:
            if kind == "json_schema":
                return self._compiler.compile_grammar(_json_schema_ebnf(structured.schema_dict()))
            if kind == "json_object":  # an object, as OpenAI's json_object means (the builtin allows arrays)
                return self._compiler.compile_grammar(_json_schema_ebnf({"type": "object"}))
            if kind == "regex":
                assert structured.regex is not None
                return self._compiler.compile_regex(structured.regex)
            assert structured.choice is not None
            return self._compiler.compile_grammar(_choice_ebnf(structured.choice))
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

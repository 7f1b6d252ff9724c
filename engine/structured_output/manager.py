"""Gives constrained requests their grammar state, from one grammar compiler built on the first compile.

The compiler is xgrammar's, from the optional `structured` extra: it is imported only there, so an engine
installed without it imports and serves every unconstrained request, and refuses a constrained one with a
ValueError naming the extra (the worker fails such a job as invalid_request).
"""

from __future__ import annotations

import importlib.util
import threading
from typing import TYPE_CHECKING

from conveyor.engine.config import EngineConfig
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Sequence
from conveyor.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from conveyor.engine.structured_output.grammar import GrammarCompiler

GRAMMAR_BACKEND = "xgrammar"
MISSING_EXTRA = (
    "structured outputs need the `structured` extra, which this install lacks (no xgrammar): "
    "pip install 'conveyor[structured]'"
)


def check_structured_supported(params: SamplingParams) -> None:
    """ValueError naming the missing extra for a constrained request when xgrammar is not installed.
    Looks it up without importing it (an import takes a while; the first compile does it)."""
    if params.structured is not None and importlib.util.find_spec(GRAMMAR_BACKEND) is None:
        raise ValueError(MISSING_EXTRA)


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def built_compiler(self) -> GrammarCompiler | None:
        """The compiler if a compile built it, else None (nothing built)."""
        return self._compiler

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use (caller threads may race here), so unconstrained serving never loads it.
        ValueError naming the extra when xgrammar cannot be imported."""
        with self._lock:
            if self._compiler is None:
                self._compiler = self._build()
            return self._compiler

    def attach(self, seq: Sequence, *, compile: bool) -> bool:
        """Gives a constrained seq its grammar state, from the cache or (when `compile`) compiling it.
        False when it still needs a compile. Raises ValueError (GrammarLimitError) for a constraint that
        cannot be compiled, or was refused before."""
        structured = seq.params.structured
        if structured is None:
            return True
        if not compile and self._compiler is None:
            return False  # the compiler (seconds for a large vocabulary) is built by the first compile
        compiler = self.compiler
        compiled = compiler.compile(structured) if compile else compiler.cached(structured)
        if compiled is None:
            return False
        from conveyor.engine.structured_output.grammar import (
            xgrammar_matcher,  # imported by self.compiler already
        )

        seq.matcher = xgrammar_matcher(compiled)
        return True

    def close(self) -> None:
        """Stops the grammar probe process, if one was started."""
        with self._lock:
            if self._compiler is not None:
                self._compiler.close()

    def _build(self) -> GrammarCompiler:
        try:
            from conveyor.engine.structured_output.grammar import GrammarCompiler
        except ModuleNotFoundError as exc:
            if exc.name != GRAMMAR_BACKEND:
                raise
            raise ValueError(MISSING_EXTRA) from exc
        config = self.config
        return GrammarCompiler(
            self.tokenizer.hf_tokenizer, self.vocab_size, sorted(self.tokenizer.eos_token_ids),
            timeout_s=config.grammar_compile_timeout_s,
            memory_bytes=config.grammar_compile_memory_bytes,
            cache_bytes=config.grammar_cache_bytes,
        )

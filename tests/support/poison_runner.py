"""A FakeRunner that fails every forward containing one chosen sequence, as a request-specific bug would."""

from __future__ import annotations

from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk
from tests.support.fake_runner import FakeRunner


class PoisonRunner(FakeRunner):
    """Fails a forward if a chunk belongs to a sequence whose first token is `marker` (its prompt's first
    token) and would reach `fail_from` tokens. Before raising it overwrites every chunk's new slots with
    garbage, as a forward dying half-way could: a retry that skipped a chunk would read it back.
    `broken` fails every forward (a dead device)."""

    def __init__(self, marker: int, fail_from: int = 1, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.marker = marker
        self.fail_from = fail_from
        self.broken = False
        self.calls = 0

    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        self.calls += 1
        if self.broken or any(self._poisoned(c) for c in chunks):
            for chunk in chunks:
                for pos in range(chunk.start_pos, chunk.seq_len):
                    self._write(chunk.block_table, pos, 0)
            raise RuntimeError("poisoned forward")
        return super().execute(chunks)

    def _poisoned(self, chunk: ScheduledChunk) -> bool:
        first = chunk.token_ids[0] if chunk.start_pos == 0 else self._read(chunk.block_table, 0)
        return first == self.marker and chunk.seq_len >= self.fail_from

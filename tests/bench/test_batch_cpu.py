"""The batch-line CPU bench's arithmetic and its reading of /proc: per-thread CPU by name between two samples
(threads that ended included), the per-line figures outside the engine, the input it sends, its tables."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from conveyor.bench.batch_cpu import ENGINE_THREAD, batch_input, figures, table, thread_table
from conveyor.bench.served_process import NAMER, ServedProcess
from conveyor.bench.thread_cpu import ENDED, ThreadSample, cpu_by_name, sample_threads


def test_cpu_by_name_adds_threads_of_a_name_and_counts_those_that_ended() -> None:
    before = ThreadSample(total=10.0, threads={1: ("MainThread", 4.0), 2: ("AnyIO worker th", 1.0),
                                               3: ("AnyIO worker th", 2.0), 4: ("engine-host", 3.0)})
    # Thread 3 ended after spending 0.5 s more; thread 5 started and spent 0.25 s.
    after = ThreadSample(total=14.0, threads={1: ("MainThread", 5.0), 2: ("AnyIO worker th", 1.5),
                                              4: ("engine-host", 4.75), 5: ("AnyIO worker th", 0.25)})
    spent = cpu_by_name(before, after)
    assert spent == pytest.approx({"MainThread": 1.0, "AnyIO worker th": 0.75, "engine-host": 1.75,
                                   ENDED: 0.5})
    assert sum(spent.values()) == pytest.approx(after.total - before.total)
    assert cpu_by_name(after, after)[ENDED] == 0.0


def test_a_sample_reads_each_live_thread_by_its_os_name() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="named-for-test")
    worker.start()
    try:
        assert worker.native_id is not None
        Path(f"/proc/self/task/{worker.native_id}/comm").write_text("named-for-test")
        sample = sample_threads(threading.get_native_id())  # the process's id is its main thread's
        assert sample.threads[worker.native_id][0] == "named-for-test"
        assert sample.total >= sum(cpu for _, cpu in sample.threads.values()) - 0.02  # clock ticks apart
    finally:
        stop.set()
        worker.join()


def test_outside_the_engine_is_every_thread_but_the_engine_and_the_bench_s_own() -> None:
    spent = {ENGINE_THREAD: 2.0, "batch-runner": 1.0, "job-writer": 0.5, NAMER: 0.25, ENDED: 0.5}
    out = figures(spent, lines=1000, wall_s=10.0, idle_per_s=0.01)
    assert out["outside_engine_ms_per_line"] == pytest.approx(2.0)
    assert out["engine_ms_per_line"] == pytest.approx(2.0)
    assert out["cpu_ms_per_line"] == pytest.approx(4.0)  # the namer is the bench's, not the server's
    assert out["idle_ms_per_line"] == pytest.approx(0.1) and out["lines_per_s"] == pytest.approx(100.0)
    assert next(iter(out["threads_ms_per_line"])) == ENGINE_THREAD  # most first


def test_the_input_is_one_token_chat_lines_with_their_own_ids() -> None:
    lines = [json.loads(line) for line in batch_input(3, "t").splitlines()]
    assert [line["custom_id"] for line in lines] == ["t-0", "t-1", "t-2"]
    assert all(line["url"] == "/v1/chat/completions" and line["body"]["max_tokens"] == 1 for line in lines)


def test_the_tables_show_each_code_s_median_and_runs() -> None:
    def run(code: str, outside: float) -> dict[str, object]:
        return {"code": code, **figures({ENGINE_THREAD: 1.0, "batch-runner": outside}, 1000, 5.0, 0.0)}

    runs = [run("before", 3.0), run("after", 1.0), run("before", 5.0), run("after", 0.5)]
    text = table(runs)
    assert "| before | 2 | **4** (3 / 5) |" in text and "| after | 2 | **0.75** (1 / 0.5) |" in text
    assert "| batch-runner | 4.000 | 0.750 |" in thread_table(runs)


def test_a_code_folder_without_conveyor_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no conveyor package"):
        ServedProcess(port=1, data_dir=tmp_path / "data", code=tmp_path).start()

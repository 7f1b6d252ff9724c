"""`python -m conveyor.worker` starts quietly: Conveyor's own summary instead of Celery's banner, the
cold-start lines, and a SIGTERM that ends it with status 0 and no traceback."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.seams.broker import BrokerPublisher
from conveyor.core.seams.dispatch import publish_and_mark
from conveyor.core.settings import Settings
from tests.support.worker import WorkerProcesses, add_job, lane, wait_finished, worker_env


def test_worker_logs_its_summary_and_cold_start_not_celerys_banner(
    pg_url: str, redis_url: str, sessions: sessionmaker[Session], worker_model_dir: Path,
    worker_procs: WorkerProcesses, tmp_path: Path,
) -> None:
    proc = worker_procs.start(worker_env(pg_url, redis_url, worker_model_dir, tmp_path))
    publisher = BrokerPublisher(
        Settings(database_url=pg_url, broker_url=redis_url, model=str(worker_model_dir)))
    job_id = add_job(sessions, "Hello", "interactive", max_tokens=2)
    assert publish_and_mark(sessions, publisher.publish, [(job_id, lane("interactive"))]) == 1
    assert wait_finished(sessions, [job_id])[0].status == "succeeded"
    publisher.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log = worker_procs.log(0)

    summary = ("serves model demo-model, consuming: interactive (max_running 16, priority 0), "
               "documents (max_running 4, priority 1)")
    assert summary in log
    assert "KV cache 1024 blocks x 16 = 16384 tokens" in log and "on cpu float32" in log
    assert f"broker {redis_url}" in log
    assert "cold start: engine ready" in log and "(imports " in log and "cold start: first token" in log
    # The demo model's weights: random fp32, not quantized, in the start line and the cold-start line.
    assert "; weights none " in log and re.search(r"weights [0-9.]+ s \(none, [0-9.]+ MiB\)", log)
    assert "; speculative off; " in log  # the `speculative` setting, unset
    assert "[tasks]" not in log and "conveyor.control" not in log  # Celery's banner
    assert "SecurityWarning" not in log and "Traceback" not in log and "alembic" not in log

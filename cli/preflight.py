"""Checks a server command runs before it starts: its port is free, the database, its schema and the
broker answer.

Without them `conveyor api` would start and answer 500s, and `conveyor worker` would load its engine first
and then fail (Postgres) or retry the broker forever (Celery's retry on start-up). Failing at once, with the
one line of cli/errors.py, is what a newcomer needs; in Kubernetes the pod restarts until its services are up.
"""

from __future__ import annotations

import logging
import socket

from conveyor.cli.errors import SetupError
from conveyor.core.log_setup import masked_url

log = logging.getLogger("conveyor")

BROKER_CHECK_TIMEOUT_S = 2.0


def check_database(database_url: str) -> None:
    """Connects (errors are OperationalError, for cli/errors.py), then compares the schema revision."""
    from conveyor.core.store.migrate import current_revision, head_revision

    revision, head = current_revision(database_url), head_revision()
    if revision is None:
        raise SetupError(f"the database {masked_url(database_url)}", "no Conveyor schema (never migrated)",
                         "run `conveyor migrate` (with the same CONVEYOR_DATABASE_URL)")
    if revision != head:  # older: migrate; newer (a rollback of the code): may still work, so only a warning
        log.warning("database %s: schema at revision %s, this version of Conveyor expects %s: run "
                    "`conveyor migrate` when upgrading", masked_url(database_url), revision, head)


def check_broker(broker_url: str) -> None:
    """One connection attempt to the broker; kombu's OperationalError when nobody answers."""
    from kombu import Connection

    with Connection(broker_url, connect_timeout=BROKER_CHECK_TIMEOUT_S) as connection:
        connection.ensure_connection(max_retries=1)



def check_port(host: str, port: int) -> None:
    """The server's address is free, checked before the slow part of a start (migrations, model loads) by
    binding it for a moment, so that a port in use is said at once, naming it. SO_REUSEADDR as uvicorn binds:
    a port left in TIME_WAIT by a server that just stopped is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise SetupError(f"listening on {host}:{port}", exc.strerror or str(exc),
                             f"stop what serves port {port}, or choose another port with --port or "
                             f"CONVEYOR_PORT (e.g. CONVEYOR_PORT={port + 1})") from exc

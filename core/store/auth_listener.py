"""Each API process's ear for auth notices (core/store/auth_notices.py) on PostgreSQL: one thread holding a
connection of its own (not one of the pool's) in LISTEN on the notices' channel, telling the process's
AuthCache to forget what each notice names as it arrives.

- NOTIFY is delivered at the sender's commit, so a revoked key is dropped within moments of the revocation
  becoming visible, in every process listening, and a lookup racing it cannot store it again (the cache's
  generation).
- (Re)connected, it clears the whole cache once LISTEN holds: notices sent while nobody listened are lost,
  and anything cached before may be what one of them was about.
- Down (the server restarting, the connection cut), it reconnects with backoff, RETRY_MIN_S doubling up to
  RETRY_MAX_S. Meanwhile nothing is dropped early, and an entry lives at most `auth_cache_s`: the bound
  every answer has anyway. TCP keepalives notice a peer that vanished without closing the connection.
- It waits for notices in slices of POLL_S, so that a stop is seen within one.
"""

from __future__ import annotations

import logging
import threading

import psycopg
from sqlalchemy import Engine
from sqlalchemy.engine import URL

from conveyor.core.background import BackgroundLoop
from conveyor.core.store.auth_cache import AuthCache
from conveyor.core.store.auth_notices import CHANNEL, decode

log = logging.getLogger(__name__)

POLL_S = 0.5
RETRY_MIN_S, RETRY_MAX_S = 0.5, 15.0
STOP_WAIT_S = 5.0
APPLICATION_NAME = "conveyor-auth-listener"  # how pg_stat_activity shows its session
CONNECT_OPTIONS: dict[str, str | int] = {
    "connect_timeout": 5, "application_name": APPLICATION_NAME,
    "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}


class AuthListener:
    def __init__(self, url: URL, cache: AuthCache, *, poll_s: float = POLL_S) -> None:
        """`url`: the store's SQLAlchemy URL (a PostgreSQL one)."""
        self._conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._cache = cache
        self._poll_s = poll_s
        self._failing = False
        self.listening = threading.Event()  # set while LISTEN holds
        self._loop: BackgroundLoop | None = None

    def start(self) -> None:
        """Starts listening (again, after a stop: an app's lifespan may run more than once)."""
        assert self._loop is None, "started twice"
        self._loop = BackgroundLoop("auth-listener", self._run)
        self._loop.start()

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.stop(STOP_WAIT_S)

    def _run(self, stop: threading.Event) -> None:
        delay = RETRY_MIN_S
        while not stop.is_set():
            try:
                self._listen(stop)
            except Exception as exc:  # the server down or restarted, or the connection cut
                if self.listening.is_set():  # it was working: a new outage, retried quickly at first
                    delay = RETRY_MIN_S
                if not self._failing:
                    log.warning("auth notices: not listening on PostgreSQL (%s); cached keys and limits "
                                "live at most auth_cache_s meanwhile; retrying", exc)
                self._failing = True
            self.listening.clear()
            if stop.wait(delay):
                return
            delay = min(delay * 2, RETRY_MAX_S)

    def _listen(self, stop: threading.Event) -> None:
        with psycopg.connect(self._conninfo, autocommit=True, **CONNECT_OPTIONS) as conn:
            conn.execute(f"LISTEN {CHANNEL}")
            self._cache.forget(None)
            self._heard_again()
            while not stop.is_set():
                for notify in conn.notifies(timeout=self._poll_s):
                    self._cache.forget(decode(notify.payload))

    def _heard_again(self) -> None:
        if self._failing:
            log.info("auth notices: listening on PostgreSQL again")
            self._failing = False
        self.listening.set()


def listener_for(db_engine: Engine, cache: AuthCache) -> AuthListener | None:
    """The listener for a store, or None where there is nothing to hear: SQLite, or the cache off."""
    if db_engine.dialect.name != "postgresql" or not cache.enabled:
        return None
    return AuthListener(db_engine.url, cache)

"""The operator console: server-rendered pages under /console, served by the API process itself when
`console_enabled` is set (off by default). Who may see what: viewer.py; what every page shares: pages.py;
the pages: sign_in.py, jobs.py, batches.py and fleet.py (workers, tenants, purges: an admin's); the HTML:
templates/ (Jinja2, every value escaped); while it is off, disabled.py says how to turn it on."""

from __future__ import annotations

from conveyor.api.console import batches, disabled, fleet, jobs, sign_in
from conveyor.api.console.pages import SignInRequired, api_error, to_sign_in

ROUTERS = (sign_in.router, jobs.router, batches.router, fleet.router)
OFF_ROUTER = disabled.router  # what /console answers while the console is off

__all__ = ["OFF_ROUTER", "ROUTERS", "SignInRequired", "api_error", "to_sign_in"]

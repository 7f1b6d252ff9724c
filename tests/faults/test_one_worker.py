"""The fault suite shares one private stack per test process, so under `make test` (pytest-xdist with
`--dist loadgroup`) all of it must run on one worker: tests/conftest.py puts it in the `faults` group, and
pytest-xdist marks a grouped test by its node id. Were the groups silently lost (as with pytest 9.2 and
pytest-xdist 3.8), every worker would start its own PostgreSQL, Redis and API, and the suite would crawl."""

from __future__ import annotations

import pytest


def test_the_fault_suite_is_one_xdist_group(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("xdist_group")
    assert marker is not None and marker.args == ("faults",), marker
    grouped = request.node.nodeid.endswith("@faults")
    # pytest-xdist sets `loadgroup` on its workers; a serial run has no groups to form.
    assert grouped == bool(getattr(request.config.option, "loadgroup", False)), request.node.nodeid

"""The fault suite shares one private stack per test process, so under `make test` (pytest-xdist with
`--dist loadgroup`) all of it must run on one worker: tests/conftest.py puts it in the `faults` group, and
pytest-xdist marks a grouped test by its node id. Were the groups silently lost (as with pytest 9.2 and
pytest-xdist 3.8), every worker would start its own PostgreSQL, Redis and API, and the suite would crawl."""

from __future__ import annotations

import pytest


def test_the_fault_suite_is_one_xdist_group(request: pytest.FixtureRequest) -> None:
    if not getattr(request.config.option, "loadgroup", False):  # set by pytest-xdist on its workers
        pytest.skip("only under pytest-xdist's --dist loadgroup (make test)")
    assert request.node.nodeid.endswith("@faults"), request.node.nodeid

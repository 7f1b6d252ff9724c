"""The fault suite shares one private stack per test process, so under `make test` (pytest-xdist with
`--dist loadgroup`) each of its two groups must run on one worker: tests/conftest.py puts every file in the
`faults` or the `faults-services` group, and pytest-xdist marks a grouped test by its node id. Were the
groups silently lost (as with pytest 9.2 and pytest-xdist 3.8), every worker would start its own
PostgreSQL, Redis and API, and the suite would crawl."""

from __future__ import annotations

import pytest

from tests.conftest import FAULT_GROUP_OF_FILE


def test_the_fault_suite_is_two_xdist_groups(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("xdist_group")
    assert marker is not None and marker.args == ("faults",), marker  # this file's group
    assert set(FAULT_GROUP_OF_FILE.values()) == {"faults-services"}
    grouped = request.node.nodeid.endswith("@faults")
    # pytest-xdist sets `loadgroup` on its workers; a serial run has no groups to form.
    assert grouped == bool(getattr(request.config.option, "loadgroup", False)), request.node.nodeid

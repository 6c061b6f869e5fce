"""Fixtures shared by every folder of the tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stratagem.testing.forked import fork_server_variable


@pytest.fixture(scope="module")
def forked_launches(request: pytest.FixtureRequest) -> Iterator[None]:
    """``stratagem launch`` started by the module's tests and module fixtures (in this process, or
    as a command that inherits its environment) forks its tasks from the test fork server instead
    of starting a fresh interpreter for each (``stratagem.launch.forks``). A module opts in with
    ``pytestmark = pytest.mark.usefixtures("forked_launches")``; tests of how an interpreter starts
    (the launcher's own imports, a task's parent) stay without it. A test finds a forked task by the
    environment it was given with ``stratagem.testing.task_environments`` (its ``/proc/PID/environ``
    is its server's). A module none of whose selected tests is marked ``multiprocess`` starts no
    server for it."""
    if not any(getattr(item, "module", None) is request.module and item.get_closest_marker("multiprocess") is not None
               for item in request.session.items):
        yield
        return
    with pytest.MonkeyPatch.context() as monkeypatch:
        for key, value in fork_server_variable().items():
            monkeypatch.setenv(key, value)
        yield

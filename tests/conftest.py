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


# Modules that share something of the machine besides its cores: they run on one pytest-xdist worker,
# one after the other (Ray's local heads and its /tmp/ray sessions).
_SHARED = {"tests/launch/test_ray.py": "ray", "tests/launch/test_ray_nodes.py": "ray"}


@pytest.hookimpl(tryfirst=True)   # (before pytest-xdist's, which reads the groups)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n 2 --dist loadgroup`` (the suite's command; tests/README.md, "Two workers") each module
    runs whole on one worker, so its module fixtures (a shared cluster, a launched job) are made once;
    :data:`_SHARED`'s modules share one."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        module = item.nodeid.split("::", 1)[0]   # the file, from the root
        item.add_marker(pytest.mark.xdist_group(_SHARED.get(module, module)))

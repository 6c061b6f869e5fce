"""What counts as a gloo thread at rest (stratagem/comm/gloo_threads.py), read from /proc's lines
as Linux writes them for threads blocked where gloo's and CPython's threads block."""

import platform

import pytest

from stratagem.comm import gloo_threads

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the lines are x86_64's")

IDLE = "202 0x558408907c54 0x189 0x0 0x0 0x0 0xffffffff 0x7fe9e6f12d10 0x7fea090a3f16"   # cv wait, no limit


@pytest.mark.parametrize(("state", "line", "at_rest"), [
    ("S", IDLE, True),
    ("R", IDLE, False),   # woken: on its way out of the wait
    ("S", "202 0x7f6d00 0x189 0x0 0x7f85b250f9f0 0x0 0xffffffff 0x1 0x2", False),   # the GIL's wait: a time limit
    ("S", "202 0x557e4bc3df20 0x80 0x2 0x0 0x0 0x0 0x1 0x2", False),   # blocked on a lock
    ("S", "232 0x5 0x7fe9e7713b80 0x40 0xa 0x0 0x7ffd314f48a7 0x1 0x2", False),   # epoll, not a futex
    ("R", "running", False),
])
def test_only_a_condition_variables_wait_without_a_limit_is_rest(state: str, line: str, at_rest: bool) -> None:
    assert gloo_threads._waiting_untimed(state, line.split()) is at_rest


def test_a_process_whose_gloo_threads_do_nothing_is_at_rest() -> None:
    assert gloo_threads.bring_to_rest(timeout=10.0) is True   # (at once where no gloo thread works)

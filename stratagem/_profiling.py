"""Profiler labels placed inside the package: free when no profiler is running.

``with label("stratagem.optimizer.step"):`` opens a ``torch.profiler.record_function``
range only while a profiler is active in the process (a module flag that torch's
profiler sets; unlike ``torch.autograd._profiler_enabled()`` it is also true in replica
threads and RPC handler threads, which ``profile_all_threads=True`` records); otherwise
it enters a shared no-op context. While stratagem's own recorder is on (the timeline, the step
clock: :mod:`stratagem.observe.record`), the label is also one of its spans. Benchmarks and users read these ranges from
``torch.profiler.profile`` tables instead of wrapping private methods.

The labels (one place to look them up):

========================================  ================================================
``stratagem.run``                         ``strategy.run``: splitting arguments, replicas, regrouping
``stratagem.replica_fn``                  one replica's call of the user's function
``stratagem.optimizer.step``              a scoped optimizer's ``step`` in one replica
``stratagem.gradients.local_reduce``      summing gradients among this process's replicas
``stratagem.gradients.cross_worker``      summing gradients over workers (torch.distributed)
``stratagem.optimizer.update``            applying the update to parameters
``stratagem.input.split``                 slicing a global batch for the replicas
``stratagem.ps.pull``                     a worker or coordinator reading variables from the ps
``stratagem.ps.push``                     pushing gradients to the ps
``stratagem.ps.closure``                  a scheduled closure running on a worker
``stratagem.ps.schedule``                 ``ClusterCoordinator.schedule`` on the coordinator
``stratagem.rpc.call``                    one RPC round trip (client side)
``stratagem.rpc.handle``                  one RPC handled by a server (MAC, decode, run, encode)
========================================  ================================================

Example::

    import torch
    from stratagem._profiling import label
    with torch.profiler.profile() as prof:
        with label("stratagem.run"):
            torch.ones(2).sum()
    assert any(e.key == "stratagem.run" for e in prof.key_averages())
"""

from __future__ import annotations

import contextlib
import sys

from stratagem.observe import record as _record

_NOOP = contextlib.nullcontext()
#: torch's profiler module, read where it is loaded: a process that never imported torch (the
#: ``stratagem launch`` of a multi-node job, which makes RPC calls) runs no profiler, and does
#: not import torch for this
_PROFILER = "torch.autograd.profiler"


def label(name: str) -> "contextlib.AbstractContextManager":
    """A profiler range named ``name`` while a profiler runs (and a span of stratagem's recorder
    while it is on); a no-op otherwise."""
    profiler = sys.modules.get(_PROFILER)
    profiling = profiler is not None and profiler._is_profiler_enabled
    if _record.ON:
        return _record.Span(name, _record.CATEGORIES.get(name, "stratagem"),
                            inner=_range(name) if profiling else None)
    return _range(name) if profiling else _NOOP


def _range(name: str) -> "contextlib.AbstractContextManager":
    from torch.profiler import record_function   # (loaded: a profiler runs)
    return record_function(name)

"""Seeing inside a running job: what each task is doing, and where it stands.

- ``flight.py`` -- the collective flight recorder: every collective this process issues
  (process-group calls, the replica threads' sums, parameter-server RPC calls), the last
  few thousand kept, always on;
- ``stacks.py`` -- where each thread of this process stands, in the user's code;
- ``answer.py`` -- a task's answers to the launcher (or a peer) asking where it stands;
- ``hang_report.py`` -- asking every task and putting their answers in one message;
- ``record.py`` -- the timeline's spans of each step, per thread, behind one flag (off by
  default), and the step clock behind the straggler table; ``chrome.py`` -- one
  Chrome/Perfetto trace merged from every task; ``report.py`` -- the straggler table;
  ``draw.py``, ``command.py`` -- ``stratagem timeline PATH --png OUT``; ``epochs.py`` -- the
  per-epoch line of ``stratagem launch`` (docs/observability.md).

``observe/`` sits below the core (docs/architecture.md): ``comm/`` and ``rpc/`` record into
it, so it imports nothing of ``comm/``, ``strategies/`` or anything built on them.
"""

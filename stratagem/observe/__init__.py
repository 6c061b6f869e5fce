"""Seeing inside a running job: spans of each step recorded per thread (:mod:`.record`), merged
into one Chrome/Perfetto trace for the whole job (:mod:`.chrome`), the straggler table
(:mod:`.report`) and a picture of a trace (:mod:`.draw`). Off by default; docs/observability.md.

The public doors are ``sg.experimental.Timeline``, ``strategy.experimental_step_report()``,
``stratagem launch --timeline PATH`` and ``stratagem timeline PATH --png OUT``.
"""

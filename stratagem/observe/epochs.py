"""The one-line throughput summary per epoch that ``stratagem launch`` prints.

A task started by ``stratagem launch`` (which sets :data:`EPOCH_VARIABLE`) whose ``fit`` runs
on the chief prints, after each epoch, one machine-readable line (:func:`marker_line`); the
launcher turns it into its own line (:func:`summary_line`) instead of passing it on.

Example::

    from stratagem.observe.epochs import marker_line, parse_marker, summary_line
    line = marker_line("Epoch 2/3", samples=6400, steps=100, seconds=2.0)
    print(summary_line(parse_marker(line)))
    # epoch 2/3: 6400 samples in 2.0 s -- 3200 samples/s, 50.0 steps/s (20.0 ms a step)
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["EPOCH_VARIABLE", "MARKER", "marker_line", "parse_marker", "summary_line"]

#: set to "1" by ``stratagem launch`` for its tasks: the chief's fit prints its epoch lines
EPOCH_VARIABLE = "STRATAGEM_EPOCH_LINES"
MARKER = "stratagem-epoch-summary "


def marker_line(desc: str, *, samples: int, steps: int, seconds: float) -> str:
    """The line a task prints after an epoch (``desc``: ``"Epoch 2/3"``)."""
    return MARKER + json.dumps({"epoch": desc.partition(" ")[2], "samples": samples, "steps": steps,
                                "seconds": round(seconds, 6)})


def parse_marker(line: str) -> "dict[str, Any] | None":
    """The epoch's numbers in ``line``, or None when it is no marker line."""
    if not line.startswith(MARKER):
        return None
    try:
        found = json.loads(line[len(MARKER):])
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def summary_line(epoch: dict[str, Any]) -> str:
    """The launcher's line for one epoch."""
    seconds, steps, samples = float(epoch.get("seconds", 0)), int(epoch.get("steps", 0)), int(epoch.get("samples", 0))
    if seconds <= 0 or steps <= 0:
        return f"epoch {epoch.get('epoch', '?')}: {steps} steps"
    rate = f"{samples / seconds:.0f} samples/s, " if samples else ""
    return (f"epoch {epoch.get('epoch', '?')}: {samples} samples in {seconds:.1f} s -- {rate}"
            f"{steps / seconds:.1f} steps/s ({1e3 * seconds / steps:.1f} ms a step)")

"""The launcher's output: every task's lines, whole and prefixed with the task's name.

A task's stdout and stderr arrive on one pipe; :meth:`TaskOutput.pump` (one thread per
task process) cuts them into lines and writes each line to the launcher's stdout with
the task's prefix (``[worker 1] ``), one whole line at a time whoever writes, so that
lines of different tasks never tear. :meth:`TaskOutput.say` writes the launcher's own
messages (``[launch] ...``) to its stderr under the same lock.

Example::

    import io
    from stratagem.launch.output import TaskOutput
    out, err = io.StringIO(), io.StringIO()
    output = TaskOutput(out, err)
    output.write("[worker 0] ", [b"step 1\\n", b"\\r", b"step 2\\r\\n"])
    output.say("worker 1 exited with code 0")
    assert out.getvalue() == "[worker 0] step 1\\n[worker 0] step 2\\n"
    assert err.getvalue() == "[launch] worker 1 exited with code 0\\n"
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import IO, TextIO

from stratagem.observe.epochs import MARKER, parse_marker, summary_line

__all__ = ["TaskOutput"]

_MARKER = MARKER.encode()
# A line ends at "\n", "\r\n" or a lone "\r" (progress bars redraw their line with "\r").
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")


class TaskOutput:
    """Where the tasks' lines and the launcher's messages go, one whole line at a time."""

    def __init__(self, stdout: TextIO, stderr: TextIO) -> None:
        self._stdout, self._stderr = stdout, stderr
        self._lock = threading.Lock()

    def pump(self, pipe: IO[bytes], prefix: str) -> None:
        """Copies a task's output to stdout until the pipe closes, each line prefixed."""
        pending = b""
        with pipe:
            while chunk := pipe.read(65536):
                pending += chunk
                # Up to the last line end, looking only at the new bytes (and a "\r" held
                # back): whole lines, in linear time however long a line is. A final "\r"
                # waits for the next read, which may bring the "\n" of a "\r\n".
                start = max(0, len(pending) - len(chunk) - 1)
                cut = max(pending.rfind(b"\n", start), pending.rfind(b"\r", start)) + 1
                if cut == len(pending) and pending.endswith(b"\r"):
                    cut -= 1
                lines = _LINE.findall(pending, 0, cut) if cut else []
                pending = pending[sum(map(len, lines)):]
                self.write(prefix, lines)
            if pending:
                self.write(prefix, [pending + b"\n"])

    def write(self, prefix: str, lines: list[bytes]) -> None:
        """Writes whole ``lines`` (each with its line end) to stdout, each after ``prefix``."""
        if any(line.startswith(_MARKER) for line in lines):
            epochs = [parse_marker(line.decode("utf-8", "replace").rstrip("\r\n")) for line in lines
                      if line.startswith(_MARKER)]
            lines = [line for line in lines if not line.startswith(_MARKER)]
            for epoch in epochs:
                if epoch is not None:
                    self.say(f"{summary_line(epoch)} ({prefix.strip()[1:-1]})")
        # A lone "\r" with nothing before it is a progress bar going back to the start of its
        # line to redraw it: prefixing it would print an empty "[task]" line each time.
        text = "".join(prefix + line.decode("utf-8", "replace").replace("\r\n", "\n")
                       for line in lines if line != b"\r")
        if not text:
            return
        with self._lock, contextlib.suppress(OSError, ValueError):  # a closed stdout drops output
            self._stdout.write(text)
            self._stdout.flush()

    def say(self, message: str) -> None:
        """The launcher's own message, ``[launch] message``, on stderr."""
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._stderr.write(f"[launch] {message}\n")
            self._stderr.flush()

"""How long ``import stratagem`` takes, next to ``import torch`` which it cannot avoid.

Each measurement is a fresh interpreter run with ``-X importtime``; a module's time is the
cumulative microseconds Python reports for it (its own imports included), so interpreter
start-up is left out. Per run, three interpreters, interleaved so that a busy moment of a
shared machine touches all three:

- ``import torch``;
- ``import stratagem`` (torch included);
- ``import torch; import stratagem``: the second import's time is what stratagem adds on
  top of torch, measured in one process -- far less noisy than the difference of the first
  two, which two separate interpreters measure.

The medians of ``--runs`` runs are printed, then the slowest imports under stratagem in the
last run of the third kind (``--top``).

Commands::

    python tools/import_time.py                 # 7 runs
    python tools/import_time.py --runs 15 --top 10
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

# "import time:       self |  cumulative | <indent>module"
_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$")


def measure(code: str) -> dict[str, int]:
    """Cumulative import time in microseconds of every module that ``code`` imports, in a fresh interpreter."""
    completed = subprocess.run([sys.executable, "-X", "importtime", "-c", code],
                               capture_output=True, text=True, check=True)
    times: dict[str, int] = {}
    for line in completed.stderr.splitlines():
        match = _LINE.match(line)
        if match:
            times[match.group(4)] = int(match.group(2))
    return times


def _total(times: dict[str, int], module: str) -> float:
    return times[module] / 1e6   # the module's cumulative time covers everything it imported


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="runs of each measurement (default: 7)")
    parser.add_argument("--top", type=int, default=5, help="slowest imports under stratagem to list (default: 5)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")

    torch_seconds, stratagem_seconds, added_seconds = [], [], []
    after_torch: dict[str, int] = {}
    for _ in range(args.runs):
        torch_seconds.append(_total(measure("import torch"), "torch"))
        stratagem_seconds.append(_total(measure("import stratagem"), "stratagem"))
        after_torch = measure("import torch; import stratagem")
        added_seconds.append(_total(after_torch, "stratagem"))
    torch_median, stratagem_median = statistics.median(torch_seconds), statistics.median(stratagem_seconds)
    print(f"import torch                     {torch_median:.3f} s   (median of {args.runs})")
    print(f"import stratagem                 {stratagem_median:.3f} s   (median of {args.runs}, torch included)")
    print(f"difference                       {stratagem_median - torch_median:+.3f} s")
    print(f"import stratagem after torch     {statistics.median(added_seconds):.3f} s   "
          f"(median of {args.runs}, one process: what stratagem adds)")
    if args.top:
        print("slowest imports under stratagem after torch, cumulative (last run):")
        names = list(after_torch)   # in the order their imports finished: torch's tree, then stratagem's
        under = sorted(((after_torch[m], m) for m in names[names.index("torch") + 1:] if m != "stratagem"),
                       reverse=True)
        for micros, module in under[:args.top]:
            print(f"  {micros / 1e6:.3f} s  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The pictures of docs/observability.md, made from real runs on this machine.

Runs three jobs with ``stratagem launch --timeline`` and draws each trace with
``stratagem timeline TRACE --png PICTURE`` (matplotlib needed), into OUT (default docs/images):

- ``two_workers``: MultiWorkerMirroredStrategy, 2 workers, ``sg.Model.fit`` of an MLP, worker 1's
  input pipeline slowed by a 30 ms sleep before each batch (the straggler);
- ``parameter_server``: examples/train_ps.py, 2 workers and 1 ps, 40 steps;
- ``pipeline``: examples/pipeline.py on 2 stages, GPipe over 4 micro-batches, 6 steps.

    python tools/timeline_pictures.py            # docs/images/timeline_*.png (and the traces beside)
    python tools/timeline_pictures.py /tmp/pics
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SLOW_WORKER = textwrap.dedent('''
    import time, torch, stratagem as sg
    torch.set_num_threads(1)
    strategy = sg.MultiWorkerMirroredStrategy()
    slow = 0.03 if strategy.topology.worker_index == 1 else 0.0

    class Batches:
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.items = [(torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g))
                          for _ in range(8)]
        def __len__(self):
            return len(self.items)
        def __iter__(self):
            for item in self.items:
                time.sleep(slow)   # worker 1 reads its input slowly
                yield item

    with strategy.scope():
        model = sg.Model(torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                             torch.nn.ReLU(), torch.nn.Linear(512, 10)))
        model.compile(optimizer="sgd", loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(Batches(), epochs=2, verbose=2)
''')


def run(name: str, out: str, launch: list[str], script: list[str]) -> None:
    trace = os.path.join(out, f"timeline_{name}.json")
    command = [sys.executable, "-m", "stratagem", "launch", *launch, "--timeline", trace, *script]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, timeout=600)
    picture = os.path.join(out, f"timeline_{name}.png")
    subprocess.run([sys.executable, "-m", "stratagem", "timeline", trace, "--png", picture,
                    "--title", f"stratagem launch {' '.join(launch)} --timeline ... {os.path.basename(script[0])}"],
                   check=True, cwd=ROOT, timeout=120)


def main() -> None:
    out = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "images"))
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        slow = os.path.join(folder, "slow_worker.py")
        with open(slow, "w") as f:
            f.write(SLOW_WORKER)
        run("two_workers", out, ["--workers", "2"], [slow])
    run("parameter_server", out, ["--workers", "2", "--ps", "1"], ["examples/train_ps.py", "--steps", "40"])
    run("pipeline", out, ["--workers", "2"], ["examples/pipeline.py", "--schedule", "gpipe", "--steps", "6"])


if __name__ == "__main__":
    main()

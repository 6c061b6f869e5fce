"""A worker of a 2-worker MultiWorkerMirroredStrategy job with the timeline on.

Run by tests/observe/test_multi_worker_timeline.py as `python timeline_script.py OUT MODE` in
each task of a local cluster (or by `stratagem launch`, with OUT "-" and no Timeline of its own):

- ``fit``: ``sg.Model.fit`` with ``sg.experimental.Timeline(OUT/trace.json)`` as a callback (the
  chief prints the straggler table at the end of fit);
- ``slow``: the same, worker 1's input pipeline sleeping 40 ms before each batch;
- ``hog``: the same, worker 1's forward spending 40 ms more on the CPU (a busy loop) each step;
- ``loop``: a custom loop inside ``with Timeline(...)``, then ``strategy.experimental_step_report()``.
"""

import os
import sys
import time

import torch

import stratagem as sg

STEPS, BATCH, FEATURES = 12, 64, 64


class Batches:
    """An input pipeline of ``STEPS`` global batches, each after ``delay`` seconds of work."""

    def __init__(self, delay: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.batches = [(torch.randn(BATCH, FEATURES, generator=generator),
                         torch.randint(0, 10, (BATCH,), generator=generator)) for _ in range(STEPS)]
        self.delay = delay

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            if self.delay:
                time.sleep(self.delay)   # a slow reader
            yield batch


def module() -> torch.nn.Module:
    # reversed, the last two layers fill the first 1 MiB pack: it leaves while backward goes on
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def spin(seconds: float) -> None:
    """Keep the CPU busy for ``seconds``: a compute straggler."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    strategy = sg.MultiWorkerMirroredStrategy()
    worker = strategy.topology.worker_index
    data = Batches(0.04 if mode == "slow" and worker == 1 else 0.0)
    path = os.path.join(out, "trace.json")
    if mode in ("fit", "slow", "hog"):
        with strategy.scope():
            net = module()
            if mode == "hog" and worker == 1:
                net[0].register_forward_pre_hook(lambda *_: spin(0.04))
            model = sg.Model(net)
            model.compile(optimizer="sgd", loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True))
        callbacks = [] if out == "-" else [sg.experimental.Timeline(path)]
        model.fit(data, epochs=2, callbacks=callbacks, verbose=2)
    else:
        with strategy.scope():
            net = module()
            optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

        def step(batch):
            x, y = batch
            loss = sg.nn.compute_average_loss(torch.nn.functional.cross_entropy(net(x), y, reduction="none"))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        with sg.experimental.Timeline(path):
            for batch in strategy.experimental_distribute_dataset(data):
                strategy.run(step, args=(batch,))
        print(strategy.experimental_step_report())
    print(f"worker {worker} done", flush=True)


if __name__ == "__main__":
    main()

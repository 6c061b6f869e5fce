"""A job stopped for good on one number of workers and resumed on another, from its checkpoints.

Run by tests/checkpoint/test_resize.py as
`python -m stratagem launch --workers N resize_script.py OUT CKPT_DIR --loop fit|custom|function [options]`.

A small float64 MLP trains 3 epochs under MultiWorkerMirroredStrategy (one replica per worker):

- ``fit``: ``model.fit(x, y, batch_size=8)`` (44 rows: 6 steps an epoch, the last of 4 rows), with
  ``BackupAndRestore`` every step and a ``LearningRateScheduler`` (0.05 * 0.7 ** epoch);
- ``custom``: a loop over ``experimental_distribute_dataset`` of a shuffling DataLoader of the same
  rows and global batch, Adam with a StepLR stepped every step, a ``CheckpointManager`` saved every step;
- ``function``: the same loop over ``distribute_datasets_from_function`` (42 rows, global batch 6: 7
  steps an epoch), each pipeline reading its slice of every global batch of one shared order,
  ``get_per_replica_batch_size(6)`` rows a step; ``--resizable`` passes
  ``InputOptions(experimental_resizable=True)``.

Column 5 of x is the row's index: the model's forward records it, so each worker appends to
OUT/<tag>-rank<r>.jsonl ``{"resume": global step}`` at start-up, then after every step
``{"step", "epoch", "lr", "ids"}`` (the ids of its slice). It prints ``rank R saved step S`` once
step S's checkpoint is complete (the loops save again when an epoch ends: ``rank R saved epoch E``);
with ``--kill-at "step S"`` (or ``"epoch E"``) the last worker then SIGKILLs itself (a node lost for
good). At the end every worker writes OUT/<tag>-final-rank<r>.json (parameters, step, lr).
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.data.sharding import split_sizes
from stratagem.placement.layout.mirrored import MirroredPlacement

EPOCHS, LR, GAMMA = 3, 0.05, 0.7
ROWS = {"fit": 44, "custom": 44, "function": 42}
GLOBAL_BATCH = {"fit": 8, "custom": 8, "function": 6}


def arrays(loop: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (features and, in column 5, the row's index) and y, float64."""
    rows = ROWS[loop]
    g = torch.Generator().manual_seed(5)
    features = torch.randn(rows, 5, generator=g, dtype=torch.float64)
    x = torch.cat([features, torch.arange(rows, dtype=torch.float64)[:, None]], dim=1)
    return x, torch.randint(0, 3, (rows,), generator=g)


class Net(torch.nn.Module):
    """An MLP on x's first 5 columns; in training it records the row indices it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
        self.seen: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.append(x[:, 5].long().tolist())
        return self.body(x[:, :5])


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


class GlobalOrder:
    """A batch sampler for the replicas ``first..first+count-1`` of ``num_replicas``: their slices of
    every global batch, in turn, of one permutation per epoch drawn from ``generator`` (seeded alike
    on every worker)."""

    def __init__(self, rows: int, global_batch: int, num_replicas: int, first: int, count: int,
                 generator: torch.Generator):
        self.rows, self.global_batch = rows, global_batch
        self.num_replicas, self.first, self.count = num_replicas, first, count
        self.generator = generator

    def __len__(self) -> int:
        return -(-self.rows // self.global_batch) * self.count

    def __iter__(self):
        order = torch.randperm(self.rows, generator=self.generator).tolist()
        for start in range(0, self.rows, self.global_batch):
            batch = order[start:start + self.global_batch]
            sizes = split_sizes(len(batch), self.num_replicas)
            for replica in range(self.first, self.first + self.count):
                lo = sum(sizes[:replica])
                yield batch[lo:lo + sizes[replica]]


def global_order_loader(loop: str, context: sg.InputContext) -> DataLoader:
    """A pipeline of ``dataset_fn``: this worker's replicas' slices of one order of global batches."""
    per_replica = context.get_per_replica_batch_size(GLOBAL_BATCH[loop])   # the global batch is kept
    assert per_replica * context.num_replicas_in_sync == GLOBAL_BATCH[loop]
    count = context.num_replicas_in_sync // context.num_input_pipelines   # replicas of this worker
    generator = torch.Generator().manual_seed(11)
    sampler = GlobalOrder(ROWS[loop], GLOBAL_BATCH[loop], context.num_replicas_in_sync,
                          context.input_pipeline_id * count, count, generator)
    return DataLoader(TensorDataset(*arrays(loop)), batch_sampler=sampler, generator=generator)


class Log:
    def __init__(self, path: Path) -> None:
        self._file = open(path, "a")

    def write(self, **entry) -> None:
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()


def saved(rank: int, what: str, kill_at: str, last: bool) -> None:
    print(f"rank {rank} saved {what}", flush=True)
    if what == kill_at and last:
        os.kill(os.getpid(), signal.SIGKILL)   # this node is lost for good


def run_fit(args, strategy, rank: int, log: Log) -> tuple[Net, torch.optim.Optimizer, int]:
    with strategy.scope():
        net = make_net()
        model = sg.Model(net)
        optimizer = torch.optim.Adam(net.parameters(), lr=LR)
        model.compile(optimizer, loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = sg.callbacks.BackupAndRestore(args.ckpt_dir, save_freq=1, delete_checkpoint=False)
    steps_per_epoch = -(-ROWS["fit"] // GLOBAL_BATCH["fit"])
    last = rank == strategy.num_replicas_in_sync - 1   # one replica a worker
    done = {"step": 0}

    class Recorder(sg.callbacks.Callback):
        def on_train_begin(self, logs=None):
            done["step"] = backup.epoch * steps_per_epoch + backup.step
            log.write(resume=done["step"])

        def on_train_batch_end(self, batch, logs=None):   # after the backup's (it comes first)
            done["step"] += 1
            log.write(step=done["step"], epoch=backup.epoch, lr=optimizer.param_groups[0]["lr"], ids=net.seen[-1])
            saved(rank, f"step {done['step']}", args.kill_at, last)

    schedule = sg.callbacks.LearningRateScheduler(lambda epoch: LR * GAMMA ** epoch)
    torch.manual_seed(42)   # the chief's draws fix every epoch's shuffle
    model.fit(*arrays("fit"), batch_size=GLOBAL_BATCH["fit"], epochs=EPOCHS, verbose=0,
              callbacks=[backup, schedule, Recorder()])
    return net, optimizer, done["step"]


def run_loop(args, strategy, rank: int, log: Log) -> tuple[Net, torch.optim.Optimizer, int]:
    with strategy.scope():
        net = make_net()
        optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=GAMMA)
    torch.manual_seed(42)
    if args.loop == "custom":
        loader = DataLoader(TensorDataset(*arrays("custom")), batch_size=GLOBAL_BATCH["custom"], shuffle=True)
        data = strategy.experimental_distribute_dataset(loader)
    else:
        options = sg.InputOptions(experimental_resizable=True) if args.resizable else None
        data = strategy.distribute_datasets_from_function(lambda ctx: global_order_loader("function", ctx), options)
    ckpt = sg.Checkpoint(model=net, optimizer=optimizer, scheduler=scheduler, data=data, step=0)
    manager = sg.CheckpointManager(ckpt, args.ckpt_dir, max_to_keep=2)
    manager.restore_or_initialize()
    log.write(resume=ckpt.step)
    last = rank == strategy.num_replicas_in_sync - 1

    def train_step(x, y):
        loss = sg.nn.compute_average_loss(F.cross_entropy(net(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for epoch in range(data.epoch, EPOCHS):
        for x, y in data:
            lr = optimizer.param_groups[0]["lr"]
            strategy.run(train_step, args=(x, y))
            scheduler.step()
            ckpt.step += 1
            log.write(step=ckpt.step, epoch=epoch, lr=lr, ids=net.seen[-1])
            manager.save()
            saved(rank, f"step {ckpt.step}", args.kill_at, last)
        manager.save()   # the epoch has ended: a position at an epoch boundary
        saved(rank, f"epoch {epoch}", args.kill_at, last)
    return net, optimizer, ckpt.step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("ckpt_dir")
    parser.add_argument("--loop", choices=["fit", "custom", "function"], required=True)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--kill-at", default="", help="'step S' or 'epoch E' (loops: after its end)")
    parser.add_argument("--sharding", default=None)
    parser.add_argument("--resizable", action="store_true")
    args = parser.parse_args()

    options = sg.CommunicationOptions(timeout_seconds=60)
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=options, sharding=args.sharding)
    rank = strategy.cluster_resolver.worker_rank
    log = Log(Path(args.out, f"{args.tag}-rank{rank}.jsonl"))
    run = run_fit if args.loop == "fit" else run_loop
    net, optimizer, step = run(args, strategy, rank, log)
    params = {k: v.tolist() for k, v in net.body.state_dict().items()}
    Path(args.out, f"{args.tag}-final-rank{rank}.json").write_text(json.dumps(
        {"params": params, "step": step, "lr": optimizer.param_groups[0]["lr"], "module": sg.__file__,
         # the mirrored placement's update rule (ZeRO 1/2), else the placement (ZeRO-3)
         "placement": type(strategy.placement.update if isinstance(strategy.placement, MirroredPlacement)
                           else strategy.placement).__name__}))


if __name__ == "__main__":
    main()

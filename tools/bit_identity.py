"""Fingerprint the exact parameters that every synchronous strategy produces.

A refactor that must change no computation runs this before and after and compares:

    python tools/bit_identity.py > before.json     # on the old code
    python tools/bit_identity.py --check before.json

Each configuration trains the equivalence tests' models with a fixed seed and records
a SHA-256 of the raw bytes of every parameter and optimizer-state tensor after the
last step (multi-worker ones: of every worker's parameters after every step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import stratagem as sg  # noqa: E402
from tests.strategies.test_equivalence import BufferedNet, _data, _optimizer  # noqa: E402


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def _train(strategy, optimizer_kind: str, batch_sizes: list[int], scheduler: bool = False) -> str:
    torch.manual_seed(0)
    reference = BufferedNet()
    with strategy.scope():
        model = BufferedNet()
        optimizer = (torch.optim.Adafactor(model.parameters(), lr=0.01) if optimizer_kind == "adafactor"
                     else _optimizer(optimizer_kind, model.parameters()))   # (not split by ranges: twins)
    model.load_state_dict(reference.state_dict())
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if scheduler else None
    data = _data(batch_sizes)

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = []
    for batch in strategy.experimental_distribute_dataset(data):
        losses.append(strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None))
        if sched is not None:
            sched.step()
    tensors = list(losses)
    for p in model.parameters():
        tensors.extend(strategy.experimental_local_results(p))
    for state in optimizer.state_dict()["state"].values():
        tensors.extend(torch.as_tensor(v) for _, v in sorted(state.items()))
    tensors.extend(model.buffers())
    return _digest(tensors)


class _PluginOps(sg.CrossDeviceOps):
    """A user's cross-device op: the base class's reference sums, through the plug-in collective."""


def local_configurations():
    for replicas in (1, 2, 3, 4):
        for kind in ("sgd", "adam"):
            yield f"mirrored{replicas}-{kind}", lambda r=replicas, k=kind: _train(
                sg.MirroredStrategy([f"cpu:{i}" for i in range(r)]), k, [12, 12, 7, 12, 2])
    ops = {"hierarchical": lambda: sg.HierarchicalCopyAllReduce(),
           "one_device": lambda: sg.ReductionToOneDevice(),
           "one_device_cpu1": lambda: sg.ReductionToOneDevice(reduce_to_device="cpu:1")}
    for name, make in ops.items():
        for kind in ("sgd", "adam"):
            yield f"op-{name}-{kind}", lambda m=make, k=kind: _train(
                sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=m()), k, [9, 9, 5, 1])
    for kind in ("sgd", "adam"):
        yield f"op-ring-{kind}", lambda k=kind: _train(
            sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=sg.RingAllReduce()), k, [9, 9, 5, 1])
        yield f"op-plugin-{kind}", lambda k=kind: _train(
            sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=_PluginOps()), k, [9, 9, 5, 1])
    for replicas in (2, 3):
        for kind in ("sgd", "adam", "adafactor"):
            yield f"central{replicas}-{kind}", lambda r=replicas, k=kind: _train(
                sg.CentralStorageStrategy([f"cpu:{i}" for i in range(r)]), k, [12, 12, 7, 12, 2])
    yield "mirrored2-adafactor", lambda: _train(sg.MirroredStrategy(["cpu:0", "cpu:1"]), "adafactor", [12, 12, 7])
    for kind in ("sgd", "adam"):
        yield f"one_device-{kind}", lambda k=kind: _train(sg.OneDeviceStrategy("cpu"), k, [8, 8, 3])
    yield "default-adam", lambda: _train(sg.get_strategy(), "adam", [8, 3])
    yield "scheduler-sgd", lambda: _train(sg.MirroredStrategy(["cpu:0", "cpu:1"]), "sgd", [8] * 5, True)


MULTI_WORKER = {
    "mw2-sgd": (2, ["--optimizer", "sgd"]),
    "mw2x2-adam": (2, ["--optimizer", "adam", "--replicas-per-worker", "2", "--batches", "12,12,7,2"]),
    "mw3-adam-tiny-packs": (3, ["--optimizer", "adam", "--bytes-per-pack", "1", "--batches", "12,12,7,2"]),
    "mw2-sgd-big-pack-loader": (2, ["--optimizer", "sgd", "--bytes-per-pack", str(1 << 30),
                                    "--batches", "8,8,8,5", "--input", "loader"]),
    "mw2-adam-zero1": (2, ["--optimizer", "adam", "--sharding", "optimizer", "--batches", "12,12,7,2"]),
    "mw2-sgd-zero2": (2, ["--optimizer", "sgd", "--sharding", "gradients", "--batches", "12,12,7,2"]),
}


def multi_worker(name: str) -> str:
    from stratagem.testing import run_local_cluster

    num_workers, args = MULTI_WORKER[name]
    script = ROOT / "tests" / "strategies" / "train_script.py"
    with tempfile.TemporaryDirectory() as out:
        results = run_local_cluster(script, num_workers, args=[out, *args, "--timeout", "60"], timeout=150)
        for r in results:
            if r.returncode != 0:
                raise RuntimeError(f"{name}: {r.task} failed:\n{r.output}")
        blobs = [Path(out, f"rank{rank}.json").read_text() for rank in range(num_workers)]
    payload = [json.loads(b)["history"] for b in blobs]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=Path, help="compare with a JSON file written before")
    parser.add_argument("--no-multi-worker", action="store_true")
    args = parser.parse_args()
    got = {name: run() for name, run in local_configurations()}
    if not args.no_multi_worker:
        got.update({name: multi_worker(name) for name in MULTI_WORKER})
    if args.check is None:
        print(json.dumps(got, indent=1))
        return 0
    want = json.loads(args.check.read_text())
    bad = [name for name in want if name in got and got[name] != want[name]]
    for name in want:
        print(f"{'OK ' if got.get(name) == want[name] else 'DIFF'} {name}")
    print(f"{len(want) - len(bad)} identical, {len(bad)} different")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

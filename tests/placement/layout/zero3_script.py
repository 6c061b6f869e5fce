"""Trains under MultiWorkerMirroredStrategy(sharding="parameters") (ZeRO-3, FSDP2) and checks, in
each worker, what the test then reads from OUT_DIR/rankR.json:

- float64 equivalence with plain single-process PyTorch (SGD with momentum, and Adam), every
  step, read through ``model.state_dict()`` (full tensors, a collective);
- the parameter and optimizer-state bytes each worker holds against plain PyTorch's;
- ``optimizer.state_dict()`` (gathered) equal to plain PyTorch's;
- ``strategy.reduce`` and ``sg.metrics`` over the workers;
- ``sg.Checkpoint`` written under stage 3 (OUT_DIR/ckpt3) restored under stage 3 and under
  stage 2 (a second strategy in the same processes), one written under stage 2 restored under
  stage 3, and one written without sharding by the test (OUT_DIR/plain) restored here: each
  then trains on exactly as the original did;
- ``sg.Model.fit`` for two epochs in float32 (gradients summed with ReduceOp.SUM under gloo);
- gradient clipping (the steps of clips.py): the norms and parameters of every step as plain PyTorch's.

With ``--restore DIR`` (another number of workers): only restores DIR under stage 3 and under
stage 2, takes the two steps after it and checks them against plain PyTorch.

Usage: python zero3_script.py OUT_DIR [--restore CKPT]
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import stratagem as sg  # noqa: E402
from tests.placement.data_axis.sharding_script import (STEPS, build_models, clipping, make_data, make_model,  # noqa: E402
                                                reference, step)


def local_bytes(tensors) -> int:
    return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for t in tensors)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--restore")
    args = parser.parse_args(argv)
    options = sg.CommunicationOptions(timeout_seconds=60)
    strategy = sg.MultiWorkerMirroredStrategy(sharding="parameters", communication_options=options)
    rank = strategy.cluster_resolver.worker_rank

    def error(models, want) -> float:
        worst = 0.0
        for m, w in zip(models, want):
            for p, ref in zip(m.state_dict().values(), w):
                worst = max(worst, (p - ref).abs().max().item())
        return worst

    def train_on(strategy, models, optimizers, steps):
        data = list(strategy.experimental_distribute_dataset(make_data()))
        for i in steps:
            strategy.run(step, args=(models, optimizers, data[i]))

    def restored(strategy, path, seed):
        models, optimizers = build_models(strategy, seed)
        sg.Checkpoint(model_sgd=models[0], model_adam=models[1], sgd=optimizers[0],
                      adam=optimizers[1]).restore(path)
        return models, optimizers

    expected, ref_states, full = reference()
    result = {"num_replicas": strategy.num_replicas_in_sync}
    # stage 2 in the same processes, with small packs (several per step, some across workers' ranges)
    stage2 = sg.MultiWorkerMirroredStrategy(sharding="gradients", communication_options=sg.CommunicationOptions(
        timeout_seconds=60, bytes_per_pack=200))
    if args.restore:
        models, optimizers = restored(strategy, args.restore, 70)
        train_on(strategy, models, optimizers, range(STEPS, STEPS + 2))
        result["restored_error"] = error(models, expected[STEPS + 1])
        in_stage2 = restored(stage2, args.restore, 75)
        train_on(stage2, *in_stage2, range(STEPS, STEPS + 2))
        result["stage2_error"] = error(in_stage2[0], expected[STEPS + 1])
        return finish(args.out, rank, result)

    models, optimizers = build_models(strategy, 10 + rank)   # the chief's initial values win
    for m, r in zip(models, (make_model(0), make_model(0))):
        m.load_state_dict(r.state_dict())   # the same start as the reference (every worker alike)
    data = list(strategy.experimental_distribute_dataset(make_data()))
    worst = 0.0
    for i in range(STEPS):
        strategy.run(step, args=(models, optimizers, data[i]))
        worst = max(worst, error(models, expected[i]))
    result["worst"] = worst
    result["param_bytes"] = local_bytes(list(models[1].parameters()))
    result["full_param_bytes"] = sum(p.numel() * p.element_size() for p in make_model(0).parameters())
    result["state_bytes"] = [strategy.placement.state_bytes(o) for o in optimizers]
    result["full_bytes"] = full

    ckpt3 = os.path.join(args.out, "ckpt3")
    sg.Checkpoint(model_sgd=models[0], model_adam=models[1], sgd=optimizers[0], adam=optimizers[1]).save(ckpt3)
    gathered = [o.state_dict() for o in optimizers]   # every worker asks: a collective
    state_error = 0.0
    for got, want_state in zip(gathered, ref_states):
        assert sorted(got["state"]) == sorted(want_state), (sorted(got["state"]), sorted(want_state))
        for index, entry in want_state.items():
            for key, value in entry.items():
                state_error = max(state_error, (got["state"][index][key].double() - value.double()).abs().max().item())
    result["state_error"] = state_error

    # strategy.reduce and a metric over the workers
    values = strategy.run(lambda: torch.tensor(float(rank + 1)))
    result["reduced"] = strategy.reduce("sum", values, axis=None).item()
    with strategy.scope():
        mean = sg.metrics.Mean()
    strategy.run(lambda: mean.update_state(torch.tensor([float(rank)] * (rank + 1))))
    result["metric"] = mean.result().item()

    # two more steps; every restored copy must take exactly (or, across stages, nearly) the same
    train_on(strategy, models, optimizers, range(STEPS, STEPS + 2))
    result["worst"] = max(result["worst"], error(models, expected[STEPS + 1]))
    after = [[v.clone() for v in m.state_dict().values()] for m in models]
    again = restored(strategy, ckpt3, 50)
    train_on(strategy, *again, range(STEPS, STEPS + 2))
    result["resumed_error"] = error(again[0], after)
    if os.path.exists(os.path.join(args.out, "plain")):   # saved without sharding, by the test
        plain = restored(strategy, os.path.join(args.out, "plain"), 60)
        train_on(strategy, *plain, range(STEPS, STEPS + 2))
        result["plain_error"] = error(plain[0], after)

    in_stage2 = restored(stage2, ckpt3, 80)   # stage 3 -> stage 2
    ckpt2 = os.path.join(args.out, "ckpt2")
    sg.Checkpoint(model_sgd=in_stage2[0][0], model_adam=in_stage2[0][1], sgd=in_stage2[1][0],
                  adam=in_stage2[1][1]).save(ckpt2)
    train_on(stage2, *in_stage2, range(STEPS, STEPS + 2))
    result["stage2_error"] = error(in_stage2[0], after)
    back = restored(strategy, ckpt2, 90)   # stage 2 -> stage 3
    train_on(strategy, *back, range(STEPS, STEPS + 2))
    result["back_error"] = error(back[0], after)

    result["fit_loss"] = fit(strategy)
    result["clipping"] = clipping(strategy, lambda seed: build_models(strategy, seed))
    return finish(args.out, rank, result)


def fit(strategy) -> list[float]:
    """The losses of two epochs of Keras-style fit, in float32 (the test runs it under one device too)."""
    with strategy.scope():
        keras = sg.Model(make_model(3).float())
        keras.compile(optimizer="adam", loss=torch.nn.CrossEntropyLoss())
    x = torch.randn(24, 6, generator=torch.Generator().manual_seed(4))
    y = torch.arange(24) % 3
    return keras.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]


def finish(out, rank, result) -> int:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print(f"rank {rank} done", flush=True)
    dist.barrier()   # leave together (as collectives_script.py): a worker exiting alone once aborted at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Trains under MultiWorkerMirroredStrategy(sharding=STAGE) and checks, in each worker, what the
test then reads from OUT_DIR/rankR.json:

- float64 equivalence with plain single-process PyTorch (SGD with momentum, and Adam, both
  trained in the same steps), every step, on every worker;
- the optimizer state each worker holds (bytes) against plain PyTorch's;
- ``optimizer.state_dict()`` (gathered) equal to plain PyTorch's;
- ``sg.Checkpoint`` saved under sharding (OUT_DIR/ckpt), restored into a fresh model and
  optimizer under the same strategy, training on exactly as the original; and one saved
  without sharding (OUT_DIR/plain, when the test wrote it) restored under sharding;
- gradient clipping (the steps of clips.py): the norms and the parameters of every step as plain
  PyTorch's.

Usage: python sharding_script.py OUT_DIR --sharding optimizer|gradients
"""

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the repository: run as a script, or imported
from tests._support import clips  # noqa: E402

STEPS = 4


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3)).double()   # 93 parameters: uneven ranges


def make_optimizers(model_sgd: nn.Module, model_adam: nn.Module):
    return (torch.optim.SGD(model_sgd.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
            torch.optim.Adam(model_adam.parameters(), lr=0.01))


def make_data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (10,), generator=g))
            for _ in range(STEPS + 2)]


def state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def build_models(strategy, seed):
    """The SGD and the Adam model with their optimizers, created in ``strategy``'s scope."""
    with strategy.scope():
        models = make_model(seed), make_model(seed)
        optimizers = make_optimizers(*models)
    return models, optimizers


def step(models, optimizers, batch):
    """One training step of both models (run by ``strategy.run``)."""
    x, y = batch
    for model, optimizer in zip(models, optimizers):
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def reference():
    """Plain PyTorch, one process, the whole batch: parameters after every step, the optimizers'
    state (and its bytes) after STEPS steps."""
    models = make_model(0), make_model(0)
    optimizers = make_optimizers(*models)
    history, states = [], None
    for i, (x, y) in enumerate(make_data()):
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        history.append([[p.detach().clone() for p in m.parameters()] for m in models])
        if i == STEPS - 1:
            states = [copy.deepcopy(o.state_dict()["state"]) for o in optimizers]
            full = [state_bytes(o) for o in optimizers]
    return history, states, full


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sharding", required=True)
    args = parser.parse_args(argv)
    # small packs (200 bytes): several per step, within one worker's range and across two
    options = sg.CommunicationOptions(timeout_seconds=60, bytes_per_pack=200)
    strategy = sg.MultiWorkerMirroredStrategy(sharding=args.sharding, communication_options=options)
    rank = strategy.cluster_resolver.worker_rank

    def build(seed):
        return build_models(strategy, seed)

    models, optimizers = build(10 + rank)   # the chief's initial values win
    ref_models = make_model(0), make_model(0)
    for m, r in zip(models, ref_models):
        m.load_state_dict(r.state_dict())   # the same start as the reference (every worker alike)

    expected, ref_states, full = reference()
    data = list(strategy.experimental_distribute_dataset(make_data()))
    worst = 0.0
    for i in range(STEPS):
        strategy.run(step, args=(models, optimizers, data[i]))
        for m, want in zip(models, expected[i]):
            for p, w in zip(m.parameters(), want):
                worst = max(worst, (p.detach() - w).abs().max().item())
    ckpt = sg.Checkpoint(model_sgd=models[0], model_adam=models[1], sgd=optimizers[0], adam=optimizers[1])
    ckpt.save(os.path.join(args.out, "ckpt"))
    gathered = [o.state_dict() for o in optimizers]   # every worker asks: a collective
    state_error = 0.0
    for got, want_state in zip(gathered, ref_states):
        assert sorted(got["state"]) == sorted(want_state), (sorted(got["state"]), sorted(want_state))
        for index, entry in want_state.items():
            for key, value in entry.items():
                state_error = max(state_error, (got["state"][index][key].double() - value.double()).abs().max().item())
    mine = [strategy.placement.state_bytes(o) for o in optimizers]

    # go on two steps; then restore the checkpoint into fresh objects and take the same two steps
    for i in range(STEPS, STEPS + 2):
        strategy.run(step, args=(models, optimizers, data[i]))
    after = [[p.detach().clone() for p in m.parameters()] for m in models]
    fresh_models, fresh_optimizers = build(50)
    restored = sg.Checkpoint(model_sgd=fresh_models[0], model_adam=fresh_models[1],
                             sgd=fresh_optimizers[0], adam=fresh_optimizers[1])
    restored.restore(os.path.join(args.out, "ckpt"))
    for i in range(STEPS, STEPS + 2):
        strategy.run(step, args=(fresh_models, fresh_optimizers, data[i]))
    resumed_equal = all(torch.equal(p.detach(), a) for m, want in zip(fresh_models, after)
                        for p, a in zip(m.parameters(), want))
    plain_error = None   # a checkpoint saved without sharding (by the test, under one device), restored here
    if os.path.exists(os.path.join(args.out, "plain")):
        plain_models, plain_optimizers = build(60)
        sg.Checkpoint(model_sgd=plain_models[0], model_adam=plain_models[1], sgd=plain_optimizers[0],
                      adam=plain_optimizers[1]).restore(os.path.join(args.out, "plain"))
        for i in range(STEPS, STEPS + 2):
            strategy.run(step, args=(plain_models, plain_optimizers, data[i]))
        plain_error = max((p.detach() - a).abs().max().item() for m, want in zip(plain_models, after)
                          for p, a in zip(m.parameters(), want))
    for m, want in zip(models, expected[STEPS + 1]):
        for p, w in zip(m.parameters(), want):
            worst = max(worst, (p.detach() - w).abs().max().item())
    accumulated_error = accumulated(strategy, build, data, expected[0])
    older_refused = None
    if args.sharding == "gradients":   # a newer optimizer over the same parameters takes their gradients
        with strategy.scope():
            torch.optim.SGD(models[0].parameters(), lr=0.1)
        try:
            optimizers[0].step()
            older_refused = False
        except sg.errors.InvalidArgumentError as error:
            older_refused = "another optimizer was created in scope over these parameters" in str(error)
    clipped = clipping(strategy, build)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"clipping": clipped, "worst": worst, "state_error": state_error, "state_bytes": mine, "full_bytes": full,
                   "resumed_equal": resumed_equal, "plain_error": plain_error,
                   "accumulated_error": accumulated_error, "older_refused": older_refused, "num_replicas": strategy.num_replicas_in_sync}, f)
    print(f"rank {rank} done", flush=True)
    dist.barrier()   # leave together (as collectives_script.py): a worker exiting alone once aborted at exit


def clipping(strategy, build) -> dict:
    """The steps of clips.STEPS for both models under ``strategy`` and in plain PyTorch: each step's
    norms (both), and the parameters' largest difference over every step."""
    g = torch.Generator().manual_seed(8)
    batches = [(torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (10,), generator=g))
               for _ in clips.STEPS]
    models, optimizers = build(40)
    plain = make_model(0), make_model(0)
    plain_optimizers = make_optimizers(*plain)
    for m, r in zip(models, plain):
        m.load_state_dict(r.state_dict())
    out = {"got": [[], []], "want": [[], []], "worst": 0.0}

    def step(how, batch):
        x, y = batch
        return [clips.train_step(how, lambda scale, m=m: (scale * sg.nn.compute_average_loss(
            F.cross_entropy(m(x), y, reduction="none"))).backward(), m, o)
            for m, o in zip(models, optimizers)]
    for how, batch, (x, y) in zip(clips.STEPS, strategy.experimental_distribute_dataset(batches), batches):
        got = strategy.run(step, args=(how, batch))
        for i, (m, o) in enumerate(zip(plain, plain_optimizers)):
            out["want"][i].append(clips.train_step(how, lambda scale: (scale * F.cross_entropy(m(x), y)).backward(), m, o))
            out["got"][i].append(got[i])
            want = m.state_dict()
            for key, value in models[i].state_dict().items():   # (a collective under sharding="parameters")
                out["worst"] = max(out["worst"], (value - want[key]).abs().max().item())
    return out


def accumulated(strategy, build, data, want) -> float:
    """A backward that no step follows (zero_grad drops it), then the first step's batch in two
    backward passes (the second one's gradients arrive after packs have left): as plain PyTorch's
    first step on the whole batch."""
    models, optimizers = build(30)
    for m, r in zip(models, (make_model(0), make_model(0))):
        m.load_state_dict(r.state_dict())

    def step(batch, other):
        for model, optimizer in zip(models, optimizers):
            per_example = F.cross_entropy(model(other[0]), other[1], reduction="none")
            sg.nn.compute_average_loss(per_example, global_batch_size=10).backward()
            optimizer.zero_grad()
            x, y = batch
            for part in (slice(0, 2), slice(2, None)):
                per_example = F.cross_entropy(model(x[part]), y[part], reduction="none")
                sg.nn.compute_average_loss(per_example, global_batch_size=10).backward()
            optimizer.step()
    strategy.run(step, args=(data[0], data[1]))
    return max((p.detach() - w).abs().max().item() for m, ws in zip(models, want)
               for p, w in zip(m.parameters(), ws))


if __name__ == "__main__":
    sys.exit(main())

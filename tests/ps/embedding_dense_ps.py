"""Coordinator script: an embedding trained with RMSprop, which has no row-sparse rule.

Run as the chief of ``stratagem launch --workers 1 --ps 2 embedding_dense_ps.py OUT``. The
table is split over the two ps; batches leave some rows out, so the dense steps the ps take
(rows not looked up still move, through RMSprop's momentum) must equal plain PyTorch's
``nn.Embedding`` trained with RMSprop in this process. Also checks a checkpoint of the
optimizer restores, and records the warnings the coordinator gave. Writes OUT/tensors.pt
(for the test to compare) and OUT/report.json.
"""

import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

ROWS, DIM, STEPS = 12, 4, 4


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.head(self.embedding(ids).mean(dim=1))


def make_optimizer(params):
    return torch.optim.RMSprop(params, lr=0.01, momentum=0.5)


def step_of(model, optimizer):
    def step(ids, y):
        optimizer.zero_grad()
        loss = F.mse_loss(model(ids), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def main(out):
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
                                          variable_partitioner=sg.FixedShardsPartitioner(2))
    coordinator = sg.ClusterCoordinator(strategy)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    # rows 0..8 only, repeats within a batch; rows 9..11 are never looked up
    batches = [(torch.randint(9, (3, 4), generator=generator), torch.randn(3, 1, generator=generator))
               for _ in range(STEPS + 2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with strategy.scope():
            model = Model()
            optimizer = make_optimizer(model.parameters())
        plain = Model()
        plain.load_state_dict(model.state_dict())
        plain_optimizer = make_optimizer(plain.parameters())
        step, plain_step = step_of(model, optimizer), step_of(plain, plain_optimizer)
        for ids, y in batches[:STEPS]:
            coordinator.schedule(step, args=(ids, y))
            plain_step(ids, y)
        coordinator.join()
    tensors = {"ps": {k: v.clone() for k, v in model.state_dict().items()},
               "plain": {k: v.clone() for k, v in plain.state_dict().items()},
               "ps_square_avg": optimizer.state_dict()["state"][0]["square_avg"],
               "plain_square_avg": plain_optimizer.state_dict()["state"][0]["square_avg"].clone()}
    # a checkpoint restores: the two steps after it, run twice, give the same values
    saved_model, saved_optimizer = tensors["ps"], optimizer.state_dict()
    runs = []
    for _ in range(2):
        model.load_state_dict(saved_model)
        optimizer.load_state_dict(saved_optimizer)
        for ids, y in batches[STEPS:]:
            coordinator.schedule(step, args=(ids, y))
        coordinator.join()
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    for ids, y in batches[STEPS:]:
        plain_step(ids, y)
    tensors.update(after_restore=runs, plain_after=plain.state_dict())
    torch.save(tensors, os.path.join(out, "tensors.pt"))
    report = {"warnings": [str(w.message) for w in caught if "row-sparse" in str(w.message)],
              "warning_files": [os.path.basename(w.filename) for w in caught if "row-sparse" in str(w.message)]}
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])

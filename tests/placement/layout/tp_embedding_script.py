"""A token model whose nn.Embedding the tensor-parallel plan splits, trained with a per-token loss; the test
compares it with plain PyTorch (float64).

Usage (one process per task, with TF_CONFIG): python tp_embedding_script.py OUT_DIR

On a {"data": 1, "model": <every process>} mesh, for each plan of :data:`PLANS` (the embedding "rowwise",
"colwise", or given torch's ``RowwiseParallel(input_layouts=Replicate())``; a LayerNorm under "sequence", whose
input is whole too): :data:`STEPS` steps of SGD with momentum, the loss a cross-entropy over every token ((batch * tokens, vocab) logits against (batch * tokens)
targets). Writes OUT_DIR/rank{R}.json: per plan, the initial and per-step full parameters and reduced losses;
and the errors of the Embedding styles that would take the token ids as this process's share.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import stratagem as sg

VOCAB, WIDTH, TOKENS, BATCH, STEPS = 16, 8, 5, 4, 3
PLANS = {
    "rowwise": {"embed": "rowwise", "fc1": "colwise", "fc2": "rowwise"},
    "colwise": {"embed": "colwise", "fc1": "rowwise"},   # the embedding's share of features, summed by fc1
    "object": {"embed": RowwiseParallel(input_layouts=Replicate()), "fc1": "colwise", "fc2": "rowwise"},
    # the norm over this process's share of the tokens (5: 3 and 2), the head gathers them
    "sequence": {"embed": "rowwise", "fc1": "colwise", "fc2": "rowwise", "norm": "sequence",
                 "head": ColwiseParallel(output_layouts=Replicate())},
}


class TokenModel(nn.Module):
    """Logits over the vocabulary for every token: embedding, MLP, norm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        return self.head(self.norm(self.fc2(torch.tanh(self.fc1(self.embed(tokens))))))


def make_model() -> TokenModel:
    torch.manual_seed(0)   # the test builds the same plain model
    return TokenModel().double()


def make_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g), torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g))
            for _ in range(STEPS)]


def per_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


def listed(state):
    return {k: v.tolist() for k, v in state.items()}


def train(plan, num_workers):
    strategy = sg.experimental.TensorParallelStrategy(mesh={"data": 1, "model": num_workers}, plan=plan)
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    def step(tokens, targets):
        optimizer.zero_grad()
        loss = sg.nn.compute_average_loss(per_token_loss(model(tokens), targets))   # the mean over every token
        loss.backward()
        optimizer.step()
        return loss.detach()

    out = {"initial": listed(model.state_dict()), "history": []}
    for tokens, targets in strategy.experimental_distribute_dataset(make_data()):
        loss = strategy.reduce("sum", strategy.run(step, args=(tokens, targets)), axis=None)
        out["history"].append({"loss": loss.item(), "params": listed(model.state_dict())})
    return out


def error_of(plan, num_workers):
    try:
        with sg.experimental.TensorParallelStrategy(mesh={"data": 1, "model": num_workers}, plan=plan).scope():
            make_model()
    except sg.errors.InvalidArgumentError as error:
        return str(error)
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    rank, num_workers = sg.cluster.resolve().worker_rank, sg.cluster.resolve().num_workers
    result = {name: train(plan, num_workers) for name, plan in PLANS.items()}
    result["errors"] = {"RowwiseParallel()": error_of({"embed": RowwiseParallel()}, num_workers),
                        "sequence": error_of({"embed": "sequence"}, num_workers)}
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())

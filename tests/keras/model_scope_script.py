"""A worker of a 2-worker MultiWorkerMirroredStrategy job: where ``sg.Model`` may be built.

Run by tests/training/test_model_scope.py as `python model_scope_script.py` in each task of a
local cluster. Each worker builds the module in the strategy's scope and the Model outside it
(before the check that trained, without an error, to other weights than the strategy's), prints
the refusal, then builds both in the scope, fits, and prints the weights (those of one process).
"""

import json

import torch

import stratagem as sg
from stratagem.errors import ContextError


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)


def fit(strategy) -> list[float]:
    """The weights after fit, the module and the Model built in ``strategy``'s scope."""
    x, y = data()
    torch.manual_seed(0)
    with strategy.scope():
        model = sg.Model(torch.nn.Linear(4, 1))
        model.compile("sgd", "mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return torch.cat([p.detach().flatten() for p in model.module.parameters()]).tolist()


def main() -> None:
    torch.set_num_threads(1)
    strategy = sg.MultiWorkerMirroredStrategy()
    with strategy.scope():
        module = torch.nn.Linear(4, 1)
    try:
        sg.Model(module)
        print("REFUSED none", flush=True)
    except ContextError as error:
        print("REFUSED " + json.dumps(str(error)), flush=True)
    print("WEIGHTS " + json.dumps(fit(strategy)), flush=True)


if __name__ == "__main__":
    main()

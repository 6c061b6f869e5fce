"""Trains small models under PipelineStrategy with recompute= and split_points="auto"; the tests compare
each run with plain PyTorch (float64) and with the same run without recomputation.

Usage (every process, e.g. ``stratagem launch --workers 2``):
python pp_options_script.py OUT_DIR --part recompute|balance

Writes OUT_DIR/rank{R}.json: per case the initial parameters, the reduced loss and the whole model's
state_dict after every step, the peak bytes of activations saved for backward during a step on this
process, the split the strategy used; then the errors of the misuse cases. ``recompute``: every schedule
of tests/placement/layout/test_multi_worker_pipeline.py, an nn.Sequential and a traced model, the whole stage and named
modules; models with dropout run twice, with recomputation and without, from the same random state.
``balance``: split_points="auto" by time and by memory, a traced model, the split pinned again.
"""

import argparse
import json
import os
import sys
import time

import torch
from torch import nn

import stratagem as sg

NUM_MICROBATCHES = 4
BATCHES = (8, 10, 5)   # divisible by 4, not divisible, smaller than a micro-batch count's multiple
WIDTH = 16
STARTED = time.monotonic()


class Block(nn.Module):
    """Several operations (their activations are what recomputation drops); ``hidden`` sets its cost."""

    def __init__(self, hidden: int = WIDTH, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, hidden)
        self.out = nn.Linear(hidden, WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, h):
        return h + self.drop(self.out(torch.tanh(self.fc(self.norm(h)))))


def sequential(dropout: float = 0.0, hidden: tuple = (16,) * 6) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, WIDTH), *(Block(h, dropout) for h in hidden), nn.Linear(WIDTH, 3))


def uneven() -> nn.Sequential:
    """Blocks whose costs differ 4x (hidden width 16 or 64)."""
    return sequential(hidden=(64, 16, 16, 64, 64, 16, 16, 16))


class Tokens(nn.Module):
    """Not an nn.Sequential (cut by the tracer): each row's 6 features are 3 tokens of 2."""

    def __init__(self, blocks: int = 4, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Linear(2, WIDTH)
        self.position = nn.Parameter(torch.randn(3, WIDTH) / 4)
        self.blocks = nn.ModuleList(Block(WIDTH, dropout) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, 1)
        self.unused = nn.Linear(1, 1)   # forward never calls it

    def forward(self, x):
        h = self.embed(x.unflatten(1, (3, 2))) + self.position
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)


class Branches(Tokens):
    """A Python branch on a tensor's value: torch.export cannot trace it."""

    def forward(self, x):
        return super().forward(x) if x.sum() > 0 else -super().forward(x)


MODELS = {"seq": sequential, "uneven": uneven, "tokens": Tokens, "tokens6": lambda: Tokens(blocks=6),
          "seq-dropout": lambda: sequential(dropout=0.3), "tokens-dropout": lambda: Tokens(dropout=0.3)}

#: case -> (model, optimizer, PipelineStrategy options)
RECOMPUTE = {
    "gpipe-stage": ("seq", "sgd", {"schedule": "gpipe", "recompute": True}),
    "1f1b-named": ("seq", "adam", {"schedule": "1f1b", "recompute": ["2", "4"]}),
    "interleaved-stage": ("seq", "sgd", {"schedule": "interleaved", "recompute": "stage"}),
    "zero_bubble-stage": ("seq", "adam", {"schedule": "zero_bubble", "recompute": True}),
    "split-named": ("seq", "adam", {"schedule": "interleaved", "split_points": ["3", "4", "6"],
                                    "recompute": ["1", "4.fc"]}),
    "traced-gpipe-stage": ("tokens", "sgd", {"schedule": "gpipe", "split_points": ["blocks.3"], "recompute": True}),
    "traced-1f1b-blocks": ("tokens", "adam", {"schedule": "1f1b", "recompute": ["blocks"]}),
    "traced-interleaved-named": ("tokens", "sgd", {"schedule": "interleaved", "recompute": ["blocks.1.fc", "head"]}),
}
#: with dropout: run with the option and without it, from the same random state
DROPOUT = {
    "dropout-1f1b-stage": ("seq-dropout", "sgd", {"schedule": "1f1b", "recompute": True}),
    "dropout-zero_bubble-named": ("seq-dropout", "adam", {"schedule": "zero_bubble", "recompute": ["1", "4"]}),
    "dropout-traced-interleaved-blocks": ("tokens-dropout", "adam", {"schedule": "interleaved",
                                                                     "recompute": ["blocks"]}),
}
BALANCE = {
    "auto-gpipe": ("uneven", "sgd", {"schedule": "gpipe", "split_points": "auto"}),
    "auto-1f1b-memory": ("uneven", "adam", {"schedule": "1f1b", "split_points": "auto", "balance_by": "memory",
                                            "recompute": True}),
    "auto-traced-interleaved": ("tokens6", "sgd", {"schedule": "interleaved", "split_points": "auto"}),
}


def make_data(batches=BATCHES):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(b, 6, generator=g, dtype=torch.float64),
             torch.randn(b, 3, generator=g, dtype=torch.float64)) for b in batches]


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def loss_fn(output, target):
    return ((output - target) ** 2).mean()


def listed(state):
    return {k: v.tolist() for k, v in state.items()}


class SavedPeak:
    """The peak bytes of tensors autograd saved for backward and has not freed (each storage once;
    parameters left out): a process's activation memory during a step."""

    def __init__(self, exclude):
        self.live = self.peak = 0
        self.held: dict[int, list[int]] = {}   # storage address -> [bytes, holders]
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude if not t.is_meta}

    def hooks(self):
        tracker = self

        class Held:
            def __init__(self, tensor):
                self.tensor, self.key = tensor, tensor.untyped_storage().data_ptr()
                entry = tracker.held.setdefault(self.key, [tensor.untyped_storage().nbytes(), 0])
                if entry[1] == 0:
                    tracker.live += entry[0]
                    tracker.peak = max(tracker.peak, tracker.live)
                entry[1] += 1

            def __del__(self):
                entry = tracker.held.get(self.key)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] == 0:
                        tracker.live -= entry[0]
                        del tracker.held[self.key]

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() in tracker.excluded:
                return tensor
            return Held(tensor)

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h if isinstance(h, torch.Tensor) else h.tensor)


def train(case: str, spec: tuple, mesh: dict, seed: int, **override) -> dict:
    model_name, kind, options = spec
    options = {**options, **override}
    torch.manual_seed(seed)   # the same random state for the runs of a dropout pair
    strategy = sg.experimental.PipelineStrategy(mesh, num_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn, **options)
    with strategy.scope():
        model = MODELS[model_name]()
        optimizer = make_optimizer(kind, model.parameters())
    out = {"initial": listed(model.state_dict()), "history": [], "peak": 0,
           "split_before": strategy.split_points_of(model)}

    seen = set()

    def step(x, y):
        optimizer.zero_grad()
        micro = -(-x.shape[0] // NUM_MICROBATCHES)
        if micro not in seen:   # a new micro-batch shape traces a traced model: torch.export refuses hooks
            seen.add(micro)
            loss = strategy.forward_backward(model, x, y)
        else:
            tracker = SavedPeak(list(model.parameters()))
            with tracker.hooks():
                loss = strategy.forward_backward(model, x, y)
            out["peak"] = max(out["peak"], tracker.peak)
        optimizer.step()
        return loss

    for x, y in strategy.experimental_distribute_dataset(make_data()):
        loss = strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)
        out["history"].append({"loss": loss.item(), "params": listed(model.state_dict())})
    out["split_points"] = strategy.split_points_of(model)
    out["stages"] = strategy.stages_of(model)
    if isinstance(model, nn.Sequential):   # (a traced model would be traced again in eval mode: time)
        out["predict"] = strategy.predict(model.eval(), make_data((7,))[0][0]).tolist()
    print(f"case {case} done at {time.monotonic() - STARTED:.1f} s", flush=True)
    return out


def error_of(fn):
    try:
        fn()
    except sg.errors.StratagemError as error:
        return f"{type(error).__name__}: {error}"
    return None


def errors(mesh: dict) -> dict:
    first = sg.cluster.resolve().worker_rank == 0
    def build(model_fn, step=False, **options):
        strategy = sg.experimental.PipelineStrategy(mesh, num_microbatches=4, loss_fn=loss_fn, **options)
        with strategy.scope():
            model = model_fn()
        if step:   # every process raises (none waits for the others)
            strategy.forward_backward(model, torch.randn(8, 6), torch.randn(8, 3))
    return {
        "recompute_value": error_of(lambda: build(sequential, recompute=5)),
        "recompute_missing": error_of(lambda: build(sequential, recompute=["9"])),
        "recompute_uncalled": error_of(lambda: build(Tokens, step=True, recompute=["unused"])),
        "balance_by_alone": error_of(lambda: build(sequential, balance_by="time")),
        "balance_by_value": error_of(lambda: build(sequential, split_points="auto", balance_by="speed")),
        "auto_too_many_stages": error_of(lambda: build(sequential, split_points="auto", schedule="interleaved",
                                                       num_stages=10)),
        "auto_untraceable": error_of(lambda: build(Branches, step=True, split_points="auto")),
        # a peer started with other options: every process refuses at start-up (none measures alone)
        "mismatch_recompute": error_of(lambda: build(sequential, recompute=first)),
        "mismatch_auto": error_of(lambda: build(sequential, split_points="auto" if first else None)),
    }


#: seconds a process waits for a silent peer in the ``killed`` part
TIMEOUT = 15


def killed(out: str) -> None:
    """The process that measures for split_points="auto" (global rank 0) SIGKILLs itself while measuring;
    the other writes OUT_DIR/rank1.json: its error, and how long the step took to fail."""
    import signal

    options = sg.CommunicationOptions(timeout_seconds=TIMEOUT)
    strategy = sg.experimental.PipelineStrategy(num_microbatches=4, schedule="gpipe", split_points="auto",
                                                loss_fn=loss_fn, communication_options=options)
    rank = sg.cluster.resolve().worker_rank
    with strategy.scope():
        model = sequential()
    if rank == 0:
        def lose(module, args):
            print("losing while measuring", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        model[1].register_forward_pre_hook(lose)
    started = time.monotonic()
    try:
        strategy.forward_backward(model, torch.randn(8, 6), torch.randn(8, 3))
    except Exception as error:   # noqa: BLE001 - reported to the test
        result = {"type": type(error).__name__, "error": str(error), "seconds": time.monotonic() - started}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        print("failed as expected", flush=True)
        os._exit(3)   # the process group is broken: leave without its teardown
    os._exit(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--part", choices=("recompute", "balance", "killed"))
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    if args.part == "killed":
        killed(args.out)
    rank = sg.cluster.resolve().worker_rank
    mesh = {"data": 1, "pipe": sg.cluster.resolve().num_workers}
    result = {}
    if args.part == "recompute":
        for case, spec in RECOMPUTE.items():
            result[case] = train(case, spec, mesh, seed=rank)
        for case, spec in DROPOUT.items():
            result[case] = {"with": train(case, spec, mesh, seed=100 + rank),
                            "without": train(case, spec, mesh, seed=100 + rank, recompute=False)}
    else:
        for case, spec in BALANCE.items():
            result[case] = train(case, spec, mesh, seed=rank)
        pinned = result["auto-gpipe"]["split_points"]   # the printed split, passed back
        result["pinned"] = train("pinned", ("uneven", "sgd", {"schedule": "gpipe", "split_points": pinned}),
                                 mesh, seed=rank)
    result["errors"] = errors(mesh)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print("done", flush=True)
    sys.exit(0)

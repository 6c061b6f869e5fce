"""The coordinator of parameter-server training in a Slurm job step: ``sg.ParameterServerStrategy()``
with no arguments, the cluster from Slurm's variables and STRATAGEM_SLURM_JOBS.

Rank 0 (the chief) runs this script; the other tasks run ``stratagem server``. The steps run one
at a time on the one worker, so the result is plain PyTorch's (:func:`slurm_train_script.plain`);
the parameters go to OUT_DIR/coordinator.json.

Usage (task 0 of ``srun --ntasks=3`` with STRATAGEM_SLURM_JOBS=chief=1,ps=1,worker=1):
    python slurm_ps_script.py OUT_DIR
"""

import json
import os
import sys

import torch.nn.functional as F

import stratagem as sg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slurm_train_script import listening, make_data, make_model, make_optimizer  # noqa: E402


def main(out: str) -> int:
    strategy = sg.ParameterServerStrategy()
    resolver = strategy.cluster_resolver
    print(f"[task {os.environ.get('SLURM_PROCID')}] {type(resolver).__name__}: {resolver.task_type} "
          f"{resolver.task_id}, cluster {resolver.cluster_spec().as_dict()}", flush=True)
    coordinator = sg.ClusterCoordinator(strategy)
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(model)

    def step(x, y):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    for x, y in make_data():
        coordinator.schedule(step, args=(x, y))
        coordinator.join()   # one step at a time: the order of plain PyTorch
    with open(os.path.join(out, "coordinator.json"), "w") as f:
        json.dump({"params": {k: v.tolist() for k, v in model.state_dict().items()},
                   "resolver": type(resolver).__name__, "listening": listening()}, f)
    print("coordinator done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

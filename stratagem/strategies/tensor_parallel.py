"""TensorParallelStrategy: layers split over processes (Megatron-style), data parallel on top.

The processes of the cluster form a 2-D mesh ``(data, model)``: process ``r`` is data
rank ``r // model`` and model rank ``r % model``. Along the model axis, the layers named
by the plan are split with torch's ``parallelize_module`` (their parameters become
DTensors; see :mod:`stratagem.placement.layout.tensor_parallel`); along the data axis, each
group of ``model`` processes is one data-parallel replica: it gets its own slice of each
global batch, and gradients are summed over the data axis when backward ends (``.grad`` then
holds the global batch's gradient, as under the data-parallel strategies).

So ``num_replicas_in_sync`` is the data-parallel degree ``data``; ``strategy.reduce``
and the input pipeline work over the data axis (the processes of one model group hold
the same values and get the same input slice). Checkpoints, files and the chief's
decisions involve every process (``checkpoint_collective``): all of them call
``Checkpoint.save`` / ``restore``, and global rank 0 writes one logical copy.
"""

from __future__ import annotations

import re
from typing import Any

from stratagem.comm.options import CommunicationOptions
from stratagem.placement.layout.tensor_parallel import TensorParallelPlacement, check_plan
from stratagem.strategies.mesh import MeshStrategy


class TensorParallelStrategy(MeshStrategy):
    """Tensor parallelism over a ``{"data": d, "model": t}`` mesh of processes (experimental).

    ``plan`` maps module names (or glob patterns such as ``"blocks.*.fc1"``), relative to the
    model created in scope, to ``"colwise"``, ``"rowwise"``, ``"sequence"`` or a torch
    ``ParallelStyle``; an ``nn.Embedding`` takes its token ids whole (``"rowwise"`` is
    ``RowwiseParallel(input_layouts=Replicate())`` there), and so does a ``"sequence"`` layer its
    input (see docs/tensor_parallel.md). ``d * t`` must equal the number of processes;
    ``mesh=None`` means ``{"data": 1, "model": <all processes>}``.

    Run the same script on every process, e.g. ``stratagem launch --workers 4 train.py``.

    Example::

        import torch, stratagem as sg
        strategy = sg.experimental.TensorParallelStrategy(plan={"0": "colwise", "1": "rowwise"})
        with strategy.scope():   # one process here: a 1 x 1 mesh
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        assert strategy.num_replicas_in_sync == 1
        assert set(model.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    """

    def __init__(self, mesh: dict[str, int] | None = None, plan: dict[str, Any] | None = None, *,
                 cluster_resolver: Any = None, communication_options: CommunicationOptions | None = None):
        plan = check_plan(plan)
        data_size, model_size = self._start_mesh(mesh, cluster_resolver, communication_options)
        data = self._axis_collective("data")
        self._configure(self._data_topology(), data, TensorParallelPlacement(
            self, self.mesh, plan, data, self._full, self._mesh_device.torch_device,
            model=self._axis_collective("model")))
        self._check_same_configuration({"mesh": (data_size, model_size),
                                        "plan": {k: re.sub(r" at 0x[0-9a-f]+", "", str(v)) for k, v in plan.items()}})

    @property
    def model_rank(self) -> int:
        """This process's place along the model axis."""
        return self.mesh.get_local_rank("model")

    def __repr__(self) -> str:
        full = self._full
        return f"TensorParallelStrategy({self._mesh_repr()}, process {full.worker_index} of {full.num_workers})"

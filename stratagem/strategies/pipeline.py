"""PipelineStrategy: a model cut into stages over processes (GPipe, 1F1B, interleaved, zero bubble).

The processes of the cluster form a mesh ``(data, pipe, model)`` in row-major order:
process ``r`` is data rank ``r // (pipe * model)``, pipe rank ``(r // model) % pipe`` and
model rank ``r % model`` (the model axis innermost; with ``model = 1``, data rank
``r // pipe`` and pipe rank ``r % pipe``). Along the pipe axis, the model
created in scope is cut into stages (:mod:`stratagem.placement.layout.pipeline`), each process
keeping only its own; a step runs one of torch's pipeline schedules over micro-batches
(:mod:`stratagem.placement.layout.pipeline_schedule`). Along the data axis, each group of
``pipe`` processes is one data-parallel replica: it gets its own slice of each global
batch, and gradients are summed over the data axis when the step's schedule ends, so that
``.grad`` holds the global batch's gradient when ``forward_backward`` returns (or ZeRO shards
the update, the gradients or the parameters over it). Along the model axis, the layers of
each stage named by a tensor-parallel plan are split with ``parallelize_module``
(:mod:`stratagem.placement.layout.pipeline`: the layout's parts in mesh order).

So ``num_replicas_in_sync`` is the data-parallel degree ``data``; ``strategy.reduce``
and the input pipeline work over the data axis (the processes of one pipeline get the
same input slice, and the same loss back from ``forward_backward``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch

from stratagem.comm.options import CommunicationOptions, check_compression
from stratagem.errors import InvalidArgumentError
from stratagem.placement.layout.pipeline import PipelinePlacement
from stratagem.placement.layout.pipeline_balance import BALANCE_BY
from stratagem.placement.layout.pipeline_plan import check_schedule
from stratagem.placement.layout.pipeline_schedule import PipelineSchedules, forward_only
from stratagem.placement.layout.recompute import check_recompute
from stratagem.placement.layout.tensor_parallel import check_plan
from stratagem.placement.data_axis.zero import STAGES
from stratagem.strategies.mesh import MeshStrategy


class PipelineStrategy(MeshStrategy):
    """Pipeline parallelism over a ``{"data": d, "pipe": p, "model": t}`` mesh of processes (experimental).

    The ``nn.Sequential`` created in :meth:`scope` is cut into stages: before each child
    named in ``split_points``, or into ``num_stages`` even runs of children (default: one
    stage per pipe process, two for the interleaved and zero-bubble schedules). Another
    model (its own ``forward``) is cut by torch's tracer at its first step: before each
    module named in ``split_points`` (``["blocks.2"]``), or into even runs of its longest
    ``nn.ModuleList``. Each
    process keeps only its stages' parameters, and an optimizer created in scope only
    updates them. A training step calls :meth:`forward_backward`, which runs ``schedule``
    (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zero_bubble"``, ...) over
    ``num_microbatches`` micro-batches (any batch size: the micro-batches are weighted by
    their rows); :meth:`predict` evaluates. ``model.state_dict()``, the optimizer's state dict
    and ``sg.Checkpoint`` hold the whole logical model. ``d * p * t`` must equal the number of
    processes (``mesh=None``: every process on the pipe axis; ``model`` is 1 unless given).

    Three axes: ``plan`` (module names of the whole model, or glob patterns, to ``"colwise"``,
    ``"rowwise"``, ``"sequence"`` or a torch ``ParallelStyle``, as ``TensorParallelStrategy``
    takes it) splits those layers of each stage over the ``model`` axis; ``sharding``
    (``"optimizer"``, ``"gradients"`` or ``"parameters"``: ZeRO stages 1-3, the last on FSDP2)
    shards over the ``data`` axis. Global rank ``r`` is ``(data_rank * p + pipe_rank) * t +
    model_rank``: a model group is ``t`` consecutive ranks, a pipeline the ranks ``t`` apart, the
    processes along the data axis those ``p * t`` apart. With a plan or ``sharding``, the model
    must be an ``nn.Sequential``. See docs/pipeline.md.

    ``split_points="auto"`` cuts the model into ``num_stages`` (or the default count) by the
    measured cost of its blocks (the children of an ``nn.Sequential``, the entries of the
    longest ``nn.ModuleList`` otherwise) at the first step: ``balance_by="time"`` (forward +
    backward on this machine, the default) or ``"memory"`` (parameters, gradients, saved
    activations); the slowest stage is made as fast as it can be. Global rank 0 measures, every
    process takes its split and rank 0 prints it in the form that pins it (see
    :meth:`split_points_of`). ``recompute=True`` (or ``"stage"``) drops each stage's activations
    after its forward and recomputes them in its backward (``torch.utils.checkpoint``,
    non-reentrant: dropout masks are replayed, results unchanged); a list of module names
    (``["blocks.0", "blocks.3"]``; a ``ModuleList``'s name: each entry) recomputes those modules.

    Run the same script on every process, e.g. ``stratagem launch --workers 2 train.py``.

    Example::

        import torch, stratagem as sg
        strategy = sg.experimental.PipelineStrategy(num_microbatches=2, schedule="gpipe")
        with strategy.scope():   # one process here: a 1-stage pipeline
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x, y):
            optimizer.zero_grad()
            loss = strategy.forward_backward(model, x, y, loss_fn=torch.nn.functional.mse_loss)
            optimizer.step()
            return loss

        loss = strategy.run(train_step, args=(torch.randn(6, 4), torch.randn(6, 1)))
        print(strategy.reduce("sum", loss, axis=None))

        # three axes, each of size 1 in one process: {"data": 2, "pipe": 2, "model": 2} on 8
        mesh3d = sg.experimental.PipelineStrategy({"data": 1, "pipe": 1, "model": 1}, sharding="parameters",
                                                  plan={"0": "colwise", "2": "rowwise"}, num_microbatches=2,
                                                  schedule="gpipe", loss_fn=torch.nn.functional.mse_loss)
        with mesh3d.scope():
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        assert mesh3d.mesh.mesh_dim_names == ("data", "pipe", "model") and mesh3d.sharding == "parameters"
        loss = mesh3d.forward_backward(model, torch.randn(6, 4), torch.randn(6, 1))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the whole model's gradient norm
        optimizer.step()
        assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}   # whole tensors
    """

    axis = "pipe"
    axes = ("data", "pipe", "model")
    model_steps_kind = "pipeline"   # sg.Model runs the schedule (stratagem.keras.pipeline_steps)

    def __init__(self, mesh: dict[str, int] | None = None, *, split_points: Sequence[str] | str | None = None,
                 num_stages: int | None = None, num_microbatches: int = 4, schedule: str = "1f1b",
                 loss_fn: Callable | None = None, plan: dict[str, Any] | None = None, sharding: str | None = None,
                 recompute: bool | str | Sequence[str] = False, balance_by: str | None = None,
                 cluster_resolver: Any = None, communication_options: CommunicationOptions | None = None):
        schedule = check_schedule(schedule)
        split_points = _check_options(split_points, num_stages, num_microbatches, loss_fn)
        balance_by = _check_balance_by(balance_by, split_points)
        plan = _check_mesh_options(mesh, plan, sharding)
        check_compression(communication_options, sharding=sharding)
        if split_points == "auto" and (plan is not None or sharding is not None):
            raise InvalidArgumentError(
                "split_points='auto' measures and cuts the model at its first step, after plan= / sharding= would "
                "have split its layers: pin the split instead (run once without plan= and sharding= to print the "
                "measured split_points=[...], then pass that list)")
        self._sharding = sharding
        data_size, pipe_size, model_size = self._start_mesh(mesh, cluster_resolver, communication_options)
        data, self._pipe = self._axis_collective("data"), self._axis_collective("pipe")
        self._loss_fn = loss_fn
        self._schedule = schedule
        self._num_microbatches = num_microbatches
        self._schedules: dict[int, PipelineSchedules] = {}
        config = {"split_points": split_points, "num_stages": num_stages, "pipe_size": pipe_size,
                  "schedule": schedule, "num_microbatches": num_microbatches,
                  "recompute": check_recompute(recompute), "balance_by": balance_by}
        self._configure(self._data_topology(), data, PipelinePlacement(
            self, config=config, pipe_rank=self.pipe_rank, pipe=self._pipe, data=data, everyone=self._full,
            device=self._mesh_device.torch_device, mesh=self.mesh, plan=plan, sharding=sharding))
        self._check_same_configuration({**config, "mesh": (data_size, pipe_size, model_size), "sharding": sharding,
                                        "plan": plan and {k: re.sub(r" at 0x[0-9a-f]+", "", str(v))
                                                          for k, v in plan.items()}})

    @property
    def pipe_rank(self) -> int:
        """This process's place along the pipe axis."""
        return self.mesh.get_local_rank("pipe")

    @property
    def model_rank(self) -> int:
        """This process's place along the model (tensor-parallel) axis."""
        return self.mesh.get_local_rank("model")

    @property
    def sharding(self) -> str | None:
        """The ZeRO stage over the data axis: None, "optimizer", "gradients" or "parameters"."""
        return self._sharding

    @property
    def schedule(self) -> str:
        return self._schedule

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches

    def stages_of(self, model: Any) -> list[int]:
        """The indices of the stages of ``model`` that this process holds."""
        return self._placement.split_of(model).stages

    def forward_backward(self, model: Any, inputs: Any, target: Any = None, *,
                         loss_fn: Callable | None = None, return_outputs: bool = False) -> Any:
        """Run the schedule: forward and backward of ``model`` over the micro-batches of ``inputs``.

        ``inputs`` (a tensor, or a tuple of tensors for the first stage) and ``target`` hold
        this data group's batch, the same on every process of the pipeline (what
        ``experimental_distribute_dataset`` gives them). ``loss_fn(output, target)`` (or
        ``loss_fn(output)`` without a target) returns the mean loss of the micro-batch it
        is given; gradients accumulate in the ``.grad`` of this process's parameters
        exactly as ``loss_fn(model(inputs), target).backward()`` over the whole global batch
        would put them (micro-batches weighted by their rows; any batch size; summed over the
        data axis when the schedule ends, unless in ``strategy.no_sync()``; under
        ``sharding="gradients"`` the sum goes to each data rank's range and ``.grad`` is None). Returns,
        on every process, this data group's share of that mean loss: reduce it with
        ``strategy.reduce("sum", loss, axis=None)`` (with one data group, it is the loss).
        Call it in ``strategy.run`` (or outside), on every process, at the same step.

        ``return_outputs=True`` returns ``(loss, outputs)``: ``outputs`` is the model's output
        for this data group's batch (detached, rows in batch order), sent from the last stage
        to every process of the pipeline -- for metrics; it costs one transfer of the outputs.
        """
        loss_fn = self._loss_fn if loss_fn is None else loss_fn
        if not callable(loss_fn):
            raise InvalidArgumentError(
                "forward_backward needs loss_fn(output, target) -> mean loss of the micro-batch: pass "
                "loss_fn=... here or to PipelineStrategy(...)")
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if not inputs or not all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in inputs):
            raise InvalidArgumentError(
                f"forward_backward's inputs must be a tensor (or a tuple of tensors) with a batch "
                f"dimension, got {[type(x).__name__ for x in inputs]}")
        device = self._mesh_device.torch_device
        inputs = tuple(x.to(device) for x in inputs)
        split = self._placement.split_of(model, inputs)
        runner = self._schedules.get(id(model))
        if runner is None:
            runner = self._schedules[id(model)] = PipelineSchedules(
                split, schedule=self._schedule, num_microbatches=self._num_microbatches,
                pipe_rank=self.pipe_rank, pipe=self._pipe, data=self._collective,
                device=device, same_shape_over_data=self._sharding == "parameters")
        if isinstance(target, torch.Tensor):
            target = target.to(device)
        with self._placement.summing_gradients(model):   # .grad: the global batch's when it returns
            return runner.step(inputs, target, loss_fn, return_outputs=return_outputs)

    def predict(self, model: Any, inputs: Any) -> Any:
        """The output of ``model`` for the batch ``inputs``, on every process of the pipeline.

        For evaluation: the stages run one after the other over the whole batch, without
        gradients and without micro-batches (so any batch size). Call it on every process
        of the pipeline with the same batch, e.g. ``loss_fn(strategy.predict(model, x), y)``
        between training steps (after ``model.eval()`` if the model has dropout).
        """
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        device = self._mesh_device.torch_device
        inputs = tuple(x.to(device) for x in inputs)
        return forward_only(self._placement.split_of(model, inputs), inputs,
                            pipe_rank=self.pipe_rank, pipe=self._pipe, device=device)

    def split_points_of(self, model: Any) -> list[str] | None:
        """Where the stages of ``model`` begin, in the form ``split_points=`` takes (to pin a split).

        With ``split_points="auto"``: the measured split, once the first ``forward_backward`` (or
        ``predict``) has chosen it (None before), the same on every process.

        Example::

            import torch, stratagem as sg
            strategy = sg.experimental.PipelineStrategy(
                split_points="auto", num_stages=2, schedule="interleaved", num_microbatches=2,
                recompute=True, loss_fn=torch.nn.functional.mse_loss)
            with strategy.scope():   # one process here: it holds both stages
                model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            print(strategy.split_points_of(model))   # None: measured at the first step
            loss = strategy.forward_backward(model, torch.randn(8, 4), torch.randn(8, 1))   # prints the split
            optimizer.step()
            print(strategy.split_points_of(model))   # e.g. ['2']: split_points=['2'] pins it
        """
        layout = self._placement.split_of(model).layout
        if layout.balance is not None:
            return None
        if layout.points or not isinstance(model, torch.nn.Sequential):
            return list(layout.points)
        names = [name for name, _ in model.named_children()]
        return [names[a] for a, _ in layout.bounds[1:]]
    def __repr__(self) -> str:
        return (f"PipelineStrategy({self._mesh_repr()}, schedule={self._schedule!r}, "
                f"num_microbatches={self._num_microbatches}, "
                + (f"sharding={self._sharding!r}, " if self._sharding else "")
                + f"process {self._full.worker_index} of "
                f"{self._full.num_workers})")


def _check_mesh_options(mesh: Any, plan: Any, sharding: Any) -> dict[str, Any] | None:
    if sharding is not None and sharding not in STAGES:
        raise InvalidArgumentError(
            f"sharding must be None, 'optimizer', 'gradients' or 'parameters' (ZeRO over the data axis), "
            f"got {sharding!r}")
    model = mesh.get("model", 1) if isinstance(mesh, dict) else 1
    if plan is None:
        if isinstance(model, int) and model > 1:
            raise InvalidArgumentError(
                f"the mesh has a model axis of {model} processes, but no tensor-parallel plan: pass "
                f"plan={{'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise', ...}} (module names of the whole "
                f"model), or leave 'model' out of the mesh")
        return None
    return check_plan(plan)


def _check_options(split_points: Any, num_stages: Any, num_microbatches: Any, loss_fn: Any) -> list[str] | str | None:
    def positive(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if not positive(num_microbatches):
        raise InvalidArgumentError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if num_stages is not None and not positive(num_stages):
        raise InvalidArgumentError(f"num_stages must be a positive integer, got {num_stages!r}")
    if split_points is not None and split_points != "auto":   # "auto": measured at the first step
        if num_stages is not None:
            raise InvalidArgumentError("give split_points or num_stages, not both (split_points fix the stages)")
        if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
            raise InvalidArgumentError(
                f"split_points must be a list of module names where a stage begins, e.g. ['2', '4'] "
                f"(an nn.Sequential's children) or ['blocks.2'], or 'auto' (measured), "
                f"got {split_points!r}")
        split_points = list(split_points)
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidArgumentError(f"loss_fn must be callable, got {loss_fn!r}")
    return split_points


def _check_balance_by(balance_by: Any, split_points: Any) -> str | None:
    if balance_by is None:
        return None
    if split_points != "auto":
        raise InvalidArgumentError(
            f"balance_by={balance_by!r} chooses what split_points='auto' balances; give split_points='auto' with it "
            f"(or leave balance_by out: split_points={split_points!r} fixes the stages)")
    if balance_by not in BALANCE_BY:
        raise InvalidArgumentError(f"balance_by must be one of {list(BALANCE_BY)}, got {balance_by!r}")
    return balance_by

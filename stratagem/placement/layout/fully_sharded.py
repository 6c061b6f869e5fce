"""FullyShardedPlacement: parameters, gradients and optimizer state sharded over the workers (ZeRO-3).

``MultiWorkerMirroredStrategy(sharding="parameters")``. Modules created in scope wait
until ``finalize()``; then every root module with parameters (one that no other module
created in scope holds: :class:`~stratagem.placement.layout.roots.RootsPlacement`) moves to this
worker's device, gets the chief's initial values (every worker checks that it built the same
tensors), and is handed to torch's FSDP2 ``fully_shard``:

- units: each child of the root that holds parameters gets its own ``fully_shard`` unit,
  containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) being looked
  through, so that a model's blocks (``model.layers[i]``) are units; then the root itself
  (unless it is a ``ModuleList``/``ModuleDict``, which has no forward), which takes the
  parameters left over. A unit's parameters are all-gathered just before its forward (and
  again before its backward) and freed after; its gradients are reduce-scattered as soon
  as its backward is done, each worker keeping its shard (dimension 0 split as ``torch.chunk``).
- gradients are *summed* over the workers (the divide factor is 1), as every other
  data-parallel path of stratagem sums them: the loss is divided by the global batch size
  (``sg.nn.compute_average_loss``).

Optimizers created in scope are torch's own over the DTensor parameters: each worker's
update touches only its shards, and its state holds only its shards. ``step`` runs in the
order of :mod:`stratagem.placement.data_axis.step` (:class:`~stratagem.placement.data_axis.local_update.LocalUpdate`: torch's update;
the gradients were summed during backward), then averages the buffers over the workers. ``clip_grad_norm_`` over the model's
parameters measures every worker's shards and returns the global norm as a plain tensor
(:mod:`stratagem.placement.scope.clipping`; torch's own returns a DTensor, whose inf-norm is
each worker's partial maximum).

State: a placed module's ``state_dict()`` holds full tensors (``DTensor.full_tensor``, an
all-gather: every worker calls it), ``load_state_dict`` takes full tensors and keeps each
worker's shard; the optimizer's state dict does the same with its state, in plain PyTorch's
layout, so a checkpoint written under one layout restores under any other.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from stratagem.comm.gloo_threads import leave_every_group
from stratagem.errors import InvalidArgumentError
from stratagem.placement.data_axis.buffers import BufferSync
from stratagem.placement.dtensor_state import replacing
from stratagem.placement.layout.roots import RootsPlacement
from stratagem.placement.scope.unscoped import refuse_optimizer_over
from stratagem.placement.scope.hooks import adopt
from stratagem.placement.data_axis.local_update import LocalUpdate

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class FullyShardedPlacement(RootsPlacement):
    """Each worker holds 1/N of every parameter, gradient and optimizer state (FSDP2 units)."""

    kind = "FullySharded"
    synchronizes_batch_norm = True
    ungathered = ("{name} is sharded over the workers (sharding='parameters'): only sg.Checkpoint.save called "
                  "on every worker can save it (its full tensors are gathered first)")

    def __init__(self, strategy: Any, collective: Any, device: torch.device):
        self.collective = collective
        self.everyone = collective   # the start-up agreement on the modules built
        self.device = device
        group = collective.group
        if group.solo and not dist.is_initialized():   # a lone worker still needs a group for the mesh
            dist.init_process_group(group.backend, store=dist.HashStore(), rank=0, world_size=1)
            atexit.register(leave_every_group)
        self.mesh = DeviceMesh.from_group(group.group or dist.group.WORLD, device.type, mesh_dim_names=("data",))
        #: the layout: FSDP2 units over the workers
        self.shard = FullyShard(self.mesh, "sharding='gradients'")
        self.parts = (self.shard,)
        self.norm_group, self.norm_spans_data = collective.group, True   # (clipping: every worker's shards)
        self._start_roots(strategy, collective, LocalUpdate(self))   # the step's primitives: torch's update over the shards
        self._gathered_ids: set[int] = set()   # FSDP2's whole parameters (kept between forwards)
        #: every module of a sharded model -> the names of its parameters then
        self._sharded_names: "weakref.WeakKeyDictionary[nn.Module, frozenset]" = weakref.WeakKeyDictionary()
        placed = self._placed
        #: BatchNorm's running statistics (buffers are not sharded) averaged over the workers at each
        #: step and checkpoint
        self.data_axis.buffers = BufferSync(strategy, collective, lambda: [m for root in placed for m in root.modules()])

    # ---------------------------------------------------------------- modules

    def finalize(self) -> None:
        for root in self.new_roots():   # complete models, the chief's values on every worker
            self._shard(root)
            self._forget_pending(root.modules())   # (fully_shard re-registers parameters)

    def _shard(self, root: nn.Module) -> None:
        with replacing(root, self._replaced):
            itself = not isinstance(root, (nn.ModuleList, nn.ModuleDict))   # (no forward of its own)
            self.shard.place([root], f"{type(root).__name__} has", itself=itself)
            for module in root.modules():
                self._sharded_names[module] = frozenset(n for n, p in module._parameters.items() if p is not None)
                if isinstance(module, FSDPModule):
                    module.register_forward_pre_hook(self._note_gathered)   # (after FSDP2's: it gathers)

    # ------------------------------------------------------------ checkpoints

    def prepare_checkpoint(self, objects: dict[str, Any]) -> contextlib.AbstractContextManager:
        """Every worker, around the chief's writing: the buffers averaged, each sharded state gathered
        (collectives)."""
        self.buffers.average(None)
        return super().prepare_checkpoint(objects)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Sharded by this placement (its gradient reduce-scattered over the workers), or the
        whole parameter FSDP2 gathered from such shards for a forward."""
        return id(tensor) in self.shard.sharded or id(tensor) in self._gathered_ids

    def _note_gathered(self, module: nn.Module, args: Any) -> None:
        """After FSDP2's own forward pre-hook: the unit's parameters are the gathered ones."""
        self._gathered_ids.update(id(p) for p in module.parameters())

    def unheld(self, module: nn.Module) -> list[str]:
        """A module of a sharded model holds FSDP2's parameters under the names it had when it
        was sharded (sharded, or gathered for its forward); any other parameter, or any
        parameter of another module, was created outside the scope or assigned after it."""
        if any(m is module for m in self._pending):
            return []
        names = self._sharded_names.get(module, frozenset())
        return [name for name, p in module._parameters.items() if p is not None and name not in names]

    # ----------------------------------------------------------- optimizers

    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        self._take_replacements(optimizer)
        outside = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in self.shard.sharded]
        refuse_optimizer_over(optimizer, outside, "sharding='parameters'",
                              "this strategy did not shard them over the workers")
        adopt(optimizer, self)

    def optimizer_add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        raise InvalidArgumentError(
            "add_param_group is not supported under sharding='parameters'; create the optimizer with "
            "all its parameter groups")


class FullyShard:
    """A layout part: modules as FSDP2 units over a mesh's data axis (ZeRO-3), each parameter a DTensor
    sharded over it (over ``data``, then ``model`` where a tensor-parallel plan split it first), its
    gradient summed over it during backward. :class:`FullyShardedPlacement` is this part alone; a
    pipeline's stages on a 3-D mesh compose it last (:mod:`~stratagem.placement.layout.pipeline`)."""

    #: its parameters, gradients and optimizer state are laid out over the data axis
    spread_over_data = True

    def __init__(self, mesh: Any, instead: str):
        self.mesh = mesh          # the data axis
        self.instead = instead    # the setting to use when the modules' parameters have several dtypes
        self.sharded: set[int] = set()   # id of each parameter sharded here (a DTensor)

    def place(self, modules: list[nn.Module], holder: str, *, itself: bool = True) -> None:
        """Each of ``modules`` as FSDP2 units (:func:`shard_units`); ``holder`` names them in the refusal of
        parameters of several dtypes ("MyModel has")."""
        check_one_dtype([p for m in modules for p in m.parameters()], holder, self.instead)
        for module in modules:
            shard_units(module, self.mesh, itself=itself)
            self.sharded.update(id(p) for m in module.modules() for p in m._parameters.values()
                                if isinstance(p, DTensor))

    def spreads(self, module: nn.Module) -> bool:
        """Whether ``module`` holds parameters sharded here (its state dict gathers them over the data axis)."""
        return any(id(p) in self.sharded for p in module.parameters())

    def norm_axes(self) -> dict[str, int]:
        """Clipping: a tensor left unsharded would be the same along the data axis (this process's rank
        along it); a sharded one's placements say so."""
        return {"data": self.mesh.get_local_rank()}


def check_one_dtype(params: Any, holder: str, instead: str) -> None:
    """FSDP2 gathers each unit's parameters as one buffer: refuses ``params`` of several dtypes,
    naming their ``holder`` ("MyModel has") and the setting to use ``instead``."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise InvalidArgumentError(
            f"sharding='parameters' gathers each unit's parameters as one buffer, so they need one "
            f"dtype, but {holder} {sorted(map(str, dtypes))}; convert the model to one dtype "
            f"(e.g. model.double()) or use {instead}")


def shard_units(module: nn.Module, mesh: Any, *, itself: bool = True) -> None:
    """``module`` as FSDP2 units over ``mesh`` (:func:`units`, then ``module`` itself where ``itself``),
    their gradients summed over it, not averaged, as every other data-parallel path sums them
    (with ``ReduceOp.SUM``: gloo has no ``PREMUL_SUM``)."""
    for unit in units(module):
        fully_shard(unit, mesh=mesh)
    if itself:
        fully_shard(module, mesh=mesh)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def units(root: nn.Module) -> list[nn.Module]:
    """The modules below ``root`` that get their own ``fully_shard`` unit (see the module doc)."""
    found: list[nn.Module] = []
    for child in root.children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, _CONTAINERS):
            found += units(child)
        else:
            found.append(child)
    return found

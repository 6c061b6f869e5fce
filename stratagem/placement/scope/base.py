"""The Placement: where variables live, and what a scope does to modules and optimizers.

A strategy has one Placement. While its scope is open on a thread, the module
registration hooks of :mod:`stratagem.placement.scope.hooks` report every module that
registers a parameter or buffer there (``on_module_registered``), and every optimizer
created there (``on_optimizer_created``). The placement then owns them:

- ``finalize()`` places pending modules (their tensors move to where the placement
  keeps them) and prepares pending optimizers. It runs at the latest when the
  outermost scope is left, when an optimizer is created, and before every ``run``.
- ``replica_copy(tensor, local_id)`` / ``all_copies(tensor)``: which tensor replica
  ``local_id`` computes with, and every local copy of a placed tensor.
- ``before_run()`` / ``after_run()`` bracket every ``strategy.run``.
- The optimizer operations: an optimizer created in scope has its class replaced by
  a subclass (named after the placement, e.g. ``MirroredSGD``) whose ``step``,
  ``zero_grad``, state dicts, ``add_param_group`` and pickling call the
  ``optimizer_*`` methods below. A synchronous placement hands them, and ``no_sync``, to its
  second collaborator, its *data axis* (:class:`~stratagem.placement.data_axis.axis.DataAxis`:
  the gradient sync, the one step, the update rule); the placement itself is the layout,
  where this process's tensors live.
- ``grad_scaler_refusal()``: whether a ``torch.amp.GradScaler`` created in scope can be made
  replica-aware (:mod:`stratagem.placement.scope.grad_scaler`).

Implementations: :class:`~stratagem.placement.layout.mirrored.MirroredPlacement` (a copy per
local replica; also one device; its data axis's update rule is mirrored, central storage or
ZeRO: :mod:`stratagem.placement.data_axis.update_rule`), the placements that take whole models
(tensor parallel, pipeline), ZeRO-3's fully sharded placement, and the parameter-server
placement (variables on the ps tasks; no data axis).
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any

import torch
from torch import nn

from stratagem.placement.scope.hooks import base_of


class Placement(abc.ABC):
    """The declared interface every placement implements."""

    #: Prefix of the names of optimizer classes made by this placement (``MirroredSGD``).
    kind = "Distributed"
    #: Whether a loss given to ``backward()`` inside ``strategy.run`` must be scaled for the global
    #: batch, and is checked (:mod:`stratagem.nn.loss_check`): the replicas' gradients are summed.
    #: False where the strategy's own schedule runs the backward passes (the pipeline).
    checks_loss_scaling = True
    #: A synchronous placement's data axis (:class:`~stratagem.placement.data_axis.axis.DataAxis`): the
    #: gradient sync, the one step, the update rule. None: the placement answers those itself (the
    #: parameter server's).
    data_axis: Any = None
    #: Whether a ``torch.nn.SyncBatchNorm`` created in scope combines its training-mode batch statistics
    #: over every replica and worker through the placement's ``collective``
    #: (:mod:`stratagem.placement.scope.sync_batch_norm`); where False, its first training-mode forward is refused.
    synchronizes_batch_norm = False

    # -------------------------------------------------------------- modules

    @abc.abstractmethod
    def on_module_registered(self, module: nn.Module) -> None:
        """``module`` registered a tensor in this strategy's scope."""

    def on_submodule_registered(self, module: nn.Module) -> None:
        """``module`` registered a child module in this strategy's scope (ignored by default)."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Place pending modules and prepare pending optimizers."""

    def before_run(self) -> None:
        self.finalize()

    def after_run(self, failed: bool = False) -> None:
        """``run`` returned (``failed``: or raised; then this must not raise)."""

    def replica_copy(self, tensor: torch.Tensor, local_id: int) -> torch.Tensor:
        return tensor

    def no_sync(self) -> contextlib.AbstractContextManager:
        """``strategy.no_sync()``: backward passes inside skip the gradient exchange (the data axis's;
        without one, nothing to skip)."""
        return contextlib.nullcontext() if self.data_axis is None else self.data_axis.no_sync()

    @property
    def update(self) -> Any:
        """The data axis's update rule (:mod:`stratagem.placement.data_axis.update_rule`), or None."""
        return None if self.data_axis is None else self.data_axis.update

    @property
    def gradients(self) -> Any:
        """The data axis's gradient sync (:mod:`stratagem.placement.data_axis.gradient_sync`), or None."""
        return None if self.data_axis is None else self.data_axis.gradients

    @property
    def buffers(self) -> Any:
        """The data axis's buffer averaging (:mod:`stratagem.placement.data_axis.buffers`), or None."""
        return None if self.data_axis is None else self.data_axis.buffers

    def all_copies(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Every local replica's copy of a placed tensor, else None."""
        return None

    def holds(self, tensor: torch.Tensor) -> bool | None:
        """Whether ``tensor`` is a parameter this placement placed (so its gradient is summed and
        its initial value agreed between workers), or None where the placement does not say."""
        return None

    def unheld(self, module: nn.Module) -> list[str]:
        """The names of ``module``'s own parameters that this placement neither placed nor is
        about to place (created outside the scope, or assigned after it): used by the unscoped
        checks of :mod:`stratagem.placement.scope.unscoped`. Default: it does not say (none)."""
        return []

    def write_checkpoint_state(self, obj: Any, directory: Any, name: str) -> tuple[Any, dict[str, dict]] | None:
        """Save a module's or optimizer's state where it lives, for ``sg.Checkpoint``.

        ``directory`` is the checkpoint being written; files written into it are named
        ``<name>.*``. Returns the state for ``<name>.pt`` (pieces replaced by descriptors, see
        :mod:`stratagem.checkpoint.pieces`) and the manifest entries of the files written, or
        None: the checkpoint saves ``obj.state_dict()``, one logical copy (the default).
        """
        return None

    def prepare_checkpoint(self, objects: dict[str, Any]) -> contextlib.AbstractContextManager:
        """Entered on every worker by ``Checkpoint.save`` around the chief's writing of
        ``objects`` (a placement whose state is spread over workers gathers it on entry and
        drops what the writing did not use on exit). Default: nothing."""
        return contextlib.nullcontext()

    def read_checkpoint_state(self, obj: Any, skeleton: Any, directory: Any, name: str,
                              manifest: dict | None = None) -> Any:
        """Restore ``obj`` where its state lives, from the files that ``write_checkpoint_state``
        wrote: a :class:`~stratagem.checkpoint.pieces.PlacedRestore`, or None (the default): the
        checkpoint assembles the logical state from ``skeleton`` and calls ``load_state_dict``.
        ``manifest`` is the one the restore verified: the files read where the state lives must
        be those it lists (the same checkpoint, not another one found at that path)."""
        return None

    # ------------------------------------------------------------ gradients

    def splits_gradients(self, params: list[torch.Tensor]) -> list[bool]:
        """For each of ``params``: whether no process's ``.grad`` holds its whole gradient between
        backward and step, by this placement's design (clipping then asks :meth:`gradient_parts`;
        :mod:`stratagem.placement.scope.clipping`). Default: never."""
        return [False] * len(params)

    def gradient_parts(self, params: list[torch.Tensor]) -> Any:
        """This process's parts of the whole gradients of ``params`` (all split by this placement), as a
        :class:`~stratagem.placement.scope.clipping.GradientParts`: a collective, every process calls it.
        The data axis's (:meth:`~stratagem.placement.data_axis.axis.DataAxis.gradient_parts`), by the
        layout's :meth:`norm_axes`."""
        return self.data_axis.gradient_parts(params)

    def norm_axes(self) -> tuple[Any, dict[str, int]]:
        """Clipping, where this layout splits gradients: the group whose processes' parts make the
        global norm (None: this process), and the axes of that group along which the layout holds a
        plain tensor the same on every process (name -> this process's rank along it; a DTensor's
        placements say so for the axes of its own mesh; ``"data"``: the data axis)."""
        raise NotImplementedError(f"{type(self).__name__} keeps whole gradients")

    # ----------------------------------------------------------- optimizers

    @abc.abstractmethod
    def on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` was created in scope (its ``__init__`` has finished)."""

    # a synchronous placement's are its data axis's (the parameter-server placement answers them its own way)

    @property
    def optimizer_step(self) -> Any:
        """One logical step, ``(optimizer, closure)``: user's step hooks fire once, the update reaches
        every copy. The data axis's step (:mod:`stratagem.placement.data_axis.step`), handed over with
        no frame of the placement's between the optimizer's ``step`` and it."""
        return self.data_axis.step

    def optimizer_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        self.data_axis.zero_grad(optimizer, set_to_none)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """One logical state dict, whatever the number of copies."""
        return self.data_axis.state_dict(optimizer)

    def optimizer_load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        self.data_axis.load_state_dict(optimizer, state_dict)

    def optimizer_add_param_group(self, optimizer: torch.optim.Optimizer, param_group: dict) -> None:
        self.data_axis.add_param_group(optimizer, param_group)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of per-element optimizer state (moments, momentum) this process holds for ``optimizer``."""
        return self.data_axis.state_bytes(optimizer)

    # ------------------------------------------------------------ GradScaler

    def grad_scaler_refusal(self) -> str | None:
        """Why a ``torch.amp.GradScaler`` created in this scope cannot work here, or None when it
        can: when each replica's copy of every parameter has a gradient that ``unscale_`` and its
        inf check can read after backward (then :mod:`stratagem.placement.scope.grad_scaler` makes one
        decision for all replicas). Refused by default."""
        return ("its replicas do not each hold a gradient for every parameter after backward "
                "(the model, its gradients or its steps are split between processes)")

    def optimizer_reduce(self, optimizer: torch.optim.Optimizer) -> Any:
        """``__reduce_ex__`` of a scoped optimizer: by default it cannot be pickled."""
        raise TypeError(
            f"a {base_of(optimizer).__name__} created in a strategy's scope cannot be pickled or "
            f"deep-copied; save its state_dict() instead (one logical copy)")

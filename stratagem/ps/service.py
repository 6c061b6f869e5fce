"""ParameterServer: the variables (shards) of one ps task, and their optimizers.

In parameter-server training each variable, or each shard of a partitioned one,
lives on one parameter server, with its optimizer beside it. Workers read the latest
values (``pull``, ``pull_rows``) and send gradients (``push``, ``push_rows``); the ps
applies each push at once, with the variable's own ``torch.optim`` instance, so workers
never wait for each other (asynchronous training).

Each variable is an ``nn.Parameter`` with a lock: pushes to one variable are applied one
after the other, in arrival order; pushes to different variables run in parallel (the RPC
server runs requests on a thread pool and torch releases the GIL). A read takes the lock
too, so it never sees half of an update. (One variable's record and the checks of what
workers send for it are in :mod:`stratagem.ps.shards`.)

The service is plain Python -- usable in-process, as tests do -- and :meth:`handlers`
exposes it to :class:`stratagem.rpc.RpcServer`: each handler takes the dict of its method's
keyword arguments, e.g. ``client.call("pull", {"var_ids": ["dense/kernel"]})``
(:class:`stratagem.ps.ParameterServerClient` wraps this).

Example::

    >>> import torch
    >>> from stratagem.ps import ParameterServer
    >>> ps = ParameterServer(name="ps 0")
    >>> ps.create("w", torch.zeros(3), optimizer_spec=(torch.optim.SGD, {"lr": 0.5}))
    >>> ps.push({"w": torch.ones(3)})
    >>> ps.pull(["w"])["w"]
    tensor([-0.5000, -0.5000, -0.5000])
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.cluster.joined import mark_joined
from stratagem.errors import InvalidArgumentError, UnavailableError
from stratagem.observe import flight
from stratagem.ps.checkpointing import checkpoint_handlers
from stratagem.ps.fencing import Fence, Fences
from stratagem.ps.ownership import Ownership, owned_handlers
from stratagem.ps.shards import (OptimizerSpec, Rows, Shard, check_rows, check_spec, check_value,
                                 make_optimizer, nbytes)
from stratagem.ps.sparse_update import (apply_row_update, dense_updates_warning,
                                        note_dense_step, updates_rows_only)
from stratagem.ps.state import ShardStates
from stratagem.rpc.server import EncodedReply, Handler, fast_lane, large_requests, reads_only

__all__ = ["OptimizerSpec", "ParameterServer", "ps_service"]

logger = logging.getLogger("stratagem.ps")


class ParameterServer(ShardStates):
    """The variables of one parameter-server task, by id, each with its own optimizer.

    ``name`` ("ps 0") appears in error messages. Thread-safe.
    """

    def __init__(self, *, name: str = "ps") -> None:
        self.name = name
        self._variables: dict[str, Shard] = {}
        self._registry_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._ops: dict[str, dict[str, int]] = {}
        self._started = time.time()
        self.incarnation = uuid.uuid4().hex   # a restarted ps is a new one: its variables are gone
        self.fences = Fences()
        self.ownership = Ownership(name)   # which coordinator may change this ps
        self._warned_dense: set[str] = set()   # variables told to take dense row updates

    # ------------------------------------------------------------------ variables

    def create(self, var_id: str, value: torch.Tensor,
               optimizer_spec: OptimizerSpec | None = None) -> None:
        """Creates variable ``var_id`` holding a copy of ``value``, with an optimizer made
        from ``optimizer_spec`` over it (none: the variable can be read and assigned, not
        pushed to). Creating an existing id is an error."""
        if not isinstance(var_id, str) or not var_id:
            raise InvalidArgumentError(f"a variable id must be a non-empty str, got {var_id!r}.")
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(
                f"variable {var_id!r}: the initial value must be a torch.Tensor, got "
                f"{type(value).__name__}.")
        spec = check_spec(optimizer_spec, var_id)
        data = value.detach().to("cpu", copy=True).contiguous()   # owns its memory
        param = nn.Parameter(data, requires_grad=data.is_floating_point() or data.is_complex())
        optimizer = make_optimizer(var_id, param, spec)
        with self._registry_lock:
            if var_id in self._variables:
                raise InvalidArgumentError(
                    f"{self.name} already has a variable {var_id!r}; ids must be unique (delete "
                    "it first to recreate it).")
            self._variables[var_id] = Shard(param, optimizer, spec)
        mark_joined(self.name)   # (for stratagem launch's check that the ps was used)
        self._count("create", nbytes(data), 0)

    def delete(self, var_ids: Iterable[str]) -> None:
        """Forgets the variables ``var_ids`` (unknown ids are an error; nothing is deleted then)."""
        var_ids = list(var_ids)
        with self._registry_lock:
            for var_id in var_ids:
                self._get(var_id)
            for var_id in var_ids:
                del self._variables[var_id]

    def set_optimizer(self, var_ids: Iterable[str], optimizer_spec: OptimizerSpec | None) -> None:
        """Gives the variables ``var_ids`` each a fresh optimizer made from ``optimizer_spec``
        (None: no optimizer), keeping their values -- what creating an optimizer over an
        existing model means. Every variable is checked before any changes."""
        spec = None
        targets = []
        for var_id in list(var_ids):
            spec = check_spec(optimizer_spec, var_id)
            var = self._get(var_id)
            targets.append((var, make_optimizer(var_id, var.param, spec)))
        for var, optimizer in targets:
            with var.lock:
                var.optimizer, var.optimizer_spec = optimizer, spec

    def variables(self) -> dict[str, dict[str, Any]]:
        """What this ps holds: per id, shape, dtype, optimizer class name, updates applied."""
        return {var_id: {"shape": tuple(var.param.shape), "dtype": str(var.param.dtype),
                         "optimizer": None if var.optimizer is None else type(var.optimizer).__name__,
                         "updates": var.updates}
                for var_id, var in list(self._variables.items())}

    # ----------------------------------------------------------------------- reads

    def pull(self, var_ids: Iterable[str]) -> dict[str, torch.Tensor]:
        """The current values of ``var_ids`` (copies, each taken between two updates)."""
        result = {}
        for var_id in var_ids:
            var = self._get(var_id)
            with var.lock:
                result[var_id] = var.param.detach().clone()
        self._count("pull", 0, sum(nbytes(value) for value in result.values()))
        return result

    def _pull_framed(self, var_ids: Iterable[str]) -> EncodedReply:
        """:meth:`pull` for the RPC handler: the reply is framed straight from the live values
        while their locks are held (framing copies them once; no clone first). Locks are
        taken in id order, so concurrent pulls cannot wait on each other in a cycle; every
        other method holds one variable lock at a time."""
        wanted = {var_id: self._get(var_id) for var_id in var_ids}
        with contextlib.ExitStack() as held:
            for var_id in sorted(wanted):
                held.enter_context(wanted[var_id].lock)
            reply = EncodedReply({var_id: var.param.detach() for var_id, var in wanted.items()})
        self._count("pull", 0, sum(nbytes(var.param) for var in wanted.values()))
        return reply

    def pull_rows(self, var_id: str, row_ids: Rows) -> torch.Tensor:
        """Rows ``row_ids`` (1-D, repeats allowed) of variable ``var_id``, in that order."""
        var = self._get(var_id)
        rows = check_rows(var_id, var, row_ids)
        with var.lock:
            values = var.param.detach().index_select(0, rows)
        self._count("pull_rows", nbytes(rows), nbytes(values))
        return values

    # ---------------------------------------------------------------------- updates

    def push(self, grads: Mapping[str, torch.Tensor] | None = None,
             rows: Sequence[tuple[str, Rows, torch.Tensor]] = (), fence: Any = None,
             pull: Sequence[str] = ()) -> EncodedReply | None:
        """Applies one optimizer step per variable with its gradient in ``grads``, and the
        row-sparse steps ``rows``: ``(var_id, row_ids, row_grads)`` each, as :meth:`push_rows`
        -- so one request carries all that a training step sends to this ps.

        Everything is checked before anything is applied; a variable without optimizer is
        an error. A dense gradient is cast to the variable's dtype. ``fence`` (sent by
        workers running a coordinator's closures, see :mod:`stratagem.ps.fencing`) makes the
        update apply at most once per scheduled closure: updates another execution of the
        same closure already applied are skipped. ``pull``: ids whose values (as :meth:`pull`, read
        after this update) the reply carries, so that a worker's next step needs no pull of its own.
        """
        checked = []
        for var_id, grad in (grads or {}).items():
            var = self._get(var_id)
            self._check_optimizer(var_id, var)
            checked.append((var_id, var, check_value(var_id, var, grad, "gradient")))
        if not isinstance(rows, Sequence) or not all(isinstance(r, Sequence) and len(r) == 3 for r in rows):
            raise InvalidArgumentError(
                "push(rows=...) takes a list of (var_id, row_ids, row_grads) triples, as push_rows.")
        row_updates = [(update[0], self._checked_rows(*update)) for update in rows]
        if fence is not None:
            ids = list(dict.fromkeys([var_id for var_id, *_ in checked] + [var_id for var_id, _ in row_updates]))
            try:
                admitted = set(self.fences.admit(Fence.from_request(fence), ids))
            except UnavailableError:   # superseded, or the lease ran out: applies nothing
                self._count("push_refused", 0, 0)
                raise
            if len(admitted) < len(ids):
                self._count("push_skipped", 0, 0)
            checked = [entry for entry in checked if entry[0] in admitted]
            row_updates = [entry for entry in row_updates if entry[0] in admitted]
        for _, var, grad in checked:
            with var.lock:
                var.param.grad = grad
                try:
                    var.optimizer.step()  # type: ignore[union-attr]
                finally:
                    var.param.grad = None
                note_dense_step(var.optimizer, var.param)  # type: ignore[arg-type]
                var.updates += 1
        if checked:
            self._count("push", sum(nbytes(grad) for *_, grad in checked), 0)
        for _, update in row_updates:
            self._apply_rows(*update)
        return self._pull_framed(pull) if pull else None

    def push_rows(self, var_id: str, row_ids: Rows, row_grads: torch.Tensor, fence: Any = None) -> None:
        """A row-sparse step: only rows ``row_ids`` of ``var_id`` and their optimizer state
        change (see :mod:`stratagem.ps.sparse_update`); repeated rows' gradients are summed.
        ``row_grads`` has shape ``(len(row_ids), *shape[1:])``; ``fence`` as in :meth:`push`. An optimizer without a
        row-sparse rule (RMSprop...) takes a dense step instead, with a warning the first time."""
        self.push(rows=[(var_id, row_ids, row_grads)], fence=fence)

    def _checked_rows(self, var_id: str, row_ids: Rows,
                      row_grads: torch.Tensor) -> tuple[str, Shard, torch.Tensor, torch.Tensor]:
        var = self._get(var_id)
        rows = check_rows(var_id, var, row_ids)
        self._check_optimizer(var_id, var)
        expected = (rows.numel(), *var.param.shape[1:])
        if not isinstance(row_grads, torch.Tensor) or tuple(row_grads.shape) != expected:
            got = tuple(row_grads.shape) if isinstance(row_grads, torch.Tensor) else type(row_grads).__name__
            raise InvalidArgumentError(
                f"push_rows({var_id!r}): row_grads must have shape {expected} (one row per row "
                f"id), got {got}.")
        return var_id, var, rows, row_grads

    def _apply_rows(self, var_id: str, var: Shard, rows: torch.Tensor, row_grads: torch.Tensor) -> None:
        with var.lock:
            optimizer_class = type(var.optimizer)
            if (var_id not in self._warned_dense and rows.numel()
                    and not updates_rows_only(optimizer_class, var.param.dtype)):
                self._warned_dense.add(var_id)   # (the coordinator warned its user already)
                logger.warning(dense_updates_warning(optimizer_class.__name__, f"{var_id!r} on {self.name}",
                                                     tuple(var.param.shape)))
            apply_row_update(var.optimizer, var.param, rows, row_grads)
            var.updates += 1
        self._count("push_rows", nbytes(rows) + nbytes(row_grads), 0)

    def _check_optimizer(self, var_id: str, var: Shard) -> None:
        if var.optimizer is None:
            raise InvalidArgumentError(
                f"variable {var_id!r} on {self.name} has no optimizer: create it with an "
                "optimizer_spec to push gradients, or use assign().")

    def assign(self, values: Mapping[str, torch.Tensor]) -> None:
        """Overwrites the values of variables (optimizer state is kept)."""
        checked = [(self._get(var_id), var_id, value) for var_id, value in values.items()]
        checked = [(var, check_value(var_id, var, value, "value")) for var, var_id, value in checked]
        for var, value in checked:
            with var.lock, torch.no_grad():
                var.param.copy_(value)
        self._count("assign", sum(nbytes(value) for _, value in checked), 0)

    def set_hyperparameters(self, var_ids: Iterable[str] | None, values: Mapping[str, Any]) -> None:
        """Sets optimizer hyperparameters (``{"lr": 0.01}``) of ``var_ids`` (None: all with
        an optimizer), as a learning-rate schedule on the coordinator does each step."""
        targets = ([(var_id, var) for var_id, var in list(self._variables.items()) if var.optimizer]
                   if var_ids is None else [(var_id, self._get(var_id)) for var_id in var_ids])
        for var_id, var in targets:
            if var.optimizer is None:
                raise InvalidArgumentError(f"variable {var_id!r} on {self.name} has no optimizer.")
            group = var.optimizer.param_groups[0]
            unknown = [key for key in values if key == "params" or key not in group]
            if unknown:
                raise InvalidArgumentError(
                    f"{type(var.optimizer).__name__} of {var_id!r} has no hyperparameter "
                    f"{unknown[0]!r}; it has {sorted(key for key in group if key != 'params')}.")
        for _, var in targets:
            with var.lock:
                var.optimizer.param_groups[0].update(values)  # type: ignore[union-attr]

    # ------------------------------------------------------------------- monitoring

    def ping(self) -> dict[str, Any]:
        """A cheap liveness answer: name, incarnation, wall time, number of variables, uptime."""
        return {"name": self.name, "incarnation": self.incarnation, "time": time.time(),
                "num_variables": len(self._variables), "uptime_s": time.time() - self._started}

    def renew_lease(self, coordinator: str, lease_s: float, sent_at: float,
                    floor: int | None = None) -> dict[str, Any]:
        """A coordinator's heartbeat: its closures' pushes are applied for ``lease_s`` more
        seconds, and closures older than ``floor`` have finished (see
        :mod:`stratagem.ps.fencing`). Answers as :meth:`ping`, plus whether the lease was
        extended (not when the renewal arrived late)."""
        renewed = self.fences.renew(coordinator, lease_s=lease_s, sent_at=sent_at, floor=floor)
        return {**self.ping(), "renewed": renewed}

    def claim(self, identity: Mapping[str, Any], lease_s: float, replaces: str | None = None) -> dict[str, Any]:
        """A coordinator claims this ps (see :mod:`stratagem.ps.ownership`); taking it over from
        another one drops that one's variables and fences: the new one creates its own."""
        with self.ownership.exclusive():
            answer = self.ownership.claim(identity, lease_s, replaces)
            if answer["previous"] is not None:
                with self._registry_lock:
                    answer["dropped"] = len(self._variables)
                    self._variables.clear()
                self._warned_dense.clear()
                self.fences.forget(answer["previous"]["id"])
                logger.log(logging.INFO if answer["why"] == "it released it" else logging.WARNING,
                           "%s taken over by a new coordinator (%s) from %s: %s; its %d variables dropped",
                           self.name, identity.get("id"), answer["previous"]["id"], answer["why"], answer["dropped"])
        return answer

    def expire_lease(self, coordinator: str) -> None:
        """Ends a coordinator's lease at once (it shuts down): its closures apply nothing more."""
        self.fences.expire(coordinator)

    def stats(self) -> dict[str, Any]:
        """Tensor bytes received and sent, per operation (to check, for instance, that
        embedding traffic grows with the rows used, not the table size)."""
        with self._stats_lock:
            ops = {op: dict(counts) for op, counts in self._ops.items()}
        return {"name": self.name, "num_variables": len(self._variables),
                "variable_bytes": sum(nbytes(var.param) for var in list(self._variables.values())),
                "ops": ops, "fences": self.fences.stats(), "owner": self.ownership.state(),
                "bytes_in": sum(counts["bytes_in"] for counts in ops.values()),
                "bytes_out": sum(counts["bytes_out"] for counts in ops.values())}

    def handlers(self) -> dict[str, Handler]:
        """RPC handlers: each takes the dict of its method's keyword arguments."""
        methods: dict[str, Callable[..., Any]] = {
            "create": self.create, "delete": self.delete, "variables": self.variables,
            "set_optimizer": self.set_optimizer,
            "pull": self._pull_framed, "pull_rows": self.pull_rows, "push": self.push,
            "push_rows": self.push_rows, "assign": self.assign,
            "set_hyperparameters": self.set_hyperparameters, "get_state": self.get_state,
            "set_state": self.set_state, "ping": self.ping, "stats": self.stats,
            "renew_lease": self.renew_lease, "expire_lease": self.expire_lease,
        }
        handlers = {name: _keyword_handler(name, method) for name, method in methods.items()}
        handlers.update(checkpoint_handlers(self))   # write_shards
        # A request that changes the ps must come from its owner (claim, hold...: ownership.py).
        handlers = owned_handlers(self.ownership, handlers, self.claim,
                                  refused=lambda method: self._count(f"{method}_fenced", 0, 0))
        # These copy the request's tensors into variables or read them as gradients: the
        # transport may hand them over as views of the received bytes, without a copy.
        for name in ("create", "push", "push_rows", "assign", "set_state"):
            reads_only(handlers[name])
        # These take tensors (or row ids) as large as a variable; the others, small requests.
        for name in ("create", "push", "push_rows", "assign", "set_state", "pull_rows"):
            large_requests(handlers[name])
        # A step's calls: on the lane beside gRPC (same token, a fraction of gRPC's CPU per call).
        for name in ("pull", "pull_rows", "push"):
            fast_lane(handlers[name])
        return handlers

    # ------------------------------------------------------------------- internals

    def _get(self, var_id: str) -> Shard:
        var = self._variables.get(var_id)
        if var is None:
            known = sorted(self._variables)
            shown = ", ".join(map(repr, known[:10])) + (" ..." if len(known) > 10 else "")
            raise InvalidArgumentError(
                f"{self.name} has no variable {var_id!r}; it has {len(known)}: {shown or 'none'}.")
        return var

    def _count(self, op: str, bytes_in: int, bytes_out: int) -> None:
        flight.end(flight.begin(f"rpc served {op}", bytes_in + bytes_out))   # (the last one: where a stopped ps was)
        with self._stats_lock:
            counts = self._ops.setdefault(op, {"calls": 0, "bytes_in": 0, "bytes_out": 0})
            counts["calls"] += 1
            counts["bytes_in"] += bytes_in
            counts["bytes_out"] += bytes_out


def ps_service(task: Any) -> ParameterServer:
    """The service factory of task type "ps" for ``stratagem server``: a fresh, empty
    ParameterServer named after the task (a :class:`~stratagem.ps.server.TaskInfo`)."""
    return ParameterServer(name=task.name)


def _keyword_handler(name: str, method: Callable[..., Any]) -> Handler:
    def handler(request: Any) -> Any:
        if request is None:
            request = {}
        if not isinstance(request, Mapping):
            raise InvalidArgumentError(
                f"the request of {name!r} must be a dict of its keyword arguments, got "
                f"{type(request).__name__}.")
        return method(**request)

    handler.__name__ = name
    return handler

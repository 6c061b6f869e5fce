"""``sg.experimental.plan``: the layout of a model over processes, chosen by prediction and measurement.

The parent (the caller's process) checks the request and starts one process per device with
:func:`stratagem.testing.run_local_cluster` (free loopback ports, a deadline, every process
killed on the way out); the processes run :mod:`.trial` (profile, enumerate, predict, refuse by
memory, measure the cheapest) and global rank 0 hands back what they found, from which the parent
builds the :class:`Plan`.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import cloudpickle
import torch

import stratagem
from stratagem.errors import InvalidArgumentError, StratagemError
from stratagem.experimental.planning.cost import Prediction, calibrated
from stratagem.experimental.planning.layouts import Layout
from stratagem.experimental.planning.request import check_request, processes_of
from stratagem.testing import run_local_cluster

_MIB = float(1 << 20)


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One layout of the table: its prediction, what was measured of it, and what became of it."""

    layout: Layout
    prediction: Prediction | None
    calibrated_seconds: float | None      # the prediction times its mesh's measured / predicted (cost.calibrated)
    measured_seconds: float | None
    measured_model_states: float | None   # bytes of parameters, gradients and optimizer state, the fullest process
    note: str                             # "chosen", "measured", "not measured ...", "failed: ...", "rejected: ..."
    probe: bool = False                   # measured first, to calibrate its mesh
    measured_peak: float | None = None    # bytes at the step's peak, the fullest process (trial's PeakMeter)
    peak_parts: list | None = None        # each process's peak by kind (parameters, gradients, state, saved, ...)


class Plan:
    """The layout chosen for a model on some processes, the table it was chosen from, and its strategy.

    Build it with :func:`plan`. ``plan.layout`` is the winner, ``plan.code`` the line that pins it,
    ``plan.strategy()`` builds it (in every process of the training cluster: a ``Plan`` pickles),
    ``plan.rows`` the table, ``print(plan)`` prints the table and the line (:func:`plan`'s example).
    """

    def __init__(self, *, rows: list[PlanRow], layout: Layout, world: int, loss_fn: Callable,
                 tensor_plan: dict[str, Any] | None, summary: list[str], device: str):
        self.rows, self.layout, self.world, self.summary, self.device = rows, layout, world, summary, device
        self._loss_fn, self._tensor_plan = loss_fn, tensor_plan

    @property
    def code(self) -> str:
        """The one line that pins the chosen layout (``loss_fn`` and ``tensor_plan`` as the script names them)."""
        return "strategy = " + self.layout.code()

    def strategy(self) -> Any:
        """The chosen layout's ``sg.experimental.PipelineStrategy`` (call it in every process of the cluster)."""
        return self.layout.strategy(loss_fn=self._loss_fn, plan=self._tensor_plan)

    def table(self) -> str:
        """The table: layout, predicted memory (model states + activations), the measured peak, step time (the
        model's, calibrated, measured), note."""
        head = (f"{'layout':<28}{'memory MiB (states + act.)':>30}{'peak MiB':>10}{'model ms':>10}{'calibrated':>12}"
                f"{'measured ms':>13}  note")
        lines = [head, "-" * len(head)]
        for row in self.rows:
            p = row.prediction
            memory = (f"{p.memory / _MIB:.3f} ({p.model_states / _MIB:.3f} + {p.activations / _MIB:.3f})"
                      if p else "-")
            predicted = f"{p.seconds * 1e3:.2f}" if p else "-"
            fixed = f"{row.calibrated_seconds * 1e3:.2f}" if row.calibrated_seconds is not None else "-"
            measured = f"{row.measured_seconds * 1e3:.2f}" if row.measured_seconds is not None else "-"
            note = row.note + (" (probe)" if row.probe else "")
            peak = f"{row.measured_peak / _MIB:.3f}" if row.measured_peak is not None else "-"
            lines.append(f"{row.layout.describe():<28}{memory:>30}{peak:>10}{predicted:>10}{fixed:>12}{measured:>13}"
                         f"  {note}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return "\n".join([f"sg.experimental.plan: {self.world} processes ({self.device})", self.table(),
                          *self.summary, "pin it with:", "    " + self.code])

    def __repr__(self) -> str:
        return f"Plan({self.layout.describe()!r} of {len(self.rows)} layouts, {self.world} processes)"


def plan(model_fn: Callable[[], torch.nn.Module], sample_batch: tuple[torch.Tensor, torch.Tensor],
         devices_or_cluster: int | str, *, global_batch: int, optimizer: Any = "adam", memory_limit: float | None = None,
         time_budget_s: float = 60, loss_fn: Callable = torch.nn.functional.mse_loss,
         tensor_plan: dict[str, str] | None = None, num_measured: int | None = 3, steps: int = 3,
         verbose: bool = True) -> Plan:
    """Choose how to lay ``model_fn()`` over ``devices_or_cluster``'s processes: predict every layout, measure the cheapest.

    ``devices_or_cluster``: a number of local processes (CPU, or each a GPU when torch sees some),
    or ``"cuda"`` (one process per GPU of this machine). Every layout is a
    ``sg.experimental.PipelineStrategy`` over a ``{"data": d, "pipe": p, "model": t}`` mesh (``p > 1``
    and ``t > 1`` need an ``nn.Sequential``; ``t > 1`` a ``tensor_plan`` of its layers' names to
    ``"colwise"`` / ``"rowwise"``) with a ZeRO stage over the data axis, recomputation or not, a
    micro-batch count and a schedule, so the training script is the same for all: a step calls
    ``strategy.forward_backward(model, x, y)`` and ``optimizer.step()``.

    The processes profile the model on one device (``sample_batch = (inputs, target)``), measure
    their collectives, predict each layout's step time and per-process memory for ``global_batch``
    rows a step and ``optimizer`` (``"adam"``, ``"adamw"``, ``"sgd"``, ``"momentum"``, or a function
    ``params -> Optimizer``), and refuse the layouts above ``memory_limit`` (bytes per process;
    ``None``: no limit on CPU, the least free memory of the GPUs under CUDA). They train the plainest
    layout of each mesh (a probe, which calibrates the predictions of its mesh), then
    the ``num_measured`` cheapest others by calibrated prediction (``None``: all), for ``steps``
    steps each while ``time_budget_s`` lasts. The fastest measured wins. Prints the table and the line that pins the winner (``verbose=False``: silent).

    Raises ``InvalidArgumentError`` for a request that cannot be planned, or when no layout fits
    ``memory_limit`` (saying what the smallest needs).

    Example::

        import torch, stratagem as sg
        mlp = lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        # one process, started as stratagem.testing.run_local_cluster starts a test's
        chosen = sg.experimental.plan(mlp, (torch.randn(8, 16), torch.randn(8, 4)), 1,
                                      global_batch=8, time_budget_s=5, verbose=False)
        assert chosen.layout.mesh == {"data": 1, "pipe": 1, "model": 1}   # one process: one mesh (recompute or not)
        print(chosen.code)   # strategy = sg.experimental.PipelineStrategy({'data': 1, ...}, loss_fn=loss_fn)
    """
    x, y = check_request(model_fn, sample_batch, global_batch=global_batch, optimizer=optimizer,
                         memory_limit=memory_limit, time_budget_s=time_budget_s, loss_fn=loss_fn,
                         tensor_plan=tensor_plan, num_measured=num_measured, steps=steps)
    world = processes_of(devices_or_cluster)
    spec = {"world": world, "model_fn": model_fn, "sample": (x.detach().cpu(), y.detach().cpu()), "loss_fn": loss_fn,
            "optimizer": optimizer, "tensor_plan": tensor_plan, "global_batch": global_batch,
            "memory_limit": memory_limit, "num_measured": num_measured, "time_budget_s": time_budget_s,
            "steps": steps}
    with tempfile.TemporaryDirectory(prefix="stratagem-plan-") as folder:
        spec_path, out = os.path.join(folder, "spec.pkl"), os.path.join(folder, "result.pkl")
        try:
            with open(spec_path, "wb") as f:
                cloudpickle.dump(spec, f)
        except Exception as e:
            raise InvalidArgumentError(
                f"the plan's processes get model_fn, loss_fn and optimizer pickled (cloudpickle), and this one "
                f"could not be: {type(e).__name__}: {e}; define them at a module's top level") from e
        results = run_local_cluster(Path(__file__).with_name("trial.py"), world, args=[spec_path, out],
                                    timeout=120 + 3 * time_budget_s, env=_environment())
        failed = [r for r in results if r.returncode != 0]
        if failed or not os.path.exists(out):
            raise StratagemError("sg.experimental.plan: a trial process failed:\n" + "\n".join(
                f"--- {r.task} (exit {r.returncode}) ---\n{r.output[-4000:]}" for r in (failed or results)))
        with open(out, "rb") as f:
            result = pickle.load(f)
    chosen = _assemble(result, world=world, loss_fn=loss_fn, tensor_plan=tensor_plan)
    if verbose:
        print(chosen, flush=True)
    return chosen


def _environment() -> dict[str, str]:
    """The trials import this stratagem, and what the caller's module path reaches (its model_fn's module)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    paths = [str(Path(stratagem.__file__).resolve().parents[1]), os.getcwd(),
             *([str(Path(main).resolve().parent)] if main else []), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _assemble(result: dict[str, Any], *, world: int, loss_fn: Callable, tensor_plan: Any) -> Plan:
    if "error" in result:
        raise InvalidArgumentError(f"sg.experimental.plan could not profile the model: {result['error']}")
    measured, limit = result["measured"], result.get("memory_limit")
    factors, probes = result.get("calibration", {}), result.get("probes", [])
    rows = []
    for entry in result["rows"]:
        layout, guess = entry["layout"], entry.get("prediction")
        got = measured.get(layout)
        if entry.get("reason"):
            note = "rejected: " + entry["reason"]
        elif isinstance(got, str):
            note = "failed: " + got
        elif got is None:
            note = "not measured (predicted slower, or past time_budget_s)"
        else:
            note = "measured"
        ok = isinstance(got, dict)
        fixed = calibrated(result["raw"], factors, layout) if layout in result["raw"] else None
        rows.append(PlanRow(layout, guess, fixed, got["seconds"] if ok else None, got["model_states"] if ok else None,
                            note, probe=layout in probes, measured_peak=got["peak"] if ok else None,
                            peak_parts=[e["parts"] for e in got["per_process"]] if ok else None))
    ran = [r for r in rows if r.measured_seconds is not None]
    if not ran:
        _refuse(rows, limit, world)
    best = min(ran, key=lambda r: r.measured_seconds)
    rows = [dataclasses.replace(r, note="chosen") if r is best else r for r in rows]
    rank = {"chosen": 0, "measured": 1, "failed": 2, "not measured": 3, "rejected": 4}
    rows.sort(key=lambda r: (rank[r.note.split(":")[0].split(" (")[0]], r.measured_seconds or 0,
                             r.calibrated_seconds or 0))
    summary = [f"chosen: {best.layout.describe()}, {best.measured_seconds * 1e3:.2f} ms per step measured "
               f"({best.calibrated_seconds * 1e3:.2f} predicted, calibrated), {best.prediction.memory / _MIB:.3f} MiB "
               f"per process predicted"]
    if limit is not None:
        summary.append(f"memory_limit: {limit / _MIB:.3f} MiB per process"
                       + (f" ({result['limit_from']})" if "limit_from" in result else ""))
        plain = next((r for r in rows if r.layout == Layout(world, 1, 1) and r.prediction), None)
        if plain is not None and plain.note.startswith("rejected"):
            summary.append(f"data parallelism ({plain.layout.describe()}) needs {plain.prediction.memory / _MIB:.3f} "
                           f"MiB per process, above the limit: the plan moved to {best.layout.describe()}")
    return Plan(rows=rows, layout=best.layout, world=world, loss_fn=loss_fn, tensor_plan=tensor_plan,
                summary=summary, device=result["device"])


def _refuse(rows: list[PlanRow], limit: float | None, world: int) -> None:
    predicted = [r for r in rows if r.prediction is not None]
    if limit is not None and predicted and all(r.note.startswith("rejected") for r in predicted):
        small = min(predicted, key=lambda r: r.prediction.memory)
        p = small.prediction
        raise InvalidArgumentError(
            f"no layout of {world} processes fits memory_limit={limit / _MIB:.3f} MiB per process: the smallest, "
            f"{small.layout.describe()}, needs {p.memory / _MIB:.3f} MiB ({p.model_states / _MIB:.3f} of parameters, "
            f"gradients and optimizer state, {p.activations / _MIB:.3f} that its step adds); raise memory_limit, use "
            f"more processes, or a smaller global_batch")
    failed = "\n".join(f"  {r.layout.describe()}: {r.note}" for r in rows if not r.note.startswith("rejected"))
    raise StratagemError(f"sg.experimental.plan measured no layout of {world} processes:\n{failed or '  (none)'}")

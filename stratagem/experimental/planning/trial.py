"""The planner's trial: the script every process of the cluster that ``sg.experimental.plan`` starts runs.

    python trial.py SPEC OUT

``SPEC`` is the plan's request (cloudpickled by :func:`stratagem.experimental.planning.plan.plan`);
global rank 0 writes the outcome to ``OUT``. In order, every process taking part:

1. builds data parallelism over every process (``{"data": n, "pipe": 1, "model": 1}``), which
   starts the process group, and times all-reduces of 4 bytes and of 4 MiB (the network's
   latency and bandwidth, :class:`~stratagem.experimental.planning.cost.Network`); on GPUs each
   process reports its device's free memory (the default ``memory_limit``: the least of them);
2. rank 0 profiles the model on its own device (the others wait), enumerates the layouts, predicts
   each one's step time and memory, refuses those above the limit, and sends every process the
   probes: of each mesh, its plainest layout that fits (:func:`~.cost.probes`);
3. once they are measured, rank 0 calibrates the predictions with them (:func:`~.cost.calibration`)
   and sends the cheapest ``num_measured`` of the others by calibrated prediction (all of them when
   it is None), which are measured in turn; then the 3 fastest measured are trained again, in 2
   interleaved rounds, each keeping its fastest step of all (:func:`_remeasure`). Measuring: every process builds each layout in turn, trains it for ``steps`` steps after one
   warm-up step, one step whose memory peak is measured (:class:`~.peak.PeakMeter`), and one forward
   and backward that counts the gradients' bytes (the parameters' and
   the optimizer state's are counted after the last step), and the slowest process's fastest step
   is the layout's time (what a busy moment of a shared machine cannot inflate) -- until ``time_budget_s`` has passed (at least one is measured).

A layout that raises on every process is recorded with its error and skipped; one that breaks
only some processes leaves the others waiting, and the plan's deadline ends the cluster.
"""

from __future__ import annotations

import gc
import os
import pickle
import statistics
import sys
import time
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from stratagem.experimental.planning.cost import Network, calibrated, calibration, predict, probes
from stratagem.experimental.planning.layouts import Layout, enumerate_layouts
from stratagem.experimental.planning.memory import storage_bytes
from stratagem.experimental.planning.peak import PeakMeter, gather_buffers, gathered
from stratagem.experimental.planning.profile import profile
from stratagem.experimental.planning.request import make_optimizer

SMALL, LARGE = 1, 1 << 20   # float32 elements of the timed all-reduces
FINALISTS, FINAL_ROUNDS = 3, 2   # the fastest layouts measured again, and how many times (interleaved)


def main(spec_path: str, out: str) -> None:
    with open(spec_path, "rb") as f:
        spec = cloudpickle.load(f)
    world = spec["world"]
    base = Layout(world, 1, 1).strategy(loss_fn=spec["loss_fn"])
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    network = _network(world, device)
    free = [None] * world
    dist.all_gather_object(free, torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None)
    payload: list[Any] = [None]
    result: dict[str, Any] = {"network": network, "device": str(device), "world": world}
    if rank == 0:
        try:
            payload[0] = _choose(spec, network, device, free, result)
        except Exception as e:   # every process stops; the plan raises it
            result["error"] = f"{type(e).__name__}: {e}"
            payload[0] = []
    dist.broadcast_object_list(payload, src=0)
    del base
    started = time.monotonic()
    measured = _measure_all(spec, payload[0], device, world, started)
    if rank == 0 and "error" not in result:
        result["calibration"] = calibration(result["raw"], measured)
        payload[0] = _rest(spec, result, measured)
    dist.broadcast_object_list(payload, src=0)
    measured.update(_measure_all(spec, payload[0], device, world, started, first=not measured))
    _remeasure(spec, measured, device, world, started)
    if rank == 0:
        if "error" not in result:   # (the probes' times may have come down)
            result["calibration"] = calibration(result["raw"], {layout: measured[layout] for layout in result["probes"]
                                                                if layout in measured})
        result["measured"] = measured
        with open(out, "wb") as f:
            pickle.dump(result, f)
    print(f"trial: rank {rank} done", flush=True)


def _network(world: int, device: torch.device) -> Network:
    times = {}
    for count in (SMALL, LARGE):
        t = torch.ones(count, device=device)
        seconds = []
        for i in range(12 if count == SMALL else 4):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        times[count] = statistics.median(seconds[1:])
    n = max(world, 2)
    alpha = times[SMALL] / (2 * (n - 1))
    beta = 2 * (n - 1) / n * 4 * LARGE / max(times[LARGE] - times[SMALL], 1e-9)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = 1.0 if device.type == "cuda" else max(1.0, world * torch.get_num_threads() / cores)
    return Network(alpha=alpha, beta=beta, oversubscription=busy)


def _choose(spec: dict[str, Any], network: Network, device: torch.device, free: list[Any],
            result: dict[str, Any]) -> list[Layout]:
    """Rank 0: profile, enumerate, predict, refuse by memory; the layouts to measure, cheapest first."""
    x, y = spec["sample"]
    model = spec["model_fn"]().to(device)
    x = x.to(device)
    loss = spec["loss_fn"](model(x), y.to(device))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn(model(x), y) must return a tensor of one element, got {loss!r}")
    sizes = [t for t in range(1, spec["world"] + 1) if spec["world"] % t == 0]
    prof = profile(model, (x,), make_optimizer=lambda params: make_optimizer(spec["optimizer"], params),
                   plan=spec["tensor_plan"], model_sizes=sizes, device=device, target=y.to(device),
                   loss_fn=spec["loss_fn"])
    del model
    limit = spec["memory_limit"]
    if limit is None and device.type == "cuda":
        limit = min(f for f in free if f is not None)
        result["limit_from"] = "the least free memory of the devices (torch.cuda.mem_get_info)"
    result["memory_limit"], result["profile"] = limit, prof
    costs = [a + b * spec["global_batch"] / spec["world"] for a, b in prof.forward_backward]
    layouts, refused = enumerate_layouts(spec["world"], names=prof.names, sequential=prof.sequential, costs=costs,
                                         plan=spec["tensor_plan"], global_batch=spec["global_batch"])
    rows = [{"layout": layout, "reason": why} for layout, why in refused]
    fitting: list[tuple[float, int, Layout]] = []
    for layout in layouts:
        guess = predict(prof, layout, network, global_batch=spec["global_batch"])
        row = {"layout": layout, "prediction": guess}
        if limit is not None and guess.memory > limit:
            row["reason"] = f"needs {guess.memory / 2**20:.2f} MiB > limit {limit / 2**20:.2f} MiB"
        else:
            fitting.append((guess.seconds, len(rows), layout))
        rows.append(row)
    result["rows"] = rows
    result["raw"] = {layout: seconds for seconds, _, layout in fitting}
    result["probes"] = probes([layout for _, _, layout in sorted(fitting, key=lambda e: e[:2])])
    return result["probes"]


def _rest(spec: dict[str, Any], result: dict[str, Any], measured: dict[Layout, Any]) -> list[Layout]:
    """Rank 0, after the probes: the cheapest ``num_measured`` layouts by calibrated prediction, not measured yet."""
    factors = result["calibration"]
    ranked = sorted((layout for layout in result["raw"] if layout not in measured),
                    key=lambda layout: calibrated(result["raw"], factors, layout))
    count = spec["num_measured"]
    return ranked if count is None else ranked[:count]


def _remeasure(spec: dict[str, Any], measured: dict[Layout, Any], device: torch.device, world: int,
               started: float) -> None:
    """The :data:`FINALISTS` fastest, trained again in :data:`FINAL_ROUNDS` interleaved rounds (while
    ``time_budget_s`` lasts): each keeps its fastest step of all, so that one busy moment of a shared
    machine, which only ever slows a step down, does not decide the winner."""
    ran = sorted((got["seconds"], i, layout) for i, (layout, got) in enumerate(measured.items())
                 if isinstance(got, dict))
    finalists = [layout for _, _, layout in ran[:FINALISTS]] if len(ran) > 1 else []
    for _ in range(FINAL_ROUNDS):
        for layout, got in _measure_all(spec, finalists, device, world, started, first=False, timing=True).items():
            if isinstance(got, dict):
                measured[layout]["seconds"] = min(measured[layout]["seconds"], got["seconds"])
                measured[layout]["rounds"] = measured[layout].get("rounds", 1) + 1


def _measure_all(spec: dict[str, Any], layouts: list[Layout], device: torch.device, world: int, started: float, *,
                 first: bool = True, timing: bool = False) -> dict[Layout, Any]:
    g = torch.Generator().manual_seed(0)
    x, y = spec["sample"]
    index = torch.randint(0, x.shape[0], (spec["global_batch"],), generator=g)
    batch = (x[index], y[index])
    measured: dict[Layout, Any] = {}
    for i, layout in enumerate(layouts):
        go = [(first and i == 0) or time.monotonic() - started < spec["time_budget_s"]]
        dist.broadcast_object_list(go, src=0)   # rank 0's clock decides for everyone
        if not go[0]:
            break
        try:
            mine: Any = _measure(spec, layout, batch, device, timing=timing)
        except Exception as e:   # the same error on every process: recorded, the next layout runs
            mine = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        errors = [e for e in everyone if isinstance(e, str)]
        if timing:
            measured[layout] = errors[0] if errors else {"seconds": max(e["seconds"] for e in everyone)}
            continue
        measured[layout] = errors[0] if errors else {
            "seconds": max(e["seconds"] for e in everyone),
            "model_states": max(e["params"] + e["grads"] + e["state"] for e in everyone),
            "peak": max(e["peak"] for e in everyone),
            "per_process": everyone}
        gc.collect()
    return measured


def _measure(spec: dict[str, Any], layout: Layout, batch: tuple[torch.Tensor, torch.Tensor],
             device: torch.device, *, timing: bool = False) -> dict[str, float]:
    strategy = layout.strategy(loss_fn=spec["loss_fn"], plan=spec["tensor_plan"])
    with strategy.scope():
        model = spec["model_fn"]()
        optimizer = make_optimizer(spec["optimizer"], model.parameters())
    (xs, ys), = list(strategy.experimental_distribute_dataset([batch]))
    grads = [0]

    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        strategy.forward_backward(model, x, y)
        optimizer.step()

    def count(x: Any, y: Any) -> None:
        """The gradients' bytes at their peak: when the schedule ends (under ZeRO-2, the whole local gradient
        it holds until the reduce-scatter, which ``no_sync`` leaves in ``.grad``). No update."""
        optimizer.zero_grad(set_to_none=True)
        if layout.sharding == "gradients":
            with strategy.no_sync():
                strategy.forward_backward(model, x, y)
        else:
            strategy.forward_backward(model, x, y)
        grads[0] = storage_bytes(q.grad for q in model.parameters())
        optimizer.zero_grad(set_to_none=True)

    def metered(x: Any, y: Any) -> None:
        """One step whose memory peak is measured (:class:`~.peak.PeakMeter`)."""
        optimizer.zero_grad(set_to_none=True)
        stages = list(strategy.placement.split_of(model).local.values())
        meter = PeakMeter(list(model.parameters()), state_bytes=strategy.placement.state_bytes(optimizer),
                          buffers=lambda: strategy.placement.gradient_buffers(model) + gathered(stages),
                          stages=stages, gathering=lambda: gather_buffers(stages))
        with meter.active():
            strategy.forward_backward(model, x, y)
            optimizer.step()
        peak[0], peak[1] = meter.peak, meter.parts

    seconds, peak = [], [0, {}]
    strategy.run(step, args=(xs, ys))   # warms up (pipeline shapes, buffers, the optimizer's state)
    if not timing:
        strategy.run(metered, args=(xs, ys))
        strategy.run(count, args=(xs, ys))
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        strategy.run(step, args=(xs, ys))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    optimizer.zero_grad(set_to_none=True)
    # the fastest step: another process's burst on a shared machine only ever slows a step down
    if timing:
        return {"seconds": min(seconds)}
    return {"seconds": min(seconds), "params": storage_bytes(model.parameters()),
            "grads": grads[0], "state": strategy.placement.state_bytes(optimizer), "peak": peak[0], "parts": peak[1]}


if __name__ == "__main__":
    main(*sys.argv[1:3])

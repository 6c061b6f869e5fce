"""Predicted step time and memory of a layout, from a profile and a measured network.

Step time, for a ``d x p x t`` layout with ``m`` micro-batches of ``rows = global_batch / (d m)``:

- each stage's time per micro-batch: its blocks' forward + backward (``fixed + per_row * rows``,
  from :mod:`.profile`; blocks a plan splits divided by ``t``; with
  recomputation, what a checkpointed forward and backward measured over a plain one in the profile), the model axis's all-reduces (the output of each ``"rowwise"`` layer in forward,
  the input gradient of each ``"colwise"`` one in backward), and the activations and their
  gradients sent to the next stage;
- the schedule: ``(m + p - 1)`` times the slowest stage's micro-batch (GPipe and 1F1B have the same
  bubble; 1F1B holds fewer activations);
- the data axis once per step: the gradients all-reduced (``None``, ZeRO-1, whose ranges are then
  all-gathered), reduce-scattered and the parameters all-gathered (ZeRO-2), or, under ZeRO-3, the
  parameters all-gathered in each micro-batch's forward and once for the backward (torch's pipeline
  stage keeps them whole until the schedule ends, as the measured memory shows -- or until a forward
  reshards them: under 1F1B each backward that follows a forward gathers them again) and the
  gradients reduce-scattered once;
- the optimizer's step over this process's parameters (its range under ZeRO).

Collectives of ``n`` processes over ``B`` bytes cost as a ring: ``2 (n - 1) (α + B / (n β))`` for an
all-reduce, half that for a reduce-scatter or an all-gather, ``α + B / β`` from one stage to the next
(``α``, ``β``: :class:`Network`, measured on the cluster). Compute is multiplied by how many
processes share a core (``oversubscription``: 1 on GPUs).

What this leaves out is what a framework costs per step on top: Python, DTensor's dispatch,
FSDP's hooks, the schedule's bookkeeping -- on a CPU often more than the arithmetic of a small
model. So the prediction is **calibrated by measurement**: of each mesh ``(d, p, t)`` the plainest
layout (no ZeRO stage, no recomputation, the fewest micro-batches) is measured first (:func:`probes`), and every other layout of that mesh is
predicted as ``model x measured / model`` of its probe (:func:`calibration`, :func:`calibrated`;
a mesh whose probe was not measured takes the median factor). The model ranks the layouts within
a mesh (ZeRO stage, recomputation, micro-batches, schedule), the probes rank the meshes.

Memory of pipe rank ``s``, at its step's peak: what it keeps between steps -- its parameters and
optimizer state (:func:`~.memory.model_states`), under a data axis without ZeRO-2/3 the packs of
summed gradients that ``.grad`` views -- plus what its schedule adds (:func:`~.memory.schedule_peak`):
the activations each block saves per micro-batch (the profile's bytes per row, the part a plan splits
divided by ``t``, the loss's on the last stage) for the micro-batches in flight (GPipe: all ``m``;
1F1B: ``min(m, p - s)``), the stage's input and output of each (where no block saves them), the
gradients its backward creates, and under ZeRO-3 the blocks' parameters gathered while they run and
the all-gather buffers FSDP keeps besides (each unit's parameters, rows padded to a multiple of ``d``).
With recomputation a micro-batch in flight holds only its input and output, and its backward saves
the whole stage's activations again.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from stratagem.experimental.planning.layouts import Layout
from stratagem.experimental.planning.memory import gather_bytes, model_states, schedule_peak
from stratagem.experimental.planning.profile import Profile


@dataclasses.dataclass(frozen=True)
class Network:
    """Latency ``alpha`` (s) and bandwidth ``beta`` (bytes/s) of the cluster's collectives; how many
    processes share a core (``oversubscription``, 1 when each has its own)."""

    alpha: float
    beta: float
    oversubscription: float = 1.0

    def all_reduce(self, nbytes: float, n: int) -> float:
        return 0.0 if n <= 1 else 2 * (n - 1) * (self.alpha + nbytes / (n * self.beta))

    def gather(self, nbytes: float, n: int) -> float:
        """An all-gather or a reduce-scatter of ``nbytes`` in all."""
        return 0.0 if n <= 1 else (n - 1) * (self.alpha + nbytes / (n * self.beta))

    def send(self, nbytes: float) -> float:
        return self.alpha + nbytes / self.beta


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the model says of one layout: seconds per step; the model states of the process that holds the
    most (exact), and ``activations``: what its step adds to them at the fullest process's peak (activations,
    gradients being summed, gathered parameters): ``memory``, their sum, is the predicted peak."""

    seconds: float
    parameters: float
    gradients: float
    optimizer_state: float
    activations: float

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def memory(self) -> float:
        return self.model_states + self.activations


def stage_bounds(profile: Profile, layout: Layout) -> list[tuple[int, int]]:
    """The blocks ``[a, b)`` of each stage of ``layout``."""
    starts = [0] + [profile.names.index(n) for n in layout.split_points]
    return list(zip(starts, starts[1:] + [len(profile.names)]))


def predict(profile: Profile, layout: Layout, network: Network, *, global_batch: int) -> Prediction:
    """Seconds per step and per-process memory of ``layout`` (the fullest process's).

    Example::

        from stratagem.experimental.planning.cost import Network, predict
        from stratagem.experimental.planning.layouts import Layout
        from stratagem.experimental.planning.profile import Profile
        p = Profile(names=["0"], sequential=True, rows=8, forward=[(0.0, 1e-3)], forward_backward=[(0.0, 3e-3)],
                    activation_bytes=[400.0], input_bytes=[40.0], output_bytes=[40.0], plan_traffic=[[]],
                    block_params={1: [1000.0]}, total_params=1000.0, element_size=4, state_per_parameter=8.0,
                    step_seconds_per_parameter=1e-8)
        plain = predict(p, Layout(2, 1, 1), Network(alpha=1e-4, beta=1e9), global_batch=8)
        zero1 = predict(p, Layout(2, 1, 1, sharding="optimizer"), Network(alpha=1e-4, beta=1e9), global_batch=8)
        assert zero1.optimizer_state == plain.optimizer_state / 2 == 4000.0
    """
    d, p, t, m = layout.data, layout.pipe, layout.model, layout.num_microbatches
    rows = global_batch / (d * m)
    params = profile.block_params[t]
    bounds = stage_bounds(profile, layout)
    stage_seconds, memory, inflights = [], [], []
    for s, (a, b) in enumerate(bounds):
        compute = 0.0
        for i in range(a, b):
            fixed, per_row = profile.forward_backward[i]
            block = fixed + per_row * rows
            if layout.recompute and profile.recompute_fixed < 0:   # (a profile without the measured overhead)
                block += profile.forward[i][0] + profile.forward[i][1] * rows
            compute += block / t if profile.plan_traffic[i] else block
        if layout.recompute and profile.recompute_fixed >= 0:
            compute += _recompute_seconds(profile, a, b, t, rows)
        traffic = sum(network.all_reduce((out if style == "rowwise" else inp) * rows, t)
                      for i in range(a, b) for style, inp, out in profile.plan_traffic[i]
                      if style in ("rowwise", "colwise"))
        sends = 0.0
        if s > 0:   # the activations in, their gradients back
            sends += 2 * network.send(profile.input_bytes[a] * rows)
        stage_seconds.append(compute * network.oversubscription + traffic + sends)
        inflight = m if layout.schedule == "gpipe" or p == 1 else min(m, p - s)
        inflights.append(inflight)
        psi = sum(params[a:b])
        states = model_states(psi, data=d, sharding=layout.sharding, element_size=profile.element_size,
                              state_per_parameter=profile.state_per_parameter)
        peak = _stage_peak(profile, layout, a, b, s, rows, inflight, states)
        memory.append((states, peak, psi))
    seconds = (m + p - 1) * max(stage_seconds)
    psi_max = max(psi for _, _, psi in memory)
    grad_bytes = profile.element_size * psi_max
    if layout.sharding is None:
        seconds += network.all_reduce(grad_bytes, d)
    elif layout.sharding == "optimizer":
        seconds += network.all_reduce(grad_bytes, d) + network.gather(grad_bytes, d)
    elif layout.sharding == "gradients":
        seconds += 2 * network.gather(grad_bytes, d)
    else:   # parameters gathered in each micro-batch's forward and for the backward (again after each forward
        # that resharded them: 1F1B's beyond the micro-batches in flight), gradients scattered once
        seconds += (m + m - min(inflights) + 2) * network.gather(grad_bytes, d)
    share = d if layout.sharding else 1
    seconds += profile.step_seconds_per_parameter * psi_max / share * network.oversubscription
    params_b, grads_b, state_b = max((states for states, _, _ in memory), key=sum)
    peak = max(held for _, held, _ in memory)
    return Prediction(seconds=seconds, parameters=params_b, gradients=grads_b, optimizer_state=state_b,
                      activations=peak - params_b - grads_b - state_b)


def _recompute_seconds(profile: Profile, a: int, b: int, t: int, rows: float) -> float:
    """What recomputing a stage's blocks ``[a, b)`` adds to a micro-batch: the profile's measured overhead of a
    checkpointed forward and backward over a plain one (its fixed part once, its part per row in the share
    of the model's forward that these blocks are; a split block's by ``t``) -- on a CPU far more than the
    one more forward it replays, for a small model (torch's checkpoint keeps and replays in Python)."""
    per_row = [profile.forward[i][1] / (t if profile.plan_traffic[i] else 1) for i in range(a, b)]
    total = sum(f[1] for f in profile.forward) or 1.0
    return profile.recompute_fixed + profile.recompute_per_row * rows * sum(per_row) / total


def _stage_peak(profile: Profile, layout: Layout, a: int, b: int, s: int, rows: float, inflight: int,
                states: tuple[float, float, float]) -> float:
    """Bytes at the peak of a step on pipe rank ``s`` (blocks ``[a, b)``): what it keeps between steps
    (parameters, optimizer state, under a data axis the packs of summed gradients) and what its
    schedule adds (:func:`~.memory.schedule_peak`)."""
    d, t, e = layout.data, layout.model, profile.element_size
    n, m, last = len(profile.names), layout.num_microbatches, b == len(profile.names)
    split = profile.activation_split_bytes or [0.0] * n
    saves_in, saves_out = profile.saves_input or [False] * n, profile.saves_output or [False] * n
    outs = profile.output_storage_bytes or profile.output_bytes
    ins = [profile.input_storage_bytes or profile.input_bytes[0], *outs[:-1]]   # what each block is given
    saved = [(profile.activation_bytes[i] - split[i] + split[i] / t) * rows for i in range(a, b)]
    if saves_in[a] and (a == 0 or not saves_out[a - 1]):   # the stage's input, where the profile counted it here
        saved[0] -= ins[a] * rows
    if saves_out[b - 1]:                                    # and its output: both apart, below
        saved[-1] -= outs[b - 1] * rows
    # the input of every micro-batch (the batch; a later stage's receive buffers) is there for the whole step,
    # and so is the output a stage sends under GPipe, or 1F1B with no micro-batch beyond those in flight (torch's
    # schedules hold the sends until then); otherwise a stage's output until the micro-batch's backward
    kept = ins[a] * rows * m
    sent = layout.pipe > 1 and not last and (layout.schedule == "gpipe" or m <= inflight)
    kept += outs[b - 1] * rows * m if sent else 0.0
    io = 0.0 if sent else outs[b - 1] * rows
    shard = d if layout.sharding == "parameters" else 1
    blocks = [e * q for q in profile.block_params[t][a:b]]
    parameters, gradients, state = states
    packs = gradients if d > 1 and layout.sharding in (None, "optimizer") else 0.0
    loss = profile.loss_bytes * rows if last else 0.0   # (freed as the micro-batch's backward begins)
    if shard == 1:
        return parameters + state + packs + kept + schedule_peak(
            saved, io, blocks, in_flight=inflight, microbatches=m, recompute=layout.recompute, released=loss)
    # ZeRO-3 (FSDP2 under torch's pipeline stage): in forward a block's parameters are whole while it runs,
    # counting what it saves of them (a layer whose input needs no gradient keeps none: the profile's bytes,
    # this process's share of a model axis's split); in backward each block is gathered again and, with its
    # whole gradient, stays so until the schedule ends (the stage reduce-scatters and reshards then) or, under
    # 1F1B, until the next forward reshards it (the gradient stays)
    whole = profile.block_params[1][a:b]
    gathered = [profile.saved_param_bytes[i] * q / w if w else 0.0
                for i, q, w in zip(range(a, b), profile.block_params[t][a:b], whole)] \
        if profile.saved_param_bytes else blocks
    # FSDP gathers each unit into one buffer, each parameter's rows padded to a multiple of d (the whole
    # parameters are copied out of it into storages as large; their gradients are not padded); a block made
    # of several units (a container looked through) at its largest unit's buffer
    units = profile.unit_rows.get(t)
    padded = [sum(gather_bytes(u, data=d, element_size=e) for u in units[i]) for i in range(a, b)] \
        if units else blocks
    staged = [max((gather_bytes(u, data=d, element_size=e) for u in units[i]), default=0.0) for i in range(a, b)] \
        if units else blocks
    return parameters + state + kept + schedule_peak(
        saved, io, [w + g for w, g in zip(padded, blocks)], in_flight=inflight, microbatches=m,
        recompute=layout.recompute, gathered=gathered, regathered=padded, staged=staged, released=loss)


def probes(ranked: list[Layout]) -> list[Layout]:
    """Of each mesh ``(d, p, t)`` in ``ranked`` (cheapest first), its plainest layout: what calibrates the mesh.

    Plainest: no ZeRO stage, no recomputation, the fewest micro-batches, 1F1B -- what the model's
    arithmetic describes best (a ZeRO stage's or recomputation's own overhead is then the model's
    delta on top); among equals, the cheapest predicted.

    Example::

        from stratagem.experimental.planning.cost import probes
        from stratagem.experimental.planning.layouts import Layout
        ranked = [Layout(2, 1, 1, sharding="gradients"), Layout(1, 2, 1, num_microbatches=2, schedule="1f1b"),
                  Layout(2, 1, 1)]
        assert probes(ranked) == [Layout(2, 1, 1), Layout(1, 2, 1, num_microbatches=2, schedule="1f1b")]
    """
    seen: dict[tuple[int, int, int], Layout] = {}
    for layout in sorted(ranked, key=lambda l: (l.sharding is not None, l.recompute, l.num_microbatches,
                                                 l.schedule != "1f1b")):   # stable: cheapest first among equals
        seen.setdefault((layout.data, layout.pipe, layout.model), layout)
    return list(seen.values())


def calibration(raw: dict[Layout, float], measured: dict[Layout, Any]) -> dict[tuple[int, int, int], float]:
    """Measured over predicted seconds of each mesh's probe (``measured``: seconds in a dict, or an error)."""
    return {(layout.data, layout.pipe, layout.model): got["seconds"] / raw[layout]
            for layout, got in measured.items() if isinstance(got, dict) and raw.get(layout)}


def calibrated(raw: dict[Layout, float], factors: dict[tuple[int, int, int], float], layout: Layout) -> float:
    """``layout``'s predicted seconds times its mesh's factor (the median factor where its mesh has none).

    Example::

        from stratagem.experimental.planning.cost import calibrated, calibration
        from stratagem.experimental.planning.layouts import Layout
        raw = {Layout(2, 1, 1): 1.0, Layout(2, 1, 1, sharding="optimizer"): 1.5, Layout(1, 2, 1): 2.0}
        factors = calibration(raw, {Layout(2, 1, 1): {"seconds": 3.0}})
        assert calibrated(raw, factors, Layout(2, 1, 1, sharding="optimizer")) == 4.5
        assert calibrated(raw, factors, Layout(1, 2, 1)) == 6.0   # no probe of its own: the median factor
    """
    mesh = (layout.data, layout.pipe, layout.model)
    factor = factors.get(mesh, statistics.median(factors.values()) if factors else 1.0)
    return raw[layout] * factor

"""``TensorBoard``: scalar summaries of training (loss, metrics, learning rate, speed), from the chief.

The layout is Keras's, so that dashboards read the same: ``log_dir/train`` holds
``epoch_loss``, ``epoch_<metric>``, ``epoch_learning_rate``, ``epoch_steps_per_second``
and ``epoch_samples_per_second`` (and ``batch_<name>`` every ``update_freq`` steps), and per
worker the median step of the epoch: ``epoch_step_seconds/worker_<i>``, its time in the
gradient exchange (``epoch_exchange_seconds/...``, from each pack's launch to its sum), the bytes
it exchanged (``epoch_exchange_bytes/...``), its wait in collectives and for input
(``epoch_collective_wait_seconds/...``, ``epoch_input_wait_seconds/...``); under a
``ParameterServerStrategy``, per worker the tensor bytes it pulled from and pushed to the
parameter servers per step and its seconds in ps calls per step (``epoch_ps_pull_bytes/worker_<i>``,
``epoch_ps_push_bytes/...``, ``epoch_ps_call_seconds/...``; a step is a scheduled function,
``steps_per_execution`` steps of ``fit``); ``log_dir/validation`` holds the ``val_`` values
under the same names (``epoch_loss`` ...), so TensorBoard draws training and validation on
one chart. Written with
``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package).
"""

from __future__ import annotations

import os
import time
from typing import Any

from stratagem.callbacks.base import Callback
from stratagem.callbacks.monitor import is_chief
from stratagem.callbacks.schedule import learning_rate
from stratagem.errors import InvalidArgumentError
from stratagem.keras.summaries import summary_writer, write_scalars
from stratagem.observe import record
from stratagem.observe.report import median

__all__ = ["TensorBoard"]


class TensorBoard(Callback):
    """Write scalar summaries for TensorBoard to ``log_dir`` (on the chief only).

    ``update_freq``: ``"epoch"`` writes once per epoch; ``"batch"`` or an int N also writes
    the batch logs every N steps (``batch_loss``, ..., the step counted over the whole
    run). Samples per second come from ``logs["samples_per_second"]`` when the training
    loop reports it, else from ``params["batch_size"]`` (global) and the epoch's steps.
    View with ``tensorboard --logdir LOG_DIR``. Across workers every worker must have the
    callback (as every worker runs the same ``fit``): at each epoch's end the workers' step times
    are gathered for the chief to write. Under a ``ParameterServerStrategy`` the coordinator
    writes each worker's ps traffic per step: the tensor bytes pulled (a push's reply that
    brings back the next step's values counts as pulled) and pushed, counted where the
    worker's ps client sends and receives, and the time at least one of its ps calls was in
    flight (``epoch_ps_pull_bytes/worker_<i>``, ``epoch_ps_push_bytes/worker_<i>``,
    ``epoch_ps_call_seconds/worker_<i>``; a worker that ran no step in an epoch gets none).

    Example::

        import os, tempfile, torch, stratagem as sg
        from types import SimpleNamespace
        module = torch.nn.Linear(2, 1)
        model = SimpleNamespace(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                strategy=sg.get_strategy())
        log_dir = tempfile.mkdtemp()
        board = sg.callbacks.TensorBoard(log_dir)
        board.set_model(model)
        board.on_train_begin()
        board.on_epoch_begin(0)
        board.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.6})
        board.on_train_end()
        assert sorted(os.listdir(log_dir)) == ["train", "validation"]
    """

    def __init__(self, log_dir: "str | os.PathLike" = "logs", update_freq: "str | int" = "epoch"):
        super().__init__()
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and (isinstance(update_freq, bool) or not isinstance(update_freq, int)
                                       or update_freq < 1):
            raise InvalidArgumentError(f"TensorBoard: update_freq must be 'epoch', 'batch' or a positive number of "
                                       f"steps, got {update_freq!r}")
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self._writers: dict[str, Any] = {}
        self._step = 0            # train steps since on_train_begin, for batch summaries
        self._epoch_started = 0.0
        self._epoch_steps = 0
        self._first_step = 0      # the step clock's number of the epoch's first step
        self._traffic: dict = {}  # the ps workers' traffic at the epoch's start (stratagem.ps.traffic)

    def _writer(self, name: str) -> Any:
        if name not in self._writers:
            self._writers[name] = summary_writer(os.path.join(self.log_dir, name))
        return self._writers[name]

    def reads_train_batch_logs(self) -> bool:
        return self.update_freq != "epoch"   # else it only counts the steps

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._step = 0
        record.count_steps()   # (cheap sums per step: the step times written per epoch)
        if is_chief(self.model):
            self._writer("train")   # fails now, not after an epoch, when tensorboard is missing

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_started = time.perf_counter()
        self._epoch_steps = 0
        self._first_step = record.steps_done()
        traffic = self._worker_traffic()
        self._traffic = traffic.totals() if traffic is not None else {}

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._step += 1
        self._epoch_steps += 1
        if self.update_freq != "epoch" and self._step % self.update_freq == 0 and is_chief(self.model):
            write_scalars(self._writer("train"), "batch_", dict(logs or {}), self._step)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        workers = self._worker_steps()   # (every worker: a collective across workers)
        if not is_chief(self.model):
            return
        logs = dict(logs or {})
        train = {name: value for name, value in logs.items() if not name.startswith("val_")}
        validation = {name[4:]: value for name, value in logs.items() if name.startswith("val_")}
        rate = learning_rate(self.model)
        if rate is not None:
            train["learning_rate"] = rate
        train.pop("lr", None)
        train.update(self._speed(logs))
        write_scalars(self._writer("train"), "epoch_", train, epoch)
        if validation:
            write_scalars(self._writer("validation"), "epoch_", validation, epoch)
        traffic = self._worker_traffic()
        per_step = traffic.per_step(self._traffic, traffic.totals()) if traffic is not None else {}
        for index, times in [*enumerate(workers), *per_step.items()]:
            write_scalars(self._writer("train"), "epoch_", {f"{name}/worker_{index}": value
                                                            for name, value in times.items()}, epoch)

    def _worker_traffic(self) -> Any:
        """Under a ParameterServerStrategy, its coordinator's sums of each worker's ps traffic
        (:class:`stratagem.ps.traffic.WorkerTraffic`); None under the other strategies."""
        coordinator = getattr(getattr(self.model, "strategy", None), "coordinator", None)
        return getattr(coordinator, "worker_traffic", None)

    def _worker_steps(self) -> list[dict[str, float]]:
        """Each worker's median step of this epoch and its parts (none before its first step)."""
        steps = [s for s in record.STEPS if s[0] >= self._first_step]
        mine = {} if not steps else {
            "step_seconds": median([s[1] for s in steps]), "input_wait_seconds": median([s[2] for s in steps]),
            "collective_wait_seconds": median([s[3] for s in steps]),
            "exchange_seconds": median([s[4] for s in steps]), "exchange_bytes": median([s[5] for s in steps])}
        strategy = getattr(self.model, "strategy", None)
        if strategy is None or strategy.topology.num_workers == 1:
            return [mine]
        return strategy.collective.all_gather_object(mine, "TensorBoard (the workers' step times)")

    def _speed(self, logs: dict) -> dict[str, float]:
        seconds = time.perf_counter() - self._epoch_started
        steps = self._epoch_steps or self.params.get("steps") or 0
        if not self._epoch_started or seconds <= 0 or not steps:
            return {}
        speed = {"steps_per_second": steps / seconds}
        if "samples_per_second" not in logs and self.params.get("batch_size"):
            speed["samples_per_second"] = steps * self.params["batch_size"] / seconds
        return speed

    def on_train_end(self, logs: dict | None = None) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

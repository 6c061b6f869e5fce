"""``Callback``: the hooks a training loop calls, with Keras's names and arguments.

A Keras-style ``fit`` calls every callback's hooks; a custom loop calls the ones it
needs. The model and the parameters of the run arrive first (``set_model``,
``set_params``); then ``on_train_begin``, per epoch ``on_epoch_begin`` / the batch hooks
/ ``on_epoch_end``, and ``on_train_end``. Evaluation and prediction have their own
``on_test_*`` and ``on_predict_*`` hooks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Callback"]


class Callback:
    """Base class of callbacks: every hook does nothing until a subclass overrides it.

    ``epoch`` counts from 0; ``batch`` is the step's index in its epoch; ``logs`` is a
    dict of metrics (or None): ``"loss"``, the metrics' names, and at the end of an epoch
    with validation data ``"val_loss"`` and ``"val_<metric>"``. ``self.model`` is the model
    being trained (``model.stop_training``, ``model.optimizer``, ``model.module``,
    ``model.strategy``); ``self.params`` holds ``"epochs"``, ``"steps"`` and ``"verbose"``.

    Example::

        import stratagem as sg

        class CountSteps(sg.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.steps = 0

            def on_train_batch_end(self, batch, logs=None):
                self.steps += 1

        counter = CountSteps()
        for batch in range(3):
            counter.on_train_batch_end(batch)
        assert counter.steps == 3
    """

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict = {}

    def set_model(self, model: Any) -> None:
        self.model = model

    def set_params(self, params: dict) -> None:
        self.params = params

    def reads_train_batch_logs(self) -> bool:
        """Whether this callback reads the ``logs`` of ``on_train_batch_end``.

        Across workers every step's logs cost a collective (the metrics' global values),
        so ``fit`` makes them only when some callback reads them. By default: when the
        subclass defines ``on_train_batch_end``. A callback that only counts steps there
        (or reads the logs only with some options) says so by overriding this.
        """
        return type(self).on_train_batch_end is not Callback.on_train_batch_end

    # ---------------------------------------------------------------- training

    def on_train_begin(self, logs: dict | None = None) -> None: ...

    def on_train_end(self, logs: dict | None = None) -> None: ...

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None: ...

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None: ...

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None: ...

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None: ...

    # -------------------------------------------------- evaluation, prediction

    def on_test_begin(self, logs: dict | None = None) -> None: ...

    def on_test_end(self, logs: dict | None = None) -> None: ...

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None: ...

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None: ...

    def on_predict_begin(self, logs: dict | None = None) -> None: ...

    def on_predict_end(self, logs: dict | None = None) -> None: ...

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None) -> None: ...

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None: ...

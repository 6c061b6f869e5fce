"""The callbacks of one ``fit`` / ``evaluate`` / ``predict`` call, and :class:`History`.

:class:`CallbackList` calls one hook on every callback, in the order given. A callback
needs only the hooks it uses: one it lacks (``on_test_begin`` on a callback written
before evaluation hooks existed, say) is skipped.
"""

from __future__ import annotations

from typing import Any, Iterable

from stratagem.callbacks import Callback

__all__ = ["CallbackList", "History"]


class History(Callback):
    """What ``fit`` returns: ``history[name]`` is the list of that log's value, one per epoch.

    Example::

        import torch, stratagem as sg
        model = sg.Model(torch.nn.Linear(2, 1))
        model.compile("sgd", "mse")
        history = model.fit(torch.ones(8, 2), torch.zeros(8, 1), epochs=2, verbose=0)
        assert history.epoch == [0, 1] and len(history.history["loss"]) == 2
    """

    def __init__(self) -> None:
        super().__init__()
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.epoch = []
        self.history = {}

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(value)


class CallbackList:
    """Calls a hook on every callback that has it, in order."""

    def __init__(self, callbacks: Iterable[Any], *, model: Any, params: dict) -> None:
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not callable(getattr(callback, "set_model", None)):
                raise TypeError(f"callbacks must be sg.callbacks.Callback objects (with set_model, "
                                f"on_epoch_end, ...), got {type(callback).__name__}")
            callback.set_model(model)
            set_params = getattr(callback, "set_params", None)
            if set_params is not None:
                set_params(dict(params))

    def call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)

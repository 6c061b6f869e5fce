"""``LambdaCallback``: a callback made of functions, Keras's way."""

from __future__ import annotations

from typing import Any, Callable

from stratagem.callbacks.base import Callback
from stratagem.errors import InvalidArgumentError

__all__ = ["LambdaCallback"]

_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
          "on_train_batch_end", "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
          "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end")
_ALIASES = {"on_batch_begin": "on_train_batch_begin", "on_batch_end": "on_train_batch_end"}


class LambdaCallback(Callback):
    """Calls the functions it is given at their hooks, with the hooks' arguments.

    ``on_epoch_begin(epoch, logs)``, ``on_train_batch_end(batch, logs)``,
    ``on_train_begin(logs)``, ...: any hook of :class:`Callback` by name (Keras's
    ``on_batch_begin`` / ``on_batch_end`` mean the training batch hooks).

    Example::

        import torch, stratagem as sg
        seen = []
        printer = sg.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(epoch))
        model = sg.Model(torch.nn.Linear(2, 1))
        model.compile("sgd", "mse")
        model.fit(torch.randn(8, 2), torch.randn(8, 1), epochs=2, verbose=0, callbacks=[printer])
        assert seen == [0, 1]
    """

    def __init__(self, **functions: Callable[..., Any]) -> None:
        super().__init__()
        self._functions: dict[str, Callable[..., Any]] = {}
        for name, function in functions.items():
            hook = _ALIASES.get(name, name)
            if hook not in _HOOKS:
                raise InvalidArgumentError(f"LambdaCallback has no hook {name!r}; the hooks are {', '.join(_HOOKS)}")
            if not callable(function):
                raise InvalidArgumentError(f"LambdaCallback({name}=...) needs a function, got {function!r}")
            self._functions[hook] = function

    def reads_train_batch_logs(self) -> bool:
        return "on_train_batch_end" in self._functions

    def _call(self, hook: str, *args: Any) -> None:
        function = self._functions.get(hook)
        if function is not None:
            function(*args)


def _make_hook(hook: str, takes_index: bool) -> Callable[..., None]:
    if takes_index:
        def method(self: LambdaCallback, index: int, logs: dict | None = None) -> None:
            self._call(hook, index, logs)
    else:
        def method(self: LambdaCallback, logs: dict | None = None) -> None:   # type: ignore[misc]
            self._call(hook, logs)
    method.__name__ = hook
    return method


for _hook in _HOOKS:
    setattr(LambdaCallback, _hook, _make_hook(_hook, _hook.startswith("on_epoch") or "batch" in _hook))

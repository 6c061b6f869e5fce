"""Keras's mixed-precision policies, for ``sg.Model.compile(..., mixed_precision=...)``.

A policy names the dtype the model computes in and the dtype its variables are kept in, as
``keras.mixed_precision.Policy`` does:

- ``"float32"`` (the default): no change; the module computes in its own dtype;
- ``"mixed_bfloat16"``: parameters stay float32; the forward passes of ``fit``, ``evaluate``
  and ``predict`` run under ``torch.autocast`` with bfloat16 on every replica;
- ``"mixed_float16"``: the same with float16, and the loss is scaled (a
  ``torch.amp.GradScaler`` created in the strategy's scope): float16's narrow range would
  make small gradients underflow to zero. A step whose gradients hold an inf or NaN on any
  replica or worker is skipped everywhere and the scale backs off.

The loss and the metrics are computed in float32 from the outputs, as Keras computes losses
in float32.

``set_global_policy`` is Keras's global knob: ``compile`` without ``mixed_precision=`` reads
the global policy at that moment (passing ``mixed_precision=`` to ``compile`` says the same
thing without a process-wide setting).

Example::

    import torch, stratagem as sg
    sg.mixed_precision.set_global_policy("mixed_bfloat16")
    print(sg.mixed_precision.global_policy())            # Policy('mixed_bfloat16')
    print(sg.mixed_precision.global_policy().compute_dtype)   # torch.bfloat16
    sg.mixed_precision.set_global_policy(None)           # back to "float32"
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from stratagem.errors import InvalidArgumentError

__all__ = ["Policy", "global_policy", "set_global_policy"]

#: policy name -> the dtype computation runs in
_COMPUTE_DTYPES = {"float32": None, "mixed_bfloat16": torch.bfloat16, "mixed_float16": torch.float16}


@dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: ``Policy("mixed_bfloat16")``, ``Policy("mixed_float16")`` or
    ``Policy("float32")`` (Keras's names).

    Example::

        import stratagem as sg
        policy = sg.mixed_precision.Policy("mixed_float16")
        print(policy.compute_dtype, policy.variable_dtype, policy.loss_scaling)
        # torch.float16 torch.float32 True
    """

    name: str

    def __post_init__(self) -> None:
        if self.name not in _COMPUTE_DTYPES:
            hint = ""
            if self.name in ("float16", "bfloat16", "float64"):
                hint = (f"; to keep the parameters themselves in {self.name}, convert the module "
                        f"(module.to(torch.{self.name})) before creating the optimizer")
            raise InvalidArgumentError(
                f"unknown mixed-precision policy {self.name!r}; use 'mixed_bfloat16', 'mixed_float16' "
                f"or 'float32'{hint}")

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype autocast computes in (None for ``"float32"``: the module's own dtype)."""
        return _COMPUTE_DTYPES[self.name]

    @property
    def variable_dtype(self) -> torch.dtype:
        """The dtype the parameters are kept in: float32 (or the module's own, for ``"float32"``)."""
        return torch.float32

    @property
    def loss_scaling(self) -> bool:
        """Whether training scales the loss (float16 only: bfloat16 has float32's range)."""
        return self.compute_dtype is torch.float16

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """``torch.autocast(device_type, dtype=compute_dtype)``; nothing for ``"float32"``."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def __repr__(self) -> str:
        return f"Policy({self.name!r})"


_global = Policy("float32")


def set_global_policy(policy: "Policy | str | None") -> None:
    """Set the policy ``sg.Model.compile`` uses when it is given no ``mixed_precision=``
    (``None``: back to ``"float32"``). Keras's ``keras.mixed_precision.set_global_policy``.

    Example::

        import stratagem as sg
        sg.mixed_precision.set_global_policy("mixed_float16")
        sg.mixed_precision.set_global_policy(None)
    """
    global _global
    _global = as_policy(policy)


def global_policy() -> Policy:
    """The policy ``compile`` uses by default (``Policy("float32")`` unless set).

    Example::

        import stratagem as sg
        print(sg.mixed_precision.global_policy().name)   # float32
    """
    return _global


def as_policy(policy: "Policy | str | None") -> Policy:
    """``policy`` as a :class:`Policy` (``None``: ``"float32"``)."""
    if policy is None:
        return Policy("float32")
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy(policy)
    raise InvalidArgumentError(f"a mixed-precision policy is a name ('mixed_bfloat16', 'mixed_float16', "
                               f"'float32') or an sg.mixed_precision.Policy, got {type(policy).__name__}")

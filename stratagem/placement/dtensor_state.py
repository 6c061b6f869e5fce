"""The state of modules and optimizers whose parameters are DTensors: whole outside, shards inside.

The mesh layouts -- tensor parallel (:mod:`.layout.tensor_parallel`), ZeRO-3
(:mod:`.layout.fully_sharded`), a pipeline's stages on a 3-D mesh (:mod:`.layout.pipeline`) -- hand
a model to torch's ``parallelize_module`` or ``fully_shard``, which replace its parameters by
DTensors: each process holds its shards. What a user saves and loads stays one logical copy, as
in plain PyTorch, whatever the layout; these helpers, shared by those layouts and by the data
axis's update rules over their shards (:mod:`.data_axis.local_update`,
:mod:`.data_axis.pipeline_optimizers`, :mod:`.data_axis.zero_ranges`), make it so and find the
memory each process holds.

Example::

    import torch
    from stratagem.placement.dtensor_state import full_value, local_tensor, replacements, parameters_before
    plain = torch.ones(2)
    assert full_value(plain) is plain and torch.equal(local_tensor(plain), plain)
    model = torch.nn.Linear(2, 2)
    before = parameters_before(model)
    old = model.weight
    model.weight = torch.nn.Parameter(torch.zeros(2, 2))
    assert replacements(model, before) == {id(old): (old, model.weight)}
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from stratagem.errors import InvalidArgumentError
from stratagem.values import is_dtensor


def full_value(value: Any) -> Any:
    """``value`` as a whole tensor (a DTensor's ``full_tensor``: a collective over its mesh), else itself."""
    return value.full_tensor() if is_dtensor(value) else value


def shard_like(value: Any, param: torch.Tensor) -> Any:
    """A full tensor from a state dict, cut like the DTensor ``param`` (each process keeps its shard);
    any other value (a step count, a tensor of another shape, ``param`` whole) as it is."""
    if is_dtensor(param) and isinstance(value, torch.Tensor) and not is_dtensor(value) \
            and tuple(value.shape) == tuple(param.shape):
        from torch.distributed.tensor import distribute_tensor   # (loaded: param is a DTensor)
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


def full_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """A state-dict post-hook: ``module``'s own DTensor entries made whole (``state_dict(keep_vars=True)``,
    which holds the parameters themselves, is left as placed)."""
    for key, value in list(state_dict.items()):
        if key.startswith(prefix) and "." not in key[len(prefix):] and is_dtensor(value) \
                and not isinstance(value, nn.Parameter):
            state_dict[key] = value.full_tensor()


def sharded_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """A load-state-dict pre-hook: the full tensors given for ``module``'s own DTensor parameters and
    buffers cut to this process's shards."""
    for name, param in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = shard_like(state_dict[key], param)


def hook_state_dicts(modules: Any) -> None:
    """Give each of ``modules`` that holds a DTensor parameter of its own the two hooks above."""
    for module in modules:
        if any(is_dtensor(t) for t in module.parameters(recurse=False)):
            module.register_state_dict_post_hook(full_state)
            module.register_load_state_dict_pre_hook(sharded_state)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The memory of this process's part of ``tensor`` (a DTensor's shard), without autograd."""
    with torch.no_grad():
        return (tensor.to_local() if is_dtensor(tensor) else tensor).detach()


def local_gradient(param: torch.Tensor) -> torch.Tensor:
    """This process's part of ``param.grad``, laid out as its part of ``param`` (torch gives a
    row-wise embedding a replicated gradient of a sharded weight: this process's rows of it)."""
    grad = param.grad
    if is_dtensor(grad) and is_dtensor(param) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    local = local_tensor(grad)
    if local.shape != local_tensor(param).shape:
        raise InvalidArgumentError(
            f"a gradient's part on this process has the shape {tuple(local.shape)}, its parameter's "
            f"{tuple(local_tensor(param).shape)}; sharding= over the data axis needs them alike (use sharding=None)")
    return local


def parameters_before(root: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """Every parameter of ``root`` by (id of its module, its name), before a placement replaces them."""
    return {(id(m), n): p for m in root.modules() for n, p in m._parameters.items() if p is not None}


@contextlib.contextmanager
def replacing(root: nn.Module, replaced: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Around the layout parts that place ``root`` in mesh order (a tensor-parallel plan, then FSDP2
    units): its modules that end with DTensor parameters get the state-dict hooks (whole outside),
    and ``replaced`` the parameters replaced (:func:`replacements`), for the optimizers given the
    parameters taken before."""
    before = parameters_before(root)
    yield
    hook_state_dicts(root.modules())
    replaced.update(replacements(root, before))


def replacements(root: nn.Module, before: dict[tuple[int, str], torch.Tensor]
                 ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """id(parameter in ``before``) -> (it, the parameter now in its place), for those replaced since."""
    replaced = {}
    for module in root.modules():
        for n, p in module._parameters.items():
            old = before.get((id(module), n))
            if old is not None and p is not old:
                replaced[id(old)] = (old, p)
    return replaced


def full_optimizer_state(optimizer: torch.optim.Optimizer, base: type) -> dict:
    """``base.state_dict`` of an optimizer over DTensor parameters, its state made whole (collectives)."""
    state = base.state_dict(optimizer)
    state["state"] = {k: {n: full_value(v) for n, v in s.items()} for k, s in state["state"].items()}
    return state


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, base: type, state_dict: dict) -> None:
    """``base.load_state_dict`` of a whole state dict, each process keeping its shards of the state."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = dict(state_dict)
    state["state"] = {k: {n: shard_like(v, params[int(k)]) for n, v in s.items()}
                      for k, s in state_dict["state"].items()}
    base.load_state_dict(optimizer, state)


def local_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-element optimizer state (moments, momentum; not step counters) this process
    holds for ``optimizer``: its shards (nothing for a stage held elsewhere, on ``meta``)."""
    return sum(local_tensor(v).numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0 and not v.is_meta)

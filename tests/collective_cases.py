"""Shared by the in-process and the multi-worker collective tests: global functions for gradcheck.

``gradcheck`` perturbs its input and calls the function once per perturbation, on every
replica in lockstep (each replica runs the same gradcheck). Each replica's own Jacobian
would mix the replicas' simultaneous perturbations, so the function checked is a *global*
one: every replica holds the same global ``x``; ``x`` passes through an all-reduce MEAN
(the identity in value, whose backward sums what every replica found), each replica
takes its own slice, applies the collective under test (with replica-dependent weights,
so that a wrong routing shows), and the outputs are all-gathered into one global ``Y``.
Every replica then computes the full Jacobian of ``Y(x)``, analytically through the
collectives' backward and numerically through their forward.
"""

from __future__ import annotations

import torch

import stratagem as sg

SLICE = 6  # elements of x per replica


def weights(r: int, k: int) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, k, dtype=torch.float64) * (r + 1)


def global_function(op: str):
    def f(x: torch.Tensor) -> torch.Tensor:
        ctx = sg.get_replica_context()
        n, r = ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group
        mine = ctx.all_reduce("mean", x).view(n, SLICE)[r] * weights(r, SLICE)
        if op == "all_reduce":
            y = ctx.all_reduce("sum", mine)
        elif op == "all_reduce_mean":
            y = ctx.all_reduce("mean", [mine, mine[:2] ** 2])[1]
        elif op == "all_gather_uneven":
            y = ctx.all_gather(mine[: 1 + r % 3].reshape(-1, 1) * 2, axis=0).reshape(-1)
        elif op == "all_gather_axis1":
            y = ctx.all_gather(mine.reshape(2, 3), axis=1).reshape(-1)
        elif op == "reduce_scatter":
            y = ctx.reduce_scatter("sum", mine[:5], axis=0)  # 5 rows: uneven over 2-4 replicas
        elif op == "reduce_scatter_mean":
            y = ctx.reduce_scatter("mean", mine.reshape(3, 2), axis=1).reshape(-1)
        elif op == "all_to_all":
            pieces = [mine[j % SLICE: j % SLICE + 1 + j % 2] * (j + 1) for j in range(n)]  # uneven sizes
            y = torch.cat(ctx.all_to_all(pieces))
        elif op == "broadcast":
            y = ctx.broadcast(mine, source_replica=n - 1) * weights(r, SLICE)
        else:
            raise ValueError(op)
        return ctx.all_gather(y.reshape(-1) * (r + 1), axis=0)
    return f


OPS = ["all_reduce", "all_reduce_mean", "all_gather_uneven", "all_gather_axis1", "reduce_scatter",
       "reduce_scatter_mean", "all_to_all", "broadcast"]


def gradcheck_all(num_replicas: int) -> dict[str, bool]:
    """In replica context: gradcheck every op's global function; every replica returns the same dict."""
    x = torch.linspace(-1.0, 1.0, num_replicas * SLICE, dtype=torch.float64).requires_grad_()
    return {op: torch.autograd.gradcheck(global_function(op), (x,), eps=1e-6, atol=1e-7, rtol=1e-6)
            for op in OPS}

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


# ------------------------------------------------------------ forward results against a reference

def replica_input(s: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Replica ``s``'s (uneven) input: ``s % 3 + 1`` rows of 2, values that name the replica."""
    return (torch.arange((s % 3 + 1) * 2, dtype=torch.float64).reshape(-1, 2) + 100 * s).to(dtype)


def check_all_collectives() -> list[str]:
    """In replica context: run every collective and compare with a reference built from every
    replica's input (each replica can compute them all). Returns what failed (empty: all fine)."""
    ctx = sg.get_replica_context()
    n, r = ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group
    inputs = [replica_input(s) for s in range(n)]
    same = [torch.full((5, 3), float(s + 1)) * torch.arange(15.0).reshape(5, 3) for s in range(n)]
    failures: list[str] = []

    def expect(name: str, got, want) -> None:
        try:
            if want is None:
                assert got is None, f"expected None, got {got!r}"
            elif isinstance(want, list):
                assert len(got) == len(want)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            else:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        except AssertionError as error:
            failures.append(f"replica {r}: {name}: {error}")

    total = sum(same[1:], same[0])
    expect("all_reduce sum", ctx.all_reduce("sum", same[r]), total)
    expect("all_reduce mean of ints", ctx.all_reduce("mean", torch.tensor([r])), torch.tensor([(n - 1) / 2]))
    expect("all_reduce of two dtypes", ctx.all_reduce("sum", [same[r], torch.tensor([r], dtype=torch.int64)]),
           [total, torch.tensor([n * (n - 1) // 2])])
    expect("all_gather uneven axis 0", ctx.all_gather(inputs[r], axis=0), torch.cat(inputs))
    expect("all_gather uneven axis 1", ctx.all_gather(inputs[r].t(), axis=1), torch.cat(inputs).t())
    expect("all_gather even", ctx.all_gather(same[r], axis=0), torch.cat(same))
    sizes = [5 // n + (1 if s < 5 % n else 0) for s in range(n)]
    start = sum(sizes[:r])
    expect("reduce_scatter uneven", ctx.reduce_scatter("sum", same[r], axis=0), total[start:start + sizes[r]])
    cols = [3 // n + (1 if s < 3 % n else 0) for s in range(n)]
    expect("reduce_scatter mean axis 1", ctx.reduce_scatter("mean", same[r], axis=1),
           (total / n)[:, sum(cols[:r]):sum(cols[:r + 1])])
    sends = [[torch.full((1 + (s + j) % 2, 2), float(10 * s + j)) for j in range(n)] for s in range(n)]
    expect("all_to_all", ctx.all_to_all(sends[r]), [sends[s][r] for s in range(n)])
    flat = torch.arange(float(n * 4)) + r
    expect("all_to_all of chunks", ctx.all_to_all(list(flat.chunk(n))),
           [(torch.arange(float(n * 4)) + s).chunk(n)[r] for s in range(n)])
    expect("broadcast", ctx.broadcast(inputs[r], source_replica=n - 1), inputs[n - 1])
    expect("reduce", ctx.reduce("sum", same[r], destination_replica=n // 2), total if r == n // 2 else None)
    pieces = [replica_input(j) * 2 for j in range(n)]
    expect("scatter", ctx.scatter(pieces if r == n - 1 else None, source_replica=n - 1), pieces[r])
    expect("gather", ctx.gather(inputs[r], axis=0, destination_replica=0), torch.cat(inputs) if r == 0 else None)
    return failures

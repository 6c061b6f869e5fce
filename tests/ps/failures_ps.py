"""Coordinator script for failure tests (run as the chief of `stratagem launch --ps ...`).

Modes:
  kill-worker    SIGKILL worker 1 while closures run: join() still completes every step
  stop-worker    SIGSTOP worker 1 while a closure runs on it: the closure moves elsewhere
  user-error     a step raises: join() re-raises it with a short remote traceback, others run;
                 then a ps refuses a step's push (a user's optimizer raises): the same, nested
  kill-ps        SIGKILL ps 0: UnavailableError naming it; restore from saved state dicts, continue
Writes OUT/report.json.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.ps.remote_value import RemoteValueStatus
from stratagem.testing import task_environments


def task_pid(task_type, index):
    """The pid of a local task of this job, found by its TF_CONFIG (test helper, Linux only)."""
    mine = json.loads(os.environ["TF_CONFIG"])["cluster"]
    for pid, env in task_environments().items():
        config = json.loads(env.get("TF_CONFIG", "{}"))
        if config.get("cluster") == mine and config["task"] == {"type": task_type, "index": index}:
            return pid
    raise LookupError(f"no {task_type} {index} process found")


def restarted_pid(task_type, index):
    try:
        return task_pid(task_type, index)
    except LookupError:   # between the old process and the new one
        return None


class GuardedSGD(torch.optim.SGD):
    """A user's optimizer, run on the ps: it refuses a gradient that is too large."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.abs().max() > 1e3:
                    raise ValueError("gradient too large: lower the learning rate or clip the gradients")
        return super().step(closure)


def wait_until(condition, seconds=120.0):
    """Waits for observable progress (never a fixed sleep); fails loudly past ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no progress in {seconds:.0f} s")
        time.sleep(0.05)


def workers_seen(coordinator, step, want, seconds=120.0):
    """Schedules short steps until every worker in ``want`` has run one; {worker: pid}."""
    pids = {}
    deadline = time.monotonic() + seconds
    while not want <= pids.keys():
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers {sorted(want - pids.keys())} ran nothing in {seconds:.0f} s")
        values = [coordinator.schedule(step, args=(0.05,)) for _ in range(4)]
        coordinator.join()
        for value in values:
            _, worker, pid = value.fetch()
            pids[worker] = pid
    return pids


def failure(error):
    """What the test checks of an error: its text, and the whole remote traceback."""
    return {"text": f"{type(error).__name__}: {error}",
            "remote_traceback": getattr(error, "remote_traceback", None)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode")
    args = parser.parse_args()
    report = {"mode": args.mode}

    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    coordinator = sg.ClusterCoordinator(strategy)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.tensor([[1.0, -2.0, 3.0, 0.5]])

    def step(delay):
        ran_on = os.environ["TF_CONFIG"]
        time.sleep(delay)
        x = torch.randn(16, 4)
        y = x @ target.T
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach(), json.loads(ran_on)["task"]["index"], os.getpid()

    def check_batch(x):
        if x.shape[0] != 16:
            raise ValueError("bad step on purpose")

    def bad_step():
        check_batch(torch.ones(3, 4))

    pids = workers_seen(coordinator, step, want={0, 1})
    report["worker_pids"] = pids

    if args.mode in ("kill-worker", "stop-worker"):
        values = [coordinator.schedule(step, args=(0.3,)) for _ in range(20)]
        wait_until(lambda: any(v.status == RemoteValueStatus.READY for v in values))
        os.kill(pids[1], signal.SIGKILL if args.mode == "kill-worker" else signal.SIGSTOP)
        started = time.time()
        coordinator.join()
        report["join_seconds"] = time.time() - started
        report["ran"] = [v.fetch()[1] for v in values]
        report["run_on_lane"] = ["run" in (w.client._lane.methods or {}) for w in coordinator._workers]
        if args.mode == "kill-worker":  # the launcher restarts it: it must get work again
            report["after_restart"] = sorted(workers_seen(coordinator, step, want={1}))
        else:
            os.kill(pids[1], signal.SIGCONT)
    elif args.mode == "user-error":
        good = [coordinator.schedule(step, args=(0.0,)) for _ in range(3)]
        bad = coordinator.schedule(bad_step)
        more = [coordinator.schedule(step, args=(0.0,)) for _ in range(3)]
        try:
            coordinator.join()
            report["raised"] = None
        except Exception as error:  # noqa: BLE001
            report["raised"] = failure(error)
        try:
            bad.fetch()
        except Exception as error:  # noqa: BLE001
            report["fetch_raised"] = failure(error)
        report["others_ran"] = all(v.fetch() is not None for v in good + more)
        with strategy.scope():
            guarded = nn.Linear(4, 1)
            guarded_optimizer = GuardedSGD(guarded.parameters(), lr=0.05)

        def huge_step():
            guarded_optimizer.zero_grad()
            (guarded(torch.ones(2, 4)).sum() * 1e6).backward()
            guarded_optimizer.step()

        coordinator.schedule(huge_step)
        try:
            coordinator.join()
            report["nested"] = None
        except Exception as error:  # noqa: BLE001
            report["nested"] = failure(error)
    elif args.mode == "kill-ps":
        saved_model = {k: v.clone() for k, v in model.state_dict().items()}
        saved_opt = optimizer.state_dict()
        report["saved_weight"] = saved_model["weight"].tolist()
        killed = task_pid("ps", 0)
        os.kill(killed, signal.SIGKILL)
        started = time.time()
        try:
            for _ in range(200):
                coordinator.schedule(step, args=(0.05,))
            coordinator.join()
            report["raised"] = None
        except sg.errors.UnavailableError as error:
            report["raised"] = str(error)
            report["task"] = error.task
        report["raise_seconds"] = time.time() - started
        # the launcher restarts the ps on the same address (the restore waits until it answers)
        wait_until(lambda: restarted_pid("ps", 0) not in (None, killed))
        report["ps_pids"] = [killed, restarted_pid("ps", 0)]
        model.load_state_dict(saved_model)
        optimizer.load_state_dict(saved_opt)
        report["restored_weight"] = model.weight.tolist()
        values = [coordinator.schedule(step, args=(0.0,)) for _ in range(150)]
        coordinator.join()
        report["final_loss"] = sum(v.fetch()[0].item() for v in values[-10:]) / 10
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""The rendezvous of a multi-node launch (stratagem/launch/rendezvous.py) as a state machine, in one
process: rounds forming, elastic settling, refusals, lost nodes, the restart budgets. The real
nodes (several launchers, network namespaces) are in test_nodes.py and test_nodes_netns.py."""

from __future__ import annotations

import time

import pytest

from stratagem.launch.nodes import parse_nnodes, read_token
from stratagem.launch.job_shape import JobShape
from stratagem.launch.rendezvous import Rendezvous
from stratagem.errors import ClusterConfigError, InvalidArgumentError

SHAPE = JobShape(max_nodes=2, workers_per_node=2, max_restarts=1)


def join(rdzv: Rendezvous, node: str, host: str, rank: int | None = None, *, shape: JobShape | None = None,
         first: bool = False, ports=(1, 2)) -> dict:
    return rdzv.join({"node": node, "host": host, "ports": list(ports), "rank": rank, "first": first,
                      "shape": (shape or rdzv.shape).as_dict()})


def test_a_round_forms_when_every_node_joined_in_rank_order() -> None:
    rdzv = Rendezvous(SHAPE)
    assert join(rdzv, "b", "10.0.0.2", 1, ports=(5, 6))["state"] == "wait"
    answer = join(rdzv, "a", "10.0.0.1", 0, ports=(3, 4))
    assert answer["state"] == "run" and answer["round"] == 0
    assert answer["cluster"] == {"worker": ["10.0.0.1:3", "10.0.0.1:4", "10.0.0.2:5", "10.0.0.2:6"]}
    assert answer["tasks"] == [("worker", 0), ("worker", 1)]
    assert rdzv.poll({"node": "b", "round": 0})["tasks"] == [("worker", 2), ("worker", 3)]


def test_the_host_comes_first_and_runs_the_chief_and_the_evaluator() -> None:
    rdzv = Rendezvous(JobShape(max_nodes=2, workers_per_node=1, chief=True, evaluator=1))
    join(rdzv, "b", "10.0.0.2", ports=(7,))
    answer = join(rdzv, "a", "10.0.0.1", first=True, ports=(1, 2, 3))
    assert answer["tasks"] == [("chief", 0), ("worker", 0), ("evaluator", 0)]
    assert answer["cluster"] == {"chief": ["10.0.0.1:1"], "worker": ["10.0.0.1:2", "10.0.0.2:7"],
                                 "evaluator": ["10.0.0.1:3"]}
    assert rdzv.poll({"node": "b", "round": 0})["tasks"] == [("worker", 1)]


def test_a_node_with_other_options_or_a_taken_rank_is_refused_naming_both() -> None:
    said: list[str] = []
    rdzv = Rendezvous(SHAPE, say=said.append)
    other = JobShape(max_nodes=3, workers_per_node=2, max_restarts=1)
    answer = join(rdzv, "x", "10.0.0.9", shape=other)
    assert answer["state"] == "refused"
    assert "max_nodes 3 on the node at 10.0.0.9, 2 on the rendezvous host" in answer["message"]
    assert rdzv.ended == (1, answer["message"])   # before the first round: the job cannot start
    rdzv = Rendezvous(SHAPE, say=said.append)
    join(rdzv, "a", "10.0.0.1", 0)
    taken = join(rdzv, "c", "10.0.0.3", 0)
    assert taken["state"] == "refused" and "--node-rank 0 is taken by the node at 10.0.0.1" in taken["message"]
    assert "out of range" in join(rdzv, "d", "10.0.0.4", 5)["message"]
    assert rdzv.ended is None   # a taken or wrong rank is this node's mistake alone
    # once the job ran, a node started otherwise is refused alone; the host says so
    join(rdzv, "b", "10.0.0.2", 1)
    assert join(rdzv, "y", "10.0.0.9", shape=other)["state"] == "refused"
    assert rdzv.ended is None and rdzv.poll({"node": "a", "round": 0})["state"] == "run"
    assert len(said) == 1 and said[0].startswith("refused a node: the node at 10.0.0.9 was started otherwise")


def test_every_option_the_script_and_its_arguments_are_compared_naming_both_values() -> None:
    def shape(grace: float, digest: str, args: tuple[str, ...] | None) -> JobShape:
        return JobShape(max_nodes=2, workers_per_node=1, script="train.py", script_digest=digest,
                        options=(("--grace-period", grace), ("--nnodes", "2"), ("--per-node-args", args is None)),
                        script_args=args)
    said: list[str] = []
    rdzv = Rendezvous(shape(30.0, "a" * 64, ("--lr", "0.1")), say=said.append)
    join(rdzv, "a", "10.0.0.1", 0, first=True, ports=(1,))
    answer = join(rdzv, "b", "10.0.0.2", 1, shape=shape(5.0, "b" * 64, ("--lr", "0.2")), ports=(1,))
    assert answer["state"] == "refused"
    assert "--grace-period 5 on node 1 (10.0.0.2), 30 on the rendezvous host" in answer["message"]
    assert ("the script's contents differ: train.py (sha256 bbbbbbbbbbbb) on node 1 (10.0.0.2), train.py "
            "(sha256 aaaaaaaaaaaa) on the rendezvous host") in answer["message"]
    assert ("the script's arguments differ: ['--lr', '0.2'] on node 1 (10.0.0.2), ['--lr', '0.1'] on the "
            "rendezvous host; give --per-node-args") in answer["message"]
    assert "--nnodes" not in answer["message"]
    told = rdzv.poll({"node": "a", "round": 0})   # every node hears it
    assert told == {"state": "failed", "status": 1, "message": answer["message"]}
    # with --per-node-args on both, the arguments may differ (the script may not)
    rdzv = Rendezvous(shape(30.0, "a" * 64, None))
    join(rdzv, "a", "10.0.0.1", 0, first=True, ports=(1,))
    assert join(rdzv, "b", "10.0.0.2", 1, shape=shape(30.0, "a" * 64, None), ports=(1,))["state"] == "run"
    refused = Rendezvous(shape(30.0, "a" * 64, None))
    answer = join(refused, "b", "10.0.0.2", 1, shape=shape(30.0, "a" * 64, ("--lr", "0.2")), ports=(1,))
    assert "--per-node-args not given on node 1 (10.0.0.2), given on the rendezvous host" in answer["message"]
    assert "arguments differ" not in answer["message"]


def test_a_failure_restarts_every_node_in_a_new_round_then_fails_the_job_when_no_restart_is_left() -> None:
    rdzv = Rendezvous(SHAPE)
    join(rdzv, "a", "10.0.0.1", 0)
    join(rdzv, "b", "10.0.0.2", 1)
    answer = rdzv.report({"node": "b", "round": 0, "event": "failed", "task": "worker 3", "code": -9,
                          "how": "was killed by SIGKILL"})
    assert answer["state"] == "restart" or answer["state"] == "wait"
    news = rdzv.poll({"node": "a", "round": 0})
    assert news["state"] == "restart" and news["round"] == 1
    assert news["message"] == ("worker 3 on node 1 (10.0.0.2) was killed by SIGKILL; restarting all 4 tasks "
                               "on 2 node(s) (restart 1/1)")
    # the survivor's own, later failure belongs to the old round: it spends nothing
    rdzv.report({"node": "a", "round": 0, "event": "failed", "task": "worker 0", "code": 1, "how": "exited with code 1"})
    join(rdzv, "a", "10.0.0.1", 0)
    assert join(rdzv, "b", "10.0.0.2", 1)["round"] == 1
    rdzv.report({"node": "a", "round": 1, "event": "failed", "task": "worker 1", "code": 3, "how": "exited with code 3"})
    end = rdzv.poll({"node": "b", "round": 1})
    assert end == {"state": "failed", "status": 3, "message": "worker 1 on node 0 (10.0.0.1) exited with code 3 "
                   "(after 1 restart(s)); the job failed"}


def test_a_preemption_spends_no_restart_and_the_job_is_done_when_every_node_is() -> None:
    rdzv = Rendezvous(JobShape(max_nodes=2, workers_per_node=1))
    join(rdzv, "a", "h1", 0, ports=(1,))
    join(rdzv, "b", "h2", 1, ports=(1,))
    rdzv.report({"node": "a", "round": 0, "event": "failed", "task": "worker 0", "code": 75, "how": "exited with code 75"})
    assert "preemption 1/100" in rdzv.poll({"node": "b", "round": 0})["message"]
    join(rdzv, "a", "h1", 0, ports=(1,))
    join(rdzv, "b", "h2", 1, ports=(1,))
    assert rdzv.report({"node": "a", "round": 1, "event": "done"})["state"] == "run"
    assert rdzv.ended is None
    assert rdzv.report({"node": "b", "round": 1, "event": "done"})["state"] == "done"
    assert rdzv.ended == (0, "every task of every node exited 0")
    assert not rdzv.ended_for_everyone()   # a has not heard it yet
    assert rdzv.poll({"node": "a", "round": 1})["state"] == "done"
    assert rdzv.ended_for_everyone()


def test_a_silent_node_is_lost_and_an_elastic_job_goes_on_with_the_others_without_waiting_for_it() -> None:
    rdzv = Rendezvous(JobShape(max_nodes=3, min_nodes=2, workers_per_node=1, max_restarts=1),
                      node_timeout=0.3, settle=60)
    for node, host in (("a", "h1"), ("b", "h2"), ("c", "h3")):
        join(rdzv, node, host, ports=(1,), first=node == "a")
    assert rdzv.poll({"node": "a", "round": 0})["cluster"]["worker"] == ["h1:1", "h2:1", "h3:1"]
    deadline = time.monotonic() + 5
    answer = {}
    while time.monotonic() < deadline:   # a and b keep polling; c is silent
        answer = rdzv.poll({"node": "a", "round": 0})
        rdzv.poll({"node": "b", "round": 0})
        if answer["state"] == "restart":
            break
        time.sleep(0.05)
    assert answer["state"] == "restart" and "node (h3) stopped answering" in answer["message"]
    join(rdzv, "a", "h1", ports=(2,), first=True)
    # b was the last node still in the job: the round forms without settling (60 s) for c
    assert join(rdzv, "b", "h2", ports=(2,)) | {"tasks": None} == {
        "state": "run", "round": 1, "cluster": {"worker": ["h1:2", "h2:2"]}, "tasks": None, "nodes": 2}
    # c comes back: it waits for the next restart instead of disturbing the running round
    assert join(rdzv, "c2", "h3", ports=(3,))["state"] == "wait"


def test_an_elastic_round_settles_for_a_node_it_has_not_heard_from_yet() -> None:
    rdzv = Rendezvous(JobShape(max_nodes=3, min_nodes=2, workers_per_node=1), node_timeout=60, settle=0.3)
    join(rdzv, "a", "h1", ports=(1,), first=True)
    assert join(rdzv, "b", "h2", ports=(1,))["state"] == "wait"   # the first round: a third may come
    deadline = time.monotonic() + 5
    while (answer := rdzv.poll({"node": "b", "round": 0}))["state"] == "wait":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert answer["cluster"] == {"worker": ["h1:1", "h2:1"]}


def test_a_node_whose_connection_closes_is_lost_at_once_unless_it_calls_again(monkeypatch) -> None:
    from stratagem.launch import rendezvous

    monkeypatch.setattr(rendezvous, "CLOSED_GRACE", 0.05)
    gone = {"value": False}
    rdzv = Rendezvous(JobShape(max_nodes=3, min_nodes=2, workers_per_node=1, max_restarts=1), node_timeout=600,
                      caller_gone=lambda: gone["value"])
    for node, host in (("a", "h1"), ("b", "h2"), ("c", "h3")):
        join(rdzv, node, host, ports=(1,), first=node == "a")
    gone["value"] = True
    assert rdzv.attend({"node": "b"}) == {"state": "gone"}   # b's connection closed, but b calls again
    time.sleep(0.1)
    rdzv.poll({"node": "b", "round": 0})
    assert rdzv.attend({"node": "c"}) == {"state": "gone"}   # c's closed for good
    time.sleep(0.1)
    answer = rdzv.poll({"node": "a", "round": 0})
    assert answer["state"] == "restart" and answer["message"] == (
        "node (h3) is gone: its launcher's connection to the rendezvous closed (the launcher died); "
        "restarting all 3 tasks on 3 node(s) (restart 1/1)")
    join(rdzv, "a", "h1", ports=(2,), first=True)
    assert join(rdzv, "b", "h2", ports=(2,))["cluster"] == {"worker": ["h1:2", "h2:2"]}   # at once


def test_a_rendezvous_that_never_completes_fails_naming_the_missing_nodes() -> None:
    rdzv = Rendezvous(JobShape(max_nodes=3, workers_per_node=1), rdzv_timeout=0.2, node_timeout=60)
    join(rdzv, "a", "10.0.0.1", 0, ports=(1,))
    join(rdzv, "b", "10.0.0.2", 2, ports=(1,))
    time.sleep(0.3)
    answer = rdzv.poll({"node": "a", "round": 0})
    assert answer["state"] == "failed" and answer["status"] == 1
    assert ("2 of 3 nodes joined (node 0 (10.0.0.1), node 2 (10.0.0.2)); missing: node-rank 1"
            in answer["message"])


def test_nnodes_and_the_token_are_checked(tmp_path) -> None:
    assert parse_nnodes("3") == (3, 3) and parse_nnodes("2:4") == (2, 4)
    for bad in ("0", "3:2", "x", "2:"):
        with pytest.raises(InvalidArgumentError, match="--nnodes must be N or MIN:MAX"):
            parse_nnodes(bad)
    with pytest.raises(ClusterConfigError, match="needs the cluster token on every node"):
        read_token(None, {})
    with pytest.raises(ClusterConfigError, match="STRATAGEM_CLUSTER_TOKEN"):
        read_token(None, {"STRATAGEM_CLUSTER_TOKEN": "secret"})   # weak
    path = tmp_path / "token"
    path.write_text("9f86d081884c7d659a2feaa0c55ad0159f86d081884c7d65\n")
    path.chmod(0o644)
    with pytest.raises(ClusterConfigError, match="can be read by other users.*chmod 600"):
        read_token(str(path), {})
    path.chmod(0o600)
    assert read_token(str(path), {}) == "9f86d081884c7d659a2feaa0c55ad0159f86d081884c7d65"


def test_every_option_of_the_command_line_but_the_per_node_ones_is_shared() -> None:
    from stratagem.launch.command import build_parser, shared_options
    from stratagem.launch.job_shape import PER_NODE_OPTIONS

    parser = build_parser()
    options = shared_options(parser.parse_args(["--nnodes", "2", "--node-rank", "1", "--host", "10.0.0.2",
                                                "--rdzv", "10.0.0.1:29400", "--token-file", "t", "train.py"]))
    assert not set(PER_NODE_OPTIONS) & set(options)
    for name in ("--grace-period", "--node-timeout", "--rdzv-timeout", "--join-timeout", "--evaluator-timeout",
                 "--max-restarts", "--max-preemptions", "--workers", "--chief", "--evaluator", "--nnodes",
                 "--per-node-args"):
        assert name in options
    usage = parser.format_usage()
    for name in (*options, *PER_NODE_OPTIONS):   # each name is the command line's own
        assert f"[{name}" in usage, name

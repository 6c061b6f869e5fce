"""In one process, every misuse fails early with an error that names the problem and the fix."""

import inspect
import sys

import pytest
import torch

import stratagem as sg
from stratagem import errors
from stratagem.devices import parse_device
from stratagem.errors import ContextError, InvalidArgumentError, InvalidDeviceError, StratagemError
from stratagem.testing import run_task

pytestmark = pytest.mark.timeout(60)


def mirrored(n):
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def rid():
    return sg.get_replica_context().replica_id_in_sync_group


def test_every_error_class_subclasses_stratagem_error():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) >= 8
    for cls in classes:
        assert issubclass(cls, StratagemError), cls
        if cls is not StratagemError:
            assert issubclass(cls, (ValueError, RuntimeError, ImportError)), cls   # ImportError: a missing package
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(InvalidDeviceError, ValueError)
    assert issubclass(ContextError, RuntimeError)
    assert issubclass(errors.CollectiveMismatchError, RuntimeError)
    assert issubclass(errors.UnavailableError, RuntimeError)


# ----------------------------------------------------------------------- devices

def test_unknown_device_kind_lists_the_available_devices():
    with pytest.raises(InvalidDeviceError, match=r"unknown device kind 'tpu'.*Available: .*cpu") as info:
        sg.MirroredStrategy(["tpu:0"])
    assert isinstance(info.value, StratagemError) and isinstance(info.value, ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda:0", "cuda", "/gpu:0", "GPU:0", "/device:GPU:1",
                                    "/job:worker/replica:0/task:0/device:GPU:0", torch.device("cuda", 0)])
def test_cuda_device_on_a_cpu_machine_is_unavailable(device):
    with pytest.raises(InvalidDeviceError, match=r"not available.*no CUDA device.*'cpu:0', 'cpu:1'"):
        sg.MirroredStrategy([device])
    with pytest.raises(InvalidDeviceError, match="not available"):
        sg.OneDeviceStrategy(device)


def test_cuda_device_beyond_the_visible_ones_lists_them():
    count = torch.cuda.device_count()
    with pytest.raises(InvalidDeviceError, match=f"cuda:{count + 3}.*not available"):
        parse_device(f"cuda:{count + 3}")


def test_empty_device_list():
    for empty in ([], ()):
        with pytest.raises(InvalidDeviceError, match="device list is empty.*devices=\\["):
            sg.MirroredStrategy(empty)


@pytest.mark.parametrize("devices", [["cpu:0", "cpu:0"], ["cpu", "/cpu:0"], ["cpu:1", "CPU:1"],
                                     ["cpu:0", "/job:localhost/replica:0/task:0/device:CPU:0"]])
def test_duplicate_devices(devices):
    with pytest.raises(InvalidDeviceError, match="appears twice.*distinct logical CPU devices"):
        sg.MirroredStrategy(devices)


@pytest.mark.parametrize("spec", ["cpu:x", "", "cpu:-1", "gpu0", "cpu:1:2", "/job:worker/task:0",
                                  "device:", "cpu 1"])
def test_malformed_device_strings(spec):
    with pytest.raises(InvalidDeviceError, match="cannot parse device.*available"):
        sg.MirroredStrategy([spec])


@pytest.mark.parametrize("spec", [5, None, 1.0, ["cpu:0"]])
def test_device_of_the_wrong_type(spec):
    with pytest.raises(InvalidDeviceError, match="must be a string or torch.device"):
        sg.OneDeviceStrategy(spec)


@pytest.mark.parametrize("spec, expected", [
    ("cpu", "cpu:0"), ("cpu:3", "cpu:3"), ("CPU:1", "cpu:1"), ("/cpu:2", "cpu:2"), ("/CPU:0", "cpu:0"),
    ("/device:CPU:2", "cpu:2"), ("device:cpu:4", "cpu:4"), (" cpu:1 ", "cpu:1"),
    ("/job:worker/replica:0/task:1/device:CPU:1", "cpu:1"), ("/job:localhost/device:CPU:5", "cpu:5"),
    ("/replica:0/task:0/device:CPU:0", "cpu:0"), (torch.device("cpu"), "cpu:0"),
    (torch.device("cpu", 2), "cpu:2"),
])
def test_tensorflow_and_pytorch_device_spellings_parse(spec, expected):
    assert str(parse_device(spec)) == expected
    assert parse_device(spec).torch_device == torch.device("cpu")


def test_tensorflow_spellings_make_a_strategy():
    strategy = sg.MirroredStrategy(["/cpu:0", "/job:localhost/replica:0/task:0/device:CPU:1", "CPU:2"])
    assert strategy.worker_devices == ("cpu:0", "cpu:1", "cpu:2")
    assert strategy.num_replicas_in_sync == 3
    assert sg.OneDeviceStrategy("/cpu:0").worker_devices == ("cpu:0",)


# ---------------------------------------------------------------- cross-device ops and options

def test_bad_cross_device_ops_and_communication_options():
    with pytest.raises(InvalidArgumentError, match="NcclAllReduce needs CUDA"):
        sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=sg.NcclAllReduce())
    with pytest.raises(InvalidArgumentError, match="cross_device_ops must be"):
        sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=sg.HierarchicalCopyAllReduce)
    with pytest.raises(InvalidArgumentError, match="num_packs"):
        sg.HierarchicalCopyAllReduce(num_packs=0)
    with pytest.raises(InvalidArgumentError, match="implementation must be one of"):
        sg.CommunicationOptions(implementation="gloo")
    with pytest.raises(InvalidArgumentError, match="bytes_per_pack"):
        sg.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(InvalidArgumentError, match="timeout_seconds"):
        sg.CommunicationOptions(timeout_seconds=0)
    assert sg.CommunicationOptions(implementation="ring").implementation is sg.CommunicationImplementation.RING


# ------------------------------------------------------------------ reduce / values

def test_reduce_op_max():
    with pytest.raises(InvalidArgumentError, match="unsupported reduce op 'max'.*ReduceOp.SUM"):
        mirrored(2).reduce("max", 1.0)
    with pytest.raises(InvalidArgumentError, match="unsupported reduce op"):
        mirrored(2).run(lambda: sg.get_replica_context().all_reduce("max", 1.0))


def test_reduce_and_collectives_of_values_that_are_not_numbers():
    strategy = mirrored(2)
    with pytest.raises(InvalidArgumentError, match="NoneType leaf"):
        strategy.reduce("sum", {"loss": torch.ones(1), "extra": None})
    with pytest.raises(InvalidArgumentError, match="str leaf"):
        strategy.gather(["text"], axis=0)
    with pytest.raises(InvalidArgumentError, match="collectives combine tensors and numbers, got a str"):
        strategy.run(lambda: sg.get_replica_context().all_reduce("sum", "text"))


def test_reduce_in_replica_context():
    strategy = mirrored(2)
    with pytest.raises(ContextError, match=r"strategy.reduce\(\) must be called in cross-replica context"):
        strategy.run(lambda: strategy.reduce("sum", 1.0))
    with pytest.raises(ContextError, match="cross-replica context"):
        strategy.run(lambda: strategy.experimental_distribute_dataset([torch.ones(2)]))


def test_per_replica_from_another_strategy():
    first, second = mirrored(2), mirrored(2)
    value = first.run(lambda: torch.tensor(float(rid())))
    with pytest.raises(InvalidArgumentError, match="produced by another strategy") as info:
        second.reduce("sum", value)
    assert isinstance(info.value, StratagemError)
    with pytest.raises(InvalidArgumentError, match="another strategy"):
        second.run(lambda x: x, args=({"nested": [value]},))


def test_get_per_replica_batch_size_not_divisible():
    with pytest.raises(InvalidArgumentError, match="not divisible") as info:
        sg.InputContext(num_replicas_in_sync=4).get_per_replica_batch_size(10)
    assert isinstance(info.value, ValueError)


# ------------------------------------------------------------------------- run

@pytest.mark.parametrize("fn", [None, 3, "train_step"])
def test_run_with_a_non_callable(fn):
    with pytest.raises(InvalidArgumentError, match="strategy.run needs a callable"):
        mirrored(2).run(fn)


def test_run_with_args_that_are_not_a_sequence():
    with pytest.raises(InvalidArgumentError, match=r"args=\(x,\)"):
        mirrored(2).run(lambda x: x, args=torch.ones(2))


@pytest.mark.parametrize("failing", [0, 1])
def test_user_exception_keeps_its_type_and_names_the_replica(failing):
    strategy = mirrored(2)

    class Custom(Exception):
        pass

    def fn():
        if rid() == failing:
            raise Custom("bad data")
        return rid()

    with pytest.raises(Custom, match="bad data") as info:
        strategy.run(fn)
    notes = getattr(info.value, "__notes__", [])
    assert any(f"replica {failing}" in note and f"cpu:{failing}" in note for note in notes), notes
    assert strategy.experimental_local_results(strategy.run(rid)) == (0, 1)  # the strategy recovers


def test_user_exception_in_every_replica_is_reported_once():
    strategy = mirrored(3)

    def fn():
        raise IndexError(f"replica says {rid()}")

    with pytest.raises(IndexError, match="replica says 0") as info:
        strategy.run(fn)
    assert len(getattr(info.value, "__notes__", [])) == 1


def test_user_exception_in_a_single_replica_keeps_its_type():
    with pytest.raises(KeyError):
        sg.OneDeviceStrategy("cpu").run(lambda: {}["missing"])


# -------------------------------------------------------------- modules and optimizers

def test_module_created_outside_the_scope_used_in_a_multi_replica_run():
    strategy = mirrored(2)
    model = torch.nn.Linear(3, 1)  # no scope: one copy that both replicas would share
    with pytest.raises(ContextError, match="'weight', 'bias'.*created outside strategy.scope().*Create the module") as info:
        strategy.run(lambda: model(torch.ones(1, 3)))
    assert isinstance(info.value, StratagemError)
    # a parameter-free module is fine, and so is the same model with one replica
    relu = torch.nn.ReLU()
    assert strategy.experimental_local_results(strategy.run(lambda: relu(torch.ones(1)).item())) == (1.0, 1.0)
    assert sg.OneDeviceStrategy("cpu").run(lambda: model(torch.ones(1, 3)).shape) == (1, 1)


OPTIMIZER_OUTSIDE = """
import sys, torch, torch.nn.functional as F
from torch import nn
import stratagem as sg
strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)     # outside the scope
data = [(torch.randn(64, 8), torch.randint(0, 2, (64,)))] * 4
def step(batch, zero_first):
    x, y = batch
    if zero_first:   # the usual order: its zero_grad would race the other replica's backward
        optimizer.zero_grad()
    sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
    optimizer.step()
for zero_first in (True, False):
    for _ in range(3):
        try:
            for batch in strategy.experimental_distribute_dataset(data):
                strategy.run(step, args=(batch, zero_first))
            print("TRAINED")
        except sg.errors.ContextError as error:
            print("REFUSED", str(error).replace("\\n", " "))
# outside run, and for an optimizer in scope, nothing changes
optimizer.zero_grad()
with strategy.scope():
    scoped = torch.optim.SGD(model.parameters(), lr=0.1)
for batch in strategy.experimental_distribute_dataset(data):
    strategy.run(lambda b: (scoped.zero_grad(), sg.nn.compute_average_loss(
        F.cross_entropy(model(b[0]), b[1], reduction="none")).backward(), scoped.step()), args=(batch,))
print("SCOPED OK")
"""


@pytest.mark.multiprocess
def test_optimizer_created_outside_the_scope_is_refused_in_a_multi_replica_run():
    # it used to train silently wrong (the replicas drifted apart), and its zero_grad on one
    # replica's thread could crash the interpreter inside another's backward: a subprocess
    proc = run_task([sys.executable, "-c", OPTIMIZER_OUTSIDE], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    refused = [line for line in lines if line.startswith("REFUSED")]
    assert len(refused) == 6, proc.stdout
    assert all("SGD was created outside strategy.scope()" in line and "Create the optimizer inside" in line
               for line in refused), refused[0]
    assert lines[-1] == "SCOPED OK"


def test_parameter_assigned_after_the_scope_closed_is_refused_by_name():
    strategy = mirrored(2)

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.fc(x) * getattr(self, "scale", 1.0)

    with strategy.scope():
        model = Scaled()
    model.scale = torch.nn.Parameter(torch.ones(1))    # after the scope: no copy per replica
    with pytest.raises(ContextError, match="Scaled has parameters with no copy per replica \\('scale'\\).*"
                                           "assigned to it after the scope closed"):
        strategy.run(lambda: model(torch.ones(1, 3)))
    # a parameter registered on a module whose parameters are mirrored gets its copies at once
    model = None
    with strategy.scope():
        layer = torch.nn.Linear(3, 1)
    layer.register_parameter("extra", torch.nn.Parameter(torch.ones(1)))
    copies = strategy.experimental_local_results(strategy.run(lambda: layer.extra))
    assert copies[0] is not copies[1] and all(torch.equal(c, torch.ones(1)) for c in copies)


def test_module_created_outside_the_scope_inside_a_scoped_container():
    strategy = mirrored(2)
    outside = torch.nn.Linear(3, 3)
    with strategy.scope():
        model = torch.nn.Sequential(outside, torch.nn.Linear(3, 1))
    results = None
    try:
        results = strategy.run(lambda: model(torch.ones(1, 3)))
    except ContextError as error:
        assert "outside strategy.scope()" in str(error)
    if results is not None:
        # if accepted, the outer module must really be mirrored: replicas see their own copy
        copies = strategy.experimental_local_results(outside.weight)
        assert len(copies) == 2 and copies[0] is not copies[1]


def test_module_of_another_strategy_used_in_run():
    first, second = mirrored(2), mirrored(2)
    with first.scope():
        model = torch.nn.Linear(2, 1)
    with pytest.raises(ContextError, match="use each module only with the strategy it was created under"):
        second.run(lambda: model(torch.ones(1, 2)))


def test_optimizer_in_scope_over_parameters_of_an_unscoped_model():
    strategy = mirrored(2)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(InvalidArgumentError, match="not created in that scope.*inside `with strategy.scope\\(\\):`"):
        with strategy.scope():
            torch.optim.SGD(model.parameters(), lr=0.1)


def test_optimizer_step_with_a_closure():
    strategy = mirrored(2)
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    with pytest.raises(InvalidArgumentError, match=r"step\(closure\) is not supported.*loss.backward\(\)"):
        strategy.run(lambda: optimizer.step(closure))
    with pytest.raises(InvalidArgumentError, match=r"step\(closure\) is not supported"):
        optimizer.step(closure)


# ---------------------------------------------------------------------- contexts

def test_context_misuse():
    first, second = mirrored(2), sg.OneDeviceStrategy("cpu")
    with pytest.raises(ContextError, match="cannot be constructed"):
        type(sg.get_strategy())()
    with first.scope():
        with pytest.raises(ContextError, match="cannot enter the scope"):
            with second.scope():
                pass  # pragma: no cover
    with pytest.raises(ContextError, match="runs of one strategy cannot nest"):
        first.run(lambda: sg.get_replica_context().merge_call(lambda s: s.run(lambda: 1)))


def test_one_replica_strategy_names_the_replica_in_user_errors():
    with pytest.raises(KeyError) as info:
        sg.OneDeviceStrategy("cpu").run(lambda: {}["k"])
    assert any("replica 0" in note for note in info.value.__notes__)

"""Input distribution and the loss helpers, in one process."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import stratagem as sg
from stratagem.data import DistributedDataset
from stratagem.devices import parse_devices
from stratagem.errors import InvalidArgumentError, StratagemError

pytestmark = pytest.mark.timeout(60)


def mirrored(n):
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def local(strategy, value):
    return strategy.experimental_local_results(value)


def rows(strategy, value):
    """Each replica's component as a list (of rows)."""
    return [t.tolist() for t in local(strategy, value)]


# ------------------------------------------------------------ experimental_distribute_dataset

def test_list_of_tensors_is_split_into_contiguous_slices():
    strategy = mirrored(2)
    data = [torch.arange(8).reshape(4, 2), torch.arange(8, 16).reshape(4, 2)]
    batches = list(strategy.experimental_distribute_dataset(data))
    assert len(batches) == 2
    assert all(isinstance(b, sg.PerReplica) for b in batches)
    assert rows(strategy, batches[0]) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert rows(strategy, batches[1]) == [[[8, 9], [10, 11]], [[12, 13], [14, 15]]]
    for batch in batches:
        for component, device in zip(local(strategy, batch), strategy.worker_devices):
            assert component.device == torch.device("cpu")


def test_dataloader_batches_keep_their_structure_and_split_unevenly():
    strategy = mirrored(4)
    x, y = torch.arange(13.0).reshape(13, 1), torch.arange(13)
    loader = DataLoader(TensorDataset(x, y), batch_size=5)  # batches of 5, 5, 3
    seen_x, seen_y, sizes = [], [], []
    for batch in strategy.experimental_distribute_dataset(loader):
        bx, by = batch
        assert isinstance(batch, list) and isinstance(bx, sg.PerReplica)
        sizes.append([t.shape[0] for t in local(strategy, bx)])
        seen_x.extend(v for t in local(strategy, bx) for v in t.flatten().tolist())
        seen_y.extend(v for t in local(strategy, by) for v in t.tolist())
    assert sizes == [[2, 1, 1, 1], [2, 1, 1, 1], [1, 1, 1, 0]]
    assert seen_x == x.flatten().tolist() and seen_y == y.tolist()  # nothing lost, nothing repeated


def test_five_rows_over_four_replicas_is_two_one_one_one():
    strategy = mirrored(4)
    batch = next(iter(strategy.experimental_distribute_dataset([torch.arange(5)])))
    assert rows(strategy, batch) == [[0, 1], [2], [3], [4]]


def test_two_rows_over_three_replicas_leave_one_replica_empty_but_in_the_step():
    strategy = mirrored(3)
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = strategy.experimental_distribute_dataset([torch.ones(2, 3)])
    batch = next(iter(data))
    shapes = [tuple(t.shape) for t in local(strategy, batch)]
    assert shapes == [(1, 3), (1, 3), (0, 3)]

    def step(x):
        ctx = sg.get_replica_context()
        out = model(x)
        loss = sg.nn.compute_average_loss(out.squeeze(1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # every replica, the empty one too, takes part in the gradient sum
        total = ctx.all_reduce("sum", x.shape[0])
        return ctx.replica_id_in_sync_group, total, out.shape[0]

    ids, totals, out_rows = strategy.run(step, args=(batch,))
    assert local(strategy, ids) == (0, 1, 2)
    assert totals == 2
    assert local(strategy, out_rows) == (1, 1, 0)
    copies = local(strategy, model.weight)
    assert all(torch.equal(copies[0], c) for c in copies[1:])


class Numbers:
    """A re-iterable whose iterator is a generator."""

    def __init__(self, num_batches):
        self.num_batches = num_batches
        self.epochs = 0

    def __iter__(self):
        self.epochs += 1
        for i in range(self.num_batches):
            yield torch.full((4, 1), float(i))


def test_generator_backed_iterable_and_reiteration_starts_a_new_epoch():
    strategy = mirrored(2)
    source = Numbers(3)
    data = strategy.experimental_distribute_dataset(source)
    first = [rows(strategy, b) for b in data]
    second = [rows(strategy, b) for b in data]
    assert first == second == [[[[float(i)]] * 2] * 2 for i in range(3)]
    assert source.epochs == 2


def test_iter_next_and_stop_iteration():
    strategy = mirrored(2)
    data = strategy.experimental_distribute_dataset([torch.zeros(2), torch.ones(2)])
    it = iter(data)
    assert rows(strategy, next(it)) == [[0.0], [0.0]]
    assert rows(strategy, it.get_next()) == [[1.0], [1.0]]
    with pytest.raises(StopIteration):
        next(it)
    # a fresh iterator starts over, independent of the exhausted one
    assert rows(strategy, next(iter(data))) == [[0.0], [0.0]]


def test_numpy_arrays_become_tensors():
    strategy = mirrored(2)
    batch = (np.arange(6, dtype=np.float32).reshape(3, 2), np.array([0, 1, 2]))
    x, y = next(iter(strategy.experimental_distribute_dataset([batch])))
    assert all(isinstance(t, torch.Tensor) for t in local(strategy, x) + local(strategy, y))
    assert rows(strategy, x) == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0]]]
    assert local(strategy, x)[0].dtype == torch.float32
    assert rows(strategy, y) == [[0, 1], [2]]


def test_dict_batches_and_values_without_a_batch_dimension():
    strategy = mirrored(2)
    batch = {"image": torch.arange(4.0).reshape(4, 1), "label": torch.tensor([0, 1, 0, 1]), "epoch": 7}
    out = next(iter(strategy.experimental_distribute_dataset([batch])))
    assert isinstance(out, dict) and list(out) == ["image", "label", "epoch"]
    assert rows(strategy, out["image"]) == [[[0.0], [1.0]], [[2.0], [3.0]]]
    assert rows(strategy, out["label"]) == [[0, 1], [0, 1]]
    assert local(strategy, out["epoch"]) == (7, 7)

    def step(b):
        return b["image"].sum() + b["epoch"]

    assert [t.item() for t in local(strategy, strategy.run(step, args=(out,)))] == [8.0, 12.0]


def test_dataloader_of_dicts():
    class Rows(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return {"x": torch.tensor([float(i)]), "y": i}

    strategy = mirrored(3)
    batches = list(strategy.experimental_distribute_dataset(DataLoader(Rows(), batch_size=6)))
    assert len(batches) == 1
    assert rows(strategy, batches[0]["x"]) == [[[0.0], [1.0]], [[2.0], [3.0]], [[4.0], [5.0]]]
    assert rows(strategy, batches[0]["y"]) == [[0, 1], [2, 3], [4, 5]]


def test_one_replica_yields_plain_batches():
    for strategy in (mirrored(1), sg.OneDeviceStrategy("cpu")):
        batch = next(iter(strategy.experimental_distribute_dataset([(torch.ones(3, 2), np.zeros(3))])))
        assert isinstance(batch, tuple) and isinstance(batch[0], torch.Tensor)
        assert batch[0].shape == (3, 2) and isinstance(batch[1], torch.Tensor)


def test_auto_shard_policy_off_in_one_process_splits_among_local_replicas():
    strategy = mirrored(2)
    data = [torch.arange(5)]
    for policy in sg.AutoShardPolicy:
        options = sg.InputOptions(auto_shard_policy=policy)
        batch = next(iter(strategy.experimental_distribute_dataset(data, options=options)))
        assert rows(strategy, batch) == [[0, 1, 2], [3, 4]], policy


def test_input_options_validate():
    with pytest.raises(InvalidArgumentError, match="AutoShardPolicy"):
        sg.InputOptions(auto_shard_policy="OFF")
    strategy = mirrored(2)
    with pytest.raises(InvalidArgumentError, match="InputOptions"):
        strategy.experimental_distribute_dataset([torch.ones(2)], options={"auto_shard_policy": "OFF"})
    no_fetch = sg.InputOptions(experimental_fetch_to_device=False)
    batch = next(iter(strategy.experimental_distribute_dataset([torch.ones(2)], options=no_fetch)))
    assert rows(strategy, batch) == [[1.0], [1.0]]


def test_bad_datasets_and_batches():
    strategy = mirrored(2)
    with pytest.raises(InvalidArgumentError, match="iterable of global batches"):
        strategy.experimental_distribute_dataset(42)
    with pytest.raises(InvalidArgumentError, match="disagree on the batch size"):
        next(iter(strategy.experimental_distribute_dataset([(torch.ones(4), torch.ones(3))])))
    with pytest.raises(InvalidArgumentError, match="batch dimension"):
        next(iter(strategy.experimental_distribute_dataset([(1, 2)])))


# ------------------------------------------------------------------ compute_average_loss

@pytest.mark.parametrize("num_rows, num_replicas", [(5, 4), (2, 3), (7, 2), (8, 4)])
def test_compute_average_loss_without_global_batch_size_is_exact_on_uneven_batches(num_rows, num_replicas):
    strategy = mirrored(num_replicas)
    values = torch.arange(1.0, num_rows + 1.0)
    batch = next(iter(strategy.experimental_distribute_dataset([values])))
    losses = strategy.run(lambda v: sg.nn.compute_average_loss(v), args=(batch,))
    total = sum(t.item() for t in local(strategy, losses))
    assert total == pytest.approx(values.mean().item(), rel=1e-6)
    assert strategy.reduce("sum", losses).item() == pytest.approx(values.mean().item(), rel=1e-6)


def test_compute_average_loss_without_a_dataset_sums_the_batch_over_replicas():
    strategy = mirrored(3)
    # replica r has r + 1 examples, each of loss r + 1: 1 + 4 + 9 = 14 over 6 examples
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((ctx.replica_id_in_sync_group + 1,), ctx.replica_id_in_sync_group + 1.0))
    losses = strategy.run(sg.nn.compute_average_loss, args=(value,))
    assert sum(t.item() for t in local(strategy, losses)) == pytest.approx(14 / 6)


def test_compute_average_loss_with_sample_weight():
    strategy = mirrored(4)
    x = torch.arange(1.0, 6.0)
    w = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.0])
    batch = next(iter(strategy.experimental_distribute_dataset([(x, w)])))
    losses = strategy.run(lambda b: sg.nn.compute_average_loss(b[0], sample_weight=b[1]), args=(batch,))
    assert strategy.reduce("sum", losses).item() == pytest.approx((x * w).sum().item() / 5)
    scalar = strategy.run(lambda b: sg.nn.compute_average_loss(b[0], sample_weight=2.0), args=(batch,))
    assert strategy.reduce("sum", scalar).item() == pytest.approx(2 * x.mean().item())


def test_compute_average_loss_with_explicit_global_batch_size():
    strategy = mirrored(2)
    batch = next(iter(strategy.experimental_distribute_dataset([torch.ones(6)])))
    losses = strategy.run(lambda v: sg.nn.compute_average_loss(v, global_batch_size=12), args=(batch,))
    assert [t.item() for t in local(strategy, losses)] == [0.25, 0.25]


def test_compute_average_loss_in_the_default_strategy_and_one_device():
    assert sg.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0])).item() == 2.0
    assert sg.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6).item() == 1.0
    assert sg.nn.compute_average_loss(torch.tensor([1.0, 3.0]), sample_weight=torch.tensor([0.0, 1.0])).item() == 1.5
    strategy = sg.OneDeviceStrategy("cpu")
    batch = next(iter(strategy.experimental_distribute_dataset([torch.tensor([2.0, 4.0])])))
    assert strategy.run(sg.nn.compute_average_loss, args=(batch,)).item() == 3.0


def test_compute_average_loss_rejects_bad_input():
    with pytest.raises(InvalidArgumentError, match="reduction='none'"):
        sg.nn.compute_average_loss(torch.tensor(1.0))
    with pytest.raises(InvalidArgumentError, match="tensor of per-example losses"):
        sg.nn.compute_average_loss([1.0, 2.0])
    for bad in (0, -4, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="global_batch_size"):
            sg.nn.compute_average_loss(torch.ones(2), global_batch_size=bad)


def test_scale_regularization_loss():
    assert sg.nn.scale_regularization_loss(torch.tensor(8.0)).item() == 8.0  # default strategy
    strategy = mirrored(4)
    scaled = strategy.run(lambda: sg.nn.scale_regularization_loss(torch.tensor(8.0)))
    assert [t.item() for t in local(strategy, scaled)] == [2.0] * 4
    assert strategy.reduce("sum", scaled).item() == 8.0  # one copy over all replicas
    with strategy.scope():
        assert sg.nn.scale_regularization_loss(torch.tensor(8.0)).item() == 2.0


# ------------------------------------------------------------ distribute_datasets_from_function

def test_distribute_datasets_from_function_calls_dataset_fn_once_with_an_input_context():
    strategy = mirrored(4)
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        n = ctx.get_per_replica_batch_size(8)
        return [torch.full((n,), float(i)) for i in range(8)]

    data = strategy.distribute_datasets_from_function(dataset_fn)
    assert len(contexts) == 1
    ctx = contexts[0]
    assert isinstance(ctx, sg.InputContext)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 4)
    batches = [rows(strategy, b) for b in data]
    # each replica takes the next per-replica batch in turn
    assert batches == [[[0.0] * 2, [1.0] * 2, [2.0] * 2, [3.0] * 2],
                       [[4.0] * 2, [5.0] * 2, [6.0] * 2, [7.0] * 2]]
    assert [rows(strategy, b) for b in data] == batches  # a new epoch
    assert len(contexts) == 1


def test_distribute_datasets_from_function_running_out_mid_step_gives_empty_slices():
    strategy = mirrored(2)
    data = strategy.distribute_datasets_from_function(
        lambda ctx: [(torch.ones(2, 3) * i, torch.tensor([i, i])) for i in range(3)])
    batches = list(data)
    assert len(batches) == 2
    x, y = batches[1]
    assert [tuple(t.shape) for t in local(strategy, x)] == [(2, 3), (0, 3)]
    assert [t.tolist() for t in local(strategy, y)] == [[2, 2], []]
    # the loss divides by the true global batch (2 rows here), also on the replica left empty
    losses = strategy.run(lambda b: sg.nn.compute_average_loss(b[0].sum(1)), args=(batches[1],))
    assert strategy.reduce("sum", losses).item() == pytest.approx((6.0 + 6.0) / 2)  # rows of 2 * 3


def test_distribute_datasets_from_function_errors():
    strategy = mirrored(2)
    with pytest.raises(InvalidArgumentError, match="callable"):
        strategy.distribute_datasets_from_function([1, 2])
    with pytest.raises(InvalidArgumentError, match="iterable of per-replica batches"):
        strategy.distribute_datasets_from_function(lambda ctx: 3)
    with pytest.raises(ValueError, match="not divisible"):
        strategy.distribute_datasets_from_function(lambda ctx: [torch.ones(ctx.get_per_replica_batch_size(7))])


def test_input_context_get_per_replica_batch_size():
    ctx = sg.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    with pytest.raises(ValueError, match="64 is not divisible by the 3") as info:
        sg.InputContext(num_replicas_in_sync=3).get_per_replica_batch_size(64)
    assert isinstance(info.value, StratagemError)
    assert "multiple of 3" in str(info.value)
    assert sg.InputContext().get_per_replica_batch_size(5) == 5

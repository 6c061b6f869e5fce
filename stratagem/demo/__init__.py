"""``stratagem demo``: train a small classifier under a strategy and check it against plain PyTorch.

The first thing to run on a fresh machine. It trains a two-layer MLP on scikit-learn's
handwritten digits (1,797 8x8 images shipped inside scikit-learn, so nothing is
downloaded) with ``sg.Model.fit``, under ``MirroredStrategy`` on two
logical CPU replicas by default. Then it trains the same model again with plain
single-device PyTorch -- same initial weights, same batches in the same order,
``F.cross_entropy`` with its mean -- and compares the final parameters: the equivalence
equivalence guarantee, checked on real data.

The default global batch of 64 does not divide the 1,437 training images: the last batch
of every epoch has 29 rows, split 15/14 over two replicas, and ``fit`` still divides
its loss by the true global size.

``--strategy multi_worker`` and ``--strategy parameter_server`` start a local cluster of
processes themselves (:mod:`stratagem.demo.cluster`): two workers under
``MultiWorkerMirroredStrategy``, checked for equivalence like the others; or a
coordinator, two workers and a parameter server under ``ParameterServerStrategy``, whose
asynchronous training cannot be equivalent to plain PyTorch step by step and passes
instead when test accuracy reaches :data:`MIN_ASYNC_ACCURACY` (0.9; about 5 epochs).

Commands::

    stratagem demo                                  # MirroredStrategy on cpu:0, cpu:1
    stratagem demo --replicas 3 --optimizer adam    # three replicas, Adam
    stratagem demo --strategy one_device --quiet    # results only
    stratagem demo --strategy multi_worker          # 2 worker processes, 1 replica each
    stratagem demo --strategy parameter_server      # coordinator + 2 workers + 1 ps
    python -m stratagem demo --help

In Python::

    from stratagem.demo import run_demo
    result = run_demo(strategy="mirrored", replicas=2, epochs=1, progress=False)
    assert result.passed, result.max_rel_diff

The modules, each importing only those above it::

    data.py       the digits split and the per-epoch shuffled batches
    training.py   the model, the training loop under a strategy and in plain PyTorch
    check.py      DemoResult and the equivalence check against plain PyTorch
    report.py     the header and the results block
    local.py      the strategies of this process: mirrored, one_device, default
    tasks.py      what the processes of the demo's local cluster run
    cluster.py    multi_worker and parameter_server: start that cluster, read its result
    run.py        run_demo and the --strategy choices
    command.py    the ``stratagem demo`` subcommand
"""

from stratagem.demo.check import DemoResult, max_relative_difference
from stratagem.demo.cluster import ClusterDemoError
from stratagem.demo.command import add_subcommand
from stratagem.demo.data import Digits, ShuffledBatches, load_digits_split
from stratagem.demo.report import format_result
from stratagem.demo.run import MIN_ASYNC_ACCURACY, STRATEGIES, run_demo
from stratagem.demo.training import TrainConfig

__all__ = [
    "ClusterDemoError", "DemoResult", "Digits", "MIN_ASYNC_ACCURACY", "STRATEGIES", "ShuffledBatches",
    "TrainConfig", "add_subcommand", "format_result", "load_digits_split", "max_relative_difference",
    "run_demo",
]

"""TensorFlow's side of the comparisons, run only in an interpreter where ``import tensorflow``
works (this one, or ``parameter_server.py --tf-python PATH``). No torch, no stratagem here.

    _tf.py mirrored --child tf_single|tf_mirrored --batch B --steps N ...   (from mirrored.py)
    _tf.py ps-server                      a tf.distribute.Server for TF_CONFIG's task, until killed
    _tf.py ps-chief SPEC_JSON             the coordinator; writes its result to SPEC["out"]

Every model mirrors the PyTorch one of the same benchmark: same widths, same SGD-with-momentum
rule, same synthetic data where the data is made by numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402


def _import_tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


def mirrored_child(argv: list[str]) -> dict:
    """A custom loop (``strategy.run`` inside ``tf.function``) with the default strategy or
    MirroredStrategy over two logical CPU devices, on the same batches as mirrored.py."""
    p = argparse.ArgumentParser()
    for flag in ("--batch", "--steps", "--warmup", "--distinct", "--seed"):
        p.add_argument(flag, type=int)
    p.add_argument("--child")
    p.add_argument("--patience", type=float)
    p.add_argument("--max-other-load", type=float)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    try:
        tf = _import_tf()
    except Exception as error:  # noqa: BLE001 - ImportError, or a broken install
        return {"skipped": f"import tensorflow failed: {type(error).__name__}: {error}"}
    x_np, y_np = h.synthetic_batches(args.batch, args.distinct, seed=args.seed)
    if args.child == "tf_mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")[:2]])
    else:
        strategy = tf.distribute.get_strategy()
    tf.random.set_seed(args.seed)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input(shape=(h.MLP_LAYERS[0],))]
                                    + [tf.keras.layers.Dense(n, activation="relu") for n in h.MLP_LAYERS[1:-1]]
                                    + [tf.keras.layers.Dense(h.MLP_LAYERS[-1])])
        optimizer = tf.keras.optimizers.SGD(learning_rate=h.LR, momentum=h.MOMENTUM)
    dataset = (tf.data.Dataset.from_tensor_slices((x_np.reshape(-1, h.MLP_LAYERS[0]), y_np.reshape(-1)))
               .batch(args.batch, drop_remainder=True).repeat())
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    iterator = iter(strategy.experimental_distribute_dataset(dataset.with_options(options)))

    def step_fn(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=args.batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def train_step(batch: Any) -> Any:
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step_fn, args=batch), axis=None)

    def probe() -> float:
        logits = model(x_np[0], training=False)
        return float(tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y_np[0], logits=logits)))

    result = h.timed_loop(lambda i: train_step(next(iterator)).numpy(), warmup=args.warmup, steps=args.steps,
                          patience_s=args.patience, max_other_load=args.max_other_load, probe=probe)
    result.update(tf=tf.__version__, peak_rss_mib=0.0)
    return result


def ps_server() -> None:
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    tf = _import_tf()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id, protocol="grpc", start=True)
    server.join()


def ps_chief(spec: dict) -> dict:
    """TensorFlow's ParameterServerStrategy + ClusterCoordinator, phases as parameter_server.py's."""
    tf = _import_tf()
    batch, distinct, emb_dim, classes = spec["batch"], spec["distinct"], spec["emb_dim"], 10
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.TFConfigClusterResolver(),
        variable_partitioner=(tf.distribute.experimental.partitioners.FixedShardsPartitioner(spec["shards"])
                              if spec["shards"] > 1 else None))
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    result: dict = {"framework": "tensorflow", "tf": tf.__version__}

    def rates(run_round: Any, count: int) -> dict:
        return h.rate_rounds(run_round, count, rounds=spec["rounds"], extra_rounds=spec["extra_rounds"],
                             max_other_load=spec["max_other_load"])

    def parts(v: Any) -> list:   # a ShardedVariable's shards, or the variable itself
        return [v] if isinstance(v, tf.Variable) else list(v.variables)

    def whole(v: Any) -> Any:
        return parts(v)[0] if len(parts(v)) == 1 else tf.concat(parts(v), axis=0)

    @tf.function
    def noop() -> Any:
        return tf.constant(0)

    def noops(count: int) -> None:
        for _ in range(count):
            coordinator.schedule(noop)
        coordinator.join()

    def per_worker(dataset_fn: Any) -> Any:
        @tf.function
        def make() -> Any:
            return strategy.distribute_datasets_from_function(dataset_fn)
        return iter(coordinator.create_per_worker_dataset(make))

    def scheduled(step: Any, iterator: Any, losses: list | None = None) -> Any:
        def run(count: int) -> None:
            values = [coordinator.schedule(step, args=(iterator,)) for _ in range(count)]
            coordinator.join()
            if losses is not None:
                losses.extend(float(v.fetch()) for v in values)
        return run

    phases = spec["phases"].split(",")
    if "noop" in phases:
        noops(spec["warmup"])
        result["noop"] = rates(noops, spec["noop_count"])
    if "sched" in phases:
        result["sched"] = {"rates": []}
        for _ in range(spec["rounds"]):
            t0 = time.perf_counter()
            for _ in range(spec["sched_count"]):
                coordinator.schedule(noop)
            result["sched"]["rates"].append(spec["sched_count"] / (time.perf_counter() - t0))
            coordinator.join()
    if "emb" in phases:   # plain SGD with sparse (IndexedSlices) updates, as on our side
        result["emb"] = []
        for rows, k in spec["emb"]:
            with strategy.scope():
                table = tf.Variable(tf.random.normal([rows, emb_dim]))
                head_w = tf.Variable(tf.random.normal([emb_dim, classes], stddev=emb_dim ** -0.5))
                head_b = tf.Variable(tf.zeros([classes]))
            variables = parts(table) + parts(head_w) + parts(head_b)

            def emb_data(ctx: Any, rows: int = rows, k: int = k) -> Any:
                return tf.data.Dataset.range(1).repeat().map(lambda _: (
                    tf.random.uniform([batch, k], 0, rows, tf.int64), tf.random.uniform([batch], 0, classes, tf.int64)))

            @tf.function
            def emb_step(it: Any) -> Any:
                def replica_fn(ids: Any, labels: Any) -> Any:
                    with tf.GradientTape() as tape:
                        pooled = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
                        logits = tf.matmul(pooled, whole(head_w)) + whole(head_b)
                        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
                    for var, grad in zip(variables, tape.gradient(loss, variables)):
                        with tf.device(var.device):
                            if isinstance(grad, tf.IndexedSlices):
                                var.scatter_sub(tf.IndexedSlices(spec["emb_lr"] * grad.values, grad.indices))
                            elif grad is not None:
                                var.assign_sub(spec["emb_lr"] * grad)
                    return loss
                return strategy.run(replica_fn, args=next(it))

            run = scheduled(emb_step, per_worker(emb_data), done := [])
            run(spec["warmup"])
            cpu, first = h.cluster_cpu_s(), len(done)
            measured = rates(run, spec["emb_steps"])
            result["emb"].append({"rows": rows, "ids_per_example": k, **measured,
                                  "cluster_cpu_ms": 1e3 * (h.cluster_cpu_s() - cpu) / (len(done) - first)})
    if "mlp" in phases:
        layers = h.MLP_LAYERS
        with strategy.scope():
            weights, momenta = [], []
            for n_in, n_out in zip(layers[:-1], layers[1:]):
                bound = n_in ** -0.5   # torch.nn.Linear's default initialisation range
                weights += [tf.Variable(tf.random.uniform([n_in, n_out], -bound, bound)),
                            tf.Variable(tf.random.uniform([n_out], -bound, bound))]
                momenta += [tf.Variable(tf.zeros([n_in, n_out])), tf.Variable(tf.zeros([n_out]))]
        flat_w = [p for w in weights for p in parts(w)]
        flat_m = [p for m in momenta for p in parts(m)]

        def mlp_data(ctx: Any) -> Any:
            x = tf.random.stateless_normal([distinct, batch, layers[0]], seed=[ctx.input_pipeline_id, 0])
            y = tf.random.stateless_uniform([distinct, batch], seed=[ctx.input_pipeline_id, 1], minval=0,
                                            maxval=layers[-1], dtype=tf.int64)
            return tf.data.Dataset.from_tensor_slices((x, y)).repeat()

        @tf.function
        def mlp_step(it: Any) -> Any:
            def replica_fn(x: Any, y: Any) -> Any:
                with tf.GradientTape() as tape:
                    out = x
                    for i in range(0, len(weights), 2):
                        out = tf.matmul(out, whole(weights[i])) + whole(weights[i + 1])
                        out = tf.nn.relu(out) if i + 2 < len(weights) else out
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, out))
                for w, m, g in zip(flat_w, flat_m, tape.gradient(loss, flat_w)):
                    with tf.device(w.device):            # the update runs on the ps, as ours does
                        m.assign(h.MOMENTUM * m + g)     # torch.optim.SGD's momentum rule
                        w.assign_sub(h.LR * m)
                return loss
            return strategy.run(replica_fn, args=next(it))

        losses: list = []
        run = scheduled(mlp_step, per_worker(mlp_data), losses)
        run(spec["warmup"])
        cpu, first = h.cluster_cpu_s(), len(losses)
        result["mlp"] = {**rates(run, spec["steps"]), "first_loss": sum(losses[:10]) / 10,
                         "last_loss": sum(losses[-20:]) / 20}
        result["mlp"]["cluster_cpu_ms"] = 1e3 * (h.cluster_cpu_s() - cpu) / (len(losses) - first)
        if "noop_loaded" in phases:
            noops(spec["warmup"])
            result["noop_loaded"] = rates(noops, max(20, spec["noop_count"] // 10))
    return result


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "mirrored":
        h.emit(mirrored_child(sys.argv[2:]))
    elif mode == "ps-server":
        ps_server()
    elif mode == "ps-chief":
        spec = json.loads(sys.argv[2])
        out = ps_chief(spec)
        with open(spec["out"], "w") as f:
            json.dump(out, f)
    else:
        raise SystemExit(f"unknown mode {mode!r}: mirrored, ps-server or ps-chief")

"""Where am I in the cluster: cluster specs and the resolvers that find them.

- :class:`ClusterSpec` -- the jobs of a cluster and every task's "host:port" (``spec.py``);
- :class:`ClusterResolver` -- which task this process is, and its rank in the collective
  (``resolver.py``), with :class:`SimpleClusterResolver` for a cluster given by hand,
  :class:`TFConfigClusterResolver` for TensorFlow's TF_CONFIG (``tf_config.py``) and
  :class:`TorchrunClusterResolver` for torchrun's variables (``torchrun.py``; Kubeflow's
  PyTorchJob sets them too, ``pytorchjob.py``), :class:`SlurmClusterResolver` for a Slurm job
  step (``slurm.py``, its node lists in ``nodelist.py``) and :class:`KubernetesClusterResolver`
  for the pods of an Indexed Job or a JobSet (``kubernetes.py``);
- :func:`resolve` -- picks one from the environment (``detect.py``).

Every malformed description raises :class:`stratagem.errors.ClusterConfigError` (a
``ValueError``) saying what is wrong and how to fix it.

Example::

    >>> import stratagem.cluster as sgc
    >>> resolver = sgc.SimpleClusterResolver({"worker": ["h1:2222", "h2:2222"]},
    ...                                      task_type="worker", task_id=0)
    >>> resolver.is_chief, resolver.num_workers
    (True, 2)
    >>> sgc.resolve({}).task_type is None    # no TF_CONFIG, torchrun or srun: a lone local task
    True
"""

from stratagem.cluster.detect import resolve
from stratagem.cluster.kubernetes import KubernetesClusterResolver
from stratagem.cluster.resolver import ClusterResolver, SimpleClusterResolver
from stratagem.cluster.slurm import SlurmClusterResolver
from stratagem.cluster.spec import ClusterSpec
from stratagem.cluster.tf_config import TFConfigClusterResolver
from stratagem.cluster.torchrun import TorchrunClusterResolver

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "KubernetesClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "resolve",
]

"""How bytes move between replicas: the :class:`~stratagem.comm.collective.Collective`.

- ``collective.py`` -- the declared operations (exchange, all_reduce, all_gather,
  broadcast, reduce, reduce_scatter, all_to_all, scatter, gather, barrier, and the
  process-level ones);
- ``replicas.py`` -- among the replica threads of one process (``sync.py`` is their
  rendezvous); ``cross_device_ops.py`` -- TensorFlow's cross-device ops, which configure it;
- ``workers.py`` -- across processes, each with its replica threads (hierarchical);
  ``processes.py`` -- the ``torch.distributed`` process group and its failure detection;
  ``gradients.py`` -- gradient packs all-reduced while backward runs; ``options.py`` --
  ``CommunicationOptions``.

Everything in stratagem that talks to ``torch.distributed`` is here.

``ring.py`` (``RingAllReduce``) and ``plugin.py`` (a user's ``CrossDeviceOps``) add
replica collectives; they are imported here so that ``ReplicaCollective.create`` finds them.
"""

from stratagem.comm import plugin, ring  # noqa: F401 - registers their collectives (see above)

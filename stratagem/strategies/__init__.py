"""The Strategy base, one small file per strategy (each a configuration of a runner, a
Collective and a Placement), the replica runners and the ReplicaContext."""

"""Who starts the processes: the local launcher behind ``stratagem launch``.

``stratagem launch`` runs a script as a whole cluster on one machine, over loopback: one
process per task (chief, workers, parameter servers), each given TensorFlow's TF_CONFIG
for its task and a cluster token shared by the job, so that the script finds its place with
``sg.cluster.TFConfigClusterResolver()`` exactly as it would on a real cluster.

- :func:`launch_local` -- the launcher as a Python function returning the exit status
  (``local.py``);
- ``supervisor.py`` -- starts, watches, restarts (a collective group together, servers
  one by one) and stops the processes;
- ``lifeline.py`` -- the tasks die with the launcher, even when it is killed (a reaper
  process and a parent-death signal);
- ``joining.py`` -- the join timeout: tasks that never join their cluster stop the job;
- ``output.py`` -- every task's output lines, prefixed with the task;
- :func:`add_launch_parser` -- the ``launch`` subcommand for the ``stratagem`` command
  (``command.py``; ``python -m stratagem.launch`` runs it alone);
- ``tasks.py`` -- which tasks a launch has, what each runs, its TF_CONFIG;
- ``ports.py`` -- free loopback ports;
- :func:`launch_ray` -- the same job as Ray actors on a Ray cluster's nodes
  (``stratagem launch --ray ADDRESS``; ``ray_launch.py``, ``ray_job.py``, ``ray_group.py``,
  ``ray_actor.py``, ``ray_command.py``; docs/ray.md).

Commands::

    stratagem launch --workers 2 train.py --epochs 3
    stratagem launch --workers 2 --max-restarts 3 --grace-period 30 train.py
    stratagem launch --ps 1 --workers 2 --max-restarts 3 train_ps.py
    stratagem launch --workers 2 --join-timeout 1800 train.py
    python -m stratagem.launch --chief --workers 2 train.py
    stratagem launch --ray 10.0.0.1:6379 --workers 4 --ray-spread train.py
"""

from stratagem.launch.command import add_launch_parser, add_subcommand
from stratagem.launch.local import launch_local
from stratagem.launch.ray_launch import launch_ray

__all__ = ["add_launch_parser", "add_subcommand", "launch_local", "launch_ray"]

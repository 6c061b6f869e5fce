"""Training state that outlives a process: ``sg.Checkpoint``, ``sg.CheckpointManager``, and how they lie on disk.

- ``checkpoint.py`` -- :class:`Checkpoint`: one logical copy of the tracked objects, saved by the
  processes that hold it (``pieces.py`` for tensors held in pieces), ``background.py`` for
  ``save(blocking=False)``, ``validate.py`` for the checks made before anything is loaded;
- ``storage.py`` -- the directory, manifest and checksums, written atomically; ``identity.py`` --
  what a checkpoint is (its name, job, save counter), checked against what a restore asked for;
- ``manager.py`` -- :class:`CheckpointManager`: numbered checkpoints, the newest few kept;
- ``writer_lock.py`` -- one live writer per series; ``chief_copy.py`` -- the chief's copy sent
  to workers that do not share its directory.

This layer uses the core (strategies, placements, collectives) through the strategy's
declared hooks (``Strategy.checkpoint_collective``, the placements' ``prepare_checkpoint``);
the core imports nothing from here.
"""

from stratagem.checkpoint.checkpoint import Checkpoint
from stratagem.checkpoint.manager import CheckpointManager, latest_checkpoint

__all__ = ["Checkpoint", "CheckpointManager", "latest_checkpoint"]

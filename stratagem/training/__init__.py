"""Training state that outlives a process: checkpoints, their manager, backups."""

from stratagem.training.checkpoint import Checkpoint
from stratagem.training.manager import CheckpointManager

__all__ = ["Checkpoint", "CheckpointManager"]

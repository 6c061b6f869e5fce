"""Training state that outlives a process: checkpoints, their manager, backups."""

from stratagem.training.checkpoint import Checkpoint
from stratagem.training.manager import CheckpointManager, latest_checkpoint
from stratagem.training.sidecar import SidecarEvaluator

__all__ = ["Checkpoint", "CheckpointManager", "SidecarEvaluator", "latest_checkpoint"]

"""Loss helpers that make per-replica losses add up to the single-device loss."""

from stratagem.ps.embedding import embedding_lookup
from stratagem.nn.loss_check import LossScalingWarning
from stratagem.nn.losses import (compute_average_loss, mean_over_replicas, scale_regularization_loss,
                                 skip_loss_scaling_check)

__all__ = ["LossScalingWarning", "compute_average_loss", "embedding_lookup", "mean_over_replicas",
           "scale_regularization_loss", "skip_loss_scaling_check"]

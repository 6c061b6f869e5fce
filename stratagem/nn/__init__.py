"""Loss helpers that make per-replica losses add up to the single-device loss, gradient
clipping by the global norm where no process holds a whole gradient, the warning that plain
BatchNorm normalizes per replica, and the embedding lookup that pulls only the rows used from
parameter servers. Part of the core (the strategies' loss check lives here): it imports nothing
of the layers built on it."""

from stratagem.nn.embedding import embedding_lookup
from stratagem.nn.loss_check import LossScalingWarning
from stratagem.placement.data_axis.buffers import BatchNormWarning
from stratagem.nn.losses import (compute_average_loss, mean_over_replicas, scale_regularization_loss,
                                 skip_loss_scaling_check)
from stratagem.placement.scope.clipping import clip_grad_norm_, clip_grad_value_

__all__ = ["BatchNormWarning", "LossScalingWarning", "clip_grad_norm_", "clip_grad_value_", "compute_average_loss",
           "embedding_lookup", "mean_over_replicas", "scale_regularization_loss", "skip_loss_scaling_check"]

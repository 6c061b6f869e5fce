"""Loss helpers that make per-replica losses add up to the single-device loss, and gradient
clipping by the global norm where no process holds a whole gradient."""

from stratagem.ps.embedding import embedding_lookup
from stratagem.nn.losses import compute_average_loss, scale_regularization_loss
from stratagem.placement.clipping import clip_grad_norm_, clip_grad_value_

__all__ = ["clip_grad_norm_", "clip_grad_value_", "compute_average_loss", "embedding_lookup",
           "scale_regularization_loss"]

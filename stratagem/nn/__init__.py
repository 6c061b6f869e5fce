"""Loss helpers that make per-replica losses add up to the single-device loss."""

from stratagem.ps.embedding import embedding_lookup
from stratagem.nn.losses import compute_average_loss, scale_regularization_loss

__all__ = ["compute_average_loss", "embedding_lookup", "scale_regularization_loss"]

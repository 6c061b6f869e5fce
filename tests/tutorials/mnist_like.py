"""An MNIST-shaped dataset the tutorial ports make themselves (nothing is downloaded).

``load_data()`` answers like ``tf.keras.datasets.mnist.load_data()``: ``(x_train, y_train),
(x_test, y_test)``, images ``uint8`` of shape ``(n, 28, 28)``, labels ``int64`` in ``0..9``.
Each class is a fixed pattern of three strokes, drawn at a random shift of up to two pixels,
at a random brightness, over noise: a small convolutional network learns it in one short epoch,
a linear model does not quite, and the same seed always gives the same bytes.
"""

from __future__ import annotations

import numpy as np

NUM_CLASSES = 10


def _templates(rng: np.random.Generator) -> np.ndarray:
    templates = np.zeros((NUM_CLASSES, 28, 28), dtype=np.float32)
    for c in range(NUM_CLASSES):
        for _ in range(3):   # three strokes, each a horizontal or a vertical bar
            length, start = rng.integers(8, 16), rng.integers(4, 14)
            at = rng.integers(5, 23)
            if rng.random() < 0.5:
                templates[c, at - 1:at + 2, start:start + length] = 1.0
            else:
                templates[c, start:start + length, at - 1:at + 2] = 1.0
    return templates


def _draw(rng: np.random.Generator, templates: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, NUM_CLASSES, n)
    images = np.empty((n, 28, 28), dtype=np.float32)
    shifts = rng.integers(-2, 3, (n, 2))
    brightness = rng.uniform(0.6, 1.0, n).astype(np.float32)
    for i in range(n):
        images[i] = np.roll(templates[labels[i]], tuple(shifts[i]), axis=(0, 1)) * brightness[i]
    images += rng.uniform(0.0, 0.3, images.shape).astype(np.float32)
    return (np.clip(images, 0.0, 1.0) * 255).astype(np.uint8), labels.astype(np.int64)


def load_data(num_train: int = 1024, num_test: int = 256, seed: int = 0):
    """``(x_train, y_train), (x_test, y_test)``, as ``tf.keras.datasets.mnist.load_data()``."""
    rng = np.random.default_rng(seed)
    templates = _templates(rng)
    return _draw(rng, templates, num_train), _draw(rng, templates, num_test)

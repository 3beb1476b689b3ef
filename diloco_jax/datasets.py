"""Small real datasets that ship inside the package, for examples and tests without a
download."""

import gzip
from importlib import resources

import numpy as np


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The handwritten digits data (1797 8 x 8 images; `diloco_jax/data/README.md`): images
    float32 [1797, 8, 8, 1] in [0, 1] (pixel / 16) and labels int32 [1797] in 0..9, in the
    file's order (the same rows and order as `sklearn.datasets.load_digits`)."""
    with resources.files("diloco_jax").joinpath("data/digits.csv.gz").open("rb") as f:
        table = np.loadtxt(gzip.open(f), delimiter=",", dtype=np.int64)
    images = (table[:, :64].reshape(-1, 8, 8, 1) / 16.0).astype(np.float32)
    return images, table[:, 64].astype(np.int32)

"""The sparse workload: synthetic click data on Zipf-distributed categorical ids, and the
bag-of-embeddings click model that `mpidist train --model embedding` trains on it and
benchmarks/ps.py measures.

Each sample is a bag of `bag` ids drawn from a table of `rows` ids with Zipf probabilities
(the id of popularity rank k has probability proportional to 1 / k**exponent, as the
categorical features of click logs are: a few ids in most samples, most ids rarely seen);
popularity ranks are dealt to ids by a seeded permutation, so that the popular ids are spread
over the table (and over the servers' row ranges) as hashed ids are. Its label, click or not,
comes from a hidden weight per id: clicked when the bag's summed weights, scaled by
1 / sqrt(bag), plus Gaussian noise of standard deviation NOISE, are above their median over the
training set (half the training samples are clicks: a constant guess scores about 0.5). A model can
learn the weights of the ids it sees often; the noise and the rarely seen ids bound its
accuracy.

No data set with categorical or text features ships inside the packages mpidist installs
(scikit-learn's bundled ones are numeric; its text data sets are downloaded), so the data is
generated, the same on every rank from the seed.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidArgumentError

BAG = 8
EXPONENT = 1.05
NOISE = 0.5
CLASSES = 2  # no click, click


class ZipfSampler:
    """Ids of a table of `rows`, drawn with Zipf probabilities over a seeded order of popularity."""

    def __init__(self, rows: int, exponent: float = EXPONENT, seed: int = 0):
        if not isinstance(rows, int) or rows < 1:
            raise InvalidArgumentError(f"rows must be a positive integer, got {rows!r}")
        if not exponent > 0:
            raise InvalidArgumentError(f"the Zipf exponent must be positive, got {exponent!r}")
        self.rows = rows
        cumulative = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -exponent)
        self._cumulative = cumulative / cumulative[-1]
        self._id_of_rank = np.random.default_rng(seed).permutation(rows)

    def draw(self, shape, generator: np.random.Generator) -> np.ndarray:
        ranks = np.searchsorted(self._cumulative, generator.random(shape), side="right")
        return self._id_of_rank[np.minimum(ranks, self.rows - 1)]


class ClickDataset(torch.utils.data.Dataset):
    """`samples` bags of ids (`x`, int64, samples x bag) and their labels (`y`, int64 0/1);
    items are (ids, label) tensors."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return torch.from_numpy(self.x[index]), torch.tensor(self.y[index])


def click_datasets(rows: int, train: int = 16384, test: int = 2048, bag: int = BAG, seed: int = 0):
    """The training and test sets of one hidden click model over a table of `rows` ids."""
    if not isinstance(bag, int) or bag < 1:
        raise InvalidArgumentError(f"bag must be a positive integer, got {bag!r}")
    sampler = ZipfSampler(rows, seed=seed)
    generator = np.random.default_rng(seed + 1)
    hidden = generator.standard_normal(rows)

    def draw(samples: int):
        ids = sampler.draw((samples, bag), generator)
        return ids.astype(np.int64), hidden[ids].sum(axis=1) / np.sqrt(bag) + NOISE * generator.standard_normal(samples)

    (train_ids, train_logits), (test_ids, test_logits) = draw(train), draw(test)
    threshold = np.median(train_logits)
    return (ClickDataset(train_ids, (train_logits > threshold).astype(np.int64)),
            ClickDataset(test_ids, (test_logits > threshold).astype(np.int64)))


class ClickModel(torch.nn.Module):
    """A bag of embeddings and a small MLP over it (a DLRM with sparse features only): the
    sum of the bag's rows of a `rows` x `dim` table, then Linear(dim, hidden), ReLU and
    Linear(hidden, 2). `sparse=True` gives the table sparse gradients (the rows the batch
    touched)."""

    def __init__(self, rows: int, dim: int = 16, hidden: int = 32, sparse: bool = False):
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse)
        self.head = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids))

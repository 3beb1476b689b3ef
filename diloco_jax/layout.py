"""Data in, without hand layouts: one dataset cut into DiLoCo's rounds and into the same
examples in `train_sync`'s steps, so a DiLoCo run and its baseline see the same data in the
same order.

A dataset is a pytree of arrays with a leading example axis N (or an iterable of examples,
each a pytree of arrays, stacked here). Each pass over it (an epoch) is shuffled by NumPy's
generator seeded with (seed, epoch) and split among the workers:

- iid: the shuffled examples are cut into M equal parts, worker m taking part m;
- non-iid (`iid=False`): the examples, in dataset order, are cut into M contiguous shards
  (worker m keeps shard m for the whole run: a dataset sorted by label gives each worker its
  own labels), each shard shuffled on its own.

Round r, worker m, inner step h takes the next B examples of worker m's stream. Only whole
rounds are made; the examples left over at the end of an epoch are dropped.
"""

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np


class Rounds(list):
    """What `worker_rounds` returns: a list of DiLoCo rounds, each a pytree with leaves
    [M, H, B, ...]. A list in every way; the type lets `train_sync`, whose items are steps
    [M, B, ...], refuse it instead of training one step per round on H x B examples."""


def worker_rounds(
    dataset: Any,
    num_workers: int,
    inner_steps: int,
    batch_size: int,
    *,
    iid: bool = True,
    seed: int = 0,
    num_rounds: int | None = None,
) -> Rounds:
    """DiLoCo's rounds of `dataset`: a list (`Rounds`) of pytrees with leaves [M, H, B, ...]
    (NumPy).

    num_rounds: how many; None: as many whole rounds as one epoch holds (a ValueError if that
    is none). More rounds than an epoch holds continue into the next epochs, each reshuffled.
    Raises ValueError naming the argument for a bad count or a dataset whose leaves disagree
    on N.
    """
    for name, value in (("num_workers", num_workers), ("inner_steps", inner_steps),
                        ("batch_size", batch_size)):  # fmt: skip
        _check_count(name, value, 1)
    _check_count("seed", seed, 0)
    if num_rounds is not None:
        _check_count("num_rounds", num_rounds, 0)
    if not isinstance(iid, bool):
        raise ValueError(f"iid must be True or False, got {iid!r}")
    data = _stacked(dataset)
    n = jax.tree.leaves(data)[0].shape[0]
    per_round = inner_steps * batch_size  # examples per worker per round
    shard = n // num_workers
    per_epoch = shard // per_round
    if per_epoch == 0:
        raise ValueError(
            f"dataset has {n} examples, fewer than one round needs: num_workers x inner_steps "
            f"x batch_size = {num_workers * per_round}"
        )
    total = per_epoch if num_rounds is None else num_rounds
    rounds = []
    for epoch in range(-(-total // per_epoch)):
        order_MxK = _order(n, num_workers, per_epoch * per_round, iid, seed, epoch)
        for r in range(min(per_epoch, total - epoch * per_epoch)):
            idx = order_MxK[:, r * per_round : (r + 1) * per_round]
            idx = idx.reshape(num_workers, inner_steps, batch_size)
            rounds.append(jax.tree.map(lambda x, i=idx: x[i], data))
    return Rounds(rounds)


def sync_steps(
    dataset: Any,
    num_workers: int,
    inner_steps: int,
    batch_size: int,
    *,
    iid: bool = True,
    seed: int = 0,
    num_rounds: int | None = None,
) -> list[Any]:
    """The examples of `worker_rounds(...)` with the same arguments in `train_sync`'s layout:
    one pytree with leaves [M, B, ...] per step, round r's H steps in order (H x the rounds)."""
    rounds = worker_rounds(
        dataset, num_workers, inner_steps, batch_size, iid=iid, seed=seed, num_rounds=num_rounds
    )
    return [jax.tree.map(lambda x, h=h: x[:, h], r) for r in rounds for h in range(inner_steps)]


def _order(n: int, num_workers: int, count: int, iid: bool, seed: int, epoch: int) -> np.ndarray:
    """int64 [M, count]: the example indices each worker takes in one epoch."""
    rng = np.random.default_rng([seed, epoch])
    if iid:
        return rng.permutation(n)[: num_workers * count].reshape(num_workers, count)
    shard = n // num_workers
    return np.stack([m * shard + rng.permutation(shard)[:count] for m in range(num_workers)])


def _stacked(dataset: Any) -> Any:
    """The dataset as a pytree of NumPy arrays sharing a leading dim N."""
    if isinstance(dataset, Iterable) and not isinstance(dataset, dict | tuple | np.ndarray):
        examples = list(dataset)
        if not examples:
            raise ValueError("dataset is empty")
        dataset = jax.tree.map(lambda *xs: np.stack(xs), *examples)
    leaves = jax.tree.leaves(dataset)
    if not leaves:
        raise ValueError("dataset must hold at least one array")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"dataset leaves must share a leading example axis, got sizes {sizes}")
    return jax.tree.map(np.asarray, dataset)


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

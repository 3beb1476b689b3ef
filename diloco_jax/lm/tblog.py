"""TensorBoard event files of LM runs, written with tensorboardX.

Each run (pretrain, diloco, sync_1worker, sync_data_parallel, ...) writes its own folder
OUT/tensorboard/RUN/, so `tensorboard --logdir OUT/tensorboard` overlays DiLoCo and the
baselines on one chart per tag. The x axis is steps per worker (a DiLoCo round shows at its
last inner step; an async server update at the workers' mean steps so far, rounded), and
every scalar is a field of the run's metrics.jsonl record (SCALARS, and each train metric
beside the loss as "train/NAME", e.g. train/accuracy: `aux_metrics`), stored as
float32 as TensorBoard does.
"""

from collections.abc import Iterable
from pathlib import Path
from typing import Any

# metrics.jsonl field -> TensorBoard tag.
SCALARS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "eval_bits_per_byte": "eval/bits_per_byte",
    "outer_grad_norm": "diloco/outer_grad_norm",
    "bytes_communicated": "communication/bytes_communicated",
    "wire_bytes": "communication/wire_bytes",
    "wire_bytes_per_device": "communication/wire_bytes_per_device",
    "tokens_per_second": "throughput/tokens_per_second",
    "mfu": "throughput/mfu",
}
_EVENT_PREFIX = "events.out.tfevents."


def run_dir(out: Path, name: str) -> Path:
    """OUT/tensorboard/NAME: the event folder of run NAME."""
    return Path(out) / "tensorboard" / name


def scalars(record: dict[str, Any], aux: Iterable[str] = ()) -> dict[str, float]:
    """The TensorBoard tags and values of one metrics record: the SCALARS fields it has that
    are numbers (None, e.g. an unknown MFU, is left out; NaN and inf are kept), then its train
    metrics beside the loss as "train/NAME" (`aux_metrics(record, aux)`)."""
    out = {}
    for key, tag in SCALARS.items():
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[tag] = float(value)
    for name, value in aux_metrics(record, aux).items():
        if name not in SCALARS:
            out[f"train/{name}"] = value
    return out


def aux_metrics(record: dict[str, Any], names: Iterable[str] = ()) -> dict[str, float]:
    """The train metrics a record holds beside "loss" (the loss_fn's aux outputs), in record
    order: every number k with a "worker_" + k field too (what train_diloco and train_sync
    record for each aux metric), and those of `names` that it holds (train_async records
    only the mean, no per-worker list). Values that are not numbers are left out."""
    names = set(names)
    out = {}
    for key, value in record.items():
        if key == "loss" or not (key in names or "worker_" + key in record):
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


class TensorBoardLog:
    """Writes one run's records as scalars into `folder`, replacing event files an earlier
    run left there (so rerunning a command into the same OUT doesn't stack two runs). `aux`
    as for `scalars`."""

    def __init__(self, folder: Path, flush_secs: int = 10, aux: Iterable[str] = ()):
        self._aux = tuple(aux)
        from tensorboardX import SummaryWriter  # imported only when TensorBoard is asked for

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(f"{_EVENT_PREFIX}*"):
            old.unlink()
        self._writer = SummaryWriter(logdir=str(folder), flush_secs=flush_secs)

    def __call__(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record, self._aux).items():
            self._writer.add_scalar(tag, value, global_step=x_step(record))

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> "TensorBoardLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def x_step(record: dict[str, Any]) -> int:
    """The record's x: steps per worker ("steps_per_worker", the mean over workers, for async;
    an async record's "steps" is the length of the job that just ended)."""
    return round(record.get("steps_per_worker", record["steps"]))


def write_history(folder: Path, history: list[dict[str, Any]], aux: Iterable[str] = ()) -> None:
    """Rewrites `folder` with a whole history (a resumed run's, once it is complete)."""
    with TensorBoardLog(folder, aux=aux) as log:
        for record in history:
            log(record)

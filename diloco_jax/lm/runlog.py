"""Run outputs: one JSON line of metrics per record (big_vision style), a tqdm progress bar,
and atomic JSON files."""

import contextlib
import json
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from diloco_jax.lm.tblog import TensorBoardLog, aux_metrics


def write_json(path: Path, obj: Any) -> None:
    """Writes JSON atomically: a temporary file in the same folder, then a rename."""
    _write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Writes one JSON object a line, atomically (temporary file, then a rename)."""
    _write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def _write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it and a rename. The file gets the
    permissions `open` gives a new file (0666 less the umask), as every other file of a run
    does (tempfile's would be 0600)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}PB"


class RunLog:
    """Appends each record to `metrics_path` (flushed, one JSON object a line) and advances a
    progress bar showing loss, the train metrics beside it (`aux_metrics`, e.g. accuracy; `aux`
    names those a record without per-worker lists holds), eval loss, tokens/s, bytes
    communicated and the ETA. With `tensorboard` (a folder), each record's scalars also go
    there (lm/tblog.py)."""

    def __init__(
        self,
        metrics_path: Path,
        total: int,
        desc: str,
        progress: bool = True,
        tensorboard: Path | None = None,
        aux: Iterable[str] = (),
    ):
        self._aux = tuple(aux)
        self._file = open(metrics_path, "a")  # noqa: SIM115 - closed in close()
        self._tensorboard = None
        if tensorboard is not None:
            self._tensorboard = TensorBoardLog(tensorboard, aux=self._aux)
        self._bar = tqdm(
            total=total,
            desc=desc,
            disable=not progress or total == 0,
            unit="step",
            dynamic_ncols=True,
            leave=True,
        )
        self._done = 0

    def __call__(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard(record)
        # async: a mean over workers (Decoupled DiLoCo's syncs have no "steps" of their own)
        steps = record["steps_per_worker"] if "steps_per_worker" in record else record["steps"]
        self._bar.update(steps - self._done)
        self._done = steps
        seconds = max(record.get("wall_seconds", 0.0), 1e-9)
        postfix = {"loss": f"{record['loss']:.3f}"}
        for name, value in aux_metrics(record, self._aux).items():
            postfix[name] = f"{value:.3f}"
        if "eval_loss" in record:
            postfix["eval"] = f"{record['eval_loss']:.3f}"
        postfix["tok/s"] = f"{record['tokens_per_worker'] * record['workers'] / seconds:,.0f}"
        postfix["sent"] = _human_bytes(record["bytes_communicated"])
        self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        self._bar.close()
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

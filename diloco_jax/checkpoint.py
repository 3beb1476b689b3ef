"""Checkpoints of a training state on Orbax: save, find the latest, restore onto the caller's
devices, refuse a checkpoint from a different run.

A checkpoint of step `s` is the directory `<directory>/<s>/` written by one
`orbax.checkpoint.CheckpointManager.save` with three items:

- "state": the state pytree (a `DiLoCoState`, `SyncState`, or any pytree of arrays), through
  `StandardSave` (TensorStore/OCDBT, every array bit-exact in its own dtype and shape).
- "metadata": the caller's JSON dict (the run's `fingerprint` plus e.g. "data_position").
- "checksums": this module's integrity record: CRC-32s of the state, one per leaf on a
  single device, one per shard (keyed by its index range) for a leaf over several devices,
  each computed from that shard's own bytes (never a host copy of the whole leaf); the
  CRC-32 of the metadata; and every state leaf's path, shape and dtype. A restore onto
  another layout checks the shards whose index ranges it shares with the save.

A metadata "history" list (one record per round, growing with the run) is not stored in
each checkpoint: `Saver` appends the records new since its last save to `<directory>/` +
HISTORY_FILE (one JSON line each) and the metadata keeps where the step's history ends in
that file and the CRC-32 of everything before (`restore` hands back the list). A save
therefore writes and checks the same few bytes at round 10 and at round 10,000.

Atomicity is Orbax's: a save is written under `<s>.orbax-checkpoint-tmp*` and renamed to `<s>`
only once every item is complete, and only names without that suffix count as steps (on GCS,
where renames are not atomic, a step counts once its `commit_success.txt` is written). A crash
mid-save therefore leaves a temporary directory that `latest_step` and `restore` never pick
(the next `Saver` deletes it). History lines are appended and synced before the step's save
begins, so a finished step's history is always on disk; lines past it (a save that never
finished) are cut off when a run resumes. `save` is synchronous: when it returns, the files
are written (TensorStore syncs them) and the directory renamed. `Saver` writes in the
background (Orbax's asynchronous checkpointing): its `save` returns once the state is copied
off the devices, and the next `save` or `close` waits for the write in flight; a run killed
while one is in flight leaves only a temporary directory, so a resume takes the last
complete one.

A `Saver` holds the directory for one run (`run_lock`): a second run's `Saver` on it is a
`run_lock.FolderInUse` error before it touches anything there. The lock goes with the
process, so a killed run never blocks the next one.

A finished checkpoint that is damaged afterwards (a file deleted, truncated or flipped, the
metadata edited, the history cut short) fails to read, reads back bytes whose CRC-32 differs,
or disagrees with its own record of the state's leaves: `restore` warns naming that step and
the reason and falls back to the previous one. Only an intact checkpoint that disagrees with
the caller's run is "a different run" (a ValueError).
"""

import json
import os
import warnings
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from diloco_jax import run_lock

STATE, METADATA, CHECKSUMS = "state", "metadata", "checksums"
# 3: the metadata's CRC-32 and the state's leaves (path, shape, dtype) in the checksums item,
# the history in HISTORY_FILE; 2: per-shard CRCs for leaves over several devices. 1 and 2
# are still read.
FORMAT_VERSION = 3
# Metadata keys that record progress rather than identity: never compared on restore.
PROGRESS_KEYS = frozenset({"data_position"})
# Identity keys newer than some checkpoints (the caller's own fingerprint, `run`): compared
# when the checkpoint has them.
LATER_KEYS = frozenset({"run"})
HISTORY = "history"  # the metadata key whose list lives in HISTORY_FILE
HISTORY_FILE = "history.jsonl"


def fingerprint(params: Any, **fields: Any) -> dict[str, Any]:
    """Describes a run, to be saved as metadata and compared on restore.

    Args:
      params: the params pytree (arrays, or anything with `.shape` and `.dtype`).
      **fields: further JSON-able identity fields, e.g. algorithm="diloco", num_workers=4,
        inner_steps=50, inner_optimizer="adamw", and progress fields like data_position.

    Returns:
      A JSON-normalized dict (tuples become lists): {"tree": str of the tree structure,
      "shapes": {leaf path: [dims]}, "dtypes": {leaf path: dtype name}, **fields}.
    """
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    description = {
        "tree": str(jax.tree.structure(params)),
        "shapes": {jax.tree_util.keystr(p): list(np.shape(x)) for p, x in leaves},
        "dtypes": {jax.tree_util.keystr(p): _dtype_name(x) for p, x in leaves},
    }
    clash = sorted(description.keys() & fields.keys())
    if clash:
        raise ValueError(f"fingerprint fields {clash} are reserved for the params' description")
    return _json_normalized({**description, **fields}, "fingerprint fields")


def run_fields(checkpoint_fingerprint: Any) -> dict[str, Any]:
    """The trainers' `checkpoint_fingerprint` (the caller's own description of its run, e.g.
    the config a loss_fn closes over) as fingerprint fields: {"run": it}, or {} for None.
    ValueError naming it unless it is a JSON-able dict."""
    if checkpoint_fingerprint is None:
        return {}
    if not isinstance(checkpoint_fingerprint, dict):
        raise ValueError(
            f"checkpoint_fingerprint must be a dict, got {type(checkpoint_fingerprint).__name__}"
        )
    return {"run": _json_normalized(checkpoint_fingerprint, "checkpoint_fingerprint")}


def save(
    directory: str | os.PathLike,
    step: int,
    state: Any,
    metadata: dict[str, Any],
    *,
    keep: int = 3,
) -> None:
    """Writes checkpoint `step` of `state` and `metadata`, then keeps only the last `keep`.

    Args:
      directory: the run's checkpoint directory (created if missing).
      step: int >= 0, later than every step already in `directory`.
      state: pytree of jax Arrays (any sharding), NumPy arrays or Python scalars; a PRNG key
        as `jax.random.key_data(key)` (a typed key array also works).
      metadata: JSON-able dict, e.g. `fingerprint(params, ...) | {"data_position": n}`; a
        "history" list goes to HISTORY_FILE (see the module docstring).
      keep: how many checkpoints to keep (oldest steps are deleted), >= 1.

    Returns None once the checkpoint is complete on disk (synchronous; `Saver` writes in the
    background). Raises ValueError for a bad step, keep or metadata, `run_lock.FolderInUse`
    while a run holds `directory`. Every process of a multi-process run must call it.
    """
    saver = Saver(directory, keep=keep, background=False)
    try:
        saver.save(step, state, metadata)
    finally:
        saver.close()


class Saver:
    """Holds `directory` for one run and saves its checkpoints (as `save` does), keeping the
    last `keep`. With `background` (the default), `save` returns once the state is copied off
    the devices (the caller may then donate or overwrite it) and the files are written while
    the caller goes on; the next `save` and `close` wait for the one in flight, also in a
    multi-process run (each process writes its shards). `resume` restores the run's latest
    intact checkpoint first. Call `close` when done (it raises what a background write
    raised, and lets the directory go).

    Creating it locks `directory` (process 0 of a multi-process run; `run_lock`) before
    anything there is read or written: another run's `Saver` on it raises
    `run_lock.FolderInUse`."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, background: bool = True):
        _check_int("keep", keep, 1)
        # Multi-process too: Orbax's background commit waits at the distributed client's
        # barriers, not at collectives, so it cannot mix with the run's own collectives, and
        # `save` waits for the commit in flight before the next save's barriers.
        # (tests/test_multiprocess.py saves while both processes all-reduce.)
        self.background = background
        self._writer = jax.process_index() == 0  # the one process that writes HISTORY_FILE
        self._lock = None
        if self._writer and "://" not in os.fspath(directory):
            prepare(directory)
            # Before the manager: creating one clears unfinished saves, maybe another run's.
            self._lock = run_lock.acquire(_path(directory), what="checkpoint_dir")
        try:
            self._manager = _manager(directory, keep=keep, create=True, background=background)
        except BaseException:
            self._release()
            raise
        self._history: _History | None = None  # known after `resume` or the first save

    def resume(
        self, like_state: Any, expected_metadata: dict[str, Any]
    ) -> tuple[Any, dict[str, Any], int] | None:
        """`restore` from this directory, then deletes every step newer than the one restored
        (damaged ones it skipped: the run writes those steps again) and the history past it.
        Returns what `restore` returns; raises what it raises."""
        expected_metadata = _checked_expected(expected_metadata)
        restored = _restore(self._manager, like_state, expected_metadata)
        step = None if restored is None else restored[2]
        for newer in sorted(self._manager.all_steps()):
            if step is not None and newer > step:
                self._manager.delete(newer)
        pointer = None if restored is None else restored[3]
        self._history = _History.continued(self._history_path(), pointer, self._writer)
        return None if restored is None else restored[:3]

    def save(self, step: int, state: Any, metadata: dict[str, Any]) -> None:
        """Starts (background) or writes checkpoint `step`; see `save` for the arguments."""
        _check_int("step", step, 0)
        if not isinstance(metadata, dict):
            raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
        history = metadata.get(HISTORY)
        if not isinstance(history, list):
            history = None
        # The history is serialized as it is appended, never whole: only its new records.
        metadata = _json_normalized(
            {k: v for k, v in metadata.items() if history is None or k != HISTORY}, "metadata"
        )
        manager = self._manager
        manager.wait_until_finished()  # the one in flight: its step counts from here on
        latest = manager.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"checkpoint step {step} must be after the latest step {latest} already in "
                f"{manager.directory}"
            )
        if history is not None:
            if self._history is None:  # no `resume`: the whole list, written once
                self._history = _History.continued(self._history_path(), None, self._writer)
            self._history.extend(history)
            metadata[HISTORY] = self._history.pointer()
        checksums = {
            "format": FORMAT_VERSION,
            "crc32": leaf_checksums(state),
            "metadata_crc32": _metadata_crc(metadata),
            "leaves": leaf_descriptions(state),
        }
        args = ocp.args.Composite(
            **{
                STATE: ocp.args.StandardSave(state),
                METADATA: ocp.args.JsonSave(metadata),
                CHECKSUMS: ocp.args.JsonSave(checksums),
            }
        )
        if not manager.save(step, args=args, force=True):
            raise RuntimeError(f"Orbax declined to save step {step} in {manager.directory}")
        if not self.background:
            manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight and releases the directory."""
        try:
            self._manager.wait_until_finished()
        finally:
            try:
                self._manager.close()
            finally:
                self._release()

    def _history_path(self) -> epath.Path:
        return epath.Path(self._manager.directory) / HISTORY_FILE

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


class _History:
    """A run's HISTORY_FILE as far as its saves have written it: records, bytes and the
    CRC-32 of those bytes. Only the `writer` process touches the file; every process keeps
    the same counts, so every process saves the same metadata."""

    def __init__(self, path: epath.Path, writer: bool, entries: int, size: int, crc: int):
        self.path, self.writer = path, writer
        self.entries, self.size, self.crc = entries, size, crc

    @classmethod
    def continued(cls, path: epath.Path, pointer: dict | None, writer: bool) -> "_History":
        """Where a run resumed at `pointer` goes on (None: from nothing, so its first save
        writes its whole list, over the same bytes where a checkpoint counts them)."""
        entries, size, crc = (0, 0, 0) if pointer is None else _pointer_fields(pointer)
        return cls(path, writer, entries, size, crc)

    def extend(self, records: list) -> None:
        """Appends the records past the ones already written (the list must hold those)."""
        if len(records) < self.entries:
            raise ValueError(
                f"metadata history has {len(records)} records, fewer than the {self.entries} "
                "already saved"
            )
        new = records[self.entries :]
        if not new:
            return
        try:  # NaN and infinite losses too (Python's JSON reads them back)
            data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in new).encode()
        except (TypeError, ValueError) as error:
            raise ValueError(f"metadata history must be JSON-serializable: {error}") from None
        if self.writer:
            _append(self.path, data, self.size)
        self.entries += len(new)
        self.size += len(data)
        self.crc = zlib.crc32(data, self.crc)

    def pointer(self) -> dict[str, Any]:
        return {
            "file": HISTORY_FILE,
            "entries": self.entries,
            "bytes": self.size,
            "crc32": self.crc,
        }


def _pointer_fields(pointer: dict) -> tuple[int, int, int]:
    return int(pointer["entries"]), int(pointer["bytes"]), int(pointer["crc32"])


def _is_pointer(value: Any) -> bool:
    return isinstance(value, dict) and value.get("file") == HISTORY_FILE


def _append(path: epath.Path, data: bytes, offset: int) -> None:
    """`data` written at `offset`, the file cut after it (lines of a save that never
    finished, or of steps a resume skipped) and synced, before the step that counts it is
    saved."""
    if _is_local(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
        try:
            os.pwrite(fd, data, offset)
            os.ftruncate(fd, offset + len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
    else:  # an object store can neither append nor cut: rewritten (grows with the history)
        kept = path.read_bytes()[:offset] if offset else b""
        path.write_bytes(kept + data)


def _is_local(path: epath.Path) -> bool:
    return "://" not in os.fspath(path)


class _HistoryReader:
    """HISTORY_FILE read once, for the steps a restore tries."""

    def __init__(self, path: epath.Path):
        self.path, self._data = path, None

    def records(self, pointer: dict) -> list:
        """The pointer's records, after checking its bytes' length and CRC-32."""
        entries, size, crc = _pointer_fields(pointer)
        if self._data is None:
            self._data = self.path.read_bytes() if self.path.exists() else b""
        data = self._data[:size]
        if len(data) != size:
            raise ValueError(f"{HISTORY_FILE} holds {len(self._data)} bytes, fewer than {size}")
        if zlib.crc32(data) != crc:
            raise ValueError(f"{HISTORY_FILE}'s first {size} bytes fail their CRC-32")
        records = [json.loads(line) for line in data.splitlines()]
        if len(records) != entries:
            raise ValueError(f"{HISTORY_FILE} holds {len(records)} records, not {entries}")
        return records


def prepare(directory: str | os.PathLike) -> None:
    """Creates `directory` (and its parents) if missing; every process of a run calls it
    before looking for checkpoints there. Whether the directory exists decides whether
    `all_steps` opens an Orbax manager, whose cross-process barriers then have to match: made
    by each process itself first, it exists for all of them (measured: a barrier name
    mismatch when one process listed the directory another had just created)."""
    _path(directory).mkdir(parents=True, exist_ok=True)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The highest finished checkpoint step in `directory`, or None when there is none (or no
    directory). Temporary directories of unfinished saves are not steps. Doesn't read the
    checkpoint's contents: `restore` may still fall back from a damaged one."""
    steps = all_steps(directory)
    return steps[-1] if steps else None


def all_steps(directory: str | os.PathLike) -> list[int]:
    """The finished checkpoint steps in `directory`, ascending ([] when there is none).

    Safe to call while another process trains into `directory`: a step that its writer
    deletes (keeping the last N) between listing and reading is retried, not an error."""
    for attempt in range(3):
        if not _path(directory).is_dir():
            return []
        try:
            with _manager(directory, create=False) as manager:
                return sorted(manager.all_steps())
        except FileNotFoundError:
            if attempt == 2:
                raise
    return []


def discard_after(directory: str | os.PathLike, step: int) -> list[int]:
    """Deletes every checkpoint newer than `step` (e.g. damaged ones `restore` skipped, so
    the resumed run can write those steps again). Returns the deleted steps."""
    newer = [s for s in all_steps(directory) if s > step]
    if newer:
        with _manager(directory, create=False) as manager:
            for s in newer:
                manager.delete(s)
    return newer


def latest_metadata(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The metadata of the newest step in `directory` whose metadata is intact (its CRC-32
    holds, for checkpoints that record one), without its history and without reading the
    state; None when there is none. For a look at what run a directory holds before
    training (`restore` checks everything again)."""
    steps = all_steps(directory)
    if not steps:
        return None
    with _manager(directory, create=False) as manager:
        for step in reversed(steps):
            try:
                metadata, checksums = _read_json_items(manager, step)
                _check_metadata_record(metadata, checksums)
            except Exception:  # noqa: BLE001 (damage of any kind: an older step may be intact)
                continue
            return {k: v for k, v in metadata.items() if k != HISTORY}
    return None


def restore(
    directory: str | os.PathLike,
    like_state: Any,
    expected_metadata: dict[str, Any],
) -> tuple[Any, dict[str, Any], int] | None:
    """Restores the latest valid checkpoint in `directory` onto `like_state`'s devices.

    Args:
      directory: the run's checkpoint directory.
      like_state: a state pytree with the same structure, shapes and dtypes as the saved one,
        of real jax Arrays placed as the restored state should be (their `.sharding` is the
        restore target: a state on a `shard_map`/`pmap` mesh comes back sharded the same
        way). NumPy and Python scalar leaves come back as such. Or a callable that makes it
        from the checkpoint's item metadata tree (`as_saved`).
      expected_metadata: what the saved metadata must agree with, e.g.
        `fingerprint(params, ...)`: every top-level key but `PROGRESS_KEYS` is compared
        (`LATER_KEYS` only where the checkpoint has them).

    Returns:
      (state, metadata, step): the state as `like_state`'s pytree type with bit-exact values,
      the saved metadata dict (its "history" as the list that was saved), the step; or None
      when `directory` holds no checkpoint.

    Raises:
      ValueError naming `directory` and the field when an intact checkpoint belongs to
      another run (metadata differs from `expected_metadata`, or the state's leaves differ
      from `like_state`'s in path, shape or dtype); ValueError when no checkpoint is
      readable. A damaged checkpoint (unreadable, failing a CRC-32, or disagreeing with its
      own record of the state's leaves) is skipped with a RuntimeWarning naming its step and
      the reason.
    """
    expected_metadata = _checked_expected(expected_metadata)
    if not all_steps(directory):
        return None
    with _manager(directory, create=False) as manager:
        restored = _restore(manager, like_state, expected_metadata)
    return None if restored is None else restored[:3]


def _checked_expected(expected_metadata: Any) -> dict[str, Any]:
    if not isinstance(expected_metadata, dict):
        raise ValueError(
            f"expected_metadata must be a dict, got {type(expected_metadata).__name__}"
        )
    return _json_normalized(expected_metadata, "expected_metadata")


def _restore(
    manager: ocp.CheckpointManager, like_state: Any, expected_metadata: dict[str, Any]
) -> tuple[Any, dict[str, Any], int, dict | None] | None:
    """`restore` on an open manager; also returns the restored step's history pointer."""
    steps = sorted(manager.all_steps())
    if not steps:
        return None
    where = str(manager.directory)
    history = _HistoryReader(epath.Path(manager.directory) / HISTORY_FILE)
    failures: list[str] = []
    for step in reversed(steps):
        try:  # is the step whole, by its own record? any failure is damage: try an older one
            metadata, checksums = _read_json_items(manager, step)
            _check_metadata_record(metadata, checksums)
            saved_tree = manager.item_metadata(step)[STATE]
            _check_leaves_record(saved_tree, checksums)
            pointer = metadata.get(HISTORY)
            if _is_pointer(pointer):
                metadata = {**metadata, HISTORY: history.records(pointer)}
        except Exception as error:  # noqa: BLE001
            failures.append(_skip(where, step, error))
            continue
        # A whole checkpoint that disagrees with this run: another run's, never skipped.
        check_metadata(metadata, expected_metadata, where=f"{where} (step {step})")
        # A state whose layout varies is restored as this step saved it (an older step, tried
        # when this one is damaged, may hold another layout).
        target = like_state(saved_tree) if callable(like_state) else like_state
        like = _layout_of(saved_tree, target)
        check_state_matches(saved_tree, like, where=f"{where} (step {step})")
        try:
            state = _read_state(manager, step, like, saved_tree)
            _verify_checksums(state, checksums)
        except Exception as error:  # noqa: BLE001
            failures.append(_skip(where, step, error))
            continue
        if like is not target:
            state = type(target).from_legacy(state, target)
        return state, metadata, step, (pointer if _is_pointer(pointer) else None)
    raise ValueError(f"no valid checkpoint in checkpoint_dir {where}: " + "; ".join(failures))


def _metadata_crc(metadata: dict[str, Any]) -> int:
    """CRC-32 of the metadata's canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(metadata, sort_keys=True, separators=(",", ":"))
    return zlib.crc32(text.encode())


def _check_metadata_record(metadata: dict[str, Any], checksums: dict[str, Any]) -> None:
    """ValueError unless the metadata has the CRC-32 its checksums record (format 3)."""
    if checksums.get("format") not in (1, 2, FORMAT_VERSION):
        raise ValueError(f"unknown checksum format {checksums.get('format')!r}")
    if checksums["format"] >= 3 and _metadata_crc(metadata) != checksums.get("metadata_crc32"):
        raise ValueError("the metadata fails its CRC-32 (edited or damaged)")


def leaf_descriptions(state: Any) -> dict[str, list]:
    """{leaf path: [shape, dtype name]} of a state pytree, as Orbax stores the leaves."""
    out = {}
    for p, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        leaf = _as_stored(x)
        out[_path_name(p)] = [list(np.shape(leaf)), _dtype_name(leaf)]
    return out


def _check_leaves_record(saved_tree: Any, checksums: dict[str, Any]) -> None:
    """ValueError unless Orbax's metadata of the saved state lists the leaves the checksums
    record (for format 3, in their shapes and dtypes): a state item missing its tree
    metadata, say, is damage, not another run's state."""
    saved = {_path_name(p): m for p, m in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
    recorded = checksums.get("leaves") or dict.fromkeys(checksums["crc32"])
    if saved.keys() != recorded.keys():
        missing = sorted(recorded.keys() - saved.keys())
        raise ValueError(
            f"the state's tree metadata lists {len(saved)} leaves, its checksums "
            f"{len(recorded)}" + (f" (missing: {_joined(missing, 3)})" if missing else "")
        )
    for name, description in recorded.items():
        if description is None:
            continue
        shape, dtype = description
        got_shape = getattr(saved[name], "shape", None)
        got_dtype = getattr(saved[name], "dtype", None)
        if got_shape is not None and list(got_shape) != shape:
            raise ValueError(f"state leaf {name}'s stored shape {list(got_shape)} != {shape}")
        if got_dtype is not None and str(got_dtype) != dtype:
            raise ValueError(f"state leaf {name}'s stored dtype {got_dtype} != {dtype}")


def check_metadata(saved: dict[str, Any], expected: dict[str, Any], *, where: str) -> None:
    """Raises ValueError naming `where` and every differing field when `saved` disagrees with
    `expected` on a top-level key of `expected` (other than `PROGRESS_KEYS`)."""
    problems = []
    for key in sorted(expected.keys() - PROGRESS_KEYS):
        if key not in saved and key in LATER_KEYS:
            continue
        if key not in saved:
            problems.append(f"{key}: missing from the checkpoint (this run has {expected[key]!r})")
        else:
            problems.extend(_differences(key, saved[key], expected[key]))
    if problems:
        raise ValueError(
            f"checkpoint_dir {where} was written by a different run (checkpoint != this run): "
            + _joined(problems)
        )


def check_state_matches(saved_tree: Any, like_state: Any, *, where: str) -> None:
    """Raises ValueError naming `where` and the leaves when the saved state's leaf paths,
    shapes or dtypes (Orbax's item metadata tree) differ from `like_state`'s."""
    saved = {_path_name(p): m for p, m in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
    like = {_path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(like_state)[0]}
    problems = [f"state leaf {n}: not in this run's state" for n in sorted(saved.keys() - like)]
    problems += [f"state leaf {n}: not in the checkpoint" for n in sorted(like.keys() - saved)]
    for name in sorted(saved.keys() & like.keys()):
        shape, dtype = getattr(saved[name], "shape", None), getattr(saved[name], "dtype", None)
        leaf = _as_stored(like[name])
        if shape is not None and tuple(shape) != tuple(np.shape(leaf)):
            problems.append(f"state leaf {name} shape: {tuple(shape)} != {np.shape(leaf)}")
        if dtype is not None and hasattr(leaf, "dtype") and str(dtype) != str(leaf.dtype):
            problems.append(f"state leaf {name} dtype: {dtype} != {leaf.dtype}")
    if problems:
        raise ValueError(
            f"checkpoint_dir {where} holds a different state (checkpoint != this run): "
            + _joined(problems)
        )


def leaf_checksums(state: Any) -> dict[str, int | dict[str, int]]:
    """{leaf path: CRC-32} for a state pytree: of the leaf's bytes for a leaf on one device
    (or a host value), else {shard index range ("0:4,:"): CRC-32 of that shard's bytes} for
    each of this process's shards (one per distinct index range), copied to host one shard at
    a time."""
    return {_path_name(p): _crc32(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def _crc32(leaf: Any) -> int | dict[str, int]:
    leaf = _as_stored(leaf)
    if isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1:
        return {
            _index_key(shard.index): _bytes_crc(shard.data)
            for shard in leaf.addressable_shards
            if shard.replica_id == 0
        }
    return _bytes_crc(leaf)


def _bytes_crc(x: Any) -> int:
    return zlib.crc32(np.ascontiguousarray(np.asarray(x)).tobytes())


def _index_key(index: tuple) -> str:
    """A shard's index range, e.g. (slice(0, 4), slice(None)) -> "0:4,:"."""
    parts = []
    for entry in index:
        start = "" if entry.start is None else entry.start
        stop = "" if entry.stop is None else entry.stop
        parts.append(f"{start}:{stop}")
    return ",".join(parts)


def _as_stored(leaf: Any) -> Any:
    """A typed PRNG key array as the uint32 key data Orbax stores; other leaves unchanged."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_data(leaf)
    return leaf


def _verify_checksums(state: Any, checksums: dict[str, Any]) -> None:
    saved = checksums["crc32"]
    leaves = {_path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    bad = [name for name, leaf in leaves.items() if not _matches(saved.get(name), leaf)]
    if bad or saved.keys() != leaves.keys():
        raise ValueError(f"checksum mismatch in state leaves {bad or sorted(saved)}")


def _matches(saved: Any, leaf: Any) -> bool:
    """Whether a restored leaf's bytes have the saved CRC(s): per shard for the index ranges
    both layouts share; whole for a whole-leaf CRC (format 1, or a save from one device) when
    this process sees the whole leaf; None (a leaf format 1 could not check) passes."""
    if saved is None:
        return True
    if isinstance(saved, dict):
        restored = _crc32(leaf)
        if not isinstance(restored, dict):  # saved over devices, restored onto one
            restored = {_index_key(tuple(slice(None) for _ in np.shape(leaf))): restored}
        shared = saved.keys() & restored.keys()
        return all(saved[k] == restored[k] for k in shared)
    leaf = _as_stored(leaf)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return True  # a whole-leaf CRC of a leaf this process sees part of: not checkable
    return _bytes_crc(leaf) == saved


def _read_json_items(manager: ocp.CheckpointManager, step: int) -> tuple[dict, dict]:
    args = ocp.args.Composite(
        **{METADATA: ocp.args.JsonRestore(), CHECKSUMS: ocp.args.JsonRestore()}
    )
    restored = manager.restore(step, args=args)
    metadata, checksums = restored[METADATA], restored[CHECKSUMS]
    if not isinstance(metadata, dict) or not isinstance(checksums, dict):
        raise ValueError("metadata or checksums item is not a JSON object")
    return metadata, checksums


def _layout_of(saved_tree: Any, like_state: Any) -> Any:
    """What to restore the checkpoint onto: `like_state`, or the flat layout it was saved in
    before the state's parts held their own fields (a state type with `legacy_layout`, and a
    checkpoint without its "parts"): that layout's fields, None-valued ones left out."""
    legacy = getattr(like_state, "legacy_layout", None)
    if legacy is None or not hasattr(saved_tree, "keys") or "parts" in saved_tree.keys():
        return like_state
    return {name: value for name, value in legacy().items() if value is not None}


def _read_state(manager: ocp.CheckpointManager, step: int, like_state: Any, saved_tree: Any) -> Any:
    target = jax.tree.map(_restore_target, like_state)
    if isinstance(like_state, dict):  # a flat layout (`_layout_of`): the saved fields by name
        by_name = {name: value for name, value in target.items() if name in saved_tree.keys()}
        args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(by_name)})
        restored = manager.restore(step, args=args)[STATE]
        return {name: restored.get(name) for name in like_state}
    fields = getattr(like_state, "_fields", None)
    if fields is None or not hasattr(saved_tree, "keys"):
        args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target)})
        return manager.restore(step, args=args)[STATE]
    # A state type that gained fields since the checkpoint was written (None in this run,
    # absent on disk): restore the saved fields by name, keep the rest as this run has them.
    saved = set(saved_tree.keys())
    by_name = {name: getattr(target, name) for name in fields if name in saved}
    args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(by_name)})
    restored = manager.restore(step, args=args)[STATE]
    return type(like_state)(
        **{name: restored.get(name, getattr(like_state, name)) for name in fields}
    )


def as_saved(saved_tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """The restore target of a checkpoint in the layout it was saved in (its item metadata
    tree, `saved_tree`): each array's shape and dtype, on `sharding`. For a state whose
    layout varies with the run's progress (a count of pending messages), given to `resume`
    as `functools.partial(as_saved, sharding=...)`. Arrays of a dtype JAX would narrow
    (int64 without x64) come back as NumPy arrays."""

    def target(leaf):
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        if jax.dtypes.canonicalize_dtype(dtype) != dtype:  # int64 without x64: NumPy, whole
            return np.zeros(shape, dtype)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return jax.tree.map(target, saved_tree)


def _restore_target(leaf: Any) -> Any:
    """A jax Array becomes its abstract twin on the same sharding; other leaves stay."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


def _skip(where: str, step: int, error: Exception) -> str:
    reason = f"step {step}: {type(error).__name__}: {_first_line(error)}"
    warnings.warn(
        f"checkpoint step {step} in {where} is damaged or unreadable ({reason}); "
        "falling back to an earlier checkpoint",
        RuntimeWarning,
        stacklevel=3,
    )
    return reason


def _differences(name: str, saved: Any, expected: Any) -> list[str]:
    """'name: saved != expected' lines, one per differing key when both are dicts."""
    if isinstance(saved, dict) and isinstance(expected, dict):
        out = []
        for key in sorted(saved.keys() | expected.keys(), key=str):
            sub = f"{name}{key}" if str(key).startswith(("[", ".")) else f"{name}.{key}"
            if key not in expected:
                out.append(f"{sub}: {saved[key]!r} != (absent)")
            elif key not in saved:
                out.append(f"{sub}: (absent) != {expected[key]!r}")
            else:
                out.extend(_differences(sub, saved[key], expected[key]))
        return out
    return [] if saved == expected else [f"{name}: {saved!r} != {expected!r}"]


def _manager(
    directory: str | os.PathLike,
    *,
    create: bool,
    keep: int | None = None,
    background: bool = False,
) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=create,
        enable_async_checkpointing=background,
        cleanup_tmp_directories=create,
    )
    handlers = {
        STATE: ocp.StandardCheckpointHandler(),
        METADATA: ocp.JsonCheckpointHandler(),
        CHECKSUMS: ocp.JsonCheckpointHandler(),
    }
    return ocp.CheckpointManager(_path(directory), options=options, item_handlers=handlers)


def _path(directory: str | os.PathLike) -> epath.Path:
    """An absolute epath (Orbax wants absolute paths; URLs like gs:// pass unchanged)."""
    text = os.fspath(directory)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def _path_name(path: tuple) -> str:
    """'inner_opt_state.0.mu.w' for a key path: the names Orbax gives a state's leaves."""
    parts = []
    for key in path:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def _dtype_name(leaf: Any) -> str:
    dtype = getattr(leaf, "dtype", None)
    return str(dtype if dtype is not None else np.asarray(leaf).dtype)


def _json_normalized(value: dict[str, Any], what: str) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what} must be JSON-serializable: {error}") from None


def _joined(problems: list[str], limit: int = 12) -> str:
    more = len(problems) - limit
    return "; ".join(problems[:limit]) + (f"; and {more} more" if more > 0 else "")


def _first_line(error: Exception) -> str:
    """The gist of an error: its first line, without TensorStore's spec dump."""
    text = str(error).split(" See full TensorStore details")[0].strip()
    return text.splitlines()[0][:300] if text else ""


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

"""Checkpoints of a training state on Orbax: save, find the latest, restore onto the caller's
devices, refuse a checkpoint from a different run.

A checkpoint of step `s` is the directory `<directory>/<s>/` written by one
`orbax.checkpoint.CheckpointManager.save` with three items:

- "state": the state pytree (a `DiLoCoState`, `SyncState`, or any pytree of arrays), through
  `StandardSave` (TensorStore/OCDBT, every array bit-exact in its own dtype and shape).
- "metadata": the caller's JSON dict (the run's `fingerprint` plus e.g. "data_position").
- "checksums": this module's CRC-32s of the state, checked after each restore: one per leaf
  on a single device, one per shard (keyed by its index range) for a leaf over several
  devices, each computed from that shard's own bytes (never a host copy of the whole leaf). A
  restore onto another layout checks the shards whose index ranges it shares with the save.

Atomicity is Orbax's: a save is written under `<s>.orbax-checkpoint-tmp*` and renamed to `<s>`
only once every item is complete, and only names without that suffix count as steps (on GCS,
where renames are not atomic, a step counts once its `commit_success.txt` is written). A crash
mid-save therefore leaves a temporary directory that `latest_step` and `restore` never pick
(the next `save` deletes it). `save` is synchronous: when it returns, the files are written
(TensorStore syncs them) and the directory renamed. `Saver` writes in the background
(Orbax's asynchronous checkpointing): its `save` returns once the state is copied off the
devices, and the next `save` or `close` waits for the write in flight; a run killed while one
is in flight leaves only a temporary directory, so a resume takes the last complete one.

A finished checkpoint that is damaged afterwards (a file deleted, truncated or flipped) fails to
read, or reads back bytes whose CRC-32 differs: `restore` warns naming that step and falls back
to the previous one.
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

STATE, METADATA, CHECKSUMS = "state", "metadata", "checksums"
FORMAT_VERSION = 2  # 2: per-shard CRCs for leaves over several devices; 1 is still read
# Metadata keys that record progress rather than identity: never compared on restore.
PROGRESS_KEYS = frozenset({"data_position"})


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
      metadata: JSON-able dict, e.g. `fingerprint(params, ...) | {"data_position": n}`.
      keep: how many checkpoints to keep (oldest steps are deleted), >= 1.

    Returns None once the checkpoint is complete on disk (synchronous; `Saver` writes in the
    background). Raises ValueError for a bad step, keep or metadata. Every process of a
    multi-process run must call it.
    """
    saver = Saver(directory, keep=keep, background=False)
    try:
        saver.save(step, state, metadata)
    finally:
        saver.close()


class Saver:
    """Saves checkpoints of one run into `directory` (as `save` does), keeping the last
    `keep`. With `background` (the default), `save` returns once the state is copied off the
    devices (the caller may then donate or overwrite it) and the files are written while the
    caller goes on; the next `save` and `close` wait for the one in flight, also in a
    multi-process run (each process writes its shards). Call `close` when done (it raises
    what a background write raised)."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, background: bool = True):
        _check_int("keep", keep, 1)
        # Multi-process too: Orbax's background commit waits at the distributed client's
        # barriers, not at collectives, so it cannot mix with the run's own collectives, and
        # `save` waits for the commit in flight before the next save's barriers.
        # (tests/test_multiprocess.py saves while both processes all-reduce.)
        self.background = background
        self._manager = _manager(directory, keep=keep, create=True, background=self.background)

    def save(self, step: int, state: Any, metadata: dict[str, Any]) -> None:
        """Starts (background) or writes checkpoint `step`; see `save` for the arguments."""
        _check_int("step", step, 0)
        if not isinstance(metadata, dict):
            raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
        metadata = _json_normalized(metadata, "metadata")
        checksums = {"format": FORMAT_VERSION, "crc32": leaf_checksums(state)}
        manager = self._manager
        manager.wait_until_finished()  # the one in flight: its step counts from here on
        latest = manager.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"checkpoint step {step} must be after the latest step {latest} already in "
                f"{manager.directory}"
            )
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
            self._manager.close()


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
        way). NumPy and Python scalar leaves come back as such.
      expected_metadata: what the saved metadata must agree with, e.g.
        `fingerprint(params, ...)`: every top-level key but `PROGRESS_KEYS` is compared.

    Returns:
      (state, metadata, step): the state as `like_state`'s pytree type with bit-exact values,
      the saved metadata dict, the step; or None when `directory` holds no checkpoint.

    Raises:
      ValueError naming `directory` and the field when the checkpoint belongs to another run
      (metadata differs from `expected_metadata`, or the state's leaves differ from
      `like_state`'s in path, shape or dtype); ValueError when no checkpoint is readable.
      A damaged checkpoint is skipped with a RuntimeWarning naming its step.
    """
    if not isinstance(expected_metadata, dict):
        raise ValueError(
            f"expected_metadata must be a dict, got {type(expected_metadata).__name__}"
        )
    expected_metadata = _json_normalized(expected_metadata, "expected_metadata")
    steps = all_steps(directory)
    if not steps:
        return None
    failures: list[str] = []
    with _manager(directory, create=False) as manager:
        where = str(manager.directory)
        for step in reversed(steps):
            try:
                metadata, checksums = _read_json_items(manager, step)
                saved_tree = manager.item_metadata(step)[STATE]
            except Exception as error:  # any read failure is damage: try an older step
                failures.append(_skip(where, step, error))
                continue
            check_metadata(metadata, expected_metadata, where=f"{where} (step {step})")
            like = _layout_of(saved_tree, like_state)
            check_state_matches(saved_tree, like, where=f"{where} (step {step})")
            try:
                state = _read_state(manager, step, like, saved_tree)
                _verify_checksums(state, checksums)
            except Exception as error:
                failures.append(_skip(where, step, error))
                continue
            if like is not like_state:
                state = type(like_state).from_legacy(state, like_state)
            return state, metadata, step
    raise ValueError(f"no valid checkpoint in checkpoint_dir {where}: " + "; ".join(failures))


def check_metadata(saved: dict[str, Any], expected: dict[str, Any], *, where: str) -> None:
    """Raises ValueError naming `where` and every differing field when `saved` disagrees with
    `expected` on a top-level key of `expected` (other than `PROGRESS_KEYS`)."""
    problems = []
    for key in sorted(expected.keys() - PROGRESS_KEYS):
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
    if checksums.get("format") not in (1, FORMAT_VERSION):
        raise ValueError(f"unknown checksum format {checksums.get('format')!r}")
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

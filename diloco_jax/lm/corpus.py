"""The bundled corpus: the default LM data, the same bytes on every Python.

`diloco_jax/data/cpython311_stdlib.tar.xz` holds the first 4,000,000 bytes of the `.py` files
of CPython 3.11.7's standard library, in the order and with the skips of the "stdlib" source
(`diloco_jax.lm.data`), each file a tar member named by its path under `Lib/`; the last file
is cut where the 4,000,000 bytes end. So on Python 3.11.7, `load_source("bundled")` and
`load_source("stdlib", max_bytes=4_000_000)` are the same documents, byte for byte, and on any
other Python the bundled one stays those bytes (a running interpreter's own standard library
differs from one version to the next). The files are under the PSF License Agreement
(`diloco_jax/data/PYTHON-LICENSE.txt`, Python's own LICENSE file).

Maintainers rebuild the archive with the interpreter it is to copy (the archive's bytes depend
on nothing else: members in order, times and owners zeroed):

    python3.11 -m diloco_jax.lm.build_corpus diloco_jax/data/cpython311_stdlib.tar.xz

and then update SHA256 below (`load_documents` refuses an archive whose documents do not hash
to it).
"""

import hashlib
import io
import lzma
import tarfile
from collections.abc import Iterable, Sequence
from importlib import resources

import numpy as np

ARCHIVE = "data/cpython311_stdlib.tar.xz"
# data.checksum of the documents: names and bytes, in order.
SHA256 = "989ebbe92ce5794443537747f969e0f5b3c6237fffcc5fe93f445c10d0decf71"
NUM_BYTES = 4_000_000
DESCRIPTION = (
    "the first 4,000,000 bytes of CPython 3.11.7's standard library .py files "
    "(PSF License Agreement), shipped with the package"
)


def checksum(documents: Sequence[tuple[str, np.ndarray]]) -> str:
    """sha256 hex digest over, per document in order: name (UTF-8), NUL, 8-byte length, bytes."""
    h = hashlib.sha256()
    for name, data in documents:
        h.update(name.encode("utf-8") + b"\0")
        h.update(int(data.size).to_bytes(8, "little"))
        h.update(np.ascontiguousarray(data, dtype=np.uint8).tobytes())
    return h.hexdigest()


def load_documents() -> list[tuple[str, bytes]]:
    """The bundled corpus as [(name, bytes)] in order. Raises ValueError if the archive
    does not hold the documents SHA256 names (a damaged or replaced file)."""
    with resources.files("diloco_jax").joinpath(ARCHIVE).open("rb") as f:
        return verified(read_archive(f.read()))


def verified(documents: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """`documents` as they are if they hash to SHA256; else a ValueError."""
    digest = checksum([(name, np.frombuffer(data, np.uint8)) for name, data in documents])
    if digest != SHA256:
        raise ValueError(
            f"the bundled corpus diloco_jax/{ARCHIVE} is damaged: its documents hash to "
            f"{digest}, not {SHA256}; reinstall the package"
        )
    return documents


def read_archive(blob: bytes) -> list[tuple[str, bytes]]:
    """[(member name, bytes)] of an xz-compressed tar, in member order (regular files)."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:xz") as tar:
        for member in tar:
            if member.isfile():
                out.append((member.name, tar.extractfile(member).read()))
    return out


def write_archive(documents: Iterable[tuple[str, bytes]]) -> bytes:
    """An xz-compressed tar of `documents` whose bytes depend only on the documents."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in documents:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(raw.getvalue(), preset=9 | lzma.PRESET_EXTREME)

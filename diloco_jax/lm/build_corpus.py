"""Maintainers' tool: writes the bundled corpus's archive (`diloco_jax.lm.corpus`) from the
running interpreter's standard library.

    python3.11 -m diloco_jax.lm.build_corpus diloco_jax/data/cpython311_stdlib.tar.xz
"""

import sys
from pathlib import Path

from diloco_jax.lm.corpus import NUM_BYTES, write_archive
from diloco_jax.lm.data import load_source


def main(argv: list[str]) -> int:
    """Writes the archive of the running interpreter's standard library to argv[0]."""
    if len(argv) != 1:
        print("usage: python -m diloco_jax.lm.build_corpus OUT.tar.xz", file=sys.stderr)
        return 2
    source = load_source("stdlib", max_bytes=NUM_BYTES)
    Path(argv[0]).write_bytes(
        write_archive((name, data.tobytes()) for name, data in source.documents)
    )
    print(f"wrote {argv[0]}: {source.info['num_documents']} files, sha256 {source.info['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

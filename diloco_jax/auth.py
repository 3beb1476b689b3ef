"""Only the run's own processes: every message a worker sends the syncer proves the run's
secret, and the syncer refuses (and logs, with the caller's address) any message that does
not. Nothing from a refused call is read further, merged or answered with θ.

The secret is bytes every process of the run holds, at least MIN_SECRET_BYTES long: the
environment variable DILOCO_JAX_SECRET, or a file (`--secret-file`). `python -m
diloco_jax.elastic run` makes one (OUT/secret, mode 0600) the first time and hands it to the
processes it starts; `syncer` and `worker` started on their own need one of the two.

The proof is a MAC in front of each message:

- a call (Join, Heartbeat, Next, a push's header) is MAC ‖ sent ‖ nonce ‖ body, the MAC (an
  HMAC-SHA256, 32 bytes) over the call's name, the syncer's epoch (16 random bytes it draws
  at each start and tells anyone who asks: the Epoch call), `sent` (the sender's wall clock,
  8 bytes), a random 16-byte nonce and the body. The syncer refuses one sent more than
  WINDOW_S from its own clock, whose nonce it has seen in that window, or made for another
  epoch: a recorded call replayed (a Join that would evict a live worker) is refused, by this
  syncer process or by the next one after a restart.
- each piece of a push's leaves is tag ‖ piece: a Poly1305 tag (16 bytes) of the piece's bytes
  under a key used once, the HMAC-SHA256 of the header's MAC and the piece's index: a piece
  can't be moved into another push or another place in the same one. (Poly1305, from the
  `cryptography` package, is about seven times as fast as HMAC-SHA256 here: the bulk of a
  push's bytes pass it.)

What it does not do: encrypt. θ and the deltas cross the network readable by whoever can
capture it (as torchft's and gloo's traffic does); across untrusted networks run the syncer's
port through a tunnel or VPN. The syncer's replies are not signed: a worker trusts the
address it was given.
"""

import hashlib
import heapq
import hmac
import os
import secrets
import struct
import threading
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.poly1305 import Poly1305

SECRET_ENV = "DILOCO_JAX_SECRET"
MIN_SECRET_BYTES = 16
WINDOW_S = 300.0  # how far a call's clock may be from the syncer's (hosts run NTP)
MAC_BYTES, STAMP_BYTES, NONCE_BYTES, EPOCH_BYTES, TAG_BYTES = 32, 8, 16, 16, 16
CALL_HEAD = MAC_BYTES + STAMP_BYTES + NONCE_BYTES


class Refused(ValueError):
    """A message that does not prove the run's secret (or is stale, or replayed)."""


def new_secret() -> bytes:
    """A fresh random secret (64 hex characters)."""
    return secrets.token_hex(32).encode()


def load_secret(path: str | os.PathLike | None) -> bytes:
    """The run's secret: the file at `path` (its bytes, a trailing newline dropped) or, with
    None, the environment variable DILOCO_JAX_SECRET. ValueError naming where it looked when
    there is none or it is shorter than MIN_SECRET_BYTES."""
    if path is not None:
        try:
            secret = Path(path).read_bytes().rstrip(b"\r\n")
        except OSError as error:
            raise ValueError(
                f"--secret-file {str(path)!r} can't be read: {error.strerror}"
            ) from None
        where = f"--secret-file {str(path)!r}"
    else:
        secret = os.environb.get(SECRET_ENV.encode(), b"")
        where = f"${SECRET_ENV}"
        if not secret:
            raise ValueError(
                f"the run's secret is missing: set {SECRET_ENV} or pass --secret-file (every "
                "process of the run needs the same one; `run` makes one for the processes it "
                "starts)"
            )
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{where} holds {len(secret)} bytes; a secret needs at least "
                         f"{MIN_SECRET_BYTES}")  # fmt: skip
    return secret


def write_secret(path: Path) -> bytes:
    """The secret at `path`, made there (mode 0600, before any byte is written) if missing."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(new_secret() + b"\n")
    return load_secret(path)


def _mac(secret: bytes, *parts: bytes | memoryview) -> bytes:
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(part)
    return digest.digest()


def _piece_key(secret: bytes, head: bytes, index: int) -> bytes:
    """The one-time Poly1305 key of piece `index` of the push whose header frame is `head`
    (its MAC is unique: it covers a fresh random nonce)."""
    return _mac(secret, b"piece", head[:MAC_BYTES], struct.pack("<q", index))


class Signer:
    """A worker's side: frames its messages with their MACs."""

    def __init__(self, secret: bytes):
        self.secret = secret

    def call(self, name: str, body: bytes, epoch: bytes) -> bytes:
        """The frame of call `name` carrying `body`, for the syncer of `epoch`."""
        stamp = struct.pack("<d", time.time())
        nonce = secrets.token_bytes(NONCE_BYTES)
        mac = _mac(self.secret, name.encode(), epoch, stamp, nonce, body)
        return mac + stamp + nonce + body

    def part(self, head: bytes, index: int, body: bytes | memoryview) -> bytes:
        """The frame of piece `index` of the push whose header frame is `head`."""
        return Poly1305.generate_tag(_piece_key(self.secret, head, index), body) + body


class Verifier:
    """The syncer's side: checks each frame and returns its body, or raises Refused. Its
    `epoch` is drawn afresh for each syncer process."""

    def __init__(self, secret: bytes, window: float = WINDOW_S):
        self.secret, self.window = secret, window
        self.epoch = secrets.token_bytes(EPOCH_BYTES)
        # The nonces of the calls taken, until their time is outside the window everywhere.
        self._seen: set[bytes] = set()
        self._expiry: list[tuple[float, bytes]] = []  # a heap of (when to forget, nonce)
        self._lock = threading.Lock()

    def call(self, name: str, frame: bytes) -> bytes:
        """The body of a call's frame."""
        if len(frame) < CALL_HEAD:
            raise Refused(f"a {name} call without the run's secret (a {len(frame)}-byte frame)")
        mac, stamp = frame[:MAC_BYTES], frame[MAC_BYTES : MAC_BYTES + STAMP_BYTES]
        nonce, body = frame[MAC_BYTES + STAMP_BYTES : CALL_HEAD], frame[CALL_HEAD:]
        expected = _mac(self.secret, name.encode(), self.epoch, stamp, nonce, body)
        if not hmac.compare_digest(mac, expected):
            raise Refused(
                f"a {name} call without the run's secret or for another syncer epoch (its MAC "
                "does not match)"
            )
        (sent,) = struct.unpack("<d", stamp)
        now = time.time()
        if not abs(now - sent) <= self.window:
            raise Refused(f"a {name} call stamped {sent - now:+.0f} s from the syncer's clock "
                          f"(beyond {self.window:g} s: replayed late, or a clock off)")  # fmt: skip
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if nonce in self._seen:
                raise Refused(f"a {name} call replayed (its nonce was taken before)")
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (max(sent, now) + self.window, nonce))
        return body

    def part(self, head: bytes, index: int, frame: bytes) -> memoryview:
        """The body of piece `index` of the push whose header frame is `head` (a view of
        `frame`, not a copy)."""
        tag, body = frame[:TAG_BYTES], memoryview(frame)[TAG_BYTES:]
        try:
            if len(frame) < TAG_BYTES:
                raise InvalidSignature
            Poly1305.verify_tag(_piece_key(self.secret, head, index), body, tag)
        except InvalidSignature:
            raise Refused(f"piece {index} of a push without the run's secret") from None
        return body

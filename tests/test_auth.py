"""Only the run's members: the secret's MAC on every message (`diloco_jax.auth`), and the
syncer's gRPC service refusing any call that does not prove it, before it reads it."""

import hmac
import logging
import os
import re
import struct
import time

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives.poly1305 import Poly1305
from elastic_linear import make_task

from diloco_jax import auth, rpc, wire
from diloco_jax.elastic import main
from diloco_jax.elastic_task import Elastic
from diloco_jax.rpc import SERVICE, SyncerClient, serve
from diloco_jax.syncer import Syncer

SECRET = b"the run's secret for these tests"
OTHER = b"a guess at the run's secret, 32"


def test_a_signed_call_and_its_leaves_verify_and_give_their_bytes_back():
    signer, verifier = auth.Signer(SECRET), auth.Verifier(SECRET)
    head = signer.call("Push", b"header bytes", verifier.epoch)
    assert verifier.call("Push", head) == b"header bytes"
    assert verifier.part(head, 0, signer.part(head, 0, b"leaf 0")) == b"leaf 0"
    assert verifier.part(head, 1, signer.part(head, 1, b"")) == b""
    # A piece's tag is Poly1305 under the one-time key HMAC-SHA256(secret, "piece" ‖ the
    # header's MAC ‖ the index), written out here from the standard library and `cryptography`.
    key = hmac.new(SECRET, b"piece" + head[:32] + struct.pack("<q", 3), "sha256").digest()
    assert signer.part(head, 3, b"abc") == Poly1305.generate_tag(key, b"abc") + b"abc"


@pytest.mark.parametrize(
    "forge, why",
    [
        (lambda s, f, e: auth.Signer(OTHER).call("Join", b"body", e), "MAC does not match"),
        (lambda s, f, e: f[:-1] + b"x", "MAC does not match"),  # the body changed
        (lambda s, f, e: f[:40], "without the run's secret (a 40-byte frame)"),
        (lambda s, f, e: s.call("Heartbeat", b"body", e), "MAC does not match"),  # another's
        (lambda s, f, e: s.call("Join", b"body", bytes(16)), "MAC does not match"),  # epoch
        (lambda s, f, e: b"body", "without the run's secret"),  # no MAC at all
    ],
)  # fmt: skip
def test_a_forged_or_changed_call_is_refused(forge, why):
    signer, verifier = auth.Signer(SECRET), auth.Verifier(SECRET)
    frame = signer.call("Join", b"body", verifier.epoch)
    with pytest.raises(auth.Refused, match=re.escape(why)):
        verifier.call("Join", forge(signer, frame, verifier.epoch))


def test_a_replayed_or_stale_call_is_refused(monkeypatch):
    signer, verifier = auth.Signer(SECRET), auth.Verifier(SECRET)
    frame = signer.call("Join", b"body", verifier.epoch)
    assert verifier.call("Join", frame) == b"body"
    with pytest.raises(auth.Refused, match="replayed"):
        verifier.call("Join", frame)
    with pytest.raises(auth.Refused, match="another syncer epoch"):  # a restarted syncer
        auth.Verifier(SECRET).call("Join", frame)
    now = time.time()
    monkeypatch.setattr(auth.time, "time", lambda: now + auth.WINDOW_S + 1)
    same = auth.Verifier(SECRET)
    same.epoch = verifier.epoch  # only the clock differs
    with pytest.raises(auth.Refused, match=r"stamped -30\d s from the syncer's clock"):
        same.call("Join", frame)
    # Forgotten once outside the window everywhere: the seen set does not grow for ever.
    fresh = signer.call("Join", b"body", verifier.epoch)  # signed at the shifted clock
    assert verifier.call("Join", fresh) == b"body"
    assert len(verifier._seen) == 1


def test_a_piece_moved_within_or_between_pushes_is_refused():
    signer, verifier = auth.Signer(SECRET), auth.Verifier(SECRET)
    head, other = (signer.call("Push", body, verifier.epoch) for body in (b"a", b"b"))
    leaf = signer.part(head, 0, b"leaf")
    with pytest.raises(auth.Refused, match="piece 1 of a push"):
        verifier.part(head, 1, leaf)
    with pytest.raises(auth.Refused, match="piece 0 of a push"):
        verifier.part(other, 0, leaf)
    with pytest.raises(auth.Refused, match="piece 0 of a push"):
        auth.Verifier(OTHER).part(head, 0, leaf)
    with pytest.raises(auth.Refused, match="piece 0 of a push"):
        verifier.part(head, 0, leaf[:-1] + b"F")  # a byte changed
    with pytest.raises(auth.Refused, match="piece 0 of a push"):
        verifier.part(head, 0, leaf[:15])  # shorter than a tag


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="the run's secret is missing: set DILOCO_JAX_SECRET"):
        auth.load_secret(None)
    monkeypatch.setenv(auth.SECRET_ENV, "short")
    with pytest.raises(ValueError, match=r"\$DILOCO_JAX_SECRET holds 5 bytes; .* at least 16"):
        auth.load_secret(None)
    monkeypatch.setenv(auth.SECRET_ENV, SECRET.decode())
    assert auth.load_secret(None) == SECRET
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert auth.load_secret(path) == SECRET  # the file wins over the environment
    with pytest.raises(ValueError, match="--secret-file '/nowhere/s' can't be read"):
        auth.load_secret("/nowhere/s")
    made = tmp_path / "made"
    first = auth.write_secret(made)
    assert len(first) == 64 and os.stat(made).st_mode & 0o777 == 0o600
    assert auth.write_secret(made) == first  # kept: a restarted launcher's processes agree


def _syncer(tmp_path):
    options = Elastic(heartbeat_interval=0.05, heartbeat_timeout=30.0)
    return Syncer(make_task(), options, tmp_path)


def test_leaves_longer_than_a_piece_travel_in_pieces_and_arrive_whole(tmp_path, monkeypatch):
    """θ to a worker and its delta back through a real server, with pieces of 8 bytes: the
    3-float32 leaf "w" travels as 8 + 4 bytes and arrives exactly."""
    monkeypatch.setattr(rpc, "PIECE_BYTES", 8)
    w = np.asarray([1.5, -2.0, 4.0], np.float32)
    assert [len(p) for p in rpc.pieces(w)] == [8, 4]
    s = _syncer(tmp_path)
    incs = [s.join(m, None)["incarnation"] for m in range(4)]  # the round opens
    server, port = serve(s, 0, SECRET)
    client = SyncerClient(f"127.0.0.1:{port}", SECRET, syncer_timeout=5.0)
    try:
        me = {"worker": 0, "incarnation": incs[0]}
        reply = client.call("Next", {**me, "after": -1, "timeout": 5.0})
        assert reply["status"] == "round"
        expected = [np.float32(0.5).tobytes(), np.asarray([0.3, -0.2, 0.1], np.float32).tobytes()]
        assert [bytes(x) for x in reply["theta"]] == expected  # leaves "b", "w"
        header = {**me, "serial": reply["serial"], "loss": 1.0}
        assert client.push(header, [np.float32(0.25), w], lambda i: None) == {"status": "ok"}
        pushed = s.rule.pushed[0].leaves
        assert np.asarray(pushed["b"]) == np.float32(0.25)
        np.testing.assert_array_equal(np.asarray(pushed["w"]), w)
    finally:
        client.close()
        server.stop(grace=None)


def test_a_process_without_the_secret_cannot_join_heartbeat_push_or_read_theta(tmp_path, caplog):
    s = _syncer(tmp_path)
    member = s.join(0, None)["incarnation"]
    theta = {k: np.array(v) for k, v in s.theta.items()}
    server, port = serve(s, 0, SECRET)
    address = f"127.0.0.1:{port}"
    stranger = SyncerClient(address, OTHER, syncer_timeout=1.0)
    me = {"worker": 0, "incarnation": member}
    calls = [
        lambda: stranger.call("Join", {"worker": 1, "incarnation": None}),
        lambda: stranger.call("Heartbeat", me),
        lambda: stranger.call("Next", {**me, "after": -1, "timeout": 0.1}),
        lambda: stranger.push(
            {**me, "serial": 0, "loss": 0.0}, [np.float32(1)] * 2, lambda i: None
        ),
    ]
    try:
        with caplog.at_level(logging.WARNING, logger="diloco_jax.syncer"):
            for call in calls:
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Bytes that are no signed frame at all (an old client, a port scanner).
            raw = grpc.insecure_channel(address).unary_unary(f"/{SERVICE}/Join")
            with pytest.raises(grpc.RpcError) as refused:
                raw(wire.pack({"worker": 2, "incarnation": None}), timeout=5.0)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # A member's Join recorded and sent again would evict the live worker: refused.
            channel = grpc.insecure_channel(address)
            epoch = channel.unary_unary(f"/{SERVICE}/Epoch")(b"", timeout=5.0)
            body = wire.pack({"worker": 3, "incarnation": None})
            frame = auth.Signer(SECRET).call("Join", body, epoch)
            send = channel.unary_unary(f"/{SERVICE}/Join")
            assert "incarnation" in wire.unpack(send(frame, timeout=5.0))
            joined = s.members[3].incarnation
            with pytest.raises(grpc.RpcError, match="replayed"):
                send(frame, timeout=5.0)
        refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
        # The stranger's four calls each tried twice (the second with the epoch asked anew).
        assert len(refusals) == 10 and all("ipv4:127.0.0.1:" in r for r in refusals)
        assert set(s.members) == {0, 3} and s.members[0].incarnation == member
        assert s.members[3].incarnation == joined
        for name in theta:  # nothing merged
            np.testing.assert_array_equal(s.theta[name], theta[name])
        friend = SyncerClient(address, SECRET, syncer_timeout=1.0)
        assert friend.call("Heartbeat", me) == {"status": "ok"}
        # A member's push as an incarnation the syncer does not hold (worker 0's is `member`).
        with caplog.at_level(logging.WARNING, logger="diloco_jax.syncer"):
            header = {"worker": 0, "incarnation": "an old one", "serial": 0, "loss": 0.0}
            assert friend.push(header, [np.float32(1), np.ones(3, np.float32)], lambda i: None) == {
                "status": "rejoin"
            }
        assert "push from ipv4:127.0.0.1:" in caplog.records[-1].getMessage()
        assert "as worker 0 not merged" in caplog.records[-1].getMessage()
        friend.close()
    finally:
        stranger.close()
        server.stop(grace=None)


def test_the_cli_refuses_a_missing_or_short_secret(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    argv = ["syncer", "--task", "elastic_linear:make_task", "--dir", str(tmp_path / "s")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diloco-jax elastic: the run's secret is missing")
    (tmp_path / "short").write_text("abc\n")
    argv = ["worker", "--task", "elastic_linear:make_task", "--worker", "0", "--syncer",
            "127.0.0.1:9", "--dir", str(tmp_path / "s"),
            "--secret-file", str(tmp_path / "short")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"diloco-jax elastic: --secret-file '{tmp_path / 'short'}' holds 3 bytes; "
                   "a secret needs at least 16"]  # fmt: skip
    assert not (tmp_path / "s").exists()


def test_a_call_recorded_before_a_syncer_restart_is_refused_after_it(tmp_path):
    s = _syncer(tmp_path)
    server, port = serve(s, 0, SECRET)
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address)
    epoch = channel.unary_unary(f"/{SERVICE}/Epoch")(b"", timeout=5.0)
    frame = auth.Signer(SECRET).call("Join", wire.pack({"worker": 1, "incarnation": None}), epoch)
    client = SyncerClient(address, SECRET, syncer_timeout=10.0)
    try:
        member = client.call("Join", {"worker": 0, "incarnation": None})["incarnation"]
        server.stop(grace=None).wait()
        server, _ = serve(s, port, SECRET)  # a new syncer process would draw a new epoch too
        with pytest.raises(grpc.RpcError, match="another syncer epoch"):
            channel.unary_unary(f"/{SERVICE}/Join")(frame, timeout=5.0)
        assert 1 not in s.members
        # A member's own calls go on: its client asks the new epoch after the refusal.
        assert client.call("Heartbeat", {"worker": 0, "incarnation": member}) == {"status": "ok"}
    finally:
        client.close()
        server.stop(grace=None)

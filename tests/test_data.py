"""Tests for diloco_jax.lm.data: tokenizer, sources, splits, shards, samplers."""

import functools
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax.lm import corpus, data


def _docs(*texts):
    return [(f"doc{i}", np.frombuffer(t.encode(), dtype=np.uint8)) for i, t in enumerate(texts)]


@functools.cache
def _stdlib(max_documents=40):
    return data.load_source("stdlib", max_documents=max_documents)


# ---------------------------------------------------------------------------------------
# Tokenizer.


@pytest.mark.parametrize("text", ["", "hello world\n", "naïve — 日本語 🙂 \x00\t", "a" * 1000])
def test_tokenizer_round_trip(text):
    tokens = data.encode(text)
    assert tokens.dtype == np.int32 and tokens.ndim == 1
    assert tokens.size == len(text.encode("utf-8"))
    assert np.all((tokens >= 0) & (tokens < 256))
    assert data.decode(tokens) == text
    assert data.decode(list(tokens)) == text
    assert data.decode(jnp.asarray(tokens)) == text


def test_decode_replaces_invalid_utf8_and_rejects_bad_ids():
    assert data.decode([0xFF, ord("a")]) == "\ufffda"
    with pytest.raises(ValueError, match="tokens"):
        data.decode([256])
    with pytest.raises(ValueError, match="text"):
        data.encode("\ud800")  # lone surrogate: no UTF-8 encoding


# ---------------------------------------------------------------------------------------
# Sources.


def test_stdlib_source_is_deterministic():
    a = _stdlib()
    b = data.load_source("stdlib", max_documents=40)
    assert a.info == b.info
    assert [n for n, _ in a.documents] == [n for n, _ in b.documents]
    info = a.info
    assert info["num_documents"] == 40 == len(a.documents)
    assert info["num_bytes"] == sum(d.size for _, d in a.documents) > 40 * 100
    assert len(info["sha256"]) == 64
    assert info["python_version"] == ".".join(map(str, sys.version_info[:3]))
    names = [n for n, _ in a.documents]
    assert names == sorted(names)
    assert all(n.endswith(".py") for n in names)
    for name, doc in a.documents:
        assert doc.dtype == np.uint8 and doc.size > 0
        parts = name.split("/")
        assert not {"test", "tests", "site-packages", "__pycache__"} & set(parts[:-1])


def test_the_bundled_corpus_is_the_same_bytes_on_every_python():
    """The default source is pinned: 242 files, 4,000,000 bytes and this sha256 (of CPython
    3.11.7's standard library, recorded when the archive was made) on whatever Python runs
    the suite; on 3.11.7 itself it is what "stdlib" reads there, cut at 4,000,000 bytes."""
    source = data.load_source("bundled")
    assert (
        source.info["sha256"] == "989ebbe92ce5794443537747f969e0f5b3c6237fffcc5fe93f445c10d0decf71"
    )
    assert (source.info["num_documents"], source.info["num_bytes"]) == (242, 4_000_000)
    names = [n for n, _ in source.documents]
    assert names[0] == "__future__.py" and names[-1] == "encodings/gb2312.py"
    assert names == sorted(names)
    if sys.version_info[:3] == (3, 11, 7) and sys.implementation.name == "cpython":
        stdlib = data.load_source("stdlib", max_bytes=4_000_000)
        assert stdlib.info["sha256"] == source.info["sha256"]


def test_the_bundled_archive_round_trips_and_refuses_other_documents():
    docs = [("a/b.py", b"x = 1\n"), ("c.py", b"\x00\xff" * 3)]
    blob = corpus.write_archive(docs)
    assert blob == corpus.write_archive(docs)  # bytes that depend on the documents only
    assert corpus.read_archive(blob) == docs
    shipped = corpus.load_documents()
    assert corpus.verified(shipped) is shipped
    damaged = [*shipped[:-1], (shipped[-1][0], shipped[-1][1][:-1])]
    with pytest.raises(ValueError, match="bundled corpus .* is damaged"):
        corpus.verified(damaged)


def test_stdlib_limits_and_checksum_depend_on_contents():
    small = data.load_source("stdlib", max_documents=40, max_bytes=5000)
    assert small.info["num_bytes"] == 5000
    # Same names and prefix as the unlimited load; a different checksum.
    full = _stdlib()
    n = len(small.documents)
    assert [x for x, _ in small.documents] == [x for x, _ in full.documents[:n]]
    np.testing.assert_array_equal(
        small.documents[-1][1], full.documents[n - 1][1][: small.documents[-1][1].size]
    )
    assert small.info["sha256"] != full.info["sha256"]
    assert data.checksum(full.documents) == full.info["sha256"]


def test_text_file_is_split_on_paragraphs(tmp_path):
    paragraphs = [f"Paragraph {i} " + "word " * 300 + "\n" for i in range(20)]
    text = "\n".join(paragraphs) + "ünïcode end\n"
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="utf-8")
    source = data.load_source(f"text:{path}")
    docs = source.documents
    assert len(docs) > 2
    # Lossless: the documents concatenate back to the file.
    assert b"".join(d.tobytes() for _, d in docs) == text.encode("utf-8")
    # Cuts fall right after a blank line, and pieces are about TEXT_DOCUMENT_BYTES.
    for _, d in docs[:-1]:
        assert d.tobytes().endswith(b"\n\n")
        assert data.TEXT_DOCUMENT_BYTES <= d.size < 2 * data.TEXT_DOCUMENT_BYTES
    assert source.info["num_documents"] == len(docs)
    assert source.info["num_bytes"] == len(text.encode("utf-8"))


def test_split_text_falls_back_to_lines():
    text = b"".join(b"line %d of a long file\n" % i for i in range(2000))
    pieces = data.split_text(text, target=1000)
    assert b"".join(pieces) == text
    assert all(p.endswith(b"\n") and len(p) < 1100 for p in pieces[:-1])


def test_text_folder_one_document_per_file(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.md").write_text("second\n\nfile", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "ignored.py").write_text("x = 1", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    source = data.load_source(f"text:{tmp_path}")
    assert [(n, d.tobytes()) for n, d in source.documents] == [
        ("a.txt", b"first"),
        ("b/two.md", b"second\n\nfile"),
    ]


def test_text_folder_of_one_file_is_cut_like_the_file(tmp_path):
    """One document would leave nothing to evaluate on: the lone file is cut in pieces."""
    text = "".join(f"Paragraph {i} " + "word " * 300 + "\n\n" for i in range(20))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "book.txt").write_text(text, encoding="utf-8")
    folder = data.load_source(f"text:{tmp_path / 'corpus'}").documents
    pieces = data.split_text(text.encode("utf-8"))
    assert len(pieces) > 2
    # Fewer than 10 pieces: one digit in the names.
    assert [(n, d.tobytes()) for n, d in folder] == [
        (f"book.txt#{i}", p) for i, p in enumerate(pieces)
    ]


def test_text_bad_paths_raise(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        data.load_source(f"text:{tmp_path / 'missing.txt'}")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ValueError, match="UTF-8"):
        data.load_source(f"text:{tmp_path / 'bad.txt'}")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="no .txt"):
        data.load_source(f"text:{tmp_path / 'sub'}")


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs datasets")
def test_hf_text_builder_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    import datasets

    # The env is read at import; patch the config too in case datasets was imported earlier.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    path = tmp_path / "corpus.txt"
    path.write_text("first para\nline two\n\nsecond para\n\n\nthird ü\n", encoding="utf-8")

    source = data.load_source(f"hf:text:{path}")
    texts = [d.tobytes().decode() for _, d in source.documents]
    assert len(texts) == 3
    assert texts[0].startswith("first para") and "line two" in texts[0]
    assert texts[2].strip() == "third ü"
    assert source.info["hf"] == {"path": "text", "data_files": str(path), "split": "train"}
    again = data.load_source(f"hf:text:{path}:train", max_documents=2)
    assert again.info["num_documents"] == 2
    assert again.info["sha256"] == data.checksum(source.documents[:2])

    with pytest.raises(ValueError, match="no files match"):
        data.load_source(f"hf:text:{tmp_path / 'missing.txt'}")
    with pytest.raises(ValueError, match="hf:no_such_dataset_xyz"):
        data.load_source("hf:no_such_dataset_xyz")


def test_hf_spec_grammar():
    parse = data.parse_hf_spec
    assert parse("hf:wikitext:wikitext-2-raw-v1:validation") == {
        "path": "wikitext",
        "name": "wikitext-2-raw-v1",
        "data_files": None,
        "split": "validation",
    }
    assert parse("hf:roneneldan/TinyStories")["split"] == "train"
    assert parse("hf:text:/data/a.txt")["data_files"] == "/data/a.txt"
    assert parse("hf:json:/data/*.jsonl:test")["split"] == "test"
    assert parse("hf:json:https://host/x.json")["data_files"] == "https://host/x.json"
    for bad in ("hf:", "hf:text", "hf:a:b:c:d"):
        with pytest.raises(ValueError, match="hf data spec"):
            parse(bad)


@pytest.mark.parametrize("spec", ["", "stdlib2", "file:/x", "text:"])
def test_bad_specs_raise(spec):
    with pytest.raises(ValueError, match="spec"):
        data.load_source(spec)


def test_bad_limits_raise():
    with pytest.raises(ValueError, match="max_documents"):
        data.load_source("stdlib", max_documents=0)
    with pytest.raises(ValueError, match="max_bytes"):
        data.load_source("stdlib", max_bytes=-5)


# ---------------------------------------------------------------------------------------
# Splits and concatenation.


def test_split_documents_disjoint_and_deterministic():
    docs = _docs(*[f"document number {i}" for i in range(50)])
    train, val = data.split_documents(docs, 0.2, seed=3)
    assert len(val) == 10 and len(train) == 40
    train_names = [n for n, _ in train]
    val_names = [n for n, _ in val]
    assert not set(train_names) & set(val_names)
    assert sorted(train_names + val_names) == sorted(n for n, _ in docs)
    # Original order is kept within each part.
    order = {n: i for i, (n, _) in enumerate(docs)}
    assert train_names == sorted(train_names, key=order.get)
    again_train, again_val = data.split_documents(docs, 0.2, seed=3)
    assert [n for n, _ in again_val] == val_names
    _, other_val = data.split_documents(docs, 0.2, seed=4)
    assert [n for n, _ in other_val] != val_names


def test_split_documents_edge_cases():
    train, val = data.split_documents(_docs("a", "b"), 0.01, seed=0)
    assert len(train) == 1 and len(val) == 1
    train, val = data.split_documents(_docs("a", "b", "c"), 0.99, seed=0)
    assert len(train) == 1 and len(val) == 2
    with pytest.raises(ValueError, match="documents"):
        data.split_documents(_docs("a"), 0.5, seed=0)
    with pytest.raises(ValueError, match="val_fraction"):
        data.split_documents(_docs("a", "b"), 1.0, seed=0)


def test_concat_documents_separator_and_offsets():
    docs = _docs("ab", "cde", "f")
    tokens, starts = data.concat_documents(docs)
    expected = [97, 98, 0, 99, 100, 101, 0, 102, 0]
    assert tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(starts, [0, 3, 7])
    assert data.DOC_SEPARATOR == 0


# ---------------------------------------------------------------------------------------
# Worker shards.


def _stream(num_docs=30, seed=0):
    rng = np.random.default_rng(seed)
    docs = [
        (f"d{i}", rng.integers(1, 256, size=int(rng.integers(20, 200)), dtype=np.uint8))
        for i in range(num_docs)
    ]
    return data.concat_documents(docs)


@pytest.mark.parametrize("num_workers", [1, 2, 3, 8])
def test_non_iid_shards_whole_documents_disjoint_covering(num_workers):
    tokens, doc_starts = _stream()
    starts, lengths = data.worker_shards(doc_starts, len(tokens), num_workers, "non_iid", 16)
    assert starts.dtype == np.int32 and lengths.dtype == np.int32
    assert starts.shape == lengths.shape == (num_workers,)
    ends = starts + lengths
    # Contiguous, disjoint and covering [0, N).
    assert starts[0] == 0 and ends[-1] == len(tokens)
    np.testing.assert_array_equal(starts[1:], ends[:-1])
    # Every shard boundary is a document boundary.
    boundaries = set(doc_starts.tolist()) | {len(tokens)}
    assert set(starts.tolist()) | set(ends.tolist()) <= boundaries
    assert np.all(lengths >= 17)
    # Balanced up to document granularity (docs are < 201 tokens).
    assert lengths.max() - lengths.min() <= 2 * 201


def test_non_iid_balances_uneven_documents():
    sizes = [1000, 10, 10, 10, 10, 980]
    docs = [(str(i), np.ones(s, np.uint8)) for i, s in enumerate(sizes)]
    tokens, doc_starts = data.concat_documents(docs)
    _, lengths = data.worker_shards(doc_starts, len(tokens), 2, "non_iid", 8)
    assert abs(int(lengths[0]) - int(lengths[1])) <= 40


def test_iid_shards_are_the_whole_stream():
    tokens, doc_starts = _stream()
    starts, lengths = data.worker_shards(doc_starts, len(tokens), 4, "iid", 16)
    np.testing.assert_array_equal(starts, np.zeros(4))
    np.testing.assert_array_equal(lengths, np.full(4, len(tokens)))


def test_shard_errors():
    tokens, doc_starts = _stream(num_docs=4)
    n = len(tokens)
    with pytest.raises(ValueError, match="num_workers"):
        data.worker_shards(doc_starts, n, 5, "non_iid", 8)  # more workers than documents
    with pytest.raises(ValueError, match="seq_len"):
        data.worker_shards(doc_starts, n, 4, "non_iid", 400)
    with pytest.raises(ValueError, match="seq_len"):
        data.worker_shards(doc_starts, n, 2, "iid", n)
    with pytest.raises(ValueError, match="mode"):
        data.worker_shards(doc_starts, n, 2, "random", 8)
    with pytest.raises(ValueError, match="doc_offsets"):
        data.worker_shards(doc_starts[::-1], n, 2, "non_iid", 8)


# ---------------------------------------------------------------------------------------
# Samplers.


def _assert_real_windows(batch, tokens, start, length):
    """Each row is a contiguous slice of `tokens` inside [start, start + length)."""
    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    assert inputs.dtype == np.int32 and targets.dtype == np.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    seq_len = inputs.shape[-1]
    # Every position where the full window matches; the stream is random, so it is unique.
    windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)
    for row_in, row_tg in zip(inputs, targets, strict=True):
        full = np.concatenate([row_in, row_tg[-1:]])
        (hits,) = np.nonzero(np.all(windows == full, axis=1))
        assert hits.size >= 1
        assert np.any((hits >= start) & (hits + seq_len + 1 <= start + length))


def _random_stream(n=3000, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=n).astype(np.int32)


def test_sample_batch_windows_are_real_slices_inside_shard():
    tokens = _random_stream()
    start, length, batch_size, seq_len = 1000, 300, 16, 12
    batch = data.sample_batch(
        jnp.asarray(tokens),
        jnp.int32(start),
        jnp.int32(length),
        jax.random.key(0),
        batch_size,
        seq_len,
    )
    assert batch["inputs"].shape == batch["targets"].shape == (batch_size, seq_len)
    _assert_real_windows(batch, tokens, start, length)
    # A uint8 stream (4x less memory) gives the same int32 batch.
    small = data.sample_batch(
        jnp.asarray(tokens.astype(np.uint8)),
        jnp.int32(start),
        jnp.int32(length),
        jax.random.key(0),
        batch_size,
        seq_len,
    )
    assert small["inputs"].dtype == jnp.int32
    np.testing.assert_array_equal(small["inputs"], batch["inputs"])
    # Tight shard (exactly one window) still stays inside.
    tight = data.sample_batch(
        jnp.asarray(tokens), jnp.int32(50), jnp.int32(seq_len + 1), jax.random.key(1), 4, seq_len
    )
    np.testing.assert_array_equal(tight["inputs"], np.tile(tokens[50 : 50 + seq_len], (4, 1)))


def test_sample_batch_vmapped_over_workers_is_deterministic():
    tokens = _random_stream()
    starts = jnp.array([0, 1000, 2000], jnp.int32)
    lengths = jnp.array([1000, 1000, 1000], jnp.int32)
    keys = jax.random.split(jax.random.key(7), 3)
    sample = jax.jit(
        jax.vmap(
            functools.partial(data.sample_batch, batch_size=8, seq_len=10), in_axes=(None, 0, 0, 0)
        )
    )
    batch = sample(jnp.asarray(tokens), starts, lengths, keys)
    assert batch["inputs"].shape == (3, 8, 10)
    for m in range(3):
        worker = {k: v[m] for k, v in batch.items()}
        _assert_real_windows(worker, tokens, int(starts[m]), int(lengths[m]))
    again = sample(jnp.asarray(tokens), starts, lengths, keys)
    np.testing.assert_array_equal(again["inputs"], batch["inputs"])
    other = sample(jnp.asarray(tokens), starts, lengths, jax.random.split(jax.random.key(8), 3))
    assert not np.array_equal(other["inputs"], batch["inputs"])


def test_round_batches_shapes_keys_and_shards():
    tokens = _random_stream()
    starts = np.array([0, 1500], np.int32)
    lengths = np.array([1500, 1500], np.int32)
    key = jax.random.key(0)
    kwargs = dict(num_workers=2, inner_steps=3, batch_size=4, seq_len=8)
    batches = data.round_batches(jnp.asarray(tokens), starts, lengths, key, 5, **kwargs)
    assert isinstance(batches["inputs"], np.ndarray)
    assert batches["inputs"].shape == batches["targets"].shape == (2, 3, 4, 8)
    for m in range(2):
        for h in range(3):
            step = {k: v[m, h] for k, v in batches.items()}
            _assert_real_windows(step, tokens, int(starts[m]), int(lengths[m]))
    # The documented key derivation reproduces a step's batch.
    single = data.sample_batch(
        jnp.asarray(tokens),
        jnp.int32(starts[1]),
        jnp.int32(lengths[1]),
        data.batch_key(key, 5, 1, 2),
        4,
        8,
    )
    np.testing.assert_array_equal(batches["inputs"][1, 2], single["inputs"])
    again = data.round_batches(tokens, starts, lengths, key, 5, **kwargs)
    np.testing.assert_array_equal(again["inputs"], batches["inputs"])
    next_round = data.round_batches(tokens, starts, lengths, key, 6, **kwargs)
    assert not np.array_equal(next_round["inputs"], batches["inputs"])
    with pytest.raises(ValueError, match="num_workers"):
        data.round_batches(tokens, starts, lengths, key, 0, **{**kwargs, "num_workers": 3})


def test_eval_batches_fixed_non_overlapping():
    tokens = _random_stream(n=500)
    batches = data.eval_batches(tokens, num_batches=3, batch_size=4, seq_len=10)
    assert batches["inputs"].shape == batches["targets"].shape == (3, 4, 10)
    again = data.eval_batches(tokens, num_batches=3, batch_size=4, seq_len=10)
    np.testing.assert_array_equal(again["inputs"], batches["inputs"])
    np.testing.assert_array_equal(batches["inputs"][..., 1:], batches["targets"][..., :-1])
    # Windows are evenly spaced, in order, non-overlapping, and span the stream.
    firsts = batches["inputs"].reshape(12, 10)
    stride = (500 - 11) // 11
    for w in range(12):
        np.testing.assert_array_equal(firsts[w], tokens[w * stride : w * stride + 10])
    assert stride >= 11 and 11 * stride + 11 <= 500
    with pytest.raises(ValueError, match="val_tokens"):
        data.eval_batches(tokens[:100], num_batches=3, batch_size=4, seq_len=10)


def test_text_folder_does_not_follow_symbolic_links(tmp_path):
    """Issue 40, finding 8: a text: folder read the files its symbolic links pointed to,
    outside it. Like the stdlib source, it reads what the folder holds and follows none."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not part of the corpus", encoding="utf-8")
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("first", encoding="utf-8")
    (folder / "sub" / "b.md").write_text("second", encoding="utf-8")
    (folder / "link.txt").symlink_to(outside / "secret.txt")
    (folder / "linked").symlink_to(outside, target_is_directory=True)
    source = data.load_source(f"text:{folder}")
    assert [(n, d.tobytes()) for n, d in source.documents] == [
        ("a.txt", b"first"),
        ("sub/b.md", b"second"),
    ]


def _bytes_read() -> int:
    """This process's bytes read through read(2) and its kin so far (Linux's rchar)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/io is Linux's")
def test_max_bytes_reads_only_the_bytes_it_keeps(tmp_path):
    """Issue 40, finding 8: --max-bytes read the whole file and then kept its start. Only the
    kept bytes are read now: of a 4 MB file, 1000 kept (past them it is not even UTF-8);
    of a folder, the files up to the limit, the last one only up to it."""
    head = "".join(f"Paragraph {i}: words and more words.\n\n" for i in range(100)).encode()
    path = tmp_path / "big.txt"
    path.write_bytes(head + b"\xff" * (4 << 20))
    before = _bytes_read()
    source = data.load_source(f"text:{path}", max_bytes=1000)
    read = _bytes_read() - before
    assert source.info["num_bytes"] == 1000
    assert b"".join(d.tobytes() for _, d in source.documents) == head[:1000]
    assert read < 64 << 10, read  # the kept bytes, not the 4 MB
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_bytes(head)
    for name in ("b.txt", "c.txt"):
        (folder / name).write_bytes(head + b"x" * (4 << 20))
    before = _bytes_read()
    source = data.load_source(f"text:{folder}", max_bytes=len(head) + 10)
    assert [(n, d.tobytes()) for n, d in source.documents] == [
        ("a.txt", head),
        ("b.txt", head[:10]),
    ]
    assert _bytes_read() - before < 64 << 10  # b.txt's first 10 bytes; c.txt never opened

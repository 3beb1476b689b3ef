"""--tokenizer bytes | bpe:VOCAB: byte-level BPE trained on the train split, cached, lossless,
deterministic; the model's vocabulary follows it; eval reports bits per byte."""

import hashlib
import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest
from reference import assert_cli_refuses

from diloco_jax.lm import experiment
from diloco_jax.lm import model as model_lib
from diloco_jax.lm import tokenizer as tok_lib
from diloco_jax.lm.config import ConfigError, make_config, model_config

WORDS = "the quick brown fox jumps over lazy dog déjà vu 東京 naïve café 😀 def return".split()


def _text(seed: int, words: int = 300) -> str:
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, size=12)) for _ in range(words // 12)]
    return "\n".join(lines) + "\n"


def _docs(n: int = 6) -> list:
    texts = [_text(i) for i in range(n)] + ["x = '<|endoftext|>'\x00\n\tend\n"]
    return [(f"doc{i}", np.frombuffer(t.encode(), np.uint8)) for i, t in enumerate(texts)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tok_lib.CACHE_ENV, str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "spec,kind,vocab",
    [("bytes", "bytes", 256), ("bpe:257", "bpe", 257), ("bpe:32000", "bpe", 32_000)],
)
def test_parse_spec(spec, kind, vocab):
    assert tok_lib.parse_spec(spec) == tok_lib.TokenizerSpec(kind, vocab)


@pytest.mark.parametrize(
    "spec", ["bpe:256", "bpe:0", "bpe:", "bpe", "bpe:+300", "bpe: 300", "bpe:３００", "BPE:300",
             "bytes:1", "sentencepiece:300", "bpe:99999999999", ""]
)  # fmt: skip
def test_bad_specs_are_one_line_errors(spec):
    with pytest.raises(ValueError) as info:
        tok_lib.parse_spec(spec)
    assert "\n" not in str(info.value) and str(info.value).startswith("tokenizer ")
    with pytest.raises(ConfigError, match="^tokenizer "):
        make_config("micro", tokenizer=spec)


def test_bpe_is_lossless_and_keeps_id_0_for_the_separator():
    docs = _docs()
    before = [d.copy() for _, d in docs]
    tok = tok_lib.get_tokenizer("bpe:300", docs)
    assert tok.vocab_size == tok.hf.get_vocab_size() == len(tok.token_bytes) == 300
    encoded = tok.encode_documents(docs)
    for (name, data), (enc_name, ids) in zip(docs, encoded, strict=True):
        assert enc_name == name and ids.dtype == np.int32
        assert ids.min() >= 1 and ids.max() < 300  # id 0 only ever separates documents
        assert tok.to_bytes(ids) == data.tobytes()  # reference: the document itself
        assert tok.hf.decode(ids.tolist()) == data.tobytes().decode()
    assert sum(len(ids) for _, ids in encoded) < sum(d.size for _, d in docs)  # it compresses
    assert all(np.array_equal(a, d) for a, (_, d) in zip(before, docs, strict=True))


def test_bpe_stream_maps_back_to_the_byte_stream():
    from diloco_jax.lm import data as data_lib

    docs = _docs()
    tok = tok_lib.get_tokenizer("bpe:300", docs)
    bpe_stream, _ = data_lib.concat_documents(tok.encode_documents(docs))
    byte_stream, _ = data_lib.concat_documents(docs)
    assert tok.to_bytes(bpe_stream) == byte_stream.astype(np.uint8).tobytes()
    # Each token's byte count, by a second route: byte-level BPE spells a token with one
    # character per byte; the separator (id 0) is one byte, as byte 0 is on the byte path.
    lengths = [1] + [len(tok.hf.id_to_token(i)) for i in range(1, 300)]
    assert np.array_equal(tok.byte_lengths, lengths)


@pytest.mark.slow
def test_training_is_deterministic_across_processes(tmp_path):
    docs = _docs()
    here = tok_lib.train_bpe(docs, 300)
    assert tok_lib.train_bpe(docs, 300) == here
    corpus = tmp_path / "docs.json"
    corpus.write_text(json.dumps([[n, d.tobytes().decode()] for n, d in docs]))
    code = (
        "import json, sys, numpy as np; from diloco_jax.lm.tokenizer import train_bpe; "
        "docs = json.load(open(sys.argv[1])); "
        "docs = [(n, np.frombuffer(t.encode(), np.uint8)) for n, t in docs]; "
        "sys.stdout.write(train_bpe(docs, 300))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, str(corpus)], capture_output=True, text=True, check=True
    )
    assert other.stdout == here


def test_cache_is_keyed_by_data_and_vocab_and_checksummed(tmp_path, monkeypatch):
    docs = _docs()
    first = tok_lib.get_tokenizer("bpe:300", docs)
    path = tmp_path / "cache" / "tokenizers"
    files = sorted(path.iterdir())
    assert [f.name for f in files] == [f"bpe300-{first.info['train_sha256']}.json"]
    assert first.info["sha256"] == hashlib.sha256(files[0].read_bytes()).hexdigest()
    assert first.info["train_sha256"] == hashlib.sha256(b"".join(
        n.encode() + b"\0" + d.size.to_bytes(8, "little") + d.tobytes() for n, d in docs
    )).hexdigest()  # fmt: skip

    def no_training(*args):
        raise AssertionError("trained again instead of loading the cache")

    monkeypatch.setattr(tok_lib, "train_bpe", no_training)
    again = tok_lib.get_tokenizer("bpe:300", docs)
    assert again.info == first.info and again.token_bytes == first.token_bytes
    monkeypatch.undo()
    monkeypatch.setenv(tok_lib.CACHE_ENV, str(tmp_path / "cache"))
    tok_lib.get_tokenizer("bpe:290", docs)  # another vocabulary, another file
    tok_lib.get_tokenizer("bpe:300", docs[1:])  # other data, another file
    assert len(list(path.iterdir())) == 3
    files[0].write_text("{ damaged")  # a damaged file is trained again
    assert tok_lib.get_tokenizer("bpe:300", docs).info == first.info


def test_unwritable_cache_warns_and_still_tokenizes(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(tok_lib.CACHE_ENV, str(tmp_path / "file"))
    tok = tok_lib.get_tokenizer("bpe:300", _docs())
    assert tok.vocab_size == 300 and "could not cache" in capsys.readouterr().err


def test_corpus_too_small_for_the_vocabulary():
    with pytest.raises(ValueError, match="fewer than the 5,000 asked for") as info:
        tok_lib.get_tokenizer("bpe:5000", _docs(2))
    assert "\n" not in str(info.value)


def test_bytes_tokenizer_is_the_identity():
    docs = _docs()
    tok = tok_lib.get_tokenizer("bytes", docs)
    assert tok.encode_documents(docs) == docs and tok.hf is None
    assert np.array_equal(tok.byte_lengths, np.ones(256))


@pytest.mark.parametrize("name,millions", [("60m", 59.0), ("150m", 149.8), ("400m", 388.9)])
def test_bpe_32000_gives_the_papers_parameter_counts(name, millions):
    cfg = make_config("default", model=name, tokenizer="bpe:32000")
    mc = model_config(cfg)
    shapes = jax.eval_shape(model_lib.init_params, mc, jax.random.key(0))
    count = model_lib.count_params(shapes)
    d, hk, f, v = mc.d_model, mc.num_heads * mc.kv_size, mc.d_ff, 32_000
    # Per layer q, k, v, out (4 D HK), MLP (2 D F), two norms; final norm; tied embedding.
    assert count == mc.num_layers * (4 * d * hk + 2 * d * f + 2 * d) + d + v * d
    assert round(count / 1e6, 1) == millions


def _corpus(tmp_path, tokenizer, **overrides):
    folder = tmp_path / "texts"
    folder.mkdir(exist_ok=True)
    for i in range(12):
        (folder / f"part{i:02d}.md").write_text(_text(i, 600))
    cfg = make_config("micro", data=f"text:{folder}", tokenizer=tokenizer, **overrides)
    return cfg, experiment.load_corpus(cfg)


def test_bits_per_byte_and_loss_per_token(tmp_path):
    cfg, corpus = _corpus(tmp_path, "bpe:300")
    targets = corpus.eval_batches["targets"]
    assert corpus.info["tokenizer"]["vocab_size"] == 300 and targets.max() < 300
    tok = tok_lib.get_tokenizer("bpe:300", _train_docs(cfg))
    assert corpus.info["eval_bytes"] == len(tok.to_bytes(targets.ravel()))
    assert corpus.info["eval_tokens"] == targets.size
    # total nats / (ln 2 x bytes), from a mean loss per token
    loss = 2.5
    expected = loss * targets.size / (math.log(2) * corpus.info["eval_bytes"])
    got = experiment.bits_per_byte(loss, corpus.eval_bytes_per_token)
    assert got == pytest.approx(expected, rel=1e-12)
    # The byte path: one byte per token, so bits per byte is loss / ln 2 exactly.
    _, byte_corpus = _corpus(tmp_path, "bytes")
    assert byte_corpus.eval_bytes_per_token == 1.0
    assert experiment.bits_per_byte(loss, 1.0) == loss / math.log(2)


def _train_docs(cfg):
    from diloco_jax.lm import data as data_lib

    source = data_lib.load_source(cfg.data, max_bytes=cfg.max_bytes)
    return data_lib.split_documents(source.documents, cfg.val_fraction, cfg.seed)[0]


@pytest.mark.parametrize(
    "tokenizer,message",
    [("bpe:256", "tokenizer"), ("bpe:x", "tokenizer"), ("bpe:100000", "fewer than")],
)
def test_cli_bad_tokenizer_is_one_line_exit_2_and_writes_nothing(
    tmp_path, capsys, tokenizer, message
):
    corpus = tmp_path / "small"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(_text(i, 700))
    out = tmp_path / "out"
    argv = ["train", "--preset", "micro", "--data", f"text:{corpus}", "--tokenizer", tokenizer]
    assert_cli_refuses([*argv, "--out", str(out), "--no-progress"], message, capsys, out)

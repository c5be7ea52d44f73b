"""The data pipeline: default corpus offline, fixed split, reproducible batches, clear errors."""
import json
import math

import numpy as np
import pytest

from gpullm_lessons import data
from gpullm_lessons.data import BatchSampler, byte_unigram_entropy, decode, encode, load_corpus


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_default_corpus_is_local_and_large(corpus):
    assert corpus.tokens.dtype == np.uint8
    assert len(corpus.tokens) > 400_000
    assert corpus.name == "pydoc-topics" and "pydoc_data" in corpus.source
    # exactly the documented recipe: topics joined in sorted key order with blank lines, UTF-8
    from pydoc_data.topics import topics
    expected = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    assert corpus.tokens.tobytes() == expected
    assert decode(corpus.tokens) == expected.decode("utf-8")


def test_no_network_needed(monkeypatch):
    import socket

    def refuse(*a, **k):
        raise AssertionError("load_corpus tried to open a network connection")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert len(load_corpus().tokens) > 400_000


def test_split_is_first_90_percent_then_last_10(corpus):
    n = len(corpus.tokens)
    assert len(corpus.train) == n * 9 // 10
    assert len(corpus.train) + len(corpus.val) == n
    assert np.array_equal(np.concatenate([corpus.train, corpus.val]), corpus.tokens)
    assert 0.099 < len(corpus.val) / n < 0.101
    assert data.split_sizes(10) == (9, 1) and data.split_sizes(11) == (9, 2)


def test_batches_shapes_range_and_shift(corpus):
    s = BatchSampler(corpus.train, B=8, T=32, seed=0)
    for _ in range(20):
        x, y = next(s)
        assert x.shape == y.shape == (8, 32)
        assert x.dtype == y.dtype == np.int32
        assert x.min() >= 0 and x.max() < 256
        assert np.array_equal(x[:, 1:], y[:, :-1])  # y is x shifted left by one
    # each row is a real window of the stream: find it and check the target of the last position
    x, y = next(s)
    stream = corpus.train.tobytes()
    for b in range(8):
        start = stream.find(bytes(x[b].astype(np.uint8).tobytes()) + bytes([y[b, -1]]))
        assert start >= 0


def test_batches_reach_both_ends():
    tokens = np.arange(20, dtype=np.uint8)
    s = BatchSampler(tokens, B=64, T=4, seed=1)
    starts = set()
    for _ in range(20):
        x, y = next(s)
        assert y.max() <= 19  # never past the end
        starts.update(x[:, 0].tolist())
    assert starts == set(range(0, 16))  # every offset 0 .. len-T-1 occurs


def test_batches_reproducible_by_seed(corpus):
    a = BatchSampler(corpus.train, 4, 16, seed=123)
    b = BatchSampler(corpus.train, 4, 16, seed=123)
    c = BatchSampler(corpus.train, 4, 16, seed=124)
    for _ in range(5):
        (xa, ya), (xb, yb), (xc, _) = next(a), next(b), next(c)
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    assert not np.array_equal(xa, xc)


def test_sampler_state_resumes(corpus):
    a = BatchSampler(corpus.train, 4, 16, seed=7)
    for _ in range(3):
        next(a)
    state = json.loads(json.dumps(a.state()))  # survives a JSON round trip (checkpoints)
    expected = [next(a) for _ in range(3)]
    b = BatchSampler(corpus.train, 4, 16, seed=0)
    b.set_state(state)
    assert b.batches == 3
    for xe, ye in expected:
        x, y = next(b)
        assert np.array_equal(x, xe) and np.array_equal(y, ye)


def test_entropy_units(corpus):
    assert byte_unigram_entropy(np.array([0, 1, 2, 3], np.uint8)) == pytest.approx(math.log(4))
    assert byte_unigram_entropy(np.array([0, 1, 2, 3], np.uint8), unit="bits") == pytest.approx(2.0)
    assert byte_unigram_entropy(np.zeros(10, np.uint8)) == 0.0
    h = byte_unigram_entropy(corpus.val)
    assert 2.5 < h < math.log(256)  # English text: ~4.5 bits = ~3.1 nats per byte


def test_encode_decode_roundtrip():
    text = "héllo, wörld → ✓"
    assert decode(encode(text)) == text
    assert decode(encode(text)[:2]) == "h\ufffd"  # a cut multi-byte character is replaced, not an error


def test_custom_file(tmp_path):
    p = tmp_path / "small.txt"
    p.write_bytes(b"abcdefghij" * 100)
    c = load_corpus(p, block_size=8)
    assert len(c.tokens) == 1000 and c.name == "small.txt"
    assert len(c.val) == 100


def test_missing_file(tmp_path):
    p = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_corpus(p)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(p)


def test_too_short_file(tmp_path):
    p = tmp_path / "short.txt"
    p.write_bytes(b"x" * 100)
    # block size 64: each split needs 65 bytes, so 10 * 64 + 1 = 641 bytes in all
    with pytest.raises(ValueError, match=r"has 100 bytes.*at least 641 bytes.*block_size\+1 = 65"):
        load_corpus(p, block_size=64)
    assert data.min_bytes(64) == 641
    p.write_bytes(b"x" * 641)
    load_corpus(p, block_size=64)  # exactly enough
    p.write_bytes(b"x" * 640)
    with pytest.raises(ValueError, match="too short"):
        load_corpus(p, block_size=64)


def test_sampler_rejects_short_stream():
    with pytest.raises(ValueError, match="T\\+1"):
        BatchSampler(np.zeros(8, np.uint8), 2, 8)

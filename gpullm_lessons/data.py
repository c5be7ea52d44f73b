"""The course's training data: bytes in, batches of (x, y) token windows out. Nothing is ever downloaded.

Tokens
------
Byte-level: every byte of UTF-8 text is one token, so the vocabulary is the 256 byte values (V = 256) and
there is no tokenizer to train. `decode` turns bytes back into text (a cut in the middle of a multi-byte
character shows as U+FFFD).

Default corpus
--------------
Python ships its own English documentation: the standard-library module `pydoc_data.topics` holds the text
that `help()` prints for the language reference (`help("if")`, `help("SEQUENCES")`, ...). We join the values
of its `topics` dict in sorted key order with blank lines between them: about 465 KB of English prose with some
code, available on every Python install, offline. Any other text file works with `load_corpus(path)`
(the training script's `--data PATH`): its bytes are the tokens.

Split (fixed)
-------------
The first 90% of the bytes are the training split, the last 10% the validation split. Both are contiguous, so
no window of T+1 bytes straddles the two: the model never trains on validation text. Each split needs at least
block_size + 1 bytes (one window of T inputs plus the target of the last one).

The bar to beat
---------------
`byte_unigram_entropy` is the loss (nats per byte) of the best model that ignores context and predicts every
byte from its overall frequency. A GPT that has learned anything about context must go below it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Union

import numpy as np

VOCAB_SIZE = 256  # byte-level tokens
TRAIN_FRACTION = 0.9  # the first 90% of the bytes train, the last 10% validate


def default_text() -> str:
    """The default corpus as text: Python's own help topics (stdlib `pydoc_data.topics`), sorted by key."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def encode(text: Union[str, bytes]) -> np.ndarray:
    """Text -> byte tokens (np.uint8). Strings are encoded as UTF-8."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).copy()


def decode(tokens) -> str:
    """Byte tokens -> text (UTF-8; bytes that do not form a character become U+FFFD)."""
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def split_sizes(n: int) -> tuple[int, int]:
    """(train, val) sizes for n bytes: train gets floor(0.9 n), validation the rest (integer arithmetic)."""
    n_train = n * 9 // 10
    return n_train, n - n_train


def min_bytes(block_size: int) -> int:
    """The fewest bytes that give both splits block_size + 1 bytes.

    The validation split has n - floor(0.9 n) = ceil(n / 10) bytes, and ceil(n / 10) >= block_size + 1 exactly
    when n >= 10 * block_size + 1; the train split (9x bigger) is then long enough too.
    """
    n = 10 * block_size + 1
    assert min(split_sizes(n)) >= block_size + 1
    return n


@dataclasses.dataclass
class Corpus:
    """A token stream and where it came from. `train` / `val` are views of `tokens` (no copies)."""

    tokens: np.ndarray  # (n,) np.uint8, byte tokens
    name: str  # short name, e.g. "pydoc-topics" or the file name
    source: str  # one line: where the bytes came from

    @property
    def n_train(self) -> int:
        return split_sizes(len(self.tokens))[0]

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.n_train]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[self.n_train :]

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError unless each split holds at least block_size + 1 bytes."""
        need = min_bytes(block_size)
        if len(self.tokens) < need:
            n_train, n_val = split_sizes(len(self.tokens))
            raise ValueError(
                f"{self.name} is too short for block size {block_size}: it has {len(self.tokens)} bytes "
                f"({n_train} train + {n_val} validation), and at least {need} bytes are needed "
                f"(at least block_size+1 = {block_size + 1} bytes in each split; validation is the last 10%). "
                f"Use a longer file or a smaller block size.")

    def describe(self) -> str:
        """What the corpus is and where it came from: one line, or two where one would pass 90 characters (a
        notebook wraps output lines past ~100 anywhere, even inside a number)."""
        size = f"{self.name}: {len(self.tokens):,} bytes ({len(self.train):,} train / {len(self.val):,} val)"
        line = f"{size}, from {self.source}"
        return line if len(line) <= 90 else f"{size},\n  from {self.source}"


def load_corpus(path: Optional[Union[str, Path]] = None, block_size: Optional[int] = None) -> Corpus:
    """The default corpus (path=None) or any file read as bytes. With block_size, also check it fits.

    Errors: FileNotFoundError naming a missing path; ValueError for an empty file, and (with block_size) for a
    file too short to give each split block_size + 1 bytes.
    """
    if path is None:
        data = default_text().encode("utf-8")
        corpus = Corpus(encode(data), "pydoc-topics",
                        "Python's built-in help topics (stdlib module pydoc_data.topics), UTF-8 bytes")
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"data file not found: {p}")
        if not p.is_file():
            raise ValueError(f"data path is not a file: {p}")
        data = p.read_bytes()
        if len(data) == 0:
            raise ValueError(f"data file is empty (0 bytes): {p}")
        corpus = Corpus(encode(data), p.name, f"file {p} (raw bytes)")
    if block_size is not None:
        corpus.check_block_size(block_size)
    return corpus


def byte_unigram_entropy(tokens, unit: str = "nats") -> float:
    """Entropy of the byte frequencies in `tokens`: -sum p log p, in nats per byte (unit="bits" for bits).

    This is the cross-entropy loss of the best context-free model of these bytes, the same units as the training
    loss (nats). A model that beats it has learned something about context.
    """
    counts = np.bincount(np.asarray(tokens, dtype=np.uint8), minlength=VOCAB_SIZE).astype(np.float64)
    if counts.sum() == 0:
        raise ValueError("byte_unigram_entropy of an empty token array")
    p = counts[counts > 0] / counts.sum()
    h = float(-(p * np.log(p)).sum())
    if unit == "nats":
        return h
    if unit == "bits":
        return h / np.log(2.0)
    raise ValueError(f"unit must be 'nats' or 'bits', got {unit!r}")


class BatchSampler:
    """Random windows of a token stream: each batch is B windows of T+1 bytes at random offsets.

    x = window[:-1] and y = window[1:], both (B, T) int32: y[b, t] is the byte that follows x[b, t], the target
    the model predicts from x[b, :t+1]. Offsets come from np.random.default_rng(seed), so the same seed gives the
    same batches; `state()` / `set_state()` save and restore the position (for checkpoint / resume).

        sampler = BatchSampler(corpus.train, B=16, T=64, seed=0)
        x, y = next(sampler)          # or: for x, y in sampler: ... (endless)
    """

    def __init__(self, tokens, B: int, T: int, seed: int = 0):
        self.tokens = np.asarray(tokens)
        self.B, self.T, self.seed = int(B), int(T), seed
        if self.B < 1 or self.T < 1:
            raise ValueError(f"B and T must be positive, got B={B}, T={T}")
        if len(self.tokens) < self.T + 1:
            raise ValueError(f"a window needs T+1 = {self.T + 1} tokens, but the stream has {len(self.tokens)}")
        self.rng = np.random.default_rng(seed)
        self.batches = 0  # how many batches were drawn

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        # 1. B random start offsets; a window tokens[o : o+T+1] must fit, so o <= len - T - 1
        offsets = self.rng.integers(0, len(self.tokens) - self.T, size=self.B)  # (B,)
        # 2. gather the B windows at once: row b holds tokens[offsets[b] + 0 .. T]
        windows = self.tokens[offsets[:, None] + np.arange(self.T + 1)].astype(np.int32)  # (B, T+1)
        # 3. inputs and next-byte targets
        x = np.ascontiguousarray(windows[:, :-1])  # (B, T)
        y = np.ascontiguousarray(windows[:, 1:])  # (B, T)
        self.batches += 1
        return x, y

    next_batch = __next__

    def state(self) -> dict:
        """The position in the batch stream (JSON-serialisable)."""
        return {"seed": self.seed, "batches": self.batches, "rng": self.rng.bit_generator.state}

    def set_state(self, state: dict) -> None:
        """Continue from a `state()`: the next batch is the one that would have come next."""
        self.seed = state["seed"]
        self.batches = int(state["batches"])
        self.rng.bit_generator.state = state["rng"]

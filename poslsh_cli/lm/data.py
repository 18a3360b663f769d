"""Corpora for training and evaluation: the documents (:mod:`poslsh_cli.lm.documents`) split by
document, tokenised into tokens with the bytes each token covers (docs/THEORY.md, "Token models");
batches and evaluation windows are in :mod:`poslsh_cli.lm.windows`.

Split: every ``val_every``-th document (the last of each run of k) validates, so validation spans
every topic of the corpus; fewer than k documents are joined into one text that splits at
``1 - val_fraction``. The corpus hash covers every document's bytes and the split; it identifies
the data in meta.json and in every checkpoint.

Tokens: bytes (vocabulary 256) for poslsh's byte models, or a checkpoint's own tokenizer. Each
token carries the number of UTF-8 bytes of text it covers, so bits per byte is
``sum NLL / ln 2 / bytes covered`` for any tokenizer. Tokenised corpora are cached as memory-mapped
files keyed by (data hash, tokenizer hash, split), so a multi-GB corpus never sits in memory and a
second run starts at once (``$POSLSH_CACHE``, default ``~/.cache/poslsh``).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.documents import BUILTIN, SEPARATOR, open_documents
from poslsh_cli.core.files import verify_dir, write_dir
from poslsh_cli.lm.checkpoint import load_tokenizer

VOCAB = 256


# ---------------------------------------------------------------------------------------------
# documents


# ---------------------------------------------------------------------------------------------
# tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256): every token covers one byte."""

    name = "bytes"
    vocab_size = VOCAB
    digest = "bytes"

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return ids, np.ones(ids.size, dtype=np.uint8)


class HFTokenizer:
    """A checkpoint's own tokenizer (``AutoTokenizer``, offline); each token covers the UTF-8 bytes
    of its character span (the offset mapping of a fast tokenizer)."""

    def __init__(self, tokenizer: Any, name: str, digest: str):
        self.tok, self.name, self.digest = tokenizer, name, digest
        self.vocab_size = len(tokenizer)
        self.tok.model_max_length = 1 << 62  # documents are encoded whole, then cut into windows

    @classmethod
    def load(cls, path: Path) -> "HFTokenizer":
        path = Path(path)
        try:
            tok = load_tokenizer(path)
        except Exception as exc:
            raise ConfigError(f"{path}: no tokenizer to read text with ({str(exc).splitlines()[0]})") from None
        if not getattr(tok, "is_fast", False):
            raise ConfigError(f"{path}: the tokenizer is not a fast tokenizer (no offsets to count bytes with)")
        # what the tokenizer does (its serialised pipeline), not the bytes of its files: a tokenizer
        # saved again beside a fine-tuned model keeps its digest, so its corpus hash still matches
        spec = tok.backend_tokenizer.to_str()
        return cls(tok, str(path), hashlib.sha256(spec.encode("utf-8")).hexdigest())

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        offs = enc["offset_mapping"]
        # bytes covered: each token's character span, in UTF-8; the spans of consecutive tokens may
        # leave gaps (whitespace folded into the next token): count each character once, to the
        # token whose span ends at or after it
        ends = np.asarray([e for _, e in offs], dtype=np.int64)
        char_bytes = np.fromiter((len(c.encode("utf-8")) for c in text), dtype=np.int64, count=len(text))
        cum = np.concatenate([[0], np.cumsum(char_bytes)])
        ends = np.maximum.accumulate(np.clip(ends, 0, len(text))) if len(ends) else ends
        starts = np.concatenate([[0], ends[:-1]])
        nbytes = cum[ends] - cum[starts]
        return ids, nbytes.astype(np.uint32)


# ---------------------------------------------------------------------------------------------
# the tokenised corpus


@dataclass(frozen=True, eq=False)
class Corpus:
    """A tokenised corpus split by document.

    Attributes:
        train, val: (tokens,) integer arrays (memory-mapped for cached token files).
        val_bytes: (val tokens,) UTF-8 bytes each validation token covers.
        sha256: identifies the documents, the split and (for token models) the tokenizer.
        source: ``builtin``, a path or a dataset name.
        documents, val_documents: how many documents in all and in validation.
        train_text_bytes: UTF-8 bytes of the training documents (passes over them = bytes read /
            this).
    """

    train: np.ndarray
    val: np.ndarray
    val_bytes: np.ndarray
    sha256: str
    source: str
    documents: int
    val_documents: int
    train_text_bytes: int
    tokenizer: str = "bytes"
    meta: dict = field(default_factory=dict)

    def passes(self, tokens_read: float) -> float:
        """Passes over the training tokens that ``tokens_read`` make."""
        return float(tokens_read) / max(1, len(self.train))


def cache_dir() -> Path:
    return Path(os.environ.get("POSLSH_CACHE") or Path.home() / ".cache" / "poslsh").expanduser()


def load_corpus(data: str, val_fraction: float = 0.1, min_tokens: int = 0, val_every: int = 10,
                tokenizer: Any = None, field: str = "text", whole: bool = False, encoding: str = "utf-8") -> Corpus:
    """Read, split and tokenise ``data`` (see the module docstring), its files decoded with
    ``encoding`` (:func:`poslsh_cli.lm.documents.open_documents`).

    ``val_every=k``: every k-th document validates; a single document splits at
    ``1 - val_fraction``. ``whole``: every document is validation text (evaluating on other data).
    Refuses an empty corpus, or a split with fewer than ``min_tokens`` tokens on either side (one
    window). Byte corpora are tokenised in memory; other tokenisers' corpora are written once,
    document by document, to memory-mapped files in the cache.
    """
    tok = tokenizer or ByteTokenizer()
    source, docs = open_documents(data, field, encoding)
    split = f"every {val_every}th document" if not whole else "all validation"
    decoded = f"|{encoding}" if source.kind in ("files", "jsonl") and encoding != "utf-8" else ""  # utf-8: as before
    identity = f"{source.digest}|{tok.digest}|{val_every}|{val_fraction}|{whole}{decoded}"
    key = hashlib.sha256(identity.encode()).hexdigest()
    meta = {"source": BUILTIN if source.kind == "builtin" else source.description, "source_sha256": source.digest,
            "kind": source.kind, "split": split, "tokenizer": tok.name}
    if source.kind in ("files", "jsonl"):
        meta["encoding"] = encoding
    if isinstance(tok, ByteTokenizer):
        sink = _MemorySink()
        _tokenise(docs, tok, val_every, val_fraction, whole, sink)
        corpus = sink.corpus(key, meta)
    else:
        corpus = _load_cached(key, meta) or _cache(key, meta, lambda s: _tokenise(docs, tok, val_every, val_fraction,
                                                                                  whole, s))
    if not corpus.meta.get("nonblank_documents", 1):
        empty = corpus.train_text_bytes + int(np.asarray(corpus.val_bytes, dtype=np.int64).sum()) == 0
        raise ConfigError(f"data={data}: the text is empty" + (f" ({source.description} has 0 bytes)" if empty else ""))
    if len(corpus.val) < min_tokens or (not whole and len(corpus.train) < min_tokens):
        docs_text = f"{corpus.documents} document" + ("s leave" if corpus.documents != 1 else " leaves")
        raise ConfigError(f"data={data}: {docs_text} {len(corpus.train)} tokens for training "
                          f"and {len(corpus.val)} for validation, fewer than one window of {min_tokens} tokens")
    return corpus


class _MemorySink:
    """Token arrays collected in memory (byte corpora)."""

    def __init__(self) -> None:
        self.parts: dict[str, list] = {"train": [], "val": [], "val_bytes": []}
        self.counts = {"documents": 0, "val_documents": 0, "train_text_bytes": 0, "nonblank": 0}

    def add(self, where: str, ids: np.ndarray, nbytes: np.ndarray) -> None:
        self.parts[where].append(ids)
        if where == "val":
            self.parts["val_bytes"].append(nbytes)

    def corpus(self, key: str, meta: dict) -> Corpus:
        def cat(xs: list, dt: Any) -> np.ndarray:
            return np.concatenate(xs).astype(dt) if xs else np.zeros(0, dtype=dt)

        return Corpus(cat(self.parts["train"], np.uint8), cat(self.parts["val"], np.uint8),
                      cat(self.parts["val_bytes"], np.uint32), key, meta["source"], self.counts["documents"],
                      self.counts["val_documents"], self.counts["train_text_bytes"], meta["tokenizer"],
                      {**meta, "nonblank_documents": self.counts["nonblank"]})


class _FileSink:
    """Token arrays appended to raw files (int32 ids, uint32 byte counts) in a directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fh = {n: open(root / f"{n}.bin", "wb") for n in ("train", "val", "val_bytes")}
        self.counts = {"documents": 0, "val_documents": 0, "train_text_bytes": 0, "nonblank": 0}

    def add(self, where: str, ids: np.ndarray, nbytes: np.ndarray) -> None:
        self.fh[where].write(np.asarray(ids, dtype=np.int32).tobytes())
        if where == "val":
            self.fh["val_bytes"].write(np.asarray(nbytes, dtype=np.uint32).tobytes())

    def close(self) -> None:
        for f in self.fh.values():
            f.close()


def _tokenise(docs: Any, tok: Any, val_every: int, val_fraction: float, whole: bool, sink: Any) -> None:
    """Every document to its side of the split, tokenised, each followed by a blank line."""
    import itertools

    sep_ids, sep_bytes = tok.encode(SEPARATOR)
    it = docs()
    head = list(itertools.islice(it, val_every))
    single = len(head) < val_every and not whole  # fewer documents than one run of k: one text, tail validates
    if single:
        head = [("joined", SEPARATOR.join(text for _, text in head))]
    for i, (name, text) in enumerate(itertools.chain(head, it)):
        sink.counts["documents"] += 1
        sink.counts["nonblank"] += bool(text.strip())
        if single:
            cut = len(text) - int(round(len(text) * val_fraction))
            pieces = [("train", text[:cut]), ("val", text[cut:])]
        else:
            pieces = [("val" if whole or (i % val_every == val_every - 1) else "train", text)]
        for where, piece in pieces:
            ids, nbytes = tok.encode(piece)
            if where == "val":
                sink.counts["val_documents"] += 1
            else:
                sink.counts["train_text_bytes"] += int(np.asarray(nbytes, dtype=np.int64).sum())
            sink.add(where, ids, nbytes)
            sink.add(where, sep_ids, sep_bytes)


def _load_cached(key: str, meta: dict) -> Optional[Corpus]:
    d = cache_dir() / "tokens" / key
    if not (d / "meta.json").exists() or verify_dir(d) is not None:
        return None
    try:
        counts = json.loads((d / "meta.json").read_text())
        arrays = {n: np.memmap(d / f"{n}.bin", dtype=np.uint32 if n == "val_bytes" else np.int32, mode="r")
                  if (d / f"{n}.bin").stat().st_size else np.zeros(0, dtype=np.int32)
                  for n in ("train", "val", "val_bytes")}
    except (OSError, ValueError, KeyError):
        return None
    return Corpus(arrays["train"], arrays["val"], arrays["val_bytes"], key, meta["source"], counts["documents"],
                  counts["val_documents"], counts["train_text_bytes"], meta["tokenizer"],
                  {**meta, "cached": str(d), "nonblank_documents": counts.get("nonblank", 1)})


def _cache(key: str, meta: dict, tokenise: Any) -> Corpus:
    """Tokenise into the cache (written whole, with a manifest) and map the result."""
    d = cache_dir() / "tokens" / key

    def fill(tmp: Path) -> None:
        sink = _FileSink(tmp)
        try:
            tokenise(sink)
        finally:
            sink.close()
        (tmp / "meta.json").write_text(json.dumps({**sink.counts, **meta}) + "\n")

    try:
        write_dir(d, fill)
    except OSError as exc:
        raise ConfigError(f"cannot write the token cache {d} ({exc.strerror}); set POSLSH_CACHE to a writable "
                          "folder") from None
    corpus = _load_cached(key, meta)
    if corpus is None:
        raise ConfigError(f"the token cache {d} cannot be read back")
    return corpus


# ---------------------------------------------------------------------------------------------
# batches and evaluation windows



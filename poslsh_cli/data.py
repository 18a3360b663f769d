"""Corpora for training and evaluation: documents, a split by document, tokens with the bytes
each token covers, and evaluation windows (docs/THEORY.md, "Token models").

Sources (``data=``):

    builtin          the Python 3.11 documentation (497 pages, 11.0 MB of English prose and
                     reStructuredText, PSF licence), shipped with the package: the same bytes on
                     every Python and every machine (poslsh_cli/corpora/README.md)
    pydoc-topics     the pydoc topics text this Python ships (changes with the Python version)
    FILE.txt         one text file (one document)
    FOLDER           every text file below it (one document each, in sorted path order)
    FILE.jsonl       JSON lines, one document per line from the field ``data_field`` (``text``)
    FOLDER (arrow)   a dataset written by ``datasets.save_to_disk`` (field ``data_field``)
    hf:NAME[:CONFIG] a dataset ``datasets.load_dataset`` resolves (needs the hub, or its cache)

Split: every ``val_every``-th document (the last of each run of k) validates, so validation spans
every topic of the corpus; fewer than k documents are joined into one text that splits at
``1 - val_fraction``. The corpus
hash covers every document's bytes and the split; it identifies the data in meta.json and in every
checkpoint.

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
from typing import Any, Iterator, Optional

import numpy as np

from poslsh_cli.config import ConfigError

VOCAB = 256
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".raw", ".tokens", "")
BUILTIN = "builtin"
PYDOC_TOPICS = "pydoc-topics"
CORPUS_FILE = Path(__file__).resolve().parent / "corpora" / "python-3.11-docs.jsonl.xz"
#: SHA-256 of the builtin corpus as read (documents joined by blank lines); tests/test_data.py pins it.
BUILTIN_SHA256 = "1528ea8aee8ccf0bc4808753e2e03186f7f810d43cccc0f780aba25cad893217"
SEPARATOR = "\n\n"


# ---------------------------------------------------------------------------------------------
# documents


@dataclass(frozen=True)
class Source:
    """Where the documents come from: a description, and a digest of their bytes (or of the
    dataset's fingerprint) that identifies them."""

    kind: str
    description: str
    digest: str


def _builtin_documents() -> Iterator[tuple[str, str]]:
    import lzma

    with lzma.open(CORPUS_FILE, "rt", encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            yield rec["path"], rec["text"]


def pydoc_topics_text() -> str:
    """The documentation topics of ``pydoc_data`` (this Python's own: they change with its version)."""
    import re

    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return re.sub(r"(?m)^[ \t]*[*=~^\-]{3,}[ \t]*$\n?", "", text)  # drop reST underlines


def builtin_text() -> str:
    """The builtin corpus as one text (documents joined by blank lines)."""
    return SEPARATOR.join(text for _, text in _builtin_documents())


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(str(p.name).encode() + b"\0")
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def open_documents(data: str, field: str = "text") -> tuple[Source, Any]:
    """(source, a function returning a fresh iterator of (name, text)) for ``data``; refuses what
    cannot be read with one clear reason, before anything is tokenised."""
    if data == BUILTIN:
        return Source("builtin", "the Python 3.11 documentation (shipped)", BUILTIN_SHA256), _builtin_documents
    if data == PYDOC_TOPICS:
        text = pydoc_topics_text()
        return (Source("pydoc-topics", "pydoc topics of this Python", hashlib.sha256(text.encode()).hexdigest()),
                lambda: iter([("pydoc-topics", text)]))
    if data.startswith("hf:"):
        return _hub_documents(data, field)
    path = Path(os.path.expanduser(data)).resolve()
    if not path.exists():
        raise ConfigError(f"data={data}: no such file or folder (use data=builtin or a path)")
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        return _disk_documents(path, data, field)
    if path.is_file() and path.suffix.lower() in (".jsonl", ".json"):
        return _jsonl_documents(path, data, field)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                       and not p.name.startswith("."))
        if not files:
            raise ConfigError(f"data={data}: the folder holds no text files ({', '.join(s or 'no suffix' for s in TEXT_SUFFIXES)})")
    else:
        raise ConfigError(f"data={data}: {path} is neither a regular file nor a folder")
    try:
        digest = _file_digest(files)
    except OSError as exc:
        raise ConfigError(f"data={data}: cannot read ({exc.strerror})") from None

    def docs() -> Iterator[tuple[str, str]]:
        for p in files:
            name = str(p.relative_to(path.parent if path.is_file() else path))
            yield name, decode_text(p.read_bytes(), f"data={data}: {name}")

    return Source("files", str(path), digest), docs


#: A file whose characters are more than this share undecodable bytes (U+FFFD after decoding) or
#: control codes is not text: random or binary bytes come out near one half, text in a legacy
#: 8-bit encoding far below (one accented letter in a word or two).
NOT_TEXT_SHARE = 0.3


def decode_text(raw: bytes, what: str) -> str:
    """``raw`` decoded as UTF-8 (an undecodable byte becomes U+FFFD); refuses, in one line naming
    ``what``, bytes that are mostly not text (:data:`NOT_TEXT_SHARE`)."""
    text = raw.decode("utf-8", "replace")
    if not text:
        return text
    b = np.frombuffer(raw, dtype=np.uint8)
    control = int(np.count_nonzero(b < 32)) - sum(int(np.count_nonzero(b == c)) for c in (9, 10, 12, 13))
    bad = (text.count("\ufffd") + control) / len(text)
    if bad > NOT_TEXT_SHARE:
        raise ConfigError(f"{what} is not text: {bad:.0%} of its characters are undecodable bytes or control codes "
                          "(give UTF-8 text)")
    return text


def _json_lines(path: Path, data: str) -> Iterator[tuple[int, Any]]:
    """(line number, record) of every non-blank line; one error line naming the first line that is
    not UTF-8 or not JSON."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"data={data}: line {lineno} is not UTF-8 (byte {exc.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"data={data}: line {lineno} is not JSON ({str(exc).splitlines()[0]})") from None


def _jsonl_documents(path: Path, data: str, field: str) -> tuple[Source, Any]:
    """Every line read once here (UTF-8, JSON, a record; the first one with the text field), so a
    bad line is refused before anything is tokenised."""
    first = None
    for lineno, rec in _json_lines(path, data):
        if not isinstance(rec, dict):
            raise ConfigError(f"data={data}: line {lineno} is a JSON {type(rec).__name__}, not a record")
        if first is None:
            first = lineno
            if not isinstance(rec.get(field), str):
                raise ConfigError(f"data={data}: line {lineno} has no text field {field!r} (fields: "
                                  f"{', '.join(sorted(rec))}; set data_field=)")
    if first is None:
        raise ConfigError(f"data={data}: the file holds no JSON lines")

    def docs() -> Iterator[tuple[str, str]]:
        for lineno, rec in _json_lines(path, data):
            yield f"{path.name}:{lineno}", str(rec.get(field) or "")

    return Source("jsonl", str(path), _file_digest([path])), docs


def _split_of(ds: Any) -> Any:
    """One split of a DatasetDict: train if there is one, else the first."""
    if hasattr(ds, "keys") and not hasattr(ds, "column_names"):
        names = list(ds.keys())
        return ds["train"] if "train" in names else ds[names[0]]
    return ds


def _dataset_source(ds: Any, kind: str, description: str, data: str, field: str) -> tuple[Source, Any]:
    ds = _split_of(ds)
    if field not in ds.column_names:
        raise ConfigError(f"data={data}: the dataset has no text field {field!r} (fields: "
                          f"{', '.join(ds.column_names)}; set data_field=)")
    digest = getattr(ds, "_fingerprint", None) or hashlib.sha256(description.encode()).hexdigest()

    def docs() -> Iterator[tuple[str, str]]:
        for i, rec in enumerate(ds):
            yield f"row {i}", str(rec[field] or "")

    return Source(kind, description, str(digest)), docs


def _disk_documents(path: Path, data: str, field: str) -> tuple[Source, Any]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data={data}: reading a saved dataset needs the datasets package "
                          "(pip install datasets)") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # a broken dataset folder: one line
        raise ConfigError(f"data={data}: cannot load the dataset ({str(exc).splitlines()[0]})") from None
    return _dataset_source(ds, "datasets", str(path), data, field)


def _hub_documents(data: str, field: str) -> tuple[Source, Any]:
    parts = data[3:].split(":")
    name, config = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None)
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data={data}: needs the datasets package (pip install datasets)") from None
    try:
        ds = datasets.load_dataset(name, config)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        why = "the hub is not reachable (offline)" if offline or "connect" in first.lower() or "offline" in first.lower() \
            else first
        raise ConfigError(f"data={data}: cannot load it ({why}); it needs the Hugging Face hub or a local copy "
                          "(datasets.save_to_disk, then data=FOLDER)") from None
    return _dataset_source(ds, "hub", data, data, field)


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
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
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
                tokenizer: Any = None, field: str = "text", whole: bool = False) -> Corpus:
    """Read, split and tokenise ``data`` (see the module docstring).

    ``val_every=k``: every k-th document validates; a single document splits at
    ``1 - val_fraction``. ``whole``: every document is validation text (evaluating on other data).
    Refuses an empty corpus, or a split with fewer than ``min_tokens`` tokens on either side (one
    window). Byte corpora are tokenised in memory; other tokenisers' corpora are written once,
    document by document, to memory-mapped files in the cache.
    """
    tok = tokenizer or ByteTokenizer()
    source, docs = open_documents(data, field)
    split = f"every {val_every}th document" if not whole else "all validation"
    key = hashlib.sha256(f"{source.digest}|{tok.digest}|{val_every}|{val_fraction}|{whole}".encode()).hexdigest()
    meta = {"source": BUILTIN if source.kind == "builtin" else source.description, "source_sha256": source.digest,
            "kind": source.kind, "split": split, "tokenizer": tok.name}
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
    from poslsh_cli.files import verify_dir

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
    from poslsh_cli.files import write_dir

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


def train_batch(tokens: np.ndarray, seq_len: int, batch: int, generator: np.random.Generator) -> np.ndarray:
    """(batch, seq_len + 1) int64 windows at uniform random offsets ``0 .. len(tokens) - seq_len - 1``
    (every window of ``seq_len + 1`` tokens, the last one included): inputs ``[:, :-1]``, targets
    ``[:, 1:]``."""
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{len(tokens)} tokens hold no window of {seq_len + 1}")
    starts = generator.integers(0, len(tokens) - seq_len, size=batch)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return np.asarray(tokens)[idx].astype(np.int64)


def spread_sample(tokens: np.ndarray, length: int, max_tokens: int) -> np.ndarray:
    """``max_tokens // length`` spans of ``length`` tokens at evenly spaced offsets over the whole
    of ``tokens``, concatenated: non-overlapping evaluation windows of ``length`` over the result
    are spans of the text. A sample of the training split spread like the validation documents
    (every 10th of the corpus), so training and validation losses compare like with like."""
    if len(tokens) < length:
        raise ValueError(f"{len(tokens)} tokens hold no window of {length}")
    k = max(1, int(max_tokens) // int(length))
    starts = np.linspace(0, len(tokens) - length, k).round().astype(np.int64)
    return np.concatenate([np.asarray(tokens[a:a + length]) for a in starts])


@dataclass(frozen=True)
class Window:
    """One evaluation window: ``tokens`` (length,) int64, the first position whose prediction
    counts (``score_from``; position 0 has none), and the UTF-8 bytes its scored tokens cover."""

    tokens: np.ndarray
    score_from: int
    nbytes: int


def eval_windows(tokens: np.ndarray, length: int, stride: int | None = None, max_tokens: int | None = None,
                 token_bytes: np.ndarray | None = None) -> Iterator[Window]:
    """Windows of ``length`` tokens for bits per byte.

    ``stride=None`` (or ``length``): non-overlapping windows, every position but the first of
    each is predicted. ``stride < length``: sliding windows that advance by ``stride``; each
    scores only its last ``stride`` positions (the first window scores all of its own), so every
    token after the first is predicted exactly once, with up to ``length - stride`` tokens of
    context before it. ``max_tokens`` caps how many tokens the windows cover. ``token_bytes``:
    bytes each token covers (default one).
    """
    n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    stride = length if stride is None else stride
    if n < length:
        return
    start = 0
    first = True
    while start + length <= n:
        score_from = 1 if first else length - stride
        nb = (length - score_from) if token_bytes is None else int(np.asarray(
            token_bytes[start + score_from:start + length], dtype=np.int64).sum())
        yield Window(np.asarray(tokens[start:start + length]).astype(np.int64), score_from, nb)
        first = stride == length  # non-overlapping windows all score from position 1
        start += stride


def count_predicted(tokens: np.ndarray, length: int, stride: int | None = None, max_tokens: int | None = None) -> int:
    return sum(length - w.score_from for w in eval_windows(tokens, length, stride, max_tokens))

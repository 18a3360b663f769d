"""Where a corpus's documents come from (``data=``), each read and checked before anything is
tokenised; one clear line for what cannot be read.

    builtin          the Python 3.11 documentation (497 pages, 11.0 MB of English prose and
                     reStructuredText, PSF licence), shipped with the package: the same bytes on
                     every Python and every machine (poslsh_cli/corpora/README.md)
    pydoc-topics     the pydoc topics text this Python ships (changes with the Python version)
    FILE.txt         one text file (one document; refused when it is mostly not text)
    FOLDER           every text file below it (one document each, in sorted path order)
    FILE.jsonl       JSON lines, one document per line from the field ``data_field`` (``text``)

Files are decoded with ``encoding`` (UTF-8 unless given); a file that is not in it is refused in
one line naming the file and the byte offset of the first byte that is not, never read with
U+FFFD in its place.

    FOLDER (arrow)   a dataset written by ``datasets.save_to_disk`` (field ``data_field``)
    hf:NAME[:CONFIG] a dataset ``datasets.load_dataset`` resolves (needs the hub, or its cache)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from poslsh_cli.core.errors import ConfigError


TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".raw", ".tokens", "")


BUILTIN = "builtin"


PYDOC_TOPICS = "pydoc-topics"


CORPUS_FILE = Path(__file__).resolve().parents[1] / "corpora" / "python-3.11-docs.jsonl.xz"


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


def open_documents(data: str, field: str = "text", encoding: str = "utf-8") -> tuple[Source, Any]:
    """(source, a function returning a fresh iterator of (name, text)) for ``data``, its files
    decoded with ``encoding``; refuses what cannot be read with one clear reason, before anything
    is tokenised."""
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
        return _jsonl_documents(path, data, field, encoding)
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
        for p in files:  # every file decoded once here, so that one not in the encoding is refused first
            decode_text(p.read_bytes(), f"data={data}: {p.relative_to(path.parent if path.is_file() else path)}",
                        encoding)
    except OSError as exc:
        raise ConfigError(f"data={data}: cannot read ({exc.strerror})") from None

    def docs() -> Iterator[tuple[str, str]]:
        for p in files:
            name = str(p.relative_to(path.parent if path.is_file() else path))
            yield name, decode_text(p.read_bytes(), f"data={data}: {name}", encoding)

    return Source("files", str(path), digest), docs


#: A file whose characters are more than this share undecodable bytes (U+FFFD after decoding) or
#: control codes is not text: random or binary bytes come out near one half, text in a legacy
#: 8-bit encoding far below (one accented letter in a word or two).
NOT_TEXT_SHARE = 0.3


def decode_text(raw: bytes, what: str, encoding: str = "utf-8") -> str:
    """``raw`` decoded with ``encoding``; refuses, in one line naming ``what``, bytes that are not
    in it (the byte offset of the first one, and how to give the encoding) and bytes that are
    mostly not text (:data:`NOT_TEXT_SHARE` undecodable bytes or control codes)."""
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as exc:
        _refuse_not_text(raw, raw.decode(encoding, "replace"), what)
        raise ConfigError(f"{what} is not {_label(encoding)}: {_undecodable(exc.start, raw[exc.start])}") from None
    _refuse_not_text(raw, text, what)
    return text


def _label(encoding: str) -> str:
    import codecs

    return "UTF-8" if codecs.lookup(encoding).name == "utf-8" else encoding


def _undecodable(offset: int, byte: int, where: str = "") -> str:
    """The end of the line refusing a file not in its encoding: the first undecodable byte."""
    return (f"byte offset {offset} (0x{byte:02x}){where} cannot be decoded; give encoding= the file's encoding "
            "(encoding=latin-1, cp1252, ...)")


def _refuse_not_text(raw: bytes, text: str, what: str) -> None:
    if not text:
        return
    b = np.frombuffer(raw, dtype=np.uint8)
    control = int(np.count_nonzero(b < 32)) - sum(int(np.count_nonzero(b == c)) for c in (9, 10, 12, 13))
    bad = (text.count("\ufffd") + control) / len(text)
    if bad > NOT_TEXT_SHARE:
        raise ConfigError(f"{what} is not text: {bad:.0%} of its characters are undecodable bytes or control codes "
                          "(give text)")


def _json_lines(path: Path, data: str, encoding: str = "utf-8") -> Iterator[tuple[int, Any]]:
    """(line number, record) of every non-blank line; one error line naming the first line that is
    not in ``encoding`` (and the byte offset in the file) or not JSON."""
    offset = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode(encoding)
            except UnicodeDecodeError as exc:
                raise ConfigError(f"data={data}: line {lineno} is not {_label(encoding)}: "
                                  + _undecodable(offset + exc.start, raw[exc.start], " of the file")) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"data={data}: line {lineno} is not JSON ({str(exc).splitlines()[0]})") from None


def _jsonl_documents(path: Path, data: str, field: str, encoding: str = "utf-8") -> tuple[Source, Any]:
    """Every line read once here (UTF-8, JSON, a record; the first one with the text field), so a
    bad line is refused before anything is tokenised."""
    first = None
    for lineno, rec in _json_lines(path, data, encoding):
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
        for lineno, rec in _json_lines(path, data, encoding):
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
        with quiet_hub():
            ds = datasets.load_dataset(name, config)
    except Exception as exc:
        why = hub_failure(exc)
        raise ConfigError(f"data={data}: cannot load it ({why}); it needs the Hugging Face hub or a local copy ("
                          + (f"{HUB_HINT}; or " if why == HUB_UNREACHABLE else "")
                          + "datasets.save_to_disk, then data=FOLDER)") from None
    return _dataset_source(ds, "hub", data, data, field)


#: SHA-256 of the builtin corpus as read (documents joined by blank lines); tests/test_data.py pins it.
BUILTIN_SHA256 = "1528ea8aee8ccf0bc4808753e2e03186f7f810d43cccc0f780aba25cad893217"


SEPARATOR = "\n\n"


def read_text(text: str, encoding: str = "utf-8") -> str:
    """The ``text=`` of output-error: ``builtin`` (the shipped corpus), ``pydoc-topics`` (this
    Python's own topics text) or a file, decoded with ``encoding`` (:func:`decode_text`)."""
    if text == "builtin":
        return builtin_text()
    if text == PYDOC_TOPICS:
        return pydoc_topics_text()
    p = Path(os.path.expanduser(text))
    if p.is_dir():
        raise ConfigError(f"text={text}: a folder, not a text file (text= reads one file; use text=builtin or a file)")
    if not p.is_file():
        raise ConfigError(f"text={text}: no such file (use text=builtin or a path)")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"text={text}: cannot read ({exc.strerror})") from None
    return decode_text(raw, f"text={text}", encoding)


def tokenize(tokenizer: Any, text: str, n: int) -> torch.Tensor:
    """The first ``n`` tokens of ``text`` (with the tokenizer's special tokens), shape (1, n)."""
    chars = max(4096, 12 * n)
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=True, return_attention_mask=False)["input_ids"]
        if len(ids) >= n or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise ConfigError(f"the text has only {len(ids)} tokens, fewer than n={n}")
    ids = ids[:n]
    return torch.tensor([ids], dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# the Hugging Face hub, said in one line

HUB_UNREACHABLE = "the Hugging Face hub is not reachable and no copy is cached"
HUB_HINT = ("run it once where the hub is reachable, which caches it, then HF_HUB_OFFLINE=1 reads the cache "
            "without trying the hub")


@contextlib.contextmanager
def quiet_hub() -> Iterator[None]:
    """The hub client's warnings silenced while loading: without a network it writes two lines
    per attempt ("... thrown while requesting HEAD ...", "Retrying in 1s [Retry 1/5].") before it
    gives up; the caller says once what failed (:func:`hub_failure`)."""
    log = logging.getLogger("huggingface_hub")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def hub_failure(exc: BaseException) -> str:
    """Why loading from the hub failed: :data:`HUB_UNREACHABLE` for a network failure or offline
    mode without a cached copy, else the error's first line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    names = {t.__name__ for t in type(exc).__mro__}
    network = ("couldn't reach", "connect", "offline", "name or service", "timed out", "failed to resolve")
    if names & {"ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError", "TimeoutError"} \
            or any(w in text.lower() for w in network):
        return HUB_UNREACHABLE
    return text


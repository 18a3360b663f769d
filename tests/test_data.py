"""Corpora: the shipped corpus (pinned bytes, licence), the split by document, every data source
(text, folders, JSON lines, saved datasets, the hub offline), tokenizers with the bytes each token
covers, the token cache, and evaluation windows."""
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.data import ByteTokenizer, HFTokenizer, load_corpus
from poslsh_cli.lm.documents import BUILTIN_SHA256
from poslsh_cli.lm.windows import count_predicted, eval_windows
from poslsh_cli.lm.documents import CORPUS_FILE, builtin_text, pydoc_topics_text
from poslsh_cli.lm.models import minilm_path

#: SHA-256 of the compressed corpus file as committed (its bytes, not only its content).
CORPUS_FILE_SHA256 = "e441855acfced16f9c83075743b1e071f0cc160489e1925a6d6b19f84e700e96"


def test_the_builtin_corpus_is_pinned_and_licensed():
    assert hashlib.sha256(CORPUS_FILE.read_bytes()).hexdigest() == CORPUS_FILE_SHA256
    text = builtin_text().encode("utf-8")
    assert hashlib.sha256(text).hexdigest() == BUILTIN_SHA256 and len(text) >= 4_000_000
    readme = (CORPUS_FILE.parent / "README.md").read_text()
    assert "PSF License Agreement" in readme and BUILTIN_SHA256 in readme and CORPUS_FILE_SHA256 in readme


def test_validation_is_every_tenth_document_and_spans_the_corpus():
    c = load_corpus("builtin")
    assert c.documents == 497 and c.val_documents == 49 and c.meta["split"] == "every 10th document"
    assert 0.08 < len(c.val) / (len(c.train) + len(c.val)) < 0.12
    assert c.train_text_bytes >= 4_000_000 and len(c.sha256) == 64
    # the validation documents come from every part of the corpus (sorted by path: c-api ... whatsnew)
    import lzma

    with lzma.open(CORPUS_FILE, "rt") as fh:
        paths = [json.loads(line)["path"] for line in fh]
    val_topics = {p.split("/")[0] for i, p in enumerate(paths) if i % 10 == 9}
    assert {"c-api", "library", "reference", "howto", "whatsnew"} <= val_topics
    assert np.array_equal(load_corpus("builtin").val, c.val)  # deterministic


def test_the_old_text_is_still_available():
    c = load_corpus("pydoc-topics")
    assert c.documents == 1 and len(c.val) > 0
    assert abs(len(c.val) / (len(c.train) + len(c.val)) - 0.1) < 1e-3
    assert pydoc_topics_text().startswith(bytes(c.train[:20]).decode())


def test_files_folders_and_bad_data(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    with pytest.raises(ConfigError, match="no such file"):
        load_corpus(str(tmp_path / "nope.txt"))
    (tmp_path / "short.txt").write_text("a few bytes only")
    with pytest.raises(ConfigError, match="fewer than one window"):
        load_corpus(str(tmp_path / "short.txt"), min_tokens=33)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(25):
        (folder / f"doc{i:02d}.txt").write_text(f"document {i} " * 50)
    c = load_corpus(str(folder))
    assert c.documents == 25 and c.val_documents == 2  # doc09, doc19
    assert bytes(c.val[:11]).decode() == "document 9 "
    few = tmp_path / "few"
    few.mkdir()
    for i in range(3):
        (few / f"{i}.txt").write_text("x" * 1000)
    c = load_corpus(str(few))  # fewer documents than one run of 10: one text, its tail validates
    assert c.documents == 1 and abs(len(c.val) - 300) <= 2


def test_json_lines_with_a_text_field(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"body": f"line {i} " * 30, "id": i}) + "\n" for i in range(30)))
    c = load_corpus(str(path), field="body")
    assert c.documents == 30 and c.val_documents == 3
    with pytest.raises(ConfigError, match="no text field 'text'.*fields: body, id"):
        load_corpus(str(path))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        load_corpus(str(tmp_path / "bad.jsonl"))


def test_a_saved_dataset_and_the_hub_offline(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": [f"record {i} " * 40 for i in range(20)]})
    ds.save_to_disk(str(tmp_path / "saved"))
    c = load_corpus(str(tmp_path / "saved"))
    assert c.documents == 20 and c.val_documents == 2
    with pytest.raises(ConfigError, match="no text field 'body'"):
        load_corpus(str(tmp_path / "saved"), field="body")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="needs the Hugging Face hub or a local copy"):
        load_corpus("hf:this-dataset-is-not-cached:config")


class Records(list):
    """A logging handler that keeps what reaches it."""

    def __init__(self):
        import logging

        super().__init__()
        self.handler = logging.Handler()
        self.handler.emit = self.append


def unreachable_hub(monkeypatch):
    """``datasets.load_dataset`` as it fails without a network: the hub client's retry warnings,
    then a ConnectionError. Returns what reaches the hub client's logger."""
    import logging

    datasets = pytest.importorskip("datasets")
    records = Records()
    log = logging.getLogger("huggingface_hub.utils._http")
    log.addHandler(records.handler)

    def load_dataset(*args, **kwargs):
        for k in range(1, 6):
            log.warning("'[Errno -2] Name or service not known' thrown while requesting HEAD https://huggingface.co/x")
            log.warning(f"Retrying in {2 ** (k - 1)}s [Retry {k}/5].")
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return records


def test_an_unreachable_hub_is_one_sentence_with_a_hint(monkeypatch):
    """No network: no retry warnings, one reason (the hub is not reachable and no copy is cached)
    and what to do."""
    records = unreachable_hub(monkeypatch)
    with pytest.raises(ConfigError) as err:
        load_corpus("hf:wikitext:wikitext-2-raw-v1")
    assert "the Hugging Face hub is not reachable" in str(err.value) and "HF_HUB_OFFLINE=1" in str(err.value)
    assert "\n" not in str(err.value) and not records, [r.getMessage() for r in records]


def test_token_bytes_cover_the_text_exactly():
    text = "Positional LSH — naïve ALiBi: 𝑥² + 1\n\nsecond paragraph"
    ids, nb = ByteTokenizer().encode(text)
    assert int(nb.sum()) == len(text.encode())
    tok = HFTokenizer.load(minilm_path())  # a WordPiece tokenizer that drops spaces and lowercases
    ids, nb = tok.encode(text)
    assert len(ids) == len(nb) and int(nb.sum()) <= len(text.encode())
    assert int(nb.sum()) >= len(text.encode()) - text.count(" ") - text.count("\n")


def test_token_corpora_are_cached_and_mapped(tmp_path, monkeypatch):
    monkeypatch.setenv("POSLSH_CACHE", str(tmp_path / "cache"))
    tok = HFTokenizer.load(minilm_path())
    t0 = time.perf_counter()
    a = load_corpus("pydoc-topics", tokenizer=tok)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = load_corpus("pydoc-topics", tokenizer=tok)
    again = time.perf_counter() - t0
    assert isinstance(b.train, np.memmap) and np.array_equal(a.train, b.train) and np.array_equal(a.val_bytes, b.val_bytes)
    assert again < first and b.sha256 == a.sha256
    assert int(np.asarray(b.val_bytes, dtype=np.int64).sum()) > len(b.val)  # word pieces cover several bytes
    assert (Path(b.meta["cached"]) / "manifest.json").exists()


def test_eval_windows_predict_every_token_once_and_count_bytes():
    tokens = np.arange(1000) % 256
    assert count_predicted(tokens, 100) == 10 * 99  # non-overlapping: all but each window's first
    seen = np.zeros(1000, int)
    start = 0
    for w in eval_windows(tokens, 100, stride=25):
        seen[start + w.score_from:start + 100] += 1
        start += 25
    assert seen[0] == 0 and (seen[1:start + 75] == 1).all()
    nb = np.full(1000, 3)
    assert sum(w.nbytes for w in eval_windows(tokens, 100, token_bytes=nb)) == 3 * 10 * 99


def test_train_batch_draws_every_window_the_last_one_included():
    """Windows of L + 1 tokens start at 0 .. len - L - 1, each with probability 1 / (len - L); a
    split of exactly L + 1 tokens holds one window (the size check accepts it)."""
    from poslsh_cli.lm.windows import train_batch

    L = 4
    one = np.arange(L + 1)
    b = train_batch(one, L, 3, np.random.default_rng(0))
    assert b.shape == (3, L + 1) and (b == one).all()
    tokens = np.arange(10)  # starts 0 .. 5: six windows
    starts = train_batch(tokens, L, 6000, np.random.default_rng(1))[:, 0]
    counts = np.bincount(starts, minlength=6)
    assert len(counts) == 6 and counts.min() > 1000 - 5 * 30  # each 1000 +- 5 binomial SE (~29)
    with pytest.raises(ValueError, match="hold no window"):
        train_batch(np.arange(L), L, 1, np.random.default_rng(0))


def test_sliding_protocol_scores_the_last_stride_tokens_of_every_window_the_first_too():
    tokens = np.arange(1000)
    L, E = 100, 250  # trained length, evaluation length
    ws = list(eval_windows(tokens, E, stride=L, tail=True))
    starts = [int(w.tokens[0]) for w in ws]
    assert starts == list(range(0, 1000 - E + 1, L))
    # every window scores its last L positions (the first one too), each with E - L tokens before it
    assert all(w.score_from == E - L for w in ws)
    scored = np.concatenate([w.tokens[w.score_from:] for w in ws])
    assert len(scored) == len(ws) * L and len(np.unique(scored)) == len(scored)
    assert scored.min() == E - L  # nothing before the first full context is scored
    assert count_predicted(tokens, E, L, tail=True) == len(ws) * L
    # without tail the first window scores all of its own
    assert next(eval_windows(tokens, E, stride=L)).score_from == 1
    # at the training length the sliding protocol is the non-overlapping one
    assert [w.score_from for w in eval_windows(tokens, L, stride=L, tail=True)] == [1] * 10


def test_text_files_are_decoded_with_the_encoding_given_or_refused_at_the_first_bad_byte(tmp_path):
    """UTF-8 unless told: a Latin-1 file in a folder is refused naming it and its first byte that is
    not UTF-8; encoding=latin-1 reads it (and output-error's text= alike), into a corpus of its own
    hash."""
    from poslsh_cli.lm.documents import read_text

    text = "Übung macht den Meister, sagt man in Köln. " * 40
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("plain ascii text " * 100)
    (folder / "b.txt").write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"b\.txt is not UTF-8: byte offset 0 \(0xdc\)"):
        load_corpus(str(folder))
    c = load_corpus(str(folder), encoding="latin-1")
    assert "Übung".encode() in bytes(c.train) + bytes(c.val) and b"\xef\xbf\xbd" not in bytes(c.train)
    assert c.meta["encoding"] == "latin-1" and c.sha256 != load_corpus(str(folder), encoding="cp1252").sha256
    with pytest.raises(ConfigError, match=r"b\.txt is not UTF-8: byte offset 0 "):
        read_text(str(folder / "b.txt"))
    assert read_text(str(folder / "b.txt"), "latin-1") == text

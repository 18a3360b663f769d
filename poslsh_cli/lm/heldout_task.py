"""``poslsh_heldout``: an lm-eval task built from the held-out documents of the corpus the
checkpoints were trained on, so a byte model trained on this machine has a task it can be scored on
with no download.

Each item is a multiple-choice continuation: ``context`` characters of a held-out (validation)
document, then ``choices`` candidate continuations of ``span`` characters each: the text that
follows in that document and spans of the same length at random places of other held-out
documents. lm-eval scores each candidate by the model's log-likelihood after the context (no
separator between them): ``acc``, the share of items whose gold candidate is the most likely. Every
candidate has the same length, so a per-byte or per-character normalised accuracy would equal it and
is not computed. Chance is ``1 / choices``. The items are a function of the documents and the arguments alone (a fixed
seed), written to the cache (``POSLSH_CACHE``) under a name that hashes both; every
checkpoint trained on the same corpus with the same split is scored on the same items.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

import numpy as np

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.core.files import atomic_write_text

#: the task's name in ``tasks=[...]``
TASK = "poslsh_heldout"
ITEMS, CONTEXT, SPAN, CHOICES, SEED = 200, 192, 32, 4, 0


def heldout_documents(documents: Iterable[str], val_every: int) -> list[str]:
    """The validation documents of the training split (every ``val_every``-th, the last of each
    run of k: :mod:`poslsh_cli.lm.data`), blank ones left out."""
    return [text for i, text in enumerate(documents) if i % val_every == val_every - 1 and text.strip()]


def make_items(docs: list[str], items: int = ITEMS, context: int = CONTEXT, span: int = SPAN,
               choices: int = CHOICES, seed: int = SEED) -> list[dict]:
    """``items`` multiple-choice continuations from ``docs`` (see the module docstring); the gold
    candidate's place among the choices is uniform. Refused when fewer than ``choices`` documents
    are long enough to hold a context and a span."""
    long = [d for d in docs if len(d) >= context + span]
    if len(long) < choices:
        raise ConfigError(f"{TASK}: {len(long)} held-out documents hold {context + span} characters, fewer "
                          f"than the {choices} a question needs")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(items):
        k = int(rng.integers(len(long)))
        doc = long[k]
        at = int(rng.integers(context, len(doc) - span + 1))
        gold = doc[at:at + span]
        others = rng.choice([j for j in range(len(long)) if j != k], choices - 1, replace=False)
        wrong = []
        for j in others:
            at_j = int(rng.integers(0, len(long[j]) - span + 1))
            wrong.append(long[j][at_j:at_j + span])
        place = int(rng.integers(choices))
        options = wrong[:place] + [gold] + wrong[place:]
        out.append({"context": doc[at - context:at], "choices": options, "gold": place})
    return out


def write_task(folder: Path, items: list[dict]) -> Path:
    """The task YAML and its JSON lines in ``folder`` (lm-eval's ``include_path``)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    atomic_write_text(data, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items))
    atomic_write_text(folder / f"{TASK}.yaml", "\n".join([
        f"task: {TASK}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {json.dumps(str(data))}",
        "test_split: test", "output_type: multiple_choice", "doc_to_text: context",
        "doc_to_choice: choices", "doc_to_target: gold", "target_delimiter: ''",
        "metric_list:", "  - metric: acc", "    aggregation: mean", "    higher_is_better: true", ""]))
    return folder


def build(data: str, val_every: int = 10, field: str = "text", encoding: str = "utf-8") -> Path:
    """The task's folder for the held-out documents of ``data`` (split as training splits it,
    :func:`poslsh_cli.lm.data.load_corpus`), written to the cache. A corpus of fewer than ``val_every``
    documents holds out no whole document (training held out the last part of its text instead), so
    it has no task: refused saying so."""
    from poslsh_cli.lm.data import cache_dir
    from poslsh_cli.lm.documents import open_documents

    source, docs = open_documents(data, field, encoding)
    texts = [text for _, text in docs()]
    if len(texts) < val_every:
        raise ConfigError(f"{TASK} asks about held-out documents, and data={data} has {len(texts)} "
                          f"document{'s' if len(texts) != 1 else ''}, fewer than val_every={val_every}: training held "
                          "out the last part of its text, not whole documents (evaluate models trained on a corpus "
                          "of many documents, or another task)")
    name = hashlib.sha256(f"{source.digest}|{val_every}|{ITEMS}|{CONTEXT}|{SPAN}|{CHOICES}|{SEED}|acc".encode()).hexdigest()
    return write_task(cache_dir() / "tasks" / name[:16], make_items(heldout_documents(texts, val_every)))

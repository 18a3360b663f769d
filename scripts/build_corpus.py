"""Build the builtin training corpus from the Python 3.11 documentation sources.

    apt-get download python3.11-doc          # Debian bookworm: 3.11.2-6+deb12u8
    dpkg-deb -x python3.11-doc_*.deb x
    python scripts/build_corpus.py x/usr/share/doc/python3.11/html/_sources \\
        poslsh_cli/corpora/python-3.11-docs.jsonl.xz

Every ``*.rst.txt`` file (the reStructuredText source of one documentation page) becomes one
document, in sorted path order, its bytes unchanged: one JSON line ``{"path": ..., "text": ...}``
per document, xz-compressed. The SHA-256 of the decompressed corpus (the documents' bytes joined
by blank lines, as :mod:`poslsh_cli.lm.data` reads them) is printed and pinned in
``tests/test_data.py``. Licence: the PSF License Agreement (the documentation's own licence;
code examples in it are also under the Zero-Clause BSD licence), see
``poslsh_cli/corpora/README.md``.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import sys
from pathlib import Path


def main(src: str, out: str) -> None:
    root = Path(src)
    files = sorted(p for p in root.rglob("*.rst.txt") if p.is_file())
    lines, texts = [], []
    for p in files:
        text = p.read_bytes().decode("utf-8")
        texts.append(text)
        lines.append(json.dumps({"path": str(p.relative_to(root)), "text": text}, ensure_ascii=False))
    data = ("\n".join(lines) + "\n").encode("utf-8")
    Path(out).write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    joined = "\n\n".join(texts).encode("utf-8")
    print(f"{len(files)} documents, {len(joined)} bytes, sha256 {hashlib.sha256(joined).hexdigest()}")
    print(f"{out}: {Path(out).stat().st_size} bytes, sha256 {hashlib.sha256(Path(out).read_bytes()).hexdigest()}")


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""The demo model's corpus: the Python 3.11 documentation as Debian ships it, turned into plain text.

    python benchmarks/prepare_demo_corpus.py --out demo_corpus

Downloads one pinned Debian package (`apt-get download`), unpacks it (`dpkg -x`), and extracts the
main text of every HTML page in sorted path order. A hash of each page's path picks its split, so
the split depends on nothing but the file names. Writes

    OUT/train.txt, valid.txt, heldout.txt   pages (~97%, ~1%, ~2%), separated by the end-of-text token
    OUT/chat.txt                            ChatML exchanges drawn from the training pages (see `MainText`)
    OUT/corpus.json                         package, version, .deb checksum, licence, the held-out pages
    OUT/LICENSE-PSF.txt                     the licence texts, copied from the package, to ship with the model

The Python documentation is under the PSF License Version 2 (its code examples also under the
Zero-Clause BSD licence): it allows preparing and distributing derivative works, here a model
trained on the text, as long as the PSF copyright notice is kept (the demo model's README keeps it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

PACKAGE = "python3.11-doc"
VERSION = "3.11.2-6+deb12u9"
DEB_SHA256 = "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be"
LICENSE = "PSF-2.0 (Python Software Foundation License Version 2); code examples also 0BSD"
HTML_ROOT = "usr/share/doc/python3.11/html"
END_OF_TEXT = "<|endoftext|>"
HELDOUT_PER_MILLE = 20  # ~2% of pages
VALID_PER_MILLE = 10
# Index, search and changelog pages are lists of links or issue numbers, not prose.
SKIPPED = re.compile(r"^(genindex.*|search|py-modindex|contents|whatsnew/changelog)\.html$")

BLOCK_TAGS = {
    "p", "div", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "dl", "ul", "ol",
    "table", "tr", "section", "blockquote", "br", "figure", "figcaption", "caption",
}  # fmt: skip
HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
VOID_TAGS = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "source"}
GLOSSARY_TERM = "<glossary term>"


class MainText(HTMLParser):
    """The text inside Sphinx's `<div role="main">`: paragraphs as blocks, `<pre>` kept verbatim.

    It also pairs each documented object (and glossary term) with the first paragraph describing
    it: the question-answer pairs that teach the model the chat format.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.pairs: list[tuple[str, str]] = []
        self.current: list[str] = []
        self.main_depth = 0  # open <div>s since the main one opened; 0: outside it
        self.skip_depth = 0  # open tags since a skipped one (permalink marks, scripts)
        self.pre_depth = 0
        self.lists: list[str] = []  # the kind of each open <dl>: a py object kind, "glossary" or ""
        self.question: str | None = None  # asked by the last <dt>, answered in the next <dd>
        self.answers: list[tuple[str | None, int]] = []  # per open <dd>: its question and <div> depth

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if self.main_depth == 0:
            if tag == "div" and attributes.get("role") == "main":
                self.main_depth = 1
            return
        if tag == "div":
            self.main_depth += 1
        if self.skip_depth:
            if tag not in VOID_TAGS:
                self.skip_depth += 1
            return
        classes = (attributes.get("class") or "").split()
        if tag in ("script", "style") or "headerlink" in classes:
            self.skip_depth = 1
            return
        if tag in BLOCK_TAGS:
            self.flush()
        if tag == "pre":
            self.pre_depth += 1
        elif tag == "li":
            self.current.append("- ")
        elif tag in ("td", "th"):
            self.current.append(" ")
        elif tag == "dl":
            self.lists.append(classes[1] if classes[:1] == ["py"] and len(classes) > 1 else " ".join(classes))
        elif tag == "dt" and self.lists and self.question is None and attributes.get("id"):
            self.question = _question(self.lists[-1], attributes["id"])
        elif tag == "dd":
            self.answers.append((self.question, self.main_depth))
            self.question = None

    def handle_endtag(self, tag: str) -> None:
        if self.main_depth == 0:
            return
        if self.skip_depth:
            self.skip_depth -= 1
        elif tag in BLOCK_TAGS:
            self.flush()
            if tag == "pre":
                self.pre_depth -= 1
            elif tag == "dl" and self.lists:
                self.lists.pop()
            elif tag == "dt" and self.question == GLOSSARY_TERM and self.blocks:
                self.question = f"What does “{self.blocks[-1]}” mean in Python?"
            elif tag == "dd" and self.answers:
                self.answers.pop()
            elif tag == "p":
                self.answer()
        if tag == "div":
            self.main_depth -= 1

    def answer(self) -> None:
        """The paragraph just closed answers its <dd>'s question if it is the first one directly inside it."""
        if not self.answers or self.answers[-1][0] is None or self.answers[-1][1] != self.main_depth:
            return
        question = self.answers[-1][0]
        self.answers[-1] = (None, self.main_depth)
        text = self.blocks[-1]
        if 30 <= len(text) <= 500 and text.endswith("."):
            self.pairs.append((question, text))

    def handle_data(self, data: str) -> None:
        if self.main_depth and not self.skip_depth:
            self.current.append(data)

    def flush(self) -> None:
        text = "".join(self.current)
        self.current = []
        text = text.strip("\n").rstrip() if self.pre_depth else " ".join(text.split())
        if text.strip() and text.strip() != "-":
            self.blocks.append(text)


def _question(kind: str, anchor: str) -> str | None:
    if kind == "glossary":
        return GLOSSARY_TERM  # the term is the <dt>'s text, known when it closes
    if kind in ("function", "method", "classmethod", "staticmethod"):
        return f"What does {anchor}() do?"
    if kind in ("class", "exception", "data", "attribute"):
        return f"What is {anchor}?"
    return None


def parse_page(html: str) -> MainText:
    parser = MainText()
    parser.feed(html)
    parser.close()
    parser.flush()
    return parser


def split_of(name: str) -> str:
    """ "heldout" (~2%, for the reported perplexity), "valid" (~1%, picks the checkpoint) or "train"."""
    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 1000
    return (
        "heldout"
        if bucket < HELDOUT_PER_MILLE
        else "valid"
        if bucket < HELDOUT_PER_MILLE + VALID_PER_MILLE
        else "train"
    )


def chat_document(question: str, answer: str) -> str:
    """One exchange as the ChatML template renders it (atom_models.checkpoints.CHATML_TEMPLATE)."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def licence_text(root: Path) -> str:
    """The PSF License Agreement and the Zero-Clause BSD licence, as the package's licence page states them."""
    source = (root / "_sources/license.rst.txt").read_text(encoding="utf-8").replace("|release|", "3.11")
    sections = [
        ("PSF LICENSE AGREEMENT FOR PYTHON", "BEOPEN.COM LICENSE AGREEMENT"),
        ("ZERO-CLAUSE BSD LICENSE FOR CODE", ".. _OtherLicenses:"),
    ]
    parts = [
        source[source.index(start) : source.index(end)].replace(".. parsed-literal::\n", "") for start, end in sections
    ]
    return "\n".join(part.strip() + "\n" for part in parts)


def fetch_package(work: Path) -> Path:
    """The pinned .deb, downloaded once and checked against its recorded checksum, unpacked."""
    work.mkdir(parents=True, exist_ok=True)
    debs = sorted(work.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        subprocess.run(["apt-get", "download", f"{PACKAGE}={VERSION}"], cwd=work, check=True)
        debs = sorted(work.glob(f"{PACKAGE}_*.deb"))
    digest = hashlib.sha256(debs[0].read_bytes()).hexdigest()
    if digest != DEB_SHA256:
        raise SystemExit(f"{debs[0]} has sha256 {digest}, expected {DEB_SHA256}: not the pinned package")
    unpacked = work / "unpacked"
    if not (unpacked / HTML_ROOT).is_dir():
        subprocess.run(["dpkg", "-x", str(debs[0]), str(unpacked)], check=True)
    return unpacked / HTML_ROOT


def main() -> None:
    parser = argparse.ArgumentParser(description="Extract the demo model's corpus from a pinned Debian package.")
    parser.add_argument("--out", type=Path, default=Path("demo_corpus"))
    args = parser.parse_args()
    root = fetch_package(args.out / "package")
    splits: dict[str, list[str]] = {"train": [], "valid": [], "heldout": []}
    pages: dict[str, list[str]] = {"train": [], "valid": [], "heldout": []}
    chat: list[str] = []
    for name in sorted(p.relative_to(root).as_posix() for p in root.rglob("*.html")):
        if SKIPPED.match(name):
            continue
        page = parse_page((root / name).read_text(encoding="utf-8"))
        if not page.blocks:
            continue
        split = split_of(name)
        splits[split].append("\n\n".join(page.blocks))
        pages[split].append(name)
        if split == "train":
            chat.extend(chat_document(q, a) for q, a in page.pairs)
    separator = f"\n{END_OF_TEXT}\n"
    for split, documents in {**splits, "chat": chat}.items():
        (args.out / f"{split}.txt").write_text(separator.join(documents) + "\n", encoding="utf-8")
    summary = {
        "package": PACKAGE,
        "version": VERSION,
        "deb_sha256": DEB_SHA256,
        "license": LICENSE,
        "source": f"Debian bookworm, {HTML_ROOT}/**/*.html (main text of each page)",
        **{f"{split}_documents": len(docs) for split, docs in splits.items()},
        **{f"{split}_characters": sum(map(len, docs)) for split, docs in splits.items()},
        "chat_documents": len(chat),
        "valid_pages": pages["valid"],
        "heldout_pages": pages["heldout"],
    }
    (args.out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "LICENSE-PSF.txt").write_text(licence_text(root), encoding="utf-8")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

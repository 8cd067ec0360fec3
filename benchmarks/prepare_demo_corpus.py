"""The demo model's corpus: the Python 3.11 documentation as Debian ships it, turned into plain text.

    python benchmarks/prepare_demo_corpus.py --out demo_corpus

Downloads one pinned Debian package (`apt-get download`), unpacks it (`dpkg -x`), and extracts the
main text of every HTML page in sorted path order. A page is held out when a hash of its path falls
in the held-out share, so the split depends on nothing but the file names. Writes

    OUT/train.txt, OUT/heldout.txt   documents separated by the tokenizer's end-of-text token
    OUT/corpus.json                  package, version, .deb checksum, licence, the held-out page list

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
# Index, search and changelog pages are lists of links or issue numbers, not prose.
SKIPPED = re.compile(r"^(genindex.*|search|py-modindex|contents|whatsnew/changelog)\.html$")

BLOCK_TAGS = {
    "p", "div", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "dl", "ul", "ol",
    "table", "tr", "section", "blockquote", "br", "figure", "figcaption", "caption",
}  # fmt: skip
HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
VOID_TAGS = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "source"}


class MainText(HTMLParser):
    """The text inside Sphinx's `<div role="main">`: paragraphs as blocks, `<pre>` kept verbatim."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.current: list[str] = []
        self.main_depth = 0  # open <div>s since the main one opened; 0: outside it
        self.skip_depth = 0  # open tags since a skipped one (permalink marks, scripts)
        self.pre_depth = 0

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
        if tag in ("script", "style") or "headerlink" in (attributes.get("class") or ""):
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

    def handle_endtag(self, tag: str) -> None:
        if self.main_depth == 0:
            return
        if self.skip_depth:
            self.skip_depth -= 1
        elif tag in BLOCK_TAGS:
            self.flush()
            if tag == "pre":
                self.pre_depth -= 1
        if tag == "div":
            self.main_depth -= 1

    def handle_data(self, data: str) -> None:
        if self.main_depth and not self.skip_depth:
            self.current.append(data)

    def flush(self) -> None:
        text = "".join(self.current)
        self.current = []
        text = text.strip("\n").rstrip() if self.pre_depth else " ".join(text.split())
        if text.strip() and text.strip() != "-":
            self.blocks.append(text)


def page_text(html: str) -> str:
    parser = MainText()
    parser.feed(html)
    parser.close()
    parser.flush()
    return "\n\n".join(parser.blocks)


def is_heldout(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 1000 < HELDOUT_PER_MILLE


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
    train, heldout, heldout_pages = [], [], []
    pages = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.html"))
    for name in pages:
        if SKIPPED.match(name):
            continue
        text = page_text((root / name).read_text(encoding="utf-8"))
        if not text:
            continue
        if is_heldout(name):
            heldout.append(text)
            heldout_pages.append(name)
        else:
            train.append(text)
    separator = f"\n{END_OF_TEXT}\n"
    (args.out / "train.txt").write_text(separator.join(train) + "\n", encoding="utf-8")
    (args.out / "heldout.txt").write_text(separator.join(heldout) + "\n", encoding="utf-8")
    summary = {
        "package": PACKAGE,
        "version": VERSION,
        "deb_sha256": DEB_SHA256,
        "license": LICENSE,
        "source": f"Debian bookworm, {HTML_ROOT}/**/*.html (main text of each page)",
        "train_documents": len(train),
        "train_characters": sum(map(len, train)),
        "heldout_documents": len(heldout),
        "heldout_characters": sum(map(len, heldout)),
        "heldout_pages": heldout_pages,
    }
    (args.out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "heldout_pages"}, indent=2))
    print("held out:", ", ".join(heldout_pages))


if __name__ == "__main__":
    main()

"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import atom_compile as ac

README = Path(__file__).resolve().parent.parent / "README.md"


def test_compiler_example_runs(tiny_llama, tmp_path, capsys):
    text = README.read_text()
    block = re.search(r"<!-- the block below runs in tests/test_readme.py -->\n```python\n(.*?)```", text, re.S)
    assert block, "the README lost its compiler example"
    try:
        exec(block.group(1), {"MODEL_DIR": tiny_llama, "ARTIFACT_DIR": tmp_path / "artifact"})
    finally:
        ac.unregister_pass("count_linears")
    out = capsys.readouterr().out
    # count_linears runs after the fusions: what is left is o_proj in each of the 2 layers (the LM head is `logits`)
    assert "'count_linears': 2" in out and "max_rel_diff" in out

"""Shipped Triton kernels install into the process's Triton cache so that Triton finds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atom_compile.graphs.warmup import install_kernels, warm_steps


def test_install_rewrites_group_paths(tmp_path, monkeypatch):
    shipped = tmp_path / "artifact" / "triton_cache" / "KEY"
    shipped.mkdir(parents=True)
    (shipped / "kernel.cubin").write_bytes(b"\x00")
    # Triton records group members by absolute path: here, the export's staging directory, long gone.
    group_file = shipped / "__grp__kernel.json"
    group_file.write_text(json.dumps({"child_paths": {"kernel.cubin": "/staging/KEY/kernel.cubin"}}))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    install_kernels(shipped.parent)
    group = json.loads((tmp_path / "cache" / "KEY" / "__grp__kernel.json").read_text())
    assert group["child_paths"] == {"kernel.cubin": str(tmp_path / "cache" / "KEY" / "kernel.cubin")}
    assert "/staging" in group_file.read_text()  # the artifact itself is left as it was (its checksums hold)


def test_install_never_shows_a_file_half_written(tmp_path, monkeypatch):
    """The Triton cache is the machine's: another process may be loading a kernel while this one installs. A file
    already there whole is left as it is (entries are named by the kernel's hash); a new one, or one cut short,
    appears whole, by a rename, an entry's members before its group file; no temporary file stays behind."""
    from atom_compile.graphs import warmup

    shipped = tmp_path / "artifact" / "triton_cache"
    for key in ("A", "B"):
        (shipped / key).mkdir(parents=True)
        (shipped / key / "kernel.cubin").write_bytes(b"cubin " + key.encode())
        (shipped / key / "kernel.json").write_text("{}")
        group = {"child_paths": {n: f"/staging/{key}/{n}" for n in ("kernel.cubin", "kernel.json")}}
        (shipped / key / "__grp__kernel.json").write_text(json.dumps(group))
    cache = tmp_path / "cache"
    for key in ("A", "B"):
        (cache / key).mkdir(parents=True)
    (cache / "A" / "kernel.cubin").write_bytes(b"cubin a")  # whole, being loaded elsewhere: not to be touched
    (cache / "B" / "kernel.cubin").write_bytes(b"")  # cut short by an install that died: replaced
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    renamed = []
    replace = warmup.os.replace
    monkeypatch.setattr(warmup.os, "replace", lambda src, dst: renamed.append(Path(dst)) or replace(src, dst))
    install_kernels(shipped)
    assert (cache / "A" / "kernel.cubin").read_bytes() == b"cubin a"
    assert (cache / "B" / "kernel.cubin").read_bytes() == b"cubin B"
    assert cache / "A" / "kernel.cubin" not in renamed and len(renamed) == 5  # every file written came by a rename
    for key in ("A", "B"):
        group = cache / key / "__grp__kernel.json"
        members = [path for path in renamed if path.parent == group.parent and path != group]
        assert members and all(renamed.index(m) < renamed.index(group) for m in members)
        assert json.loads(group.read_text())["child_paths"]["kernel.cubin"] == str(cache / key / "kernel.cubin")
    assert not list(cache.rglob("*.tmp"))
    install_kernels(shipped)  # a second load (another server, a restart) writes nothing
    assert len(renamed) == 5


def test_warm_steps_cover_decode_prefill_and_mixed():
    steps = warm_steps(max_model_len=4096, unsplit_batch=66, large_tile_tokens=1088)
    decode_batches = {len(step) for step in steps if all(n == 1 for _, n in step)}
    assert {1, 66} < decode_batches  # one sequence, several, and the unsplit attention launch's batch
    assert any(len(step) == 1 and step[0][1] > 64 for step in steps)  # a long prefill
    mixed_batches = {len(step) for step in steps if {n == 1 for _, n in step} == {True, False}}
    assert len(mixed_batches) > 1 and max(mixed_batches) >= 66  # mixed, split and unsplit


@pytest.mark.parametrize("max_model_len,large", [(4096, 1088), (64, 300), (128, 8448), (2, 5)])
def test_warm_steps_reach_the_large_prefill_tiles(max_model_len, large):
    """A step whose prefill tokens, as the attention launch bounds them from shapes (tokens - sequences + 1), reach
    the large tiles, in sequences that fit `max_model_len`."""
    steps = warm_steps(max_model_len, unsplit_batch=17, large_tile_tokens=large)
    assert any(sum(n for _, n in step) - len(step) + 1 >= large for step in steps)
    assert all(c + n <= max_model_len for step in steps for c, n in step)


def test_unsplit_decode_batch_is_the_first_without_splits():
    """The warm-up's unsplit batch is where decode launches stop splitting contexts (4 multiprocessors on CPU)."""
    import torch

    from atom_models.ops.triton_kernels import attention

    cpu = torch.device("cpu")
    for kv_heads in (1, 2, 8):
        batch = attention.unsplit_decode_batch(kv_heads, 128, cpu)
        config = attention.default_config(128)
        assert attention.decode_splits(batch, kv_heads, config, cpu) == 1
        assert batch == 2 or attention.decode_splits(batch - 1, kv_heads, config, cpu) > 1


def test_forget_compiled_kernels_reaches_every_kernel(monkeypatch):
    """Warm-up must recompile kernels compiled earlier in the process, or they never reach the artifact."""
    import triton.runtime.jit as jit

    from atom_compile.graphs import warmup
    from atom_models.ops.triton_kernels import attention, rotary_cache

    kernels = [attention._attention_kernel, rotary_cache._rope_cache_kernel]
    if not all(isinstance(k, jit.JITFunction) for k in kernels):  # TRITON_INTERPRET: kernels are interpreted
        real = jit.JITFunction(kernels[0].fn if hasattr(kernels[0], "fn") else kernels[0])
        monkeypatch.setattr(attention, "_attention_kernel", real)
        kernels = [real]
    for kernel in kernels:
        kernel.device_caches[0] = "compiled earlier"  # a plain store: the factory would need a GPU driver
    warmup.forget_compiled_kernels()
    assert all(not kernel.device_caches for kernel in kernels)

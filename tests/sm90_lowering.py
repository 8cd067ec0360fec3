"""Compile the Triton kernels for sm_90 (H100) without a GPU: PTX and ptxas, their main variants.

Run by tests/test_triton_kernels.py in a process of its own (Triton's interpreter, which the other tests use,
must be off when kernels are defined). The interpreter executes kernels as numpy; this catches what only
lowering does (layouts, reshapes, dtypes, register limits).

    python tests/sm90_lowering.py --registers   # also each variant's registers and spill bytes (ptxas -v)
    python tests/sm90_lowering.py --sass        # also the instructions of each variant's innermost loop (nvdisasm)

Registers per thread decide how many programs a multiprocessor holds; spills go through local memory. Both
are worth a look, GPU or not, before timing a kernel change.
"""

import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from atom_models.ops.triton_kernels import activation, attention, gemm, norm, quant, rotary_cache, sampling

H100 = GPUTarget("cuda", 90, 64)
BF16, FP8, I32, I64 = "*bf16", "*fp8e4nv", "*i32", "*i64"
FLOATS = {"eps", "qk_scale"}  # the kernels' float arguments; every other non-pointer is an int


def argument_type(param, pointers: dict[str, str], constexprs: dict) -> str:
    """Pointers as given (else fp32), constexprs as declared or given (None), FLOATS fp32, others i32."""
    if param.is_constexpr or param.name in constexprs:
        return "constexpr"
    if param.name.endswith("_ptr"):
        return pointers.get(param.name, "*fp32")
    return "fp32" if param.name in FLOATS else "i32"


def build(kernel, pointers: dict[str, str], constexprs: dict, **options) -> str:
    """Compiles `kernel` and returns its PTX; one that takes USE_PDL is built with programmatic dependent launch,
    as on an H100.

    Specialised about as the JIT specialises launches on real model shapes: pointers and the integers it
    specialises (all but `do_not_specialize`) divisible by 16, as most of their dims and strides are (a head count
    of 8 is not). Without that, loads stay scalar (no 16-byte vectors) and the register counts are not those of the
    GPU (the one-token GEMV: 2-byte loads of the weight).
    """
    signature = {param.name: argument_type(param, pointers, constexprs) for param in kernel.params}
    if "USE_PDL" in signature:
        constexprs = {**constexprs, "USE_PDL": True}
        options = {**options, "launch_pdl": True}
    unspecialised = {i if isinstance(i, str) else kernel.params[i].name for i in kernel.do_not_specialize}
    divisible = [
        (i,)
        for i, (name, kind) in enumerate(signature.items())
        if kind.startswith("*") or (kind == "i32" and name not in unspecialised)
    ]
    attrs = {index: [["tt.divisibility", 16]] for index in divisible}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=H100, options=options)
    assert "cubin" in compiled.asm
    ptx = compiled.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == constexprs.get("USE_PDL", False)
    if "--registers" in sys.argv:
        report_registers(kernel.__name__, ptx, constexprs, options)
    if "--sass" in sys.argv:
        report_loop(kernel.__name__, compiled.asm["cubin"], constexprs)
    return ptx


def report_loop(name: str, cubin: bytes, constexprs: dict) -> None:
    """One line: the kernel's sm_90 instructions, those of each loop (the spans backward branches close), and the
    opcodes of its largest innermost loop, the one a streaming kernel issues every tile."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        nvdisasm = Path(get_ptxas(90).path).with_name("nvdisasm")
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    code = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*?(?:`\(([.\w]+)\))?\s*;", sass)
    labels = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"(\.L_x_\d+):\n\s*/\*([0-9a-f]+)\*/", sass)}
    spans = sorted(
        {(labels[to], int(at, 16)) for at, op, to in code if op == "BRA" and labels.get(to, 1 << 62) < int(at, 16)}
    )
    sizes = [sum(start <= int(at, 16) <= end for at, _, _ in code) for start, end in spans]
    shown = {k: v for k, v in constexprs.items() if isinstance(v, int | bool) and k != "USE_PDL"}
    innermost = [
        (size, span)
        for size, span in zip(sizes, spans, strict=True)
        if not any(other != span and span[0] <= other[0] and other[1] <= span[1] for other in spans)
    ]
    top = ""
    if innermost:
        start, end = max(innermost)[1]
        body = Counter(op for at, op, _ in code if start <= int(at, 16) <= end)
        top = "largest innermost: " + " ".join(f"{op} {n}" for op, n in body.most_common(8))
    print(f"{name:<28} sass {len(code):>5}  loops {sizes}  {top}  {shown}")


def registers_and_spills(ptx: str) -> tuple[int, int]:
    """(registers a thread, spill-store bytes) of a kernel's PTX, from ptxas -v."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        command = [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    registers, spills = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    return int(registers.group(1)), int(spills.group(1))


def report_registers(name: str, ptx: str, constexprs: dict, options: dict) -> None:
    """One line: the kernel, its registers a thread and spill-store bytes (ptxas -v), its warps and constexprs."""
    registers, spills = registers_and_spills(ptx)
    shown = {k: v for k, v in constexprs.items() if isinstance(v, int | bool) and k != "USE_PDL"}
    print(f"{name:<28} regs {registers:>3}  spill {spills:>5} B  warps {options.get('num_warps')}  {shown}")


for block, group in [(1024, 1024), (1024, 128), (4096, 128), (64, 64)]:
    rows = {"BLOCK": block, "GROUP": group}
    build(quant._quant_fp8_kernel, {"x_ptr": BF16, "q_ptr": FP8}, rows, num_warps=4)
    build(activation._silu_and_mul_quant_kernel, {"x_ptr": BF16, "q_ptr": FP8}, rows, num_warps=4)
    pointers = {"x_ptr": BF16, "res_ptr": BF16, "w_ptr": BF16, "out_ptr": FP8, "sum_ptr": BF16}
    dtypes = {"NORM_DTYPE": tl.bfloat16, "OUT_DTYPE": tl.bfloat16}
    build(norm._rms_norm_kernel, pointers, {**dtypes, "HAS_RESIDUAL": True, "QUANT": True, **rows}, num_warps=4)
# a model's final norm over the rows a step samples (gathered by the kernel)
gather = {"x_ptr": BF16, "res_ptr": BF16, "w_ptr": BF16, "out_ptr": BF16, "rows_ptr": I64}
gather_constexprs = {
    "NORM_DTYPE": tl.bfloat16,
    "OUT_DTYPE": tl.bfloat16,
    "HAS_RESIDUAL": True,
    "QUANT": False,
    "BLOCK": 4096,
    "GROUP": 4096,
    "GATHER": True,
}
build(norm._rms_norm_kernel, gather, gather_constexprs, num_warps=8)

for splits in (1, 75):  # one slice a row (no merge), and Qwen3's 151,936-wide rows
    sample = {"SPLITS": splits, "SPLITS_P": triton.next_power_of_2(splits), "QUARTER": sampling.NOISE_QUARTER}
    pointers = {"seed_ptr": I64, "position_ptr": I32, "out_ptr": I64, "part_index_ptr": I32, "ticket_ptr": I32}
    pointers |= {"token_position_ptr": I64, "slot_ptr": I64, "seq_len_ptr": I32}
    for advance in (False, True):  # and as a decode graph draws: moving its inputs on
        build(sampling._sample_kernel, pointers, {**sample, "ADVANCE": advance}, num_warps=4)

fp8_gemm = {"x_ptr": FP8, "w_ptr": FP8, "out_ptr": BF16, "ticket_ptr": "*i32"}
blocks = {"SCALE_N": 128, "SCALE_K": 128, "SCALE_ALONG_K": True, "HAS_BIAS": False}
for grouped in (False, True):
    tiles = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "NUM_STAGES": 3}
    build(gemm._scaled_mm_kernel, fp8_gemm, {**blocks, "X_GROUPED": grouped, **tiles}, num_warps=8)
    for split in (False, True):
        tiles = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": split, "USE_DOT": True, "NUM_STAGES": 4}
        scales = {**blocks, "SCALED": True, "X_GROUPED": grouped, "X_SCALED": True, "PROLOGUE": gemm.NO_PROLOGUE}
        scales |= {"ONE_TRIP": False}
        build(gemm._skinny_mm_kernel, fp8_gemm, {**scales, **tiles}, num_warps=4)

bf16_gemm = {"x_ptr": BF16, "w_ptr": BF16, "out_ptr": BF16, "ticket_ptr": "*i32"}
unscaled = {
    "SCALE_N": 1,
    "SCALE_K": 128,
    "SCALED": False,
    "SCALE_ALONG_K": False,
    "X_GROUPED": False,
    "X_SCALED": False,
    "ONE_TRIP": False,
}
for dot, block_m, block_n, block_k in [(True, 16, 64, 128), (True, 16, 64, 32), (False, 1, 8, 256)]:
    tiles = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT": True, "USE_DOT": dot}
    constexprs = {**unscaled, "HAS_BIAS": True, **tiles, "NUM_STAGES": 4}
    build(gemm._skinny_mm_kernel, bf16_gemm, {**constexprs, "PROLOGUE": gemm.NO_PROLOGUE}, num_warps=4)
    if dot:
        continue
    # the one-token GEMV's prologues (the norm's runs unsplit, with and without the residual add)
    build(gemm._skinny_mm_kernel, bf16_gemm, {**constexprs, "PROLOGUE": gemm.SILU_MUL}, num_warps=2)
    norm_pointers = {**bf16_gemm, "res_ptr": BF16, "g_ptr": BF16, "sum_ptr": BF16}
    norm_constexprs = {**constexprs, "SPLIT": False, "PROLOGUE": gemm.RMS_NORM}
    build(gemm._skinny_mm_kernel, norm_pointers, norm_constexprs, num_warps=2)
    build(gemm._skinny_mm_kernel, norm_pointers, {**norm_constexprs, "res_ptr": None, "sum_ptr": None}, num_warps=2)
# the weight-first GEMV of small weights: one 4 x 4096 tile a program, loaded before the PDL wait
weight_first = {**unscaled, "HAS_BIAS": False, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 4096, "USE_DOT": False}
weight_first |= {"NUM_STAGES": 1, "WEIGHT_FIRST": True, "PROLOGUE": gemm.RMS_NORM, "SPLIT": False}
norm_gemm = {**bf16_gemm, "res_ptr": BF16, "g_ptr": BF16, "sum_ptr": BF16}
build(gemm._skinny_mm_kernel, norm_gemm, weight_first, num_warps=8)
# Qwen3-0.6B's gate_up (8 x 1024 tiles, 4 warps) in one trip keeps its tile packed until it multiplies (unpacked where
# the tile lay in a loop: 125 registers, 4 programs a multiprocessor)
gate_up_tiles = {**weight_first, "BLOCK_N": 8, "BLOCK_K": 1024, "ONE_TRIP": True}
gate_up = build(gemm._skinny_mm_kernel, norm_gemm, gate_up_tiles, num_warps=4)
assert registers_and_spills(gate_up)[0] <= 96
# and under the cap that makes all of its programs resident (`_weight_first_gemv_config`), it spills nothing
cap = gemm._weight_first_gemv_config(6144, 1024, 2, 132).max_registers
gate_up = build(gemm._skinny_mm_kernel, norm_gemm, gate_up_tiles, num_warps=4, maxnreg=cap)
assert registers_and_spills(gate_up) == (cap, 0)
# so does its gated form (the fused_add_rms_norm_mlp op's: SiLU·mul in the epilogue)
gated = build(gemm._skinny_mm_kernel, norm_gemm, {**gate_up_tiles, "GATED": True}, num_warps=4, maxnreg=cap)
assert registers_and_spills(gated) == (cap, 0)
# the fp8_linear ops' weight-only GEMV: an unquantized token through an fp8 weight, after each prologue
weight_only = {**unscaled, "SCALED": True, "SCALE_K": 512, "HAS_BIAS": True, "BLOCK_M": 1, "BLOCK_N": 8}
weight_only |= {"BLOCK_K": 512, "USE_DOT": False, "NUM_STAGES": 4, "SPLIT": False, "WEIGHT_FIRST": False}
weight_only |= {"ONE_WAVE": False}
fp8_weight = {**bf16_gemm, "w_ptr": FP8, "res_ptr": BF16, "g_ptr": BF16, "sum_ptr": BF16}
loop_ptx = [
    build(gemm._skinny_mm_kernel, fp8_weight, {**weight_only, "PROLOGUE": prologue}, num_warps=2)
    for prologue in (gemm.NO_PROLOGUE, gemm.RMS_NORM, gemm.SILU_MUL)
]
gated_loop = {**weight_only, "PROLOGUE": gemm.RMS_NORM, "GATED": True}
loop_ptx.append(build(gemm._skinny_mm_kernel, fp8_weight, gated_loop, num_warps=2))
bf16_loop = {**weight_only, "SCALED": False, "PROLOGUE": gemm.NO_PROLOGUE}
loop_ptx.append(build(gemm._skinny_mm_kernel, bf16_gemm, bf16_loop, num_warps=2))
# the LM head's: fp32 logits rounded to bf16 first
loop_ptx.append(build(gemm._skinny_mm_kernel, {**bf16_gemm, "out_ptr": "*fp32"}, {**bf16_loop, "ROUND_TO_X": True}))
# the pipelined GEMV lets the next kernel launch once, after asking for its last weight tile
for ptx in loop_ptx:
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert 0 <= ptx.rfind("cp.async.commit_group") < ptx.find("griddepcontrol.launch_dependents")
# unless its programs are one wave: then at its wait, before it asks for its first weight tile
one_wave = build(gemm._skinny_mm_kernel, fp8_weight, {**gated_loop, "ONE_WAVE": True}, num_warps=2)
assert one_wave.count("griddepcontrol.launch_dependents") == 1
assert one_wave.find("griddepcontrol.wait") < one_wave.find("griddepcontrol.launch_dependents")
assert one_wave.find("griddepcontrol.launch_dependents") < one_wave.find("cp.async.commit_group")
# the qkv GEMV with RoPE and the cache write in its epilogue (`qkv_rope_and_cache`): Llama-3-8B's FP8 pipelined one
# and a small bf16 weight-first one, into bf16 and FP8 caches; the position and slot are read before the wait
rope_pointers = {"pos_ptr": I64, "slot_ptr": I64}  # cos/sin and the cache scales: fp32
for fp8_cache in (False, True):
    cache = {"k_cache_ptr": FP8 if fp8_cache else BF16, "v_cache_ptr": FP8 if fp8_cache else BF16}
    rope = {"ROPE_CACHE": True, "HEAD_DIM": 128, "FP8_CACHE": fp8_cache, "KV_SCALED": fp8_cache}
    gemvs = ((fp8_weight, {**weight_only, "PROLOGUE": gemm.RMS_NORM}, 2), (norm_gemm, weight_first, 4))
    for weights, constexprs, warps in gemvs:
        ptx = build(
            gemm._skinny_mm_kernel, {**weights, **rope_pointers, **cache}, {**constexprs, **rope}, num_warps=warps
        )
        before_wait = ptx[: ptx.find("griddepcontrol.wait")]
        assert before_wait.count("ld.global.b64") == 2
        registers, spills = registers_and_spills(ptx)
        # no spills, and the pipelined one's GEMV_ONE_WAVE programs fit a multiprocessor's registers (96 a thread)
        assert spills == 0 and (constexprs["WEIGHT_FIRST"] or registers * 32 * warps * gemm.GEMV_ONE_WAVE <= 65536)
# caches: bf16, FP8 with per-tensor scales, FP8 with inline (token, head) scales
for fp8_cache, inline in ((False, False), (True, False), (True, True)):
    cache = FP8 if fp8_cache else BF16
    pointers = {"pos_ptr": I64, "slot_ptr": I64, "k_cache_ptr": cache, "v_cache_ptr": cache}
    pointers |= {name: BF16 for name in ("q_ptr", "k_ptr", "v_ptr", "q_w_ptr", "k_w_ptr", "q_out_ptr", "k_out_ptr")}
    for blocks in ((32, 8), (4, 1)):  # a token's heads in one program, or a KV head's a program (decode)
        heads = {
            "NUM_Q_HEADS": 32,
            "NUM_KV_HEADS": 8,
            "Q_BLOCK": blocks[0],
            "KV_BLOCK": blocks[1],
            "HALF": 64,
            "HALF_P": 64,
        }
        for qk_norm in (False, True):
            flags = {"ROPE": True, "QK_NORM": qk_norm, "K_OUT": False, "WRITE_CACHE": True}
            constexprs = {**heads, "BLOCK_SIZE": 16, "IN_DTYPE": tl.bfloat16, "ACT_DTYPE": tl.bfloat16, **flags}
            constexprs |= {"FP8_CACHE": fp8_cache, "HAS_SCALES": fp8_cache and not inline, "INLINE_SCALES": inline}
            for first in (False, True):  # a lone token lets attention launch before its wait
                rope = constexprs | {"LAUNCH_NEXT_FIRST": first}
                ptx = build(rotary_cache._rope_cache_kernel, pointers, rope, num_warps=4)
                launched, waited = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
                assert (0 <= launched < waited) == first and launched >= 0
    pointers = {"q_ptr": BF16, "k_cache_ptr": cache, "v_cache_ptr": cache, "out_ptr": BF16, "tickets_ptr": I32}
    pointers |= {"block_tables_ptr": I32, "seq_lens_ptr": I32, "query_start_loc_ptr": I32}
    config = attention.default_config(128)
    # a mixed batch's prefill tiles and its decode programs, decode-only launches of a batch, and of a lone sequence
    # (split by the tile, its own stages)
    for tile_launch, decode_only, lone in (
        (True, False, False),
        (False, False, False),
        (False, True, False),
        (False, True, True),
    ):
        tiles = {"BLOCK_Q": config.block_m // 4, "BLOCK_N": config.block_n, "DECODE_ROWS": 16, "BLOCK_SIZE": 16}
        constexprs = {"GROUP": 4, "GROUP_P": 4, "HEAD_DIM": 128, **tiles, "SPLITS": config.merge_elements // (4 * 128)}
        split_keys = config.decode_block_n if lone else config.split_keys
        constexprs |= {"DECODE_BLOCK_N": config.decode_block_n, "DECODE_SPLIT_KEYS": split_keys}
        constexprs |= {"KV_SCALES": fp8_cache and not inline, "INLINE_SCALES": inline, "DECODE_ONLY": decode_only}
        constexprs |= {"LONE": lone, "TILES": tile_launch}
        warps = config.num_warps if tile_launch else config.decode_warps
        stages = config.lone_decode_stages if lone else config.num_stages
        constexprs |= {"DECODE_VALUES_WITH_KEYS": stages == 1}
        ptx = build(attention._attention_kernel, pointers, constexprs, num_warps=warps, num_stages=stages)
        # decode-only: the first key/value tile is asked of L2 before the wait (a hint no test could see fail)
        prefetched = ptx.find("prefetch.global.L2")
        assert (0 <= prefetched < ptx.find("griddepcontrol.wait")) == decode_only
        # an FP8 cache's value tiles leave shared memory in vectors, not a byte a load (see `_fp8_to_f16`)
        assert "ld.shared.b8" not in ptx
        if lone and not fp8_cache:  # a tile's values and keys are both asked for before either moves (`_held`)
            loop = ptx[ptx.index("Inner Loop Header") :].splitlines()
            first_move = next(i for i, line in enumerate(loop) if "st.shared.v4" in line)
            tile_loads = config.decode_block_n * 128 * 2 // (warps * 32 * 16)  # 16-byte loads a thread, a tile
            assert sum("ld.global.v4" in line for line in loop[:first_move]) == 2 * tile_loads
    # launches that split no context: their own decode tiles, a merge of one
    for decode_only in (False, True):
        unsplit = constexprs | {"DECODE_BLOCK_N": config.unsplit_block_n, "SPLITS": 1, "DECODE_ONLY": decode_only}
        unsplit |= {"LONE": False, "DECODE_VALUES_WITH_KEYS": False, "TILES": False}
        build(
            attention._attention_kernel, pointers, unsplit, num_warps=config.decode_warps, num_stages=config.num_stages
        )
print("all kernels lowered for sm_90")

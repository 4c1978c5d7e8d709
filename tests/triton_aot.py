"""Compile every Triton kernel variant of gafused ahead of time for a CUDA target, and read the result.

No GPU is needed: ``triton.compile`` lowers a kernel to PTX and, with Triton's bundled ptxas, to a cubin for any
target. What a GPU run would do with memory is visible there: whether the full-block path loads and stores 16
bytes at a time, whether a multiply and an add were contracted into an ``fma`` (which would break bitwise
agreement with the reference), and, through the bundled ``cuobjdump``, registers and spills.

    python tests/triton_aot.py --arch 80 --arch 90     # one JSON object per line, one line per variant

It must run without TRITON_INTERPRET (the kernels have to be real JIT functions), so tests/test_triton_aot.py
starts it as a separate process. A variant is what the launchers can launch: each kernel with each dtype
combination and constexpr combination they pass, for both launch configurations of ``_layout.launch_config``,
with the alignments a FlatGradBuffer and the caching allocator give (pointer arguments 16-byte aligned,
segment offsets on 64 bytes, gradient offsets on ``ALIGN_LIMIT`` elements).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gafused.triton_backend import _layout  # noqa: E402 - the checkout's gafused, not an installed one
from gafused.triton_backend.fold import _fold_kernel  # noqa: E402
from gafused.triton_backend.norm import _block_sum_of_squares_kernel, _reduce_partials_kernel  # noqa: E402
from gafused.triton_backend.scale import _scale_kernel  # noqa: E402

ACC_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
GRAD_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
_POINTER_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64"}
_SEGMENT_ALIGN_BYTES = 64  # FlatGradBuffer's default alignment

# 128-bit global accesses in PTX: four 32-bit or two 64-bit lanes in one instruction.
_WIDE = re.compile(r"^\s*(?:@%p\d+\s+)?(ld|st)\.global(?:\.[a-z0-9]+)*\.(?:v4\.[bfus]32|v2\.[bfus]64)\b", re.M)
_ANY_GLOBAL = re.compile(r"^\s*(?:@%p\d+\s+)?(ld|st)\.global\b", re.M)
_FMA = re.compile(r"\bfma\.")
_RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _signature(kernel, types: dict[str, str]) -> dict[str, str]:
    return {name: types.get(name, "constexpr") for name in kernel.arg_names}


def variants() -> Iterator[dict]:
    """Every (kernel, signature, constexprs, warps) the launchers can launch, with the 128-bit accesses its
    full-block path must issue per thread (``None`` for a kernel without such a path)."""
    for acc_name, acc in ACC_DTYPES.items():
        # (block size, warps) of every launch configuration _layout.launch_config hands out: small, large buffers.
        for block, warps in sorted({_layout.launch_config((size,), _itemsize(acc)) for size in (1, 1 << 20)}):
            per_thread = block // (32 * warps)
            acc_type, acc_bytes = _POINTER_TYPES[acc], per_thread * _itemsize(acc)
            offset_align = _layout.alignment([_SEGMENT_ALIGN_BYTES // _itemsize(acc)])
            common = {"block_segment_ptr": "*i64", "block_start_ptr": "*i64", "segment_offset_ptr": "*i64",
                      "segment_numel_ptr": "*i64"}  # fmt: skip
            for grad_name, grad in GRAD_DTYPES.items():
                fold_warps = _layout.fold_num_warps(warps, _itemsize(acc), _itemsize(grad))
                fold_per_thread = block // (32 * fold_warps)
                grad_bytes, fold_acc_bytes = fold_per_thread * _itemsize(grad), fold_per_thread * _itemsize(acc)
                for first, finish in [(True, False), (False, False), (True, True), (False, True)]:
                    types = {"acc_ptr": acc_type, "grad_base_ptr": _POINTER_TYPES[grad], "grad_offset_ptr": "*i64",
                             "weight_ptr": acc_type, "scale_ptr": acc_type, "partial_ptr": acc_type,
                             "flag_ptr": "*u8", **common}  # fmt: skip
                    yield {
                        "name": f"fold acc={acc_name} grad={grad_name} first={first} finish={finish} block={block} "
                        f"warps={fold_warps}",
                        "kernel": _fold_kernel,
                        "signature": _signature(_fold_kernel, types),
                        "constexprs": {
                            "FIRST": first,
                            "FINISH": finish,
                            "BLOCK": block,
                            "OFFSET_ALIGN": offset_align,
                            "GRAD_ALIGN": _layout.ALIGN_LIMIT,
                        },  # fmt: skip
                        "warps": fold_warps,
                        # the gradient, the accumulator unless the first micro-batch overwrites it; one store
                        "wide_loads": (grad_bytes + (0 if first else fold_acc_bytes)) // 16,
                        "wide_stores": fold_acc_bytes // 16,
                    }
            for out_name, out in {"in_place": acc, **GRAD_DTYPES}.items():
                types = {"acc_ptr": acc_type, "out_ptr": _POINTER_TYPES[out], "coef_ptr": acc_type, **common}
                yield {
                    "name": f"scale acc={acc_name} out={out_name} block={block}",
                    "kernel": _scale_kernel,
                    "signature": _signature(_scale_kernel, types),
                    "constexprs": {"BLOCK": block, "OFFSET_ALIGN": offset_align},
                    "warps": warps,
                    "wide_loads": acc_bytes // 16,
                    "wide_stores": per_thread * _itemsize(out) // 16,
                }
            types = {"acc_ptr": acc_type, "partial_ptr": acc_type, **common}
            yield {
                "name": f"sum_of_squares acc={acc_name} block={block}",
                "kernel": _block_sum_of_squares_kernel,
                "signature": _signature(_block_sum_of_squares_kernel, types),
                "constexprs": {"BLOCK": block, "OFFSET_ALIGN": offset_align},
                "warps": warps,
                "wide_loads": acc_bytes // 16,
                "wide_stores": 0,
            }
    for acc_name, acc in ACC_DTYPES.items():
        acc_type = _POINTER_TYPES[acc]
        # fold_finish_ reduces with flags; sum_of_squares reduces globally or per segment, without
        for per_segment, has_flag in [(False, True), (False, False), (True, False)]:
            types = {
                "partial_ptr": acc_type,
                "flag_ptr": "*u8" if has_flag else acc_type,
                "range_ptr": "*i64",
                "n_partials": "i64",
                "out_ptr": acc_type,
                "out_flag_ptr": "*u8" if has_flag else acc_type,
            }
            yield {
                "name": f"reduce_partials acc={acc_name} per_segment={per_segment} flag={has_flag}",
                "kernel": _reduce_partials_kernel,
                "signature": _signature(_reduce_partials_kernel, types),
                "constexprs": {"PER_SEGMENT": per_segment, "HAS_FLAG": has_flag, "REDUCE": _layout.REDUCE_BLOCK},
                "warps": 4,
                "wide_loads": None,
                "wide_stores": None,
            }


def _cuobjdump() -> str | None:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.is_file() else shutil.which("cuobjdump")


def compile_variant(variant: dict, arch: int, workdir: str) -> dict:
    """Compile one variant for ``sm_<arch>`` (fp fusion off, as every launch asks) and summarize its PTX and cubin."""
    kernel, signature = variant["kernel"], variant["signature"]
    # The JIT marks 16-byte-aligned pointer arguments (every torch allocation is) as divisible by 16; do the same.
    pointers = [index for index, name in enumerate(kernel.arg_names) if signature[name].startswith("*")]
    attrs = {(index,): [["tt.divisibility", 16]] for index in pointers}
    source = ASTSource(kernel, signature, variant["constexprs"], attrs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": variant["warps"], "enable_fp_fusion": False},
    )
    ptx = compiled.asm["ptx"]
    wide = _WIDE.findall(ptx)
    result = {
        "name": variant["name"],
        "arch": arch,
        "wide_loads": sum(1 for kind in wide if kind == "ld"),
        "wide_stores": sum(1 for kind in wide if kind == "st"),
        "global_accesses": len(_ANY_GLOBAL.findall(ptx)),
        "expected_wide_loads": variant["wide_loads"],
        "expected_wide_stores": variant["wide_stores"],
        "fma": len(_FMA.findall(ptx)),
        "registers": None,
        "stack": None,
        "local": None,
    }
    tool = _cuobjdump()
    if tool is not None and "cubin" in compiled.asm:
        path = os.path.join(workdir, f"{kernel.__name__}.cubin")
        with open(path, "wb") as handle:
            handle.write(compiled.asm["cubin"])
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True)
        match = _RESOURCES.search(usage.stdout)
        if match is not None:
            result["registers"], result["stack"], result["local"] = int(match[1]), int(match[2]), int(match[4])
    return result


def main(argv: list[str] | None = None) -> None:
    """Print one JSON line per (variant, architecture)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x 10 (default: 80 and 90)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    with tempfile.TemporaryDirectory() as workdir:
        for arch in args.arch or [80, 90]:
            for variant in variants():
                print(json.dumps(compile_variant(variant, arch, workdir)), flush=True)


if __name__ == "__main__":
    main()

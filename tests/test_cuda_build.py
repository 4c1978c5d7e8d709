"""The CUDA sources in csrc/ compile, and the machine code shows what a GPU run depends on, without a GPU.

Kernels (*.cu) depend on CUDA headers only and are compiled with nvcc for sm_80 and sm_90 with warnings as
errors; the binding (bindings.cpp) depends on torch/extension.h only and is syntax-checked with the host C++
compiler against the installed torch's headers. From the same compilation, ptxas' resource report
(`-Xptxas -v`) and the SASS (`cuobjdump -sass`) must show:
- no kernel spills registers, and every streaming kernel keeps at least MIN_RESIDENT_BLOCKS blocks resident per
  SM (register pressure is what held the fold kernels at 2);
- every stream of every streaming kernel has 128-bit global accesses (gradients: LDG.E.EF.128, the evict-first
  streaming load; accumulators: LDG.E.128 / STG.E.128), and no generic (non-global) load or store at all.
When an extension gafused._C is installed (bench/cuda_build_check.sh builds one with a CUDA build of torch),
its SASS is held to the same rules. Skipped, with the reason, when nvcc or a C++ compiler is missing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
KERNEL_SOURCES = sorted(CSRC.glob("*.cu"))
BINDING = CSRC / "bindings.cpp"
ARCHS = ("80", "90")
# torch/extension.h is written for the standard torch builds extensions with (C++20 as of torch 2.8+).
BINDING_STD = "-std=c++20"
TIMEOUT_S = 300

# sm_80 and sm_90 both have 64K 32-bit registers and 2048 threads per SM, allocated to warps 256 at a time.
REGISTERS_PER_SM = 65536
THREADS_PER_SM = 2048
REGISTER_ALLOCATION_UNIT = 256
# Threads per block of each kernel family (kThreads / kReduceThreads in csrc/).
BLOCK_THREADS = {
    "fold_kernel": 256,
    "chunk_sums_kernel": 256,
    "scale_kernel": 256,
    "reduce_chunks_per_segment_kernel": 256,
    "reduce_chunks_kernel": 1024,
}
STREAMING_KERNELS = ("fold_kernel", "chunk_sums_kernel", "scale_kernel")
# Half of an SM's threads: with 48-96 bytes in flight per thread that is several times what an H100 needs to
# cover memory latency. The fold kernels reached 2 when the gradient dtype was switched on inside the kernel.
MIN_RESIDENT_BLOCKS = 4

# Template arguments as the Itanium ABI mangles them.
_TYPES = {"f": "float", "d": "double", "13__nv_bfloat16": "bfloat16", "6__half": "float16"}
_TYPE = "|".join(re.escape(code) for code in _TYPES)
_KERNEL_PATTERNS = {
    "fold_kernel": re.compile(rf"11fold_kernelI(?P<acc>[fd])(?P<grad>{_TYPE})Lb(?P<first>[01])ELb(?P<finish>[01])E"),
    "chunk_sums_kernel": re.compile(r"17chunk_sums_kernelI(?P<acc>[fd])E"),
    "scale_kernel": re.compile(rf"12scale_kernelI(?P<acc>[fd])(?P<out>{_TYPE})E"),
    "reduce_chunks_per_segment_kernel": re.compile(r"32reduce_chunks_per_segment_kernelI(?P<acc>[fd])E"),
    "reduce_chunks_kernel": re.compile(r"20reduce_chunks_kernelI(?P<acc>[fd])E"),
}
_ACC = ("float", "double")
_ELEMENTS = ("float", "double", "bfloat16", "float16")
# Every kernel each source must define: a parser that silently matched nothing would otherwise pass every check.
EXPECTED_KERNELS = {
    "fold_kernels.cu": {
        f"fold_kernel<{acc}, {grad}, first={first}, finish={finish}>"
        for acc in _ACC
        for grad in _ELEMENTS
        for first in (0, 1)
        for finish in (0, 1)
    },
    "norm_kernels.cu": {
        f"{name}<{acc}>"
        for name in ("chunk_sums_kernel", "reduce_chunks_kernel", "reduce_chunks_per_segment_kernel")
        for acc in _ACC
    },
    "scale_kernels.cu": {f"scale_kernel<{acc}, {out}>" for acc in _ACC for out in _ELEMENTS},
}


def _kernel_name(mangled: str) -> str | None:
    """A readable name for one of gafused's kernels, e.g. 'fold_kernel<float, bfloat16, first=0, finish=0>'."""
    for family, pattern in _KERNEL_PATTERNS.items():
        match = pattern.search(mangled)
        if match is None:
            continue
        args = match.groupdict()
        if family == "fold_kernel":
            return (
                f"fold_kernel<{_TYPES[args['acc']]}, {_TYPES[args['grad']]}, "
                f"first={args['first']}, finish={args['finish']}>"
            )
        if family == "scale_kernel":
            return f"scale_kernel<{_TYPES[args['acc']]}, {_TYPES[args['out']]}>"
        return f"{family}<{_TYPES[args['acc']]}>"
    return None


def _family(name: str) -> str:
    return name.split("<", 1)[0]


# --- tools ----------------------------------------------------------------------------------------------------


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def _cuda_toolkit_dir(nvcc: str) -> Path:
    # nvcc may be a wrapper script on PATH; ask it where its toolkit lives instead of guessing from the path.
    dryrun = subprocess.run(
        [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True, text=True, timeout=60
    )
    for line in (dryrun.stdout + dryrun.stderr).splitlines():
        match = re.search(r"TOP=(\S+)", line)
        if match:
            return Path(match.group(1))
    return Path(os.path.realpath(nvcc)).parent.parent


def _cuobjdump(nvcc: str) -> str | None:
    """cuobjdump: $CUOBJDUMP, the toolkit's, PATH's, or the copy Triton ships (minimal toolkits lack one)."""
    candidates = [os.environ.get("CUOBJDUMP"), str(_cuda_toolkit_dir(nvcc) / "bin" / "cuobjdump")]
    candidates.append(shutil.which("cuobjdump"))
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin is not None:
        candidates.append(str(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"))
    return next((path for path in candidates if path and Path(path).is_file()), None)


@pytest.fixture(scope="module")
def nvcc() -> str:
    path = _nvcc()
    if path is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH): csrc/ was not compile-checked")
    return path


@pytest.fixture(scope="module")
def cuobjdump(nvcc: str) -> str:
    path = _cuobjdump(nvcc)
    assert path is not None, (
        "nvcc is here but cuobjdump is not (not in the CUDA toolkit, on PATH, or in the triton package): "
        "install triton (pip install 'gafused[triton]') or point CUOBJDUMP at one"
    )
    return path


def _run(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(command)}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


# --- ptxas resource report --------------------------------------------------------------------------------------


@dataclass
class Resources:
    registers: int = -1
    stack_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0


def parse_ptxas_report(text: str) -> dict[str, Resources]:
    """Per kernel (readable name) of gafused: registers and spills from `ptxas -v` output for one architecture."""
    kernels: dict[str, Resources] = {}
    current: Resources | None = None
    for line in text.splitlines():
        entry = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line)
        if entry:
            name = _kernel_name(entry.group(1))
            current = kernels.setdefault(name, Resources()) if name else None
            continue
        if current is None:
            continue
        spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if spills:
            current.stack_bytes, current.spill_store_bytes, current.spill_load_bytes = map(int, spills.groups())
        registers = re.search(r"Used (\d+) registers", line)
        if registers:
            current.registers = int(registers.group(1))
    return kernels


def resident_blocks(registers: int, block_threads: int) -> int:
    """Blocks of a kernel that fit on one SM at once, as far as registers and threads allow."""
    per_warp = -(-registers * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    by_registers = REGISTERS_PER_SM // (per_warp * (block_threads // 32))
    return min(by_registers, THREADS_PER_SM // block_threads)


# --- SASS -----------------------------------------------------------------------------------------------------


@dataclass
class Accesses:
    """Global memory instructions of one kernel, as opcode strings like 'LDG.E.EF.128'."""

    opcodes: list[str] = field(default_factory=list)

    def has(self, kind: str, *, width: int = 128, evict_first: bool | None = None) -> bool:
        for opcode in self.opcodes:
            parts = opcode.split(".")
            if parts[0] != kind or str(width) not in parts[1:]:
                continue
            if evict_first is None or ("EF" in parts) == evict_first:
                return True
        return False

    def generic(self) -> list[str]:
        # LD/ST without G address any memory space; the kernels only touch global (and shared) memory.
        return sorted({opcode for opcode in self.opcodes if opcode.split(".")[0] in ("LD", "ST")})


def parse_sass(text: str) -> dict[str, dict[str, Accesses]]:
    """Per architecture ('sm_90'), per kernel of gafused: the memory instructions in `cuobjdump -sass` output."""
    result: dict[str, dict[str, Accesses]] = {}
    arch = None
    current: Accesses | None = None
    for line in text.splitlines():
        arch_match = re.match(r"\s*arch = (sm_\d+)", line)
        if arch_match:
            arch = arch_match.group(1)
            continue
        function = re.match(r"\s*Function : (\S+)", line)
        if function:
            name = _kernel_name(function.group(1))
            current = result.setdefault(str(arch), {}).setdefault(name, Accesses()) if name else None
            continue
        if current is None:
            continue
        opcode = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?((?:LDG|STG|LD|ST)(?:\.[A-Z0-9_]+)*)\s", line)
        if opcode:
            current.opcodes.append(opcode.group(1))
    return result


def stream_problems(name: str, accesses: Accesses) -> list[str]:
    """What keeps a streaming kernel's streams from 128-bit global accesses (empty when nothing does)."""
    problems = [f"generic loads/stores {accesses.generic()}"] if accesses.generic() else []
    family = _family(name)
    required: list[tuple[str, str, bool | None]] = []
    if family == "fold_kernel":
        first = "first=1" in name
        required.append(("gradient loads", "LDG", True))  # evict-first streaming loads
        if not first:
            required.append(("accumulator loads", "LDG", False))
        required.append(("accumulator stores", "STG", None))
    elif family == "chunk_sums_kernel":
        required.append(("accumulator loads", "LDG", None))
    elif family == "scale_kernel":
        required += [("accumulator loads", "LDG", None), ("output stores", "STG", None)]
    for stream, kind, evict_first in required:
        if not accesses.has(kind, width=128, evict_first=evict_first):
            flavour = {True: " evict-first", False: " default-cached", None: ""}[evict_first]
            problems.append(f"{stream}: no 128-bit{flavour} {kind}")
    return problems


# --- compilation ----------------------------------------------------------------------------------------------


@dataclass
class Compiled:
    object_path: Path
    ptxas_report: str


@pytest.fixture(scope="module")
def compile_kernel(nvcc: str, tmp_path_factory: pytest.TempPathFactory):
    """Compiles one csrc/*.cu for one architecture (once per module) with warnings as errors and `ptxas -v`."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # the -D flags torch's own build adds

    directory = tmp_path_factory.mktemp("csrc_objects")
    cache: dict[tuple[str, str], Compiled] = {}

    def compile_one(source: Path, arch: str) -> Compiled:
        key = (source.name, arch)
        if key not in cache:
            output = directory / f"{source.stem}.sm_{arch}.o"
            result = _run(
                [nvcc, "-c", str(source), "-o", str(output), "-std=c++17", "-O3"]
                + ["-gencode", f"arch=compute_{arch},code=sm_{arch}", *COMMON_NVCC_FLAGS, f"-I{CSRC}"]
                + ["-Xptxas", "-v", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror,-fPIC"]
            )
            cache[key] = Compiled(output, result.stdout + result.stderr)
        return cache[key]

    return compile_one


CASES = [pytest.param(source, arch, id=f"{source.name}-sm_{arch}") for source in KERNEL_SOURCES for arch in ARCHS]


def test_kernel_sources_are_found():
    names = {path.name for path in KERNEL_SOURCES}
    assert set(EXPECTED_KERNELS) <= names, names
    assert BINDING.is_file()


@pytest.mark.parametrize(
    "path", [path for path in CSRC.iterdir() if path.suffix in (".cu", ".cuh", ".h")], ids=lambda path: path.name
)
def test_kernels_include_no_torch_headers(path: Path):
    # The kernels must build with plain nvcc on machines whose torch has no CUDA headers.
    includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', path.read_text(), flags=re.MULTILINE)
    assert includes, f"{path.name} includes nothing"
    forbidden = [name for name in includes if name.split("/")[0] in ("torch", "ATen", "c10", "caffe2")]
    assert not forbidden, f"{path.name} includes torch headers {forbidden}"


@pytest.mark.parametrize(("source", "arch"), CASES)
def test_kernel_compiles_for_sm80_and_sm90(compile_kernel, source: Path, arch: str):
    assert compile_kernel(source, arch).object_path.stat().st_size > 0


@pytest.mark.parametrize(("source", "arch"), CASES)
def test_kernels_spill_nothing_and_keep_blocks_resident(compile_kernel, source: Path, arch: str):
    kernels = parse_ptxas_report(compile_kernel(source, arch).ptxas_report)
    assert set(kernels) == EXPECTED_KERNELS[source.name], "ptxas report does not list the expected kernels"
    problems = []
    for name, used in sorted(kernels.items()):
        assert used.registers > 0, f"{name}: no register count in the ptxas report"
        if used.spill_store_bytes or used.spill_load_bytes:
            problems.append(f"{name}: spills {used.spill_store_bytes} B stored / {used.spill_load_bytes} B loaded")
        blocks = resident_blocks(used.registers, BLOCK_THREADS[_family(name)])
        needed = MIN_RESIDENT_BLOCKS if _family(name) in STREAMING_KERNELS else 1
        if blocks < needed:
            problems.append(f"{name}: {used.registers} registers leave {blocks} resident blocks per SM, need {needed}")
    assert not problems, f"sm_{arch}:\n" + "\n".join(problems)


@pytest.mark.parametrize(("source", "arch"), CASES)
def test_every_stream_uses_128_bit_global_accesses(compile_kernel, cuobjdump: str, source: Path, arch: str):
    sass = parse_sass(_run([cuobjdump, "-sass", str(compile_kernel(source, arch).object_path)]).stdout)
    kernels = sass.get(f"sm_{arch}", {})
    assert set(kernels) == EXPECTED_KERNELS[source.name], "cuobjdump does not list the expected kernels"
    problems = [
        f"{name}: {problem}"
        for name, accesses in sorted(kernels.items())
        if _family(name) in STREAMING_KERNELS
        for problem in stream_problems(name, accesses)
    ]
    assert not problems, f"sm_{arch}:\n" + "\n".join(problems)


def test_built_extension_uses_128_bit_global_accesses(nvcc: str):
    """The same rules on the SASS of an installed gafused._C (built for whatever TORCH_CUDA_ARCH_LIST said)."""
    spec = importlib.util.find_spec("gafused._C")
    if spec is None or spec.origin is None:
        pytest.skip("gafused._C is not built here (bash bench/cuda_build_check.sh builds one and runs this test)")
    path = _cuobjdump(nvcc)
    assert path is not None, "cuobjdump not found (CUDA toolkit, PATH, triton package or $CUOBJDUMP)"
    sass = parse_sass(_run([path, "-sass", spec.origin]).stdout)
    assert sass, f"no SASS for any architecture in {spec.origin}"
    expected = set().union(*EXPECTED_KERNELS.values())
    problems = []
    for arch, kernels in sorted(sass.items()):
        assert set(kernels) == expected, f"{arch}: missing kernels {sorted(expected - set(kernels))}"
        problems += [
            f"{arch} {name}: {problem}"
            for name, accesses in sorted(kernels.items())
            if _family(name) in STREAMING_KERNELS
            for problem in stream_problems(name, accesses)
        ]
    assert not problems, "\n".join(problems)


def test_binding_compiles_against_installed_torch_headers(nvcc: str):
    from torch.utils.cpp_extension import include_paths

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++/c++) found: bindings.cpp was not syntax-checked")
    cuda_include = _cuda_toolkit_dir(nvcc) / "include"
    assert (cuda_include / "cuda_runtime_api.h").is_file(), f"cuda_runtime_api.h not under {cuda_include}"
    system_includes = [*include_paths(), sysconfig.get_paths()["include"], str(cuda_include)]
    _run(
        [compiler, "-fsyntax-only", BINDING_STD, "-Wall", "-Wextra", "-Werror", f"-I{CSRC}"]
        + [flag for path in system_includes for flag in ("-isystem", path)]
        + ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", str(BINDING)]
    )

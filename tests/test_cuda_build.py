"""The CUDA sources in csrc/ compile, without a GPU and without a CUDA build of torch.

Kernels (*.cu) depend on CUDA headers only and are compiled with nvcc for sm_80 and sm_90 with warnings as
errors; the binding (bindings.cpp) depends on torch/extension.h only and is syntax-checked with the host C++
compiler against the installed torch's headers. This is what keeps a broken kernel or binding from landing
where CI has no GPU. Skipped, with the reason, when nvcc or a C++ compiler is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
KERNEL_SOURCES = sorted(CSRC.glob("*.cu"))
BINDING = CSRC / "bindings.cpp"
ARCHS = ("80", "90")
# torch/extension.h is written for the standard torch builds extensions with (C++20 as of torch 2.8+).
BINDING_STD = "-std=c++20"
TIMEOUT_S = 300


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def _cuda_include_dir(nvcc: str) -> Path:
    # nvcc may be a wrapper script on PATH; ask it where its toolkit lives instead of guessing from the path.
    dryrun = subprocess.run(
        [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True, text=True, timeout=60
    )
    for line in (dryrun.stdout + dryrun.stderr).splitlines():
        match = re.search(r"TOP=(\S+)", line)
        if match:
            return Path(match.group(1)) / "include"
    return Path(os.path.realpath(nvcc)).parent.parent / "include"


@pytest.fixture(scope="module")
def nvcc() -> str:
    path = _nvcc()
    if path is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH): csrc/ was not compile-checked")
    return path


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(command)}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}"


def test_kernel_sources_are_found():
    names = {path.name for path in KERNEL_SOURCES}
    assert {"fold_kernels.cu", "norm_kernels.cu", "scale_kernels.cu"} <= names, names
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


@pytest.mark.parametrize("source", KERNEL_SOURCES, ids=lambda path: path.name)
def test_kernel_compiles_for_sm80_and_sm90(nvcc: str, source: Path, tmp_path: Path):
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # the -D flags torch's own build adds

    gencode = [flag for arch in ARCHS for flag in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]
    output = tmp_path / (source.stem + ".o")
    _run(
        [nvcc, "-c", str(source), "-o", str(output), "-std=c++17", "-O3", *gencode, *COMMON_NVCC_FLAGS, f"-I{CSRC}"]
        + ["-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror,-fPIC"]
    )
    assert output.stat().st_size > 0


def test_binding_compiles_against_installed_torch_headers(nvcc: str):
    from torch.utils.cpp_extension import include_paths

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++/c++) found: bindings.cpp was not syntax-checked")
    cuda_include = _cuda_include_dir(nvcc)
    assert (cuda_include / "cuda_runtime_api.h").is_file(), f"cuda_runtime_api.h not under {cuda_include}"
    system_includes = [*include_paths(), sysconfig.get_paths()["include"], str(cuda_include)]
    _run(
        [compiler, "-fsyntax-only", BINDING_STD, "-Wall", "-Wextra", "-Werror", f"-I{CSRC}"]
        + [flag for path in system_includes for flag in ("-isystem", path)]
        + ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", str(BINDING)]
    )

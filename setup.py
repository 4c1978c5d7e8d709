"""Build script: the Python package always; the CUDA extension gafused._C only where CUDA can build it.

Environment switches:
    GAFUSED_SKIP_CUDA_BUILD=1   never build the extension (pure Python install: reference, foreach, triton).
    GAFUSED_FORCE_CUDA=1        build it even when no GPU is visible (needs CUDA torch and nvcc); a build that fails
                                fails the install.

Without the switch, a machine with a GPU builds the extension when its toolkit has nvcc, and a build that fails
there (a toolkit of another major version than torch's, an unsupported compiler) installs the package without
it, saying why: the other backends need no compiler.
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _cuda_home_from_nvcc() -> str | None:
    """The toolkit directory of the nvcc on PATH, as nvcc itself reports it (None without a usable nvcc).

    torch guesses CUDA_HOME as the parent of nvcc's directory, which is wrong when nvcc is a wrapper script
    (/usr/local/bin/nvcc exec'ing /usr/local/cuda-13.0/bin/nvcc gives /usr/local, without the CUDA headers).
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        dryrun = subprocess.run(
            [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"TOP=(\S+)", dryrun.stdout + dryrun.stderr)
    if match and os.path.isfile(os.path.join(match.group(1), "include", "cuda_runtime_api.h")):
        return match.group(1)
    return None


def _cuda_build() -> tuple[list, dict]:
    """Extension modules and build commands for gafused._C, or nothing when CUDA cannot build it here."""
    if _flag("GAFUSED_SKIP_CUDA_BUILD"):
        return [], {}
    try:
        import torch
    except ImportError:
        why = (
            "torch is not importable in the build environment (pip's build isolation hides an installed torch: "
            "install with --no-build-isolation)"
        )
        if _flag("GAFUSED_FORCE_CUDA"):
            raise RuntimeError(f"GAFUSED_FORCE_CUDA=1 but {why}") from None
        print(f"gafused: not building the CUDA extension: {why}", file=sys.stderr)
        return [], {}
    # torch reads CUDA_HOME once, when cpp_extension is imported: settle it first (an explicit one wins).
    if torch.version.cuda is not None and not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        cuda_home = _cuda_home_from_nvcc()
        if cuda_home is not None:
            os.environ["CUDA_HOME"] = cuda_home
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None or CUDA_HOME is None:
        if _flag("GAFUSED_FORCE_CUDA"):
            raise RuntimeError(
                f"GAFUSED_FORCE_CUDA=1 needs a CUDA build of torch and nvcc; found torch {torch.__version__} "
                f"(CUDA {torch.version.cuda}) and CUDA_HOME={CUDA_HOME}"
            )
        if torch.version.cuda is not None:  # torch's CUDA from pip, no toolkit
            print(
                "gafused: not building the CUDA extension: no CUDA toolkit found (no nvcc on PATH, CUDA_HOME unset)",
                file=sys.stderr,
            )
        return [], {}
    forced = _flag("GAFUSED_FORCE_CUDA")
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc.exe" if os.name == "nt" else "nvcc")
    if not os.path.isfile(nvcc):  # a CUDA runtime without the toolkit (torch guesses /usr/local/cuda)
        if forced:
            raise RuntimeError(f"GAFUSED_FORCE_CUDA=1 needs nvcc; CUDA_HOME={CUDA_HOME} has no {nvcc}")
        print(f"gafused: not building the CUDA extension: no nvcc at {nvcc}", file=sys.stderr)
        return [], {}
    gpu_visible = torch.cuda.is_available()
    if not gpu_visible and not forced:
        print(
            "gafused: not building the CUDA extension: no GPU visible (GAFUSED_FORCE_CUDA=1 builds it for sm_80 and "
            "sm_90 anyway)",
            file=sys.stderr,
        )
        return [], {}

    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    # Without a GPU torch cannot detect the target; build the architectures the kernels are checked for
    # (A100, H100) rather than torch's long default list, plus sm_90 PTX that newer GPUs compile at first use.
    # Older GPUs (sm_70, sm_75) get no code: the cuda backend then reports itself unavailable and "auto" moves on.
    if not gpu_visible and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
    # ninja otherwise starts one nvcc per core, and each can take GBs of memory.
    if not os.environ.get("MAX_JOBS"):
        os.environ["MAX_JOBS"] = str(max(1, min(os.cpu_count() or 1, 8)))

    # Sources relative to this file, as setuptools wants them; the header directory absolute.
    here = os.path.dirname(os.path.abspath(__file__))
    csrc = "csrc"
    sources = [os.path.join(csrc, "bindings.cpp")] + sorted(
        os.path.join(csrc, name) for name in os.listdir(os.path.join(here, csrc)) if name.endswith(".cu")
    )
    extension = CUDAExtension(
        name="gafused._C",
        sources=sources,
        include_dirs=[os.path.join(here, csrc)],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )

    class Build(BuildExtension):
        """torch's build, rebuilt at every install (torch skips sources it thinks up to date when it builds without
        ninja, which would keep a stale library after the architectures or torch changed); without
        GAFUSED_FORCE_CUDA a failed build installs the package without the extension, saying why."""

        def finalize_options(self) -> None:
            super().finalize_options()
            self.force = True

        def run(self) -> None:
            # Where an earlier build's library may be: the build directory, and the package directory that an
            # editable install builds into. Asked now: setuptools sets self.inplace to False while it builds and
            # leaves it so when the build raises.
            inplace, earlier = self.inplace, set()
            for mode in (False, True):
                self.inplace = mode
                earlier.update(self.get_ext_fullpath(ext.name) for ext in self.extensions)
            self.inplace = inplace
            try:
                super().run()
            except Exception as error:
                self.inplace = inplace
                if forced:
                    raise
                print(
                    f"gafused: the CUDA extension gafused._C did not build ({type(error).__name__}: {error}); "
                    "installing without it (backends reference, foreach, triton). GAFUSED_FORCE_CUDA=1 makes this "
                    "an error.",
                    file=sys.stderr,
                )
                for stale in earlier:  # an earlier build's library would be imported (or packaged) instead
                    if os.path.exists(stale):
                        os.remove(stale)
                self.extensions = []

    return [extension], {"build_ext": Build}


ext_modules, cmdclass = _cuda_build()

setup(
    name="gafused",
    version="0.1.0",
    description="Fused, correctly scaled gradient accumulation for PyTorch",
    long_description=open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["gafused", "gafused.*"]),
    license="BSD-3-Clause",
    python_requires=">=3.10",
    install_requires=["torch>=2.9"],  # README "Two commands": the versions tested
    extras_require={
        # Triton ships Linux wheels only; its CPU interpreter (TRITON_INTERPRET=1) imports numpy.
        "triton": ["triton>=3.5; sys_platform == 'linux'", "numpy"],
        "test": ["pytest", "ruff>=0.17,<0.18", "hypothesis", "numpy"],
        # tests/test_correctness.py's float64 GPT-2 proof; it skips with the reason when this is absent.
        # also gafused.integrations.transformers (Trainer needs accelerate); the minimum is
        # gafused.integrations.TRANSFORMERS_MIN_VERSION, the oldest Trainer with every internal GafusedTrainer uses.
        "transformers": ["transformers>=5.19", "accelerate>=1.0"],
        # gafused.integrations: each adapter imports its framework lazily.
        "accelerate": ["accelerate>=1.0"],
        "lightning": ["lightning>=2.0"],
        "bench": ["matplotlib", "tqdm"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

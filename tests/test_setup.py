"""setup.py's decision to build gafused._C, with torch's CUDA side faked: a machine with a GPU whose toolkit cannot
build the extension installs without it (saying why), unless GAFUSED_FORCE_CUDA=1 asks for the build."""

from __future__ import annotations

import runpy
import sys
import types
from pathlib import Path

import pytest
import setuptools

SETUP = Path(__file__).resolve().parents[1] / "setup.py"


class _FakeBuildExtension:
    """Stands for torch's BuildExtension: ``run`` fails when told to, as a build with a broken toolkit does."""

    fail = False

    # Where earlier builds left gafused._C: the build directory, and the package directory (editable install).
    built_library: Path | None = None
    inplace_library: Path | None = None

    def __init__(self) -> None:
        self.extensions = [types.SimpleNamespace(name="gafused._C")]
        self.force = False
        self.inplace = True  # what an editable install asks for

    def get_ext_fullpath(self, name: str) -> str:
        return str(self.inplace_library if self.inplace else self.built_library)

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        # setuptools' build_ext.run builds into the build directory first (inplace off) and copies the library
        # into the package afterwards; a build that raises leaves inplace off.
        inplace, self.inplace = self.inplace, False
        if self.fail:
            raise RuntimeError("The detected CUDA version (12.4) mismatches the version that compiled PyTorch")
        self.inplace = inplace


def _run_setup(monkeypatch: pytest.MonkeyPatch, cuda_home: Path | None, gpu: bool = True) -> dict:
    """Run setup.py against a CUDA torch that sees a GPU (faked) and a toolkit at ``cuda_home`` (None: no toolkit
    anywhere); what it passed to setuptools.setup."""
    torch = types.ModuleType("torch")
    torch.__version__ = "2.13.0+cu130"
    torch.version = types.SimpleNamespace(cuda="13.0")
    torch.cuda = types.SimpleNamespace(is_available=lambda: gpu)
    utils = types.ModuleType("torch.utils")
    extension = types.ModuleType("torch.utils.cpp_extension")
    extension.CUDA_HOME = None if cuda_home is None else str(cuda_home)
    extension.BuildExtension = _FakeBuildExtension
    extension.CUDAExtension = lambda name, **kwargs: name
    for name, module in {"torch": torch, "torch.utils": utils, "torch.utils.cpp_extension": extension}.items():
        monkeypatch.setitem(sys.modules, name, module)
    if cuda_home is None:
        monkeypatch.delenv("CUDA_HOME", raising=False)
        monkeypatch.delenv("CUDA_PATH", raising=False)
        monkeypatch.setenv("PATH", "")  # no nvcc to ask either
    else:
        monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    monkeypatch.delenv("GAFUSED_SKIP_CUDA_BUILD", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # set: setup.py would otherwise write its defaults here
    monkeypatch.setenv("MAX_JOBS", "1")
    given: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: given.update(kwargs))
    runpy.run_path(str(SETUP))
    return given


def _toolkit(root: Path, nvcc: bool) -> Path:
    (root / "lib64").mkdir(parents=True)
    if nvcc:
        (root / "bin").mkdir()
        (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    return root


@pytest.mark.parametrize("forced", [False, True])
def test_a_cuda_home_without_nvcc_builds_nothing_or_fails_when_forced(monkeypatch, tmp_path, capsys, forced):
    """torch guesses /usr/local/cuda wherever it exists; a runtime-only image has no nvcc there."""
    runtime_only = _toolkit(tmp_path / "cuda", nvcc=False)
    if forced:
        monkeypatch.setenv("GAFUSED_FORCE_CUDA", "1")
        with pytest.raises(RuntimeError, match=r"GAFUSED_FORCE_CUDA=1 needs nvcc; CUDA_HOME=.* has no .*nvcc"):
            _run_setup(monkeypatch, runtime_only)
        return
    monkeypatch.delenv("GAFUSED_FORCE_CUDA", raising=False)
    given = _run_setup(monkeypatch, runtime_only)
    assert given["ext_modules"] == [] and given["cmdclass"] == {}
    assert "not building the CUDA extension: no nvcc at" in capsys.readouterr().err


@pytest.mark.parametrize("toolkit, gpu", [(False, True), (False, False), (True, False)])
def test_why_nothing_is_built_is_said(monkeypatch, tmp_path, capsys, toolkit, gpu):
    """A CUDA torch from pip with no toolkit installed (with or without a GPU), or a toolkit and no GPU: no
    extension, and the reason."""
    monkeypatch.delenv("GAFUSED_FORCE_CUDA", raising=False)
    given = _run_setup(monkeypatch, _toolkit(tmp_path / "cuda", nvcc=True) if toolkit else None, gpu=gpu)
    assert given["ext_modules"] == [] and given["cmdclass"] == {}
    reason = "no GPU visible" if toolkit else "no CUDA toolkit found (no nvcc on PATH, CUDA_HOME unset)"
    assert f"gafused: not building the CUDA extension: {reason}" in capsys.readouterr().err


@pytest.mark.parametrize("forced", [False, True])
def test_a_build_environment_without_torch_says_why_nothing_is_built(monkeypatch, capsys, forced):
    """pip's build isolation hides the installed torch (a plain `pip install .`): no extension, and the reason
    with its remedy, so a GPU user does not learn of it first from backend="cuda"."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    monkeypatch.delenv("GAFUSED_SKIP_CUDA_BUILD", raising=False)
    given: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: given.update(kwargs))
    if forced:
        monkeypatch.setenv("GAFUSED_FORCE_CUDA", "1")
        with pytest.raises(
            RuntimeError, match=r"GAFUSED_FORCE_CUDA=1 but torch is not importable.*--no-build-isolation"
        ):
            runpy.run_path(str(SETUP))
        return
    monkeypatch.delenv("GAFUSED_FORCE_CUDA", raising=False)
    runpy.run_path(str(SETUP))
    assert given["ext_modules"] == [] and given["cmdclass"] == {}
    said = capsys.readouterr().err
    assert "not building the CUDA extension: torch is not importable" in said and "--no-build-isolation" in said


def test_the_package_version_is_the_one_setup_installs(monkeypatch):
    import gafused

    given: dict = {}
    monkeypatch.setenv("GAFUSED_SKIP_CUDA_BUILD", "1")
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: given.update(kwargs))
    runpy.run_path(str(SETUP))
    assert given["version"] == gafused.__version__


@pytest.mark.parametrize("forced", [False, True])
def test_a_build_that_fails_installs_without_the_extension_unless_forced(monkeypatch, tmp_path, capsys, forced):
    if forced:
        monkeypatch.setenv("GAFUSED_FORCE_CUDA", "1")
    else:
        monkeypatch.delenv("GAFUSED_FORCE_CUDA", raising=False)
    given = _run_setup(monkeypatch, _toolkit(tmp_path / "cuda", nvcc=True))
    assert given["ext_modules"] == ["gafused._C"]
    build = given["cmdclass"]["build_ext"]()
    build.finalize_options()
    assert build.force, "rebuilt at every install, never served stale"
    build.run()  # a working toolkit: nothing to report
    assert [ext.name for ext in build.extensions] == ["gafused._C"]
    stale = [tmp_path / where / "_C.cpython-311-x86_64-linux-gnu.so" for where in ("build", "package")]
    for library in stale:
        library.parent.mkdir()
        library.write_bytes(b"an earlier build")
    monkeypatch.setattr(_FakeBuildExtension, "built_library", stale[0])
    monkeypatch.setattr(_FakeBuildExtension, "inplace_library", stale[1])
    monkeypatch.setattr(_FakeBuildExtension, "fail", True)
    if forced:
        with pytest.raises(RuntimeError, match="mismatches the version"):
            build.run()
        assert all(library.exists() for library in stale)
        return
    build.run()
    assert build.extensions == [] and build.inplace
    assert not any(library.exists() for library in stale), "an earlier library would be imported (or packaged)"
    err = capsys.readouterr().err
    assert "gafused._C did not build (RuntimeError: The detected CUDA version (12.4) mismatches" in err
    assert "GAFUSED_FORCE_CUDA=1 makes this an error" in err

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors through the interpreter when there is no GPU. The flag is read when a
# kernel is defined, so it has to be set before gafused's Triton backend is imported. On a GPU machine the
# kernels are compiled for the GPU instead, and cannot run on CPU tensors: tests that build CPU models then
# skip the triton backend (see ``backend``).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _children_import_this_gafused() -> None:
    """Subprocesses (distributed workers, framework launchers, bench scripts) import gafused anew and do not inherit
    sys.path: when this process imported a checkout that is not installed (``python -m pytest`` from the repository
    root puts it on sys.path), they get it through PYTHONPATH too, instead of failing or finding another copy."""
    import gafused

    root = Path(gafused.__file__).resolve().parents[1]
    if not (root / "setup.py").is_file():  # an installed copy: children find it where this process did
        return
    paths = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    if not paths or paths[0] != str(root):  # (a relative entry names another directory in a child's own cwd)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *paths])


_children_import_this_gafused()

# Backends the ``backend`` fixture runs a test with. cuda is left out: it never runs the CPU models these tests
# build; tests/test_cuda_ops.py covers it on a GPU.
FIXTURE_BACKENDS = ("reference", "foreach", "triton")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def device_of(node) -> torch.device:
    """The device a test's tensors live on: its ``device_type`` parameter when it has one, else CPU (the suite's
    models are built on CPU unless a test says otherwise)."""
    callspec = getattr(node, "callspec", None)
    if callspec is not None and "device_type" in callspec.params:
        return torch.device(callspec.params["device_type"])
    return torch.device("cpu")


def backend_skip_reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run a test on ``device`` (None when it can)."""
    from gafused import ops

    reason = ops.backend_unavailable_reason(name, device)
    return None if reason is None else f"{name} backend cannot run on {device}: {reason}"


@pytest.fixture(params=FIXTURE_BACKENDS)
def backend(request):
    """Every backend that can run on the device the test uses (triton on CPU only through the interpreter)."""
    reason = backend_skip_reason(request.param, device_of(request.node))
    if reason is not None:
        pytest.skip(reason)
    return request.param


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")

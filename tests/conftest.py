import os

import pytest
import torch

# Triton kernels run on CPU tensors through the interpreter when there is no GPU. The flag is read when a
# kernel is defined, so it has to be set before gafused's Triton backend is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _backend_params():
    from gafused import ops

    params = [pytest.param("reference", id="reference")]
    reason = ops.backend_unavailable_reason("triton", "cuda" if torch.cuda.is_available() else "cpu")
    params.append(pytest.param("triton", id="triton", marks=pytest.mark.skipif(reason is not None, reason=str(reason))))
    return params


@pytest.fixture(params=_backend_params())
def backend(request):
    """Every backend that can run the wrapper on this machine's default device (triton via the interpreter)."""
    return request.param


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")

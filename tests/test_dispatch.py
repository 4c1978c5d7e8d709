"""Backend choice and op dispatch, including the decisions a machine with a CUDA GPU makes, simulated here.

CI has no GPU, yet the suite must be right on one by construction: there Triton compiles its kernels for the GPU
(no interpreter), so the triton backend cannot run the CPU models most tests build and must be skipped for them
with a reason, while GPU tensors get the fused backends. ``cuda_machine`` makes this process look like such a
machine (CUDA present, Triton kernels compiled rather than interpreted, the cuda extension missing).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from conftest import FIXTURE_BACKENDS, backend_skip_reason, device_of

import gafused
from gafused import FlatGradBuffer, ops

triton_backend = pytest.importorskip("gafused.triton_backend", reason="triton is not installed")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def cuda_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(triton_backend, "_INTERPRETED", False)  # as without TRITON_INTERPRET: compiled kernels
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    monkeypatch.delenv(ops.ENV_BACKEND, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda_module = ops._load("cuda")
    if cuda_module is not None:
        monkeypatch.setattr(cuda_module, "unavailable_reason", lambda device: "gafused._C is not built")


def _node(**params):
    """A stand-in for a collected test item, with the parameters pytest would give it."""
    return types.SimpleNamespace(callspec=types.SimpleNamespace(params=params)) if params else types.SimpleNamespace()


def test_fixture_skips_triton_for_cpu_models_on_a_cuda_machine(cuda_machine):
    for name in FIXTURE_BACKENDS:
        reason = backend_skip_reason(name, device_of(_node()))
        if name == "triton":
            assert reason is not None and "cpu" in reason and "TRITON_INTERPRET=1" in reason
        else:
            assert reason is None, reason
    # A test parametrized over device_type runs its cuda case with triton and its cpu case without.
    assert device_of(_node(device_type="cuda")) == CUDA
    assert backend_skip_reason("triton", device_of(_node(device_type="cuda"))) is None
    assert backend_skip_reason("triton", device_of(_node(device_type="cpu"))) is not None


def test_auto_on_a_cuda_machine(cuda_machine):
    assert ops.resolve_backend("auto", CUDA) == "triton"
    assert ops.resolve_backend("auto", CPU) == "foreach"
    assert gafused.available_backends() == ["reference", "foreach", "triton"]  # the default device is cuda now
    assert gafused.available_backends(CPU) == ["reference", "foreach"]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1") as info:
        ops.resolve_backend("triton", CPU)
    assert "pip install" not in str(info.value)  # triton is installed: the install hint would send users wrong


def test_auto_falls_back_to_foreach_with_a_warning_on_rocm(cuda_machine, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    reason = triton_backend.unavailable_reason(CUDA)
    assert reason is not None and "ROCm" in reason
    with pytest.warns(RuntimeWarning, match="foreach backend"):
        assert ops.resolve_backend("auto", CUDA) == "foreach"


def test_auto_falls_back_to_foreach_with_a_warning_below_what_triton_compiles_for(cuda_machine, monkeypatch):
    """Triton compiles for compute capability 7.0 and up: on an older GPU (a P100, 6.0) auto does not pick kernels
    that would fail at their first compile, and a named triton backend is refused with the reason."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 0))
    reason = triton_backend.unavailable_reason(CUDA)
    assert reason == "Triton compiles for compute capability 7.0 and up; cuda has 6.0"
    with pytest.warns(RuntimeWarning, match="foreach backend"):
        assert ops.resolve_backend("auto", CUDA) == "foreach"
    with pytest.raises(RuntimeError, match="compute capability 7.0 and up"):
        ops.resolve_backend("triton", CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert ops.resolve_backend("auto", CUDA) == "triton"


def _cuda_backend_over(extension: types.ModuleType, monkeypatch) -> types.ModuleType:
    """gafused.cuda_backend imported anew over a stand-in for the compiled gafused._C (registered nowhere else), and
    this GPU machine's answers: one visible device, an H100 (compute capability 9.0), a CUDA build of torch."""
    monkeypatch.setitem(sys.modules, "gafused._C", extension)
    monkeypatch.setattr(gafused, "_C", extension, raising=False)
    spec = importlib.util.find_spec("gafused.cuda_backend")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(ops, "_loaded", {**ops._loaded, "cuda": module})
    monkeypatch.setattr(ops, "_import_errors", {k: v for k, v in ops._import_errors.items() if k != "cuda"})
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    return module


def _extension(**functions) -> types.ModuleType:
    extension = types.ModuleType("gafused._C")
    for name in ("fold_", "fold_finish_", "sum_of_squares", "scale_"):  # never called while a backend is chosen
        setattr(extension, name, lambda *args, name=name: pytest.fail(f"{name} ran"))
    for name, function in functions.items():
        setattr(extension, name, function)
    return extension


def test_a_build_without_code_for_the_gpu_is_reported_with_the_rebuild_command(cuda_machine, monkeypatch):
    """What the extension says of the device decides: no kernel image for it, and the backend names the rebuild."""
    answers = {0: "cudaErrorNoKernelImageForDevice: no kernel image is available for execution on the device"}
    cuda_module = _cuda_backend_over(_extension(kernel_image_error=answers.get), monkeypatch)
    reason = cuda_module.unavailable_reason(CUDA)
    assert reason.startswith("gafused._C was built without code for NVIDIA H100 80GB HBM3 (compute capability 9.0)")
    assert answers[0] in reason and "TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation -e ." in reason
    assert ops.resolve_backend("auto", CUDA) == "triton"
    answers[0] = ""  # a build with code for it (asked again by a fresh import: the answer is cached per device)
    assert _cuda_backend_over(_extension(kernel_image_error=answers.get), monkeypatch).unavailable_reason(CUDA) is None
    assert ops.resolve_backend("auto", CUDA) == "cuda"


def test_an_older_build_is_reported_with_the_rebuild_command(cuda_machine, monkeypatch):
    """An extension built before it could say whether it holds code for the device (no kernel_image_error): the
    backend reports itself unavailable with the command that rebuilds it, instead of an AttributeError; "auto"
    takes the next backend, and asking for "cuda" by name raises with the reason."""
    cuda_module = _cuda_backend_over(_extension(), monkeypatch)
    reason = cuda_module.unavailable_reason(CUDA)
    assert reason.startswith("gafused._C was built by an older gafused"), reason
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0)" in reason
    assert "TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation -e ." in reason
    assert ops.resolve_backend("auto", CUDA) == "triton"
    assert gafused.available_backends(CUDA) == ["reference", "foreach", "triton"]
    with pytest.raises(RuntimeError, match="built by an older gafused") as info:
        ops.resolve_backend("cuda", CUDA)
    # The reason carries its own rebuild command; the install hint is for a backend that does not import.
    assert "TORCH_CUDA_ARCH_LIST=9.0" in str(info.value) and ops.INSTALL_HINTS["cuda"] not in str(info.value)


def test_auto_on_this_machine():
    assert ops.resolve_backend("auto", CPU) == "foreach"
    assert "foreach" in gafused.available_backends(CPU)


def _buffer_and_grads():
    params = [torch.empty(3, 5), torch.empty(7)]
    buffer = FlatGradBuffer(params)
    return buffer, [torch.randn(p.shape) for p in params]


def test_eager_calls_skip_every_custom_op(monkeypatch):
    """Each public op called on plain tensors runs its backend directly: none goes through its registered op (a
    dispatcher round trip per gradient)."""
    buffer, grads = _buffer_and_grads()
    called = []
    for name in ("_fold_op", "_fold_finish_op", "_sum_of_squares_op", "_scale_op"):
        monkeypatch.setattr(ops, name, lambda *args, name=name: called.append(name))
    ops.fold_(buffer, grads, 1.0, first=True, backend="foreach")
    total, _ = ops.fold_finish_(buffer, grads, 1.0, 0.5, first=False, backend="foreach")  # (g + g) / 2 = g
    per_segment = ops.sum_of_squares(buffer, per_segment=True, backend="foreach")
    ops.scale_(buffer, 2.0, backend="foreach")
    assert called == []
    assert isinstance(total, torch.Tensor) and per_segment.shape == (2,)
    for index, grad in enumerate(grads):
        assert torch.equal(buffer.view(index), grad * 2.0)  # every step exact in float32


def test_tracing_goes_through_the_custom_op(monkeypatch):
    buffer, grads = _buffer_and_grads()
    called = []
    monkeypatch.setattr(ops, "_fold_op", lambda *args: called.append(args[-1]))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    ops.fold_(buffer, grads, 1.0, first=True, backend="foreach")
    assert called == ["foreach"]


def test_fake_tensors_go_through_the_custom_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        buffer, grads = _buffer_and_grads()
        total, flag = ops.fold_finish_(buffer, grads, 1.0, 0.5, first=True, backend="foreach")
        assert total.shape == () and flag.dtype == torch.bool


@pytest.mark.parametrize("backend", ["reference", "foreach"])
def test_fake_cuda_tensors_go_through_the_custom_op_without_a_gpu(backend):
    """Tracing a CUDA model under FakeTensorMode needs no GPU: a named backend takes fake CUDA buffers wherever
    available_backends("cuda") lists none (no CUDA device here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        buffer = FlatGradBuffer([torch.empty(10, device="cuda"), torch.empty(2, 2, device="cuda")])
        grads = [torch.ones(10, device="cuda"), torch.ones(2, 2, device="cuda")]
        total, flag = ops.fold_finish_(buffer, grads, 1.0, 0.5, first=True, backend=backend)
        assert total.device.type == "cuda" and total.shape == () and flag.dtype == torch.bool


def test_ops_are_marked_cudagraph_unsafe():
    for name in ("fold_", "fold_finish_", "sum_of_squares", "scale_"):
        assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.gafused, name).default.tags, name


def test_graph_capture_is_refused(monkeypatch):
    asked = []
    monkeypatch.setattr(ops, "_capturing", lambda device: asked.append(device) or True)
    with pytest.raises(RuntimeError, match="CUDA graph"):
        ops._backend_for(types.SimpleNamespace(is_cuda=True, device="cuda:1"), "foreach")
    assert asked == ["cuda:1"]  # the buffer's device's stream, not the current device's
    # CPU tensors never ask (the CPU build of torch cannot answer).
    assert ops._backend_for(torch.zeros(1), "foreach") is ops._module("foreach")


def test_an_unknown_backend_name_reaching_a_registered_op_is_refused():
    """torch.ops.gafused.* take the backend by name: a name that is no backend is refused, not taken for cuda."""
    with pytest.raises(ValueError, match=r"backend must be one of .*got 'Foreach'"):
        torch.ops.gafused.sum_of_squares(torch.zeros(8), [0], [8], False, "Foreach")
    assert "Foreach" not in ops._import_errors


def test_a_built_extension_still_refuses_what_it_cannot_run_on(cuda_machine, monkeypatch):
    """A build with code for the GPU runs on that GPU only: CPU tensors, a device index that is not visible, a
    machine whose CUDA is gone and a CPU build of torch each give the reason, and "cuda" by name then raises."""
    cuda_module = _cuda_backend_over(_extension(kernel_image_error={0: "", 1: ""}.get), monkeypatch)
    assert cuda_module.unavailable_reason(CUDA) is None
    assert cuda_module.unavailable_reason(torch.device("cuda:0")) is None
    assert cuda_module.unavailable_reason(CPU) == "the cuda backend runs on CUDA devices only, got cpu"
    with pytest.raises(RuntimeError, match="CUDA devices only"):
        ops.resolve_backend("cuda", CPU)
    reason = cuda_module.unavailable_reason(torch.device("cuda:1"))
    assert reason == "the cuda backend needs a visible CUDA device; cuda:1 is not one of 1", reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "torch.cuda.is_available() is False" in cuda_module.unavailable_reason(CUDA)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "needs a CUDA build of torch" in cuda_module.unavailable_reason(CUDA)
    # No CUDA device: no backend is listed for one (also those that run anywhere there is one)...
    assert gafused.available_backends(CUDA) == []
    assert gafused.available_backends(CPU) == ["reference", "foreach"]
    # ... but a backend named for CUDA tensors still takes them (fake ones, under FakeTensorMode).
    assert ops.resolve_backend("foreach", CUDA) == "foreach"


def test_a_dispatch_mode_over_plain_tensors_goes_through_the_custom_op():
    """make_fx traces plain tensors under a dispatch mode: the graph must hold the gafused ops themselves (a
    backend run directly would leave its kernels out of the graph, or trace the wrong ops)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    buffer, grads = _buffer_and_grads()

    def window(g0, g1, weight):
        ops.fold_(buffer, [g0, g1], weight, first=True, backend="foreach")
        return ops.fold_finish_(buffer, [g0, g1], weight, 0.5, first=False, backend="foreach")

    graph = make_fx(window)(*grads, torch.tensor(2.0))
    targets = {node.target for node in graph.graph.nodes}
    assert torch.ops.gafused.fold_.default in targets and torch.ops.gafused.fold_finish_.default in targets


def test_scale_under_a_dispatch_mode_goes_through_the_custom_op_and_computes_what_eager_does():
    """scale_, in place and cast into ``out``, traced by make_fx: the graph holds gafused.scale_ for each call, and
    the traced run leaves the buffer and ``out`` as an eager run does, bit for bit."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(traced):
        buffer = FlatGradBuffer([torch.zeros(6), torch.zeros(3, 2)])
        ops.fold_(buffer, [torch.linspace(-1, 2, 6), torch.linspace(3, 1, 6).reshape(3, 2)], 1.0, first=True)
        out = torch.zeros(buffer.numel, dtype=torch.bfloat16)

        def window(coef, out):
            ops.scale_(buffer, coef, out=out, backend="foreach")
            ops.scale_(buffer, coef, backend="foreach")

        if not traced:
            window(torch.tensor(0.3), out)
            return buffer.data, out, []
        graph = make_fx(window)(torch.tensor(0.3), out)
        return buffer.data, out, [node.target for node in graph.graph.nodes if node.op == "call_function"]

    eager_data, eager_out, _ = run(traced=False)
    traced_data, traced_out, targets = run(traced=True)
    assert targets == [torch.ops.gafused.scale_.default] * 2
    assert torch.equal(traced_data, eager_data) and torch.equal(traced_out, eager_out)


def test_a_backend_that_failed_to_import_reaching_a_registered_op_is_named_with_its_install_hint():
    """torch.ops.gafused.* take the backend by name and skip resolve_backend: one that does not import raises
    RuntimeError with its import error and the command that installs it, and the buffer is left as it was."""
    reason = ops.backend_unavailable_reason("cuda", "cpu")
    if reason is None or "failed to import" not in reason:
        pytest.skip(f"the cuda backend imports here ({reason})")
    acc = torch.arange(8.0)
    refusal = r"backend 'cuda' failed to import: ImportError.*To install it: GAFUSED_FORCE_CUDA=1 pip install"
    with pytest.raises(RuntimeError, match=refusal):
        torch.ops.gafused.sum_of_squares(acc, [0], [8], False, "cuda")
    with pytest.raises(RuntimeError, match=refusal):
        torch.ops.gafused.scale_(acc, [0], [8], torch.tensor(2.0), None, "cuda")
    assert torch.equal(acc, torch.arange(8.0))


def test_capture_is_asked_of_the_buffers_device_stream(monkeypatch):
    """is_current_stream_capturing() asks about the current device: _capturing must switch to the buffer's device
    first, or a capture on the buffer's stream (another device current) is not refused."""
    current = ["cuda:0"]

    class Device:
        def __init__(self, device):
            self.device = str(device)

        def __enter__(self):
            self.previous, current[0] = current[0], self.device

        def __exit__(self, *exc):
            current[0] = self.previous

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[0] == "cuda:1")
    with pytest.raises(RuntimeError, match="CUDA graph"):
        ops._backend_for(types.SimpleNamespace(is_cuda=True, device=torch.device("cuda:1")), "foreach")
    assert ops._backend_for(types.SimpleNamespace(is_cuda=True, device=torch.device("cuda:0")), "foreach")
    assert current == ["cuda:0"]


@pytest.mark.parametrize("name", ["reference", "foreach", "triton"])
def test_fake_tensors_outside_their_mode_go_through_the_custom_op(name):
    """FakeTensors made under a FakeTensorMode and used after it (FakeTensorProp, a memory estimate over fake
    inputs) carry no dispatch mode: their type alone must route the op to its fake kernel."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    reason = ops.backend_unavailable_reason(name, "cpu")
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    with FakeTensorMode():
        buffer, grads = _buffer_and_grads()
        weight, scale = torch.tensor(2.0), torch.tensor(0.5)
    total, flag = ops.fold_finish_(buffer, grads, weight, scale, first=True, backend=name)
    assert isinstance(total, FakeTensor) and total.shape == () and flag.dtype == torch.bool
    assert ops.sum_of_squares(buffer, per_segment=True, backend=name).shape == (2,)

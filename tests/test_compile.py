"""A compiled train step that calls the accumulator: the graphs torch.compile makes, and the same numbers as eager.

GradAccumulator's public methods run outside torch.compile (``torch._disable_dynamo``): Dynamo breaks the graph
at each call and never traces the window's bookkeeping. What that costs is bounded and the same at every
micro-step of a window, the window's end included (README, "torch.compile"):

- ``torch._dynamo.explain`` of ``forward; opt.backward(loss, weight=w); opt.step(); opt.zero_grad()`` reports
  GRAPHS graphs (the forward and loss; the code after the last call) and BREAKS graph break (the one that ends
  the forward's graph: the frames between the accumulator's calls hold no operation, so they make no graph);
- compiled once: no recompilation from one micro-step, window or window length to the next (before torch 2.13,
  once for the first ``end_window=True`` a driven window passes in as a Python bool; once for a Python-number weight
  that changes value, see NUMBER_WEIGHT_FRAMES).
"""

import copy

import pytest
import torch

from gafused import FlatGradBuffer, GradAccumulator, ops

from casekit import tanh_mlp

GRAPHS = 2
BREAKS = 1
STEPS = 4
# Before torch 2.13 (measured on 2.11.0 and 2.12.1) Dynamo guards on a Python bool handed to a skipped function, so
# a driven window's ``end_window=True`` compiles the forward's frame once more: one frame more, once.
BOOL_GUARD_FRAMES = 1 if torch.__version__ < (2, 13) else 0  # torch's TorchVersion compares with tuples

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here")


@pytest.fixture(params=["reference", "foreach"])
def compile_backend(request):
    """The gafused backends a CPU train step runs (triton runs here only through its interpreter)."""
    return request.param


def _model():
    return tanh_mlp((6, 8, 3))


def _data(count, seed=1):
    """Micro-batches of one shape, so that the model's graph is not recompiled for a new shape (torch's own rule)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 6, generator=generator, dtype=torch.float64), torch.randn(4, 3, generator=generator))
        for _ in range(count)
    ]


def _train_step(model, opt, loop):
    def backward_loop(x, y, w):
        loss = torch.nn.functional.mse_loss(model(x), y.double())
        opt.backward(loss, weight=w)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def step_loop(x, y, w):
        loss = torch.nn.functional.mse_loss(model(x), y.double())
        loss.backward()
        opt.step(weight=w)
        opt.zero_grad()
        return loss.detach()

    return backward_loop if loop == "backward" else step_loop


@pytest.mark.parametrize("loop", ["backward", "step"])
def test_graphs_and_breaks_per_micro_step_are_bounded(compile_backend, loop):
    model = _model()
    opt = GradAccumulator(
        torch.optim.AdamW(model.parameters(), lr=0.01), STEPS, max_grad_norm=1.0, backend=compile_backend
    )
    step = _train_step(model, opt, loop)
    for index, (x, y) in enumerate(_data(STEPS)):
        explained = torch._dynamo.explain(step)(x, y, torch.tensor(float(x.shape[0])))
        assert explained.graph_count <= GRAPHS, (index, explained)
        assert explained.graph_break_count <= BREAKS, (index, explained)
        assert opt.stepped == (index == STEPS - 1)  # the last one ran the window's end inside the compiled step


@pytest.mark.parametrize("steps", [STEPS, None], ids=["counted", "driven"])
def test_compiled_step_compiles_once_and_matches_the_big_batch(compile_backend, steps):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(torch.optim.AdamW(model.parameters(), lr=0.01), steps, backend=compile_backend)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def step(x, y, w, end):
        loss = torch.nn.functional.mse_loss(model(x), y.double())
        opt.backward(loss, weight=w, end_window=end)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    lengths = [STEPS] * 3 if steps is not None else [3, 5, 2]
    frames = None
    for window, length in enumerate(lengths):
        batches = _data(length, seed=10 + window)
        for index, (x, y) in enumerate(batches):
            step(x, y, torch.tensor(float(x.shape[0])), steps is None and index == length - 1)
        assert opt.stepped
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames  # no recompilation after the first window
        assert counter.frame_count <= GRAPHS + (BOOL_GUARD_FRAMES if steps is None else 0)
        reference_opt.zero_grad()
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        torch.nn.functional.mse_loss(reference(x), y.double()).backward()
        reference_opt.step()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


# A Python-number argument that changes value makes Dynamo recompile the frame it enters once, with the number as a
# symbol from then on (automatic dynamic shapes): one frame more, once, as for any scalar argument of a compiled
# function. Measured on torch 2.13: the opt.backward loop recompiles for a changing int or float weight, the
# loss.backward() loop for a changing float (an int there stays as it was compiled); a 0-d tensor weight never.
NUMBER_WEIGHT_FRAMES = 1


@pytest.mark.parametrize("loop", ["backward", "step"])
@pytest.mark.parametrize("kind", ["tensor", "int", "float"])
def test_a_weight_that_changes_every_micro_step_recompiles_at_most_once(loop, kind):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = _model()
    opt = GradAccumulator(torch.optim.AdamW(model.parameters(), lr=0.01), STEPS, backend="foreach")
    counter = CompileCounter()
    step = torch.compile(_train_step(model, opt, loop), backend=counter)
    counts = []
    for index, (x, y) in enumerate(_data(3 * STEPS)):
        weight = {"tensor": torch.tensor(5.0 + index), "int": 5 + index, "float": 5.0 + index}[kind]
        step(x, y, weight)
        counts.append(counter.frame_count)
    assert opt.stepped and counts[STEPS:] == [counts[STEPS - 1]] * (2 * STEPS)  # none after the first window
    assert counts[-1] <= GRAPHS + (0 if kind == "tensor" else NUMBER_WEIGHT_FRAMES), counts
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", ["reference", "foreach"])
def test_the_ops_are_in_one_compiled_graph(name, backend):
    """fullgraph=True: a break raises. The graph holds the custom ops themselves (once, neither was traced: a list
    subclass and is_neg() broke the graph before them, and they ran eagerly), and computes what eager code does, a
    lazily negated gradient included (not under AOTAutograd, whose functionalization of a custom op has no kernel
    for the negative bit and raises)."""
    torch._dynamo.reset()
    targets: list[object] = []

    def recording(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        targets.extend(node.target for node in graph.graph.nodes)
        return torch._dynamo.lookup_backend(backend)(graph, example_inputs)

    def window(buffer, first, second, weight):
        ops.fold_(buffer, [first, second], weight, first=True, backend=name)
        return ops.fold_finish_(buffer, [second, first.reshape(3, 2)], weight, 0.25, first=False, backend=name)

    compiled = torch.compile(window, fullgraph=True, backend=recording)
    second = torch.linspace(-1, 2, 6).reshape(3, 2)
    grads = torch.arange(6.0), torch._neg_view(second) if backend == "eager" else second
    eager_buffer, compiled_buffer = (FlatGradBuffer([torch.zeros(6), torch.zeros(3, 2)]) for _ in range(2))
    expected = window(eager_buffer, *grads, torch.tensor(2.0))
    got = compiled(compiled_buffer, *grads, torch.tensor(2.0))
    assert torch.ops.gafused.fold_.default in targets and torch.ops.gafused.fold_finish_.default in targets
    assert torch.equal(compiled_buffer.data, eager_buffer.data)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    torch._dynamo.reset()


def _two_heads():
    """A model of two heads, a copy trained by plain SGD, an accumulator of 2 over the first, and 6 micro-batches."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "spare": torch.nn.Linear(3, 2)}).double()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend="reference")
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(6)]
    return model, reference, opt, plain, xs


def test_a_release_noted_in_one_window_does_not_refuse_the_next_windows_finished_gradient():
    """The loss.backward(); opt.step() loop without zero_grad(): a parameter reached by the first micro-batch of one
    window (its release hook ran there) and not by the next window's first micro-batch keeps that window's finished
    gradient, untouched: each window's marks are its own. Not refused; the windows are plain PyTorch's."""
    model, reference, opt, plain, xs = _two_heads()
    reaches_spare = [True, True, True, True, False, True]  # window 2's first micro-batch leaves spare alone
    for window in range(3):
        plain.zero_grad()
        for index in (2 * window, 2 * window + 1):
            for net, scale in ((model, 1.0), (reference, 0.5)):
                out = net["used"](xs[index]) + (net["spare"](xs[index]) if reaches_spare[index] else 0)
                (scale * out.square().mean()).backward()
            opt.step(weight=1)
        plain.step()
        assert opt.stepped
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("name", ["reference", "foreach", "triton"])
def test_a_scalar_in_the_buffers_memory_is_read_before_a_compiled_op_writes_and_an_out_there_is_refused(name, backend):
    """A scalar that is a 0-d view of the buffer: eager gafused.ops copy it, a traced call has no memory to copy,
    so the op does. The Triton backend read the values the op was writing (a fold 2.6 off), the others raised from
    inside torch; a compiled scale_ into an out in the buffer's memory overwrote the buffer (Dynamo's eager
    backend; inductor's AOTAutograd refuses that input itself)."""
    torch._dynamo.reset()

    def window(buffer, grads):
        ops.fold_(buffer, grads, buffer.data[0], first=False, backend=name)
        total, _ = ops.fold_finish_(buffer, grads, buffer.data[3], buffer.data[1], first=False, backend=name)
        ops.scale_(buffer, buffer.data[5], backend=name)
        return total

    grads = [torch.linspace(-1, 2, 6), torch.linspace(3, 1, 6).reshape(3, 2)]
    eager_buffer, compiled_buffer = (FlatGradBuffer([torch.zeros(6), torch.zeros(3, 2)]) for _ in range(2))
    for buffer in (eager_buffer, compiled_buffer):
        ops.fold_(buffer, [torch.arange(1.0, 7.0), torch.arange(7.0, 13.0).reshape(3, 2)], 1.0, first=True)
    expected = window(eager_buffer, grads)
    got = torch.compile(window, backend=backend)(compiled_buffer, grads)
    assert torch.equal(compiled_buffer.data, eager_buffer.data) and torch.equal(got, expected)
    if backend != "eager":  # AOTAutograd refuses a mutated input viewed in another dtype itself
        return
    before = compiled_buffer.data.clone()
    out = compiled_buffer.data.view(torch.bfloat16)[: compiled_buffer.numel]
    scale = torch.compile(lambda buffer, out: ops.scale_(buffer, 2.0, out=out, backend=name), backend=backend)
    with pytest.raises(ValueError, match="out shares memory with the buffer"):
        scale(compiled_buffer, out)
    assert torch.equal(compiled_buffer.data, before)
    torch._dynamo.reset()


def test_a_backend_that_failed_to_import_is_named_in_a_fullgraph_error():
    """fullgraph=True turns the op's RuntimeError into Dynamo's error, which quotes its message; the message was
    built with the import error's repr(), which Dynamo cannot call while tracing, so nothing of it was shown."""
    reason = ops.backend_unavailable_reason("cuda", "cpu")  # resolved eagerly first, as the README says
    if reason is None or "failed to import" not in reason:
        pytest.skip(f"the cuda backend imports here ({reason})")
    torch._dynamo.reset()
    buffer = FlatGradBuffer([torch.zeros(6)])
    compiled = torch.compile(
        lambda grad: ops.fold_(buffer, [grad], 1.0, first=True, backend="cuda"), fullgraph=True, backend="eager"
    )
    with pytest.raises(Exception, match=r"gafused backend .{1,2}cuda.{1,2} failed to import: ImportError"):
        compiled(torch.ones(6))
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["reference", "foreach", "triton"])
def test_ops_trace_without_a_break_when_their_backend_is_first_loaded_inside(monkeypatch, name):
    """The first call of a backend loads its module: inside a compiled function that must not break the graph."""
    if ops.backend_unavailable_reason(name, "cpu") is not None:
        pytest.skip(f"{name}: {ops.backend_unavailable_reason(name, 'cpu')}")
    monkeypatch.setattr(ops, "_loaded", {})  # as in a process whose first gafused op is in the compiled function
    buffer = FlatGradBuffer([torch.zeros(5), torch.zeros(3, 2)])

    def fold_and_measure(first, second, weight):
        ops.fold_(buffer, [first, second], weight, first=True, backend=name)
        return ops.norm(buffer, backend=name)

    explained = torch._dynamo.explain(fold_and_measure)(torch.ones(5), torch.ones(3, 2), torch.tensor(2.0))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
    assert name in ops._loaded
    torch.testing.assert_close(ops.norm(buffer, backend=name), torch.tensor(44.0).sqrt())


def test_a_hook_registered_after_the_accumulator_sees_the_gradient_under_compiled_autograd():
    """Under compiled autograd a post-accumulate-grad hook is called with a graph input, not the parameter, so the
    parameter's hook table cannot be read there: whether hooks registered after the accumulator's run later is read
    before backward. Such a hook sees each micro-batch's p.grad and its change is folded, as in eager."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.0), 2, backend="reference")
    seen = []

    def halve(param):
        seen.append(param.grad is not None)
        if param.grad is not None:
            param.grad.mul_(0.5)

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(halve)
    x = torch.randn(3, 4, dtype=torch.float64)
    plain = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    for _ in range(2):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            opt.backward(model(x).square().mean(), weight=3)
        opt.step()
    assert opt.stepped and all(seen) and len(seen) == 8
    for param, grad in zip(model.parameters(), plain, strict=True):
        torch.testing.assert_close(param.grad, grad * 0.5, rtol=1e-12, atol=0)


def test_a_backward_under_compiled_autograd_that_added_into_a_finished_gradient_is_refused_at_step():
    """The loss.backward() loop without zero_grad() after a window's step(): in eager the hook on each parameter
    releases the finished gradient (a view of the buffer) before autograd accumulates. Compiled autograd applies that
    release only after the traced backward, which added into the view: step() folded nothing and counted weight 1,
    dropping the micro-batch (0.05 off the big batch). Refused, nothing changed; after zero_grad() and the
    micro-batch's backward again, the window is the big batch's."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend="reference")
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(4)]

    def backward(x):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            model(x).square().mean().backward()

    for x in xs[:2]:
        backward(x)
        opt.step(weight=1)
    assert opt.stepped
    before = [param.detach().clone() for param in model.parameters()]
    handed = [param.grad for param in model.parameters()]
    backward(xs[2])
    if any(param.grad is view for param, view in zip(model.parameters(), handed, strict=True)):
        with pytest.raises(RuntimeError, match=r"p.grad of param_groups\[0\]\['params'\]\[0\].*compiled autograd"):
            opt.step(weight=1)
        assert opt.micro_step == 0 and all(map(torch.equal, model.parameters(), before))
        opt.zero_grad()
        todo = xs[2:]
    else:  # torch 2.11 and 2.12: compiled autograd releases the view before accumulating, as eager does
        opt.step(weight=1)
        assert opt.micro_step == 1 and all(map(torch.equal, model.parameters(), before))
        opt.zero_grad()
        todo = xs[3:]
    for x in todo:
        backward(x)
        opt.step(weight=1)
        opt.zero_grad()
    assert opt.stepped
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in (xs[:2], xs[2:]):
        ref_opt.zero_grad()
        reference(torch.cat(batch)).square().mean().backward()
        ref_opt.step()
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected, rtol=0, atol=1e-15)


def test_finished_gradients_changed_in_place_but_given_no_gradient_are_not_refused():
    """What the check above must let through, in eager: finished gradients changed in place after the step
    (clip_grad_norm_ scales every p.grad in place, by 1.0 too; model.zero_grad(set_to_none=False)) whose parameters
    the next window gives no gradient, zero_grad() never called. No backward added into them: they are the
    handed-out gradients they were, and the windows are plain PyTorch's."""
    model, reference, opt, plain, xs = _two_heads()
    windows = [(xs[0:2], True, None), (xs[2:4], False, "clip"), (xs[4:6], False, "zero")]
    for batch, both, change in windows:
        if change == "zero":
            model.zero_grad(set_to_none=False)  # the finished gradients, zeroed in place
        for x in batch:
            (model["used"](x) + (model["spare"](x) if both else 0)).square().mean().backward()
            if change == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # every p.grad in place, by 1.0
            opt.step(weight=1)
        assert opt.stepped
        plain.zero_grad()
        whole = torch.cat(batch)
        (reference["used"](whole) + (reference["spare"](whole) if both else 0)).square().mean().backward()
        plain.step()
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", ["reference", "foreach", "triton"])
def test_every_op_and_argument_reaches_the_custom_op_in_a_compiled_graph(name):
    """A compiled window whose middle micro-batch adds (first=False), a per-segment measure and a cast written into
    ``out``: the graph computes what eager code does, bitwise (each argument reaches the registered op)."""
    reason = ops.backend_unavailable_reason(name, "cpu")
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    torch._dynamo.reset()

    def window(buffer, out, g0, g1, weight):
        ops.fold_(buffer, [g0, g1], weight, first=True, backend=name)
        ops.fold_(buffer, [g1.flip(0), g0.reshape(3, 2) * 3], weight, first=False, backend=name)
        total, flag = ops.fold_finish_(buffer, [g0, None], 1.0, 0.25, first=False, backend=name)
        per_segment = ops.sum_of_squares(buffer, per_segment=True, backend=name)
        ops.scale_(buffer, 0.5, out=out, backend=name)
        return total, flag, per_segment

    compiled = torch.compile(window, fullgraph=True, backend="aot_eager")
    generator = torch.Generator().manual_seed(0)
    g0, g1 = torch.randn(6, generator=generator), torch.randn(3, 2, generator=generator)
    runs = []
    for run in (window, compiled):
        buffer = FlatGradBuffer([torch.zeros(6), torch.zeros(3, 2)])
        out = torch.zeros(buffer.numel, dtype=torch.bfloat16)
        runs.append((buffer.data, out, *run(buffer, out, g0, g1, torch.tensor(2.0))))
    for eager, traced in zip(*runs, strict=True):
        assert torch.equal(traced, eager)
    assert runs[1][-1].shape == (2,) and runs[1][1].any()
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["reference", "foreach", "triton"])
def test_a_lazily_negated_gradient_folds_its_values_in_a_compiled_graph(name):
    """Under torch.compile the custom op gets the neg view unresolved (check_grads leaves it while tracing): every
    backend, the raw-pointer ones too, must fold the negated values, as eager code does."""
    reason = ops.backend_unavailable_reason(name, "cpu")
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    torch._dynamo.reset()

    def window(buffer, first, second, weight):
        ops.fold_(buffer, [first, second], weight, first=True, backend=name)
        return ops.fold_finish_(buffer, [second, first.reshape(3, 2)], weight, 0.25, first=False, backend=name)

    compiled = torch.compile(window, fullgraph=True, backend="eager")
    second = torch.linspace(-1, 2, 6).reshape(3, 2)
    grads = torch.arange(6.0), torch._neg_view(second)
    eager_buffer, compiled_buffer = (FlatGradBuffer([torch.zeros(6), torch.zeros(3, 2)]) for _ in range(2))
    expected = window(eager_buffer, *grads, torch.tensor(2.0))
    got = compiled(compiled_buffer, *grads, torch.tensor(2.0))
    assert torch.equal(compiled_buffer.data, eager_buffer.data)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    torch._dynamo.reset()


def test_a_window_that_reaches_only_the_later_parameters_leaves_the_earlier_finished_gradients_unrefused():
    """The loss.backward(); opt.step() loop without zero_grad(), in eager: a window whose micro-batches reach only the
    second head releases that head's finished gradients (its hooks note it); the first head keeps its finished
    gradient, untouched. Each hook notes its own parameter: nothing is refused, and the windows are plain PyTorch's."""
    model, reference, opt, plain, xs = _two_heads()
    for batch, heads in ((xs[0:2], ("used", "spare")), (xs[2:4], ("spare",))):
        for x in batch:
            sum(model[head](x) for head in heads).square().mean().backward()
            opt.step(weight=1)
        assert opt.stepped
        plain.zero_grad()
        whole = torch.cat(batch)
        sum(reference[head](whole) for head in heads).square().mean().backward()
        plain.step()
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected, rtol=0, atol=1e-15)

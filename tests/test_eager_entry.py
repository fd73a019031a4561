"""The ops' eager entry (ops/_common.call): outside torch.compile each op runs its custom op's implementation,
context and backward through an autograd.Function, without the dispatcher (host time). Checked on CPU tensors (the
reference path, the same Python code as on the GPU around the kernels): in eager mode no ``coda::`` op is
dispatched, forward or backward, and results and gradients equal the dispatcher path's bitwise; with
``EAGER_FUNCTIONS = False`` both the op and its backward op are dispatched."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import coda
import coda.ops
import coda.ops._common as common


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def _rnd(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype).requires_grad_()


def _attention_block(x, g, w, wo, M):
    """q, k, v and the residual stream from the QKV op, then o_proj + residual: both ops' gradients."""
    q, k, v, xr = coda.ops.rmsnorm_linear_rope_qkv(x, g, w, torch.arange(M), coda.ops.rope_freqs(16, 6), 1e-6,
                                                   (48, 16), residual=True)
    return torch.cat((coda.ops.linear_residual(q, wo, xr), k, v), -1)


def _cases():
    M, H, I, V = 24, 64, 48, 80
    yield "linear_swiglu", lambda: (_rnd(2, M // 2, H), _rnd(2 * I, H, scale=0.1)), coda.ops.linear_swiglu
    yield "linear_geglu", lambda: (_rnd(M, H), _rnd(2 * I, H, scale=0.1)), coda.ops.linear_geglu
    yield ("linear_cross_entropy", lambda: (_rnd(M, H), _rnd(V, H, scale=0.1), torch.randint(0, V, (M,))),
           lambda x, w, t: coda.ops.linear_cross_entropy(x, w, t, label_smoothing=0.1, mode="lean"))
    yield ("linear_cross_entropy_fast", lambda: (_rnd(M, H), _rnd(V, H, scale=0.1), torch.randint(0, V, (M,))),
           lambda x, w, t: coda.ops.linear_cross_entropy(x, w, t, label_smoothing=0.1, mode="fast", softcap=3.0))
    yield ("rmsnorm_linear_rope", lambda: (_rnd(M, H), _rnd(H, dtype=torch.float32), _rnd(96, H, scale=0.1)),
           lambda x, g, w: coda.ops.rmsnorm_linear_rope(x, g, w, torch.arange(M), coda.ops.rope_freqs(16, 6)))
    yield ("rmsnorm_linear_rope_qkv", lambda: (_rnd(M, H), _rnd(H, dtype=torch.float32), _rnd(96, H, scale=0.1),
                                               _rnd(H, 48, scale=0.1)),
           lambda x, g, w, wo: _attention_block(x, g, w, wo, M))
    yield ("rmsnorm_linear_rope_qknorm_qkv", lambda: (_rnd(M, H), _rnd(H, dtype=torch.float32), _rnd(96, H, scale=0.1),
                                                      _rnd(16), _rnd(16)),
           lambda x, g, w, qn, kn: torch.cat(coda.ops.rmsnorm_linear_rope_qknorm_qkv(
               x, g, w, qn, kn, torch.arange(M), coda.ops.rope_freqs(16, 6), 1e-6, 1e-6, (48, 16), 16, residual=True),
               -1))
    yield ("rmsnorm_linear_rope_bias_qkv", lambda: (_rnd(M, H), _rnd(H, dtype=torch.float32),
                                                    _rnd(96, H, scale=0.1), _rnd(96)),
           lambda x, g, w, b: torch.cat(coda.ops.rmsnorm_linear_rope_bias_qkv(
               x, g, w, b, torch.arange(M), coda.ops.rope_freqs(16, 6), 1e-6, (48, 16), residual=True), -1))
    yield ("linear_residual", lambda: (_rnd(M, H), _rnd(I, H, scale=0.1), _rnd(M, I)), coda.ops.linear_residual)
    yield ("linear_residual_norm", lambda: (_rnd(M, H), _rnd(I, H, scale=0.1), _rnd(M, I),
                                            _rnd(I, dtype=torch.float32).detach()),
           lambda o, w, r, g: torch.cat(coda.ops.linear_residual(o, w, r, norm_weight=g)[:2], -1))  # y, y * g
    yield ("mlp", lambda: (_rnd(M, H), _rnd(H, dtype=torch.float32), _rnd(2 * I, H, scale=0.1),
                           _rnd(H, I, scale=0.1)), coda.ops.mlp)
    yield ("rmsnorm_swiglu", lambda: (_rnd(M, H), _rnd(H, dtype=torch.float32), _rnd(2 * I, H, scale=0.1)),
           coda.ops.rmsnorm_swiglu)
    yield ("linear_rope", lambda: (_rnd(M, H), _rnd(H, H, scale=0.1), torch.arange(M), coda.ops.rope_freqs(16, H // 16)),
           coda.ops.linear_rope)
    yield ("rmsnorm_linear", lambda: (_rnd(M, H), _rnd(H, dtype=torch.float32), _rnd(I, H, scale=0.1)),
           lambda x, g, w: coda.ops.rmsnorm_linear(x, g, w, 1e-6))
    yield "rmsnorm", lambda: (_rnd(M, H), _rnd(H, dtype=torch.float32)), coda.ops.rmsnorm
    yield ("embedding", lambda: (torch.randint(0, V, (2, M // 2)), _rnd(V, H)),
           lambda ids, w: coda.ops.embedding(ids, w, padding_idx=3))


@coda.epilogue
def _scaled_bias(acc, bias: coda.VecN, s: coda.Scalar):
    return acc * acc * s + bias


def _linear_cases():
    # coda.ops.linear's custom op takes its tensor operands as a list and its Python-number scalars as another
    yield ("linear", lambda: (_rnd(24, 64), _rnd(48, 64, scale=0.1), _rnd(48, dtype=torch.float32)),
           lambda x, w, bias: coda.ops.linear(x, w, epilogue=_scaled_bias, bias=bias, s=0.5))


CASES = {name: (make, fn) for name, make, fn in (*_cases(), *_linear_cases())}


def _run(make, fn, seed):
    torch.manual_seed(seed)
    args = make()
    with _Ops() as rec:
        y = fn(*args)
        y.float().square().sum().backward() if y.dim() else y.backward()
    grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return y.detach(), grads, [n for n in rec.names if n.startswith("coda::")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_calls_skip_the_dispatcher_and_equal_it(name, monkeypatch):
    make, fn = CASES[name]
    seed = int(torch.randint(0, 2**31 - 1, ()))
    y, grads, dispatched = _run(make, fn, seed)
    assert dispatched == []
    monkeypatch.setattr(common, "EAGER_FUNCTIONS", False)
    y_op, grads_op, dispatched_op = _run(make, fn, seed)
    assert f"coda::{name}" in dispatched_op, dispatched_op
    if name != "linear_cross_entropy_fast":  # its backward only scales what the forward formed (torch ops)
        assert any(n.endswith("_backward") for n in dispatched_op), dispatched_op
    assert torch.equal(y, y_op)
    assert len(grads) == len(grads_op) and all(g is not None for g in grads)
    for g, g_op in zip(grads, grads_op):
        assert torch.equal(g, g_op)


def test_every_custom_op_with_autograd_has_an_eager_entry():
    """Each op registered through ops._common.custom_op with autograd has its eager Function; the backward ops
    have none (they run inside the Function's backward), nor their in-place update twins (coda.optim under
    torch.compile)."""
    assert set(common._eager) == set(CASES)
    assert {n for n in common._impls if n not in common._eager} == {
        "linear_gated_backward", "linear_cross_entropy_backward", "mlp_backward", "linear_rope_backward",
        "rmsnorm_linear_backward", "linear_backward", "rmsnorm_linear_rope_backward",
        "rmsnorm_linear_rope_qkv_backward", "linear_residual_backward", "rmsnorm_backward",
        "rmsnorm_linear_rope_qknorm_qkv_backward", "rmsnorm_linear_rope_qknorm_qkv_backward_update",
        "rmsnorm_linear_rope_bias_qkv_backward", "rmsnorm_linear_rope_bias_qkv_backward_update",
        "embedding_backward", "mlp_backward_update", "embedding_backward_update", "linear_cross_entropy_update",
        "rmsnorm_linear_rope_qkv_backward_update", "linear_residual_backward_update"}


@pytest.mark.parametrize("name", ["mlp", "linear_rope", "linear"])
def test_double_backward_raises(name):
    """The backward's kernels are not differentiable: differentiating the gradient raises instead of returning
    the derivative of the backward's torch parts only."""
    torch.manual_seed(0)
    if name == "linear":
        args, fn = (_rnd(8, 32), _rnd(16, 32, scale=0.1)), coda.ops.linear
    else:
        make, fn = CASES[name]
        args = make()
    y = fn(*args)
    gx, = torch.autograd.grad(y.float().square().sum(), args[0], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        gx.float().square().sum().backward()

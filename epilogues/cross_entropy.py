"""Cross entropy on the LM head as GEMM epilogues (``coda.ops.linear_cross_entropy`` uses them).

Notation: logits z = x W^T (one row per token, V columns), target t (a column index; -1 on ignored rows, which
matches no column), lse = log sum_v exp(z_v), p_v = exp(z_v - lse) (softmax), eps = label smoothing, zl = z-loss
coefficient. The per-row loss (torch's ``F.cross_entropy`` with ``label_smoothing``, plus z-loss) is

    loss = (1 - eps) (lse - z_t) + eps (lse - sum_v z_v / V) + zl lse^2
         = lse - (1 - eps) z_t - (eps / V) sum_v z_v + zl lse^2

and its derivative with respect to one logit (d lse / d z_v = p_v) is

    d loss / d z_v = p_v (1 + 2 zl lse) - (1 - eps) [v == t] - eps / V.

Logit soft-capping (Gemma 2; ``softcap`` c): the logits are z = c tanh(r / c) of the raw products r = x W^T, the
loss is the same function of z, and d loss / d r = d loss / d z * (1 - tanh(r / c)^2) = ... * (1 - (z / c)^2). The
``_cap`` epilogues take c as a Scalar operand ``cap``.

The forward epilogues store no M x V output (the logits are never written): they return only per-row reductions,
finished to vectors by ``coda.gemm``. The backward epilogues recompute a logit tile and form d loss / d z times
the row's upstream gradient g. ``t`` is a float32 VecM (exact for column indices below 2**24) and is compared with
``coda.col()``, the column index *within this GEMM*: a GEMM over the vocabulary chunk [v0, v1) takes ``t - v0``.
"""
import coda

__all__ = ["ce_forward", "ce_forward_smooth", "ce_backward", "ce_backward_general", "accumulate", "ce_forward_logits",
           "ce_forward_cap", "ce_backward_cap", "ce_forward_exp", "scale_rows"]


def _row_stats(z, t, smooth: bool) -> dict:
    """lse, z_t (none without a target operand ``t``) and with ``smooth`` sum_v z_v of the logits z: the forward
    epilogues' per-row reductions."""
    out = {"lse": coda.reduce_n(z, "logsumexp")}
    if t is not None:
        out["zt"] = coda.reduce_n(coda.where(coda.col() == t, z, 0.0), "sum")
    if smooth:
        out["zsum"] = coda.reduce_n(z, "sum")
    return out


def _dz_general(p, t, lse, g, smoothing, z_loss, inv_v):
    """(p (1 + 2 zl lse) - (1 - eps) [v == t] - eps / V) g: the general derivative with respect to the logit."""
    onehot = coda.where(coda.col() == t, 1.0, 0.0)
    return (p * (1 + 2 * z_loss * lse) - (1 - smoothing) * onehot - smoothing * inv_v) * g


@coda.epilogue
def ce_forward(acc, t: coda.VecM):
    """lse = log sum_v exp(z_v) and the target logit z_t = sum_v [v == t] z_v (0 when t matches no column)."""
    return _row_stats(acc, t, smooth=False)


@coda.epilogue
def ce_forward_smooth(acc, t: coda.VecM):
    """:func:`ce_forward` plus sum_v z_v, the extra statistic label smoothing needs."""
    return _row_stats(acc, t, smooth=True)


@coda.epilogue
def ce_forward_cap(acc, t: coda.VecM, cap: coda.Scalar):
    """:func:`ce_forward_smooth` of the soft-capped logits z = cap tanh(acc / cap)."""
    return _row_stats(cap * coda.tanh(acc / cap), t, smooth=True)


@coda.epilogue
def ce_backward(acc, t: coda.VecM, lse: coda.VecM, g: coda.VecM):
    """dz_v = (p_v - [v == t]) g with p_v = exp(z_v - lse): the derivative without smoothing or z-loss."""
    return (coda.exp(acc - lse) - coda.where(coda.col() == t, 1.0, 0.0)) * g


@coda.epilogue
def ce_backward_general(acc, t: coda.VecM, lse: coda.VecM, g: coda.VecM, smoothing: coda.Scalar,
                        z_loss: coda.Scalar, inv_v: coda.Scalar):
    """dz_v = (p_v (1 + 2 zl lse) - (1 - eps) [v == t] - eps / V) g, with eps = ``smoothing``, zl = ``z_loss``
    and ``inv_v`` = 1 / V (V of the whole vocabulary, not of the chunk)."""
    return _dz_general(coda.exp(acc - lse), t, lse, g, smoothing, z_loss, inv_v)


@coda.epilogue
def ce_backward_cap(acc, t: coda.VecM, lse: coda.VecM, g: coda.VecM, smoothing: coda.Scalar, z_loss: coda.Scalar,
                    inv_v: coda.Scalar, cap: coda.Scalar):
    """:func:`ce_backward_general` on the soft-capped logits z = cap tanh(acc / cap), times dz / dacc =
    1 - tanh(acc / cap)^2: the gradient with respect to the raw product."""
    th = coda.tanh(acc / cap)
    return _dz_general(coda.exp(cap * th - lse), t, lse, g, smoothing, z_loss, inv_v) * (1 - th * th)


@coda.epilogue
def accumulate(acc, prev: coda.TileMN):
    """acc + prev: add a GEMM's product to a running sum (``out=`` may be ``prev`` itself: each element is read
    by the thread that then stores it)."""
    return acc + prev


def _logits_epilogue(dtype, smooth: bool, cap: bool):
    """The fast mode's forward epilogue for logits stored in ``dtype``: stores the logit tile and emits lse (and
    sum_v z_v with label smoothing) of the *stored* (rounded) logits, so that the in-place softmax gradient
    exp(z - lse) of ``coda.kernels.ce_grad`` sums to one over the row, as torch's softmax of its 16-bit logits does.
    The target logit z_t is read back from the stored logits (``ops.cross_entropy_fast.target_logit``): selecting
    it here cost a compare, a select and a sum per element, a quarter of this epilogue's SASS. With ``cap`` the
    logits are soft-capped first (z = cap tanh(acc / cap), a Scalar operand ``cap``)."""
    def logits(acc, cap):
        return coda.cast(cap * coda.tanh(acc / cap) if cap is not None else acc, dtype)

    def stats(z):
        return {"out": z, **_row_stats(z, None, smooth)}

    if cap:
        def ce_forward_logits(acc, cap: coda.Scalar):
            return stats(logits(acc, cap))
    else:
        def ce_forward_logits(acc):
            return stats(logits(acc, None))
    ce_forward_logits.__name__ = (f"ce_forward_logits_{str(dtype).replace('torch.', '')}{'_smooth' if smooth else ''}"
                                  f"{'_cap' if cap else ''}")
    ce_forward_logits.__qualname__ = ce_forward_logits.__name__
    return coda.epilogue(ce_forward_logits)


_LOGITS = {}


def ce_forward_logits(dtype, smooth: bool = False, cap: bool = False):
    """The fast mode's forward epilogue (stores the logits; see :func:`_logits_epilogue`), one per dtype and
    options."""
    key = (str(dtype), smooth, cap)
    if key not in _LOGITS:
        _LOGITS[key] = _logits_epilogue(dtype, smooth, cap)
    return _LOGITS[key]


@coda.epilogue
def scale_by(acc, t: coda.TileMN, s: coda.Scalar):
    """t * s, run as a K = 0 pass with ``out=t`` (in place): the fast mode's gradients times the upstream gradient
    (a device scalar, fp32 math; torch's ``t.mul_(s)`` of a bf16 ``t`` by an fp32 0-dim CUDA tensor runs an
    unvectorised casting loop: 1.0 ms for llama-1b's 128256 x 2048 dW on the H100)."""
    return t * s


_EXP = {}


def ce_forward_exp(dtype):
    """The fast mode's exp-stored forward epilogue (``ops/cross_entropy_fast.py``, phase 1'): stores exp(z) of the
    float32 logit (in ``dtype``, whose exponent range must be float32's: bfloat16, float32) and emits se = sum_v
    exp(z_v) of the same float32 exponentials (lse = log se: the caller takes a row only where lse lies in a range
    whose sum neither overflows nor underflows float32; a NaN / inf row gives a non-finite se). exp(z) = p e^lse: the softmax without its row factor e^-lse, which the dX GEMM applies in its
    epilogue (``epilogues.rmsnorm.rmsnorm_scale``: acc times a VecM) and dW's GEMM through x's rows, so that no pass
    rescales the M x V tensor."""
    key = str(dtype)
    if key not in _EXP:
        def ce_forward_exp(acc):
            e = coda.exp(acc)  # (one exponential an element: the sum needs no running maximum, see below)
            return {"out": coda.cast(e, dtype), "se": coda.reduce_n(e, "sum")}
        ce_forward_exp.__name__ = ce_forward_exp.__qualname__ = f"ce_forward_exp_{key.replace('torch.', '')}"
        _EXP[key] = coda.epilogue(ce_forward_exp)
    return _EXP[key]


@coda.epilogue
def scale_rows(acc, t: coda.TileMN, s: coda.VecM):
    """t * s[row], a K = 0 pass: the exp-stored fast mode's x rows for dW's GEMM (one pass, fp32 math)."""
    return t * s

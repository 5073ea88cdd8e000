"""Activations and their exact derivatives as Triton device functions (float32 in, out), and the
GLU pair forms that the kernels' GLU epilogue and fGETGrad operand evaluate.

ACT is a constexpr name, so each kernel compiles only the branch it uses.

  relu       act = max(z, 0)              act' = [z > 0]
  gelu       act = z Phi(z)               act' = Phi(z) + z phi(z)
             Phi(z) = (1 + erf(z / sqrt 2)) / 2,  phi(z) = exp(-z^2 / 2) / sqrt(2 pi)
  gelu_tanh  act = z (1 + tanh u) / 2,    u = c (z + 0.044715 z^3),  c = sqrt(2 / pi)
             with s = sigmoid(2u) = (1 + tanh u) / 2 and 1 - tanh^2 u = 4 s (1 - s):
             act = z s                    act' = s + 2 c z s (1 - s) (1 + 3 * 0.044715 z^2)
  silu       act = z sigmoid(z)           act' = s (1 + z (1 - s)),  s = sigmoid(z)
  identity   act = z                      act' = 1

GLU, on the halves hg, hu of h = [hg | hu] and the incoming dA (glu, glu_backward):

  any ACT above    a = act(hg) hu             dhg = dA hu act'(hg)    dhu = dA act(hg)
  clamped_swiglu   (GPT-OSS; limit L, alpha: runtime float32 scalars, the layer's constants)
                   gc = min(hg, L),  uc = clamp(hu, -L, L),  f(g) = g sigmoid(alpha g)
                   a = (uc + 1) f(gc)
                   dhg = dA (uc + 1) f'(gc) [hg <= L],  f'(g) = s (1 + alpha g (1 - s)),  s = sigmoid(alpha g)
                   dhu = dA f(gc) [-L <= hu <= L]
  The clamp passes its gradient on the closed range (hg == L, hu == +-L included), as the torch
  path's ClampedSwiGLU (shardmoe/moe/activations.py, torch.clamp's autograd) does.

tl has no tanh; the sigmoid form is the same function, not an approximation of it, and
stays finite for any z.

The constants are literals: 0.7071067811865476 = 1/sqrt 2, 0.3989422804014327 =
1/sqrt(2 pi), 1.5957691216057308 = 2c, 0.134145 = 3 * 0.044715. (A constexpr global on
the left of an operator yields a constexpr-wrapped tensor under the interpreter, which
tl.exp then rejects.)

activation_args is the host side: the kernel arguments (ACT, limit, alpha) of an activation as the
stage functions take it, a name or a clamped SwiGLU.
"""
import triton
import triton.language as tl

from shardmoe.kernels import KERNEL_ACTIVATIONS


def activation_args(activation, glu: bool) -> dict:
    """{"ACT": name, "limit": L, "alpha": alpha} for a kernel launch.

    `activation` is a name in KERNEL_ACTIVATIONS (activation's branches), or, for a GLU (glu=True)
    only, a clamped SwiGLU: an object with float attributes limit and alpha (shardmoe/moe/
    activations.py's ClampedSwiGLU; the kernels import nothing of moe/). limit and alpha are unused
    (0.0) for a name."""
    if isinstance(activation, str):
        if activation not in KERNEL_ACTIVATIONS:
            raise ValueError(f"activation: expected one of {', '.join(KERNEL_ACTIVATIONS)} or a clamped SwiGLU, "
                             f"got {activation!r}")
        return {"ACT": activation, "limit": 0.0, "alpha": 0.0}
    if not glu:
        raise ValueError(f"activation: a clamped SwiGLU is a GLU form, expected a name in "
                         f"{', '.join(KERNEL_ACTIVATIONS)} for a non-GLU GEMM, got {activation!r}")
    if not (hasattr(activation, "limit") and hasattr(activation, "alpha")):
        raise ValueError(f"activation: expected a name or a clamped SwiGLU (attributes limit, alpha), "
                         f"got {type(activation).__name__} {activation!r}")
    return {"ACT": "clamped_swiglu", "limit": float(activation.limit), "alpha": float(activation.alpha)}


@triton.jit
def sigmoid(z):
    """1 / (1 + exp(-z)), from e = exp(-|z|) <= 1 so nothing overflows for any z:
    1 / (1 + e) for z >= 0, e / (1 + e) for z < 0 (tl.sigmoid does not run under the
    interpreter)."""
    e = tl.exp(-tl.abs(z))
    return tl.where(z >= 0, 1.0, e) / (1.0 + e)


@triton.jit
def activation(z, ACT: tl.constexpr):
    """act(z), elementwise."""
    if ACT == "relu":
        out = tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as torch.relu
    elif ACT == "gelu":
        out = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACT == "gelu_tanh":
        out = z * sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
    elif ACT == "silu":
        out = z * sigmoid(z)
    else:
        tl.static_assert(ACT == "identity", "unknown activation")
        out = z
    return out


@triton.jit
def activation_grad(z, ACT: tl.constexpr):
    """act'(z), elementwise (1 for identity: callers skip the multiply then)."""
    if ACT == "relu":
        out = tl.where(z > 0.0, 1.0, 0.0)
    elif ACT == "gelu":
        out = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif ACT == "gelu_tanh":
        s = sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
        out = s + 1.5957691216057308 * z * s * (1.0 - s) * (1.0 + 0.134145 * z * z)
    elif ACT == "silu":
        s = sigmoid(z)
        out = s * (1.0 + z * (1.0 - s))
    else:
        tl.static_assert(ACT == "identity", "unknown activation")
        out = tl.full(z.shape, 1.0, tl.float32)
    return out


@triton.jit
def clamped(gate, up, limit):
    """(min(hg, L), clamp(hu, -L, L)) of the clamped SwiGLU, NaN propagating as torch.clamp does
    (triton's min/max default drops a NaN operand on compiled code)."""
    gc = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    uc = tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    return gc, uc


@triton.jit
def glu(gate, up, limit, alpha, ACT: tl.constexpr):
    """a from the halves hg = gate, hu = up of one tile (same shape)."""
    if ACT == "clamped_swiglu":
        gc, uc = clamped(gate, up, limit)
        out = (uc + 1.0) * (gc * sigmoid(alpha * gc))
    else:
        out = activation(gate, ACT) * up
    return out


@triton.jit
def glu_backward(grad, gate, up, limit, alpha, ACT: tl.constexpr):
    """(dhg, dhu) for dA = grad and the halves hg = gate, hu = up of one tile (same shape)."""
    if ACT == "clamped_swiglu":
        gc, uc = clamped(gate, up, limit)
        s = sigmoid(alpha * gc)
        slope = s * (1.0 + alpha * gc * (1.0 - s))
        # the clamps pass the gradient on their closed ranges only
        grad_gate = tl.where(gate > limit, 0.0, grad * (uc + 1.0) * slope)
        grad_up = tl.where(tl.abs(up) > limit, 0.0, grad * (gc * s))
    else:
        grad_gate = grad * up * activation_grad(gate, ACT)
        grad_up = grad * activation(gate, ACT)
    return grad_gate, grad_up

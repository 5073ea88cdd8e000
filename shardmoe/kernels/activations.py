"""Activations and their exact derivatives as Triton device functions (float32 in, out).

ACT is a constexpr name, so each kernel compiles only the branch it uses.

  relu       act = max(z, 0)              act' = [z > 0]
  gelu       act = z Phi(z)               act' = Phi(z) + z phi(z)
             Phi(z) = (1 + erf(z / sqrt 2)) / 2,  phi(z) = exp(-z^2 / 2) / sqrt(2 pi)
  gelu_tanh  act = z (1 + tanh u) / 2,    u = c (z + 0.044715 z^3),  c = sqrt(2 / pi)
             with s = sigmoid(2u) = (1 + tanh u) / 2 and 1 - tanh^2 u = 4 s (1 - s):
             act = z s                    act' = s + 2 c z s (1 - s) (1 + 3 * 0.044715 z^2)
  silu       act = z sigmoid(z)           act' = s (1 + z (1 - s)),  s = sigmoid(z)
  identity   act = z                      act' = 1

tl has no tanh; the sigmoid form is the same function, not an approximation of it, and
stays finite for any z.

The constants are literals: 0.7071067811865476 = 1/sqrt 2, 0.3989422804014327 =
1/sqrt(2 pi), 1.5957691216057308 = 2c, 0.134145 = 3 * 0.044715. (A constexpr global on
the left of an operator yields a constexpr-wrapped tensor under the interpreter, which
tl.exp then rejects.)
"""
import triton
import triton.language as tl


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
        out = tl.maximum(z, 0.0)
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

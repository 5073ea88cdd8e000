"""Device memory of the simulated run: every buffer is a cell addressed by a Ref
(device, name, key). Names, with FlashMoE's buffer name in brackets:

  expert device, per row tile s (key s), m rows:
    x_rows [m, H]       dispatched tokens        (heap stage 0 cell 1, "original input")
    z1 [m, P] / h [m, 2F]                        (z1; "glu" keeps h = [hg | hu])
    xm [m, P]           a1 = act(z1) / a         (xM)
    z2 [m, H]           pre-output-activation    (z2; "glu": y itself)
    y_rows [m, H]       expert output packet     (forward packet back to the tokens)
    grad_packet [m, H]  dispatched g rows        (backward packet)
    grad_expert [m, H]  ge = w g                 (gradCombine output, cData[0])
    grad_xm [m, P]      dL/da1 or dL/da          (gradPostGEMM output, cData[1])
    grad_x_rows [m, H]  dL/dx of the rows        (gradPreGEMM output, read P2P)
    gate_rows [m]       dots of a remote pair    (gradGateCombine output, put into gate_heap)
  expert device, per parameter name (key name): expert_grad [nLx, ...]    (gW)
  token device:
    x [S_d, H], out [S_d, H], grad_x [S_d, H]     (hiddenStates, moeOutput, gradInputBasePtr)
    grad_out [S_d, H]   dL/dout of its tokens, the source of the backward dispatch
    gate_dots [S_d, k]  dw_tj = g_t . y_j(t)     (gGateCombine, one slot per pair)
    gate_weight_grad [H, E]                      (gGateW; summed over devices at the end)
    gate_bias_grad [E]  router bias gradient, with router_bias (summed over devices at the end)
    heap (key (src, s)) [m, H]   remote arrivals: y rows (forward) or dL/dx rows (backward)
    gate_heap (key (src, s)) [m] remote arrivals of gate dots
"""
from __future__ import annotations

import torch

from shardmoe.tasks.plan import Ref


class Memory:
    """A dict of cells; reading a cell that was never written raises, naming it."""

    def __init__(self):
        self.cells: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def _key(ref: Ref) -> tuple:
        return (ref.device, ref.name, ref.key)

    def __getitem__(self, ref: Ref) -> torch.Tensor:
        try:
            return self.cells[self._key(ref)]
        except KeyError:
            raise KeyError(f"memory cell {ref} was read before anything wrote it") from None

    def __setitem__(self, ref: Ref, value: torch.Tensor) -> None:
        self.cells[self._key(ref)] = value

    def zeros(self, ref: Ref, shape, dtype: torch.dtype) -> torch.Tensor:
        self[ref] = torch.zeros(shape, dtype=dtype)
        return self[ref]

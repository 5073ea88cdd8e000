"""The CPU's own machinery for the MoE layer's stages, in three parts:

  C++ passes          fused elementwise passes, one vectorised pass per stage (csrc/elementwise.cpp)
  side-by-side GEMMs  the per-expert GEMMs, one expert per intra-op thread (csrc/experts_mm.cpp)
  Workspace           the pool of the large row buffers a step uses, kept across steps

CpuOps puts them together: it is experts.TorchOps with the C++ passes where the forward allows
them and the operands fit, the side-by-side GEMMs allowed (TorchOps.linear and weight_grad hold
every form of the experts' GEMMs and take these where gemm_fits), and the row buffers from the
workspace; everything else runs TorchOps' torch code. On other devices none of this runs
(moe/dispatch.py select()). Why each part, and the measurement behind it with its command:
docs/benchmarks.md, "What the figures settle on the CPU".

## C++ passes
CpuOps calls these for float32 and bfloat16 CPU tensors where `elementwise_fits(...)` says so,
and TorchOps' torch code for everything else (float64, other devices, activations not listed in
ACTIVATION_CODES, tensors under autograd):

  glu_forward            a = act(hg) * hu, and act(hg) when asked     h [N, 2F] -> [N, F]
  glu_backward           dh = [dA * hu * act'(hg) | dA * act(hg)]     dA, act(hg) [N, F], h -> [N, 2F]
  glu_backward_one_pass  the glu expert's backward passes in one: a, dh and the gate dots from h,
                         g Wdown and w
  scale_rows             out_r = w_r * rows_r                         [N, D], [N] -> [N, D]
  rowwise_dot            out_r = sum_d rows[r, d] f1[r, d] (f2[r, d])  [N, D] -> [N] float32
  index_add_rows         out_i = sum of (w_r *) rows_r over the rows r with index r = i
                                                                     [N, D] -> [M, D] float32
  combine_pairs          the combine's sum as a gather over each token's rows
                                                                     [N, D], [S, k] -> [S, D] float32

Each reads every input element once, forms the math in float32 registers (bf16 widened on load,
as aten's own bf16 kernels do) and rounds into the output. Where the torch path rounds a bf16
intermediate (act(hg) before the GLU product, dA * hu before act'), the passes round it too, so
that the results are the torch path's bits in bf16 and float32 (tests/moe/test_cpu_elementwise.py)
and the precision bars (docs/checking.md) hold one rounding behaviour; except the row dots, which
add their float32 products in a different order (round-off only), and the activation closed
forms, which follow aten's kernels but may differ in the last bit.

Building: csrc/elementwise.cpp and csrc/experts_mm.cpp are one library (shardmoe_cpu), compiled
once per machine, on first use, with the C++ compiler ($CXX, else c++) against the installed
torch, for the CPU capability torch runs at (AVX512, AVX2 or the portable default), into
$SHARDMOE_CACHE_DIR (default ~/.cache/shardmoe); the file name carries a hash of the sources,
flags and torch version, so a changed source rebuilds and a finished build is reused by every
later process (the build is announced by one line on stderr; loading takes milliseconds). If the
build or load fails (no compiler, no headers), one RuntimeWarning line says why and where the
compiler's output went, and every stage keeps the torch path for the rest of the process.
SHARDMOE_FUSED_ELEMENTWISE=0 (shardmoe.settings) keeps the torch path for the passes (to compare
the two); the library is still built when the side-by-side GEMMs (SHARDMOE_EXPERTS_MM) use it.

The passes are torch operators (torch.ops.shardmoe_elementwise; the GEMMs torch.ops.shardmoe_gemm):
each schema marks the buffers the op writes (Tensor(a!) out) and the op returns nothing, the
wrappers below return those buffers, and a Meta kernel (nothing to compute: the outputs are the
caller's buffers) lets FakeTensorMode and torch.compile(fullgraph=True) trace them without
running them (torch.library.opcheck passes for each: tests/moe/).

## Side-by-side GEMMs
  experts_mm           out[rows of e] = rows[rows of e] @ W_e    rows [N, K], W [E, K, O] -> [N, O]
  experts_weight_grad  dW_e = grad[rows of e]^T @ in[rows of e]  [N, O], [N, K] -> [E, O, K]

Run one after another, each small GEMM splits its rows over every thread and pays their start and
join; side by side each expert's GEMM is ATen's single-thread one, on one thread, and each output
is written by one GEMM. Experts holding a thread's share of the rows or more still run one at a
time on all threads, so a skewed routing does not leave the work to one thread.

In bf16 every GEMM here runs over a whole number of 32-row blocks or fewer than 32 rows: oneDNN,
which runs torch's bf16 GEMMs on CPU, builds a kernel per shape and keeps a bounded cache of them,
so exact row counts that change every step kept it rebuilding them. experts_mm splits an expert's
rows into the blocks and the rest; experts_weight_grad, whose reduction runs over the rows (a
split would round dW_e twice), pads them to a block instead: the narrower operand copied with
zero rows after its own, the wider read in place over the next experts' rows where those exist
and are finite, copied zero-padded too where not.

Where the library is not built, and for what it does not take (one thread, one expert, float64,
other devices, tensors under autograd), TorchOps runs one torch.mm per expert into the row buffer.
SHARDMOE_EXPERTS_MM=0 (shardmoe.settings) keeps that loop too (to compare the two).

## Workspace
Workspace: a per-layer pool of the large row buffers of the MoE layer's forward and backward.

Fresh CPU allocations of 32 MiB and more page-fault on every first touch (glibc maps them anew),
and a GEMM writing into such a buffer pays those faults inside the step. The row buffers of one
step ([N, 2F] h and its gradient, [N, F] a, act(hg), g Wdown, dA; [N, H] expert outputs) are
therefore taken from blocks this pool keeps across steps.

Ownership. A block is lent by empty() and free again only when nothing but the pool refers to
its storage (the storage's use count is 1): a tensor saved for backward keeps its block until
autograd frees it after that backward (or with the graph), whatever runs in between -- several
forwards before their backwards (gradient accumulation, several layers, activation
checkpointing) each get their own block. So the pool holds as many blocks of a size as were ever
alive at once; nothing is ever handed out twice, also to threads: one lock serialises lending
(layers sharing a pool may run in several threads; each empty() call is atomic).

Sharing. One pool may serve several layers (share(layers); shardmoe.Transformer and hf.convert
give all their MoE layers one). Each layer's saved tensors keep their blocks lent until its
backward, and one layer's scratch buffers are free again before the next layer runs, so the pool
holds every layer's saved blocks plus one layer's scratch, not one working set per layer.
stats['workspace_bytes'] then reports the shared pool.

Size. A request that no free block fits allocates a new block and drops the free blocks of that
device (all smaller than the request): of the request's size the first time, and of at least
GROWTH times the largest block it replaces after that, so steps that keep growing a little (a
batch of more tokens, fewer drops) do not allocate every time. A block is never larger than
needed by more than that factor, which matters: a saved tensor's block counts whole in the saved
bytes. release() forgets every block (blocks still lent stay alive with their tensors and are
freed with them); MoE.to() / _apply call it, since blocks never move. resident_bytes counts every
block the pool holds, lent or free.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from shardmoe.moe.combine import token_rows
from shardmoe.moe.experts import TorchOps
from shardmoe.rows import Groups
from shardmoe.settings import SETTINGS

LIBRARY_DTYPES = (torch.float32, torch.bfloat16)
# the activations the kernels evaluate, with the codes csrc/elementwise.cpp's Activation enum uses
ACTIVATION_CODES = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "identity": 4}
# one library: these passes and the side-by-side GEMMs below (csrc/experts_mm.cpp)
SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("elementwise.cpp", "experts_mm.cpp"))
_LIBRARY = "shardmoe_cpu"

# compiler flags per CPU capability, as ATen builds its own vectorised kernels (cmake/Codegen.cmake)
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}


def _compile_command(sources: tuple[Path, ...], output: Path) -> list[str]:
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    flags = _CAPABILITY_FLAGS.get(capability, ["-DCPU_CAPABILITY=DEFAULT"])
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    # -fopenmp: without it ATen's headers compile at::parallel_for as a serial loop; the library
    # then shares the libgomp.so.1 that libtorch_cpu already loaded (same soname, torch/lib rpath)
    return [os.environ.get("CXX", "c++"), "-O3", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *flags, *includes,
            *map(str, sources), "-o", str(output), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]


def _cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardmoe"
    return Path(os.environ.get("SHARDMOE_CACHE_DIR", default))


def build_library() -> Path:
    """Compile SOURCES unless a build of these exact sources, torch and flag set is cached; returns
    the shared library's path. Concurrent processes each compile into a private temporary file and
    rename it into place, so none ever loads a half-written library.
    Raises RuntimeError (with the compiler's last line) or OSError (no compiler) on failure."""
    probe = _compile_command(SOURCES, Path("out.so"))
    texts = [source.read_text() for source in SOURCES]
    key = hashlib.sha256("\0".join([*texts, torch.__version__, *probe]).encode()).hexdigest()[:16]
    cache = _cache_dir()
    library = cache / f"{_LIBRARY}_{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / f"{_LIBRARY}_{key}.log"
    # the first forward on a machine waits for the compiler; say why before it starts
    print(f"shardmoe: building the C++ CPU passes for this torch and CPU, once (about 40 s of compiler CPU time, "
          f"longer on a busy machine; cached in {cache})", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        partial = Path(scratch) / library.name
        result = subprocess.run(_compile_command(SOURCES, partial), capture_output=True, text=True)
        if result.returncode != 0:
            log.write_text(result.stdout + result.stderr)
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{probe[0]} exited {result.returncode} ({last[:200]}); full output in {log}")
        os.replace(partial, library)
    return library


@functools.cache
def library_loaded() -> bool:
    """Whether the library (torch.ops.shardmoe_elementwise and torch.ops.shardmoe_gemm) is loaded,
    after building/loading it once per process; False (with one warning) when that fails. The
    wrappers below run only where CpuOps said yes, so the library is loaded: they call its operators
    directly, which Dynamo traces (it would trace through this cache into build_library's compiler
    probe and break the graph)."""
    try:
        torch.ops.load_library(str(build_library()))
        return True
    except Exception as error:  # no compiler, no headers, a broken cache: all mean "use torch"
        message = " ".join(str(error).split())
        warnings.warn(f"shardmoe: the C++ CPU library (elementwise passes, side-by-side GEMMs) is unavailable, "
                      f"using the torch path: {type(error).__name__}: {message}", RuntimeWarning, stacklevel=3)
        return False


class CpuOps(TorchOps):
    """The row primitives of moe/experts.py's TorchOps with the CPU's own machinery, for one forward
    of a layer (and again for its backward; dispatch.select decides both):

      elementwise   the fused elementwise passes of this module
      experts_mm    the experts' GEMMs side by side, one per intra-op thread (the side-by-side GEMMs below)
      workspace     the pool the large row buffers come from (None: fresh allocations)

    decide(x) reads what is the same for every stage of a forward: the settings
    (shardmoe.settings), the device and dtype of the layer's input x, the intra-op thread count,
    and whether the library built (the first decision that gets that far builds it). What each
    primitive still checks per call is what its own operands are (dtype, device, strides, autograd
    tracking) and, for the elementwise passes, its activation (elementwise_fits, gemm_fits); where
    they do not fit, it runs TorchOps' torch code."""

    # a given buffer rules out grouped_mm, which allocates: on CPU it runs the per-expert loop's products
    fills_row_buffers = True

    def __init__(self, elementwise: bool = False, side_by_side: bool = False, workspace: Workspace | None = None):
        self.elementwise, self.side_by_side, self.workspace = elementwise, side_by_side, workspace

    def __repr__(self) -> str:
        return f"CpuOps(elementwise={self.elementwise}, side_by_side={self.side_by_side})"

    @classmethod
    def decide(cls, x: torch.Tensor, workspace: Workspace | None = None) -> "CpuOps":
        if x.device.type != "cpu" or x.dtype not in LIBRARY_DTYPES:
            return cls(workspace=workspace)
        elementwise, side_by_side = SETTINGS.fused_elementwise, SETTINGS.experts_mm and torch.get_num_threads() >= 2
        if not (elementwise or side_by_side) or not library_loaded():
            return cls(workspace=workspace)
        return cls(elementwise, side_by_side, workspace)

    def elementwise_fits(self, *tensors: torch.Tensor, activation: str = "identity", extra: tuple = ()) -> bool:
        """Whether the fused passes take these operands: this forward allows them, the operands fit
        (operands_fit) with a unit last-dim stride for `tensors`, and `activation` is one the kernels
        evaluate."""
        return (self.elementwise and activation in ACTIVATION_CODES and all(t.stride(-1) == 1 for t in tensors)
                and operands_fit(tensors, extra))

    def gemm_fits(self, groups: Groups, *tensors: torch.Tensor) -> bool:
        """Whether the experts' GEMMs run side by side: this forward allows them, there is more than
        one expert, and the operands fit (operands_fit; any strides)."""
        return self.side_by_side and groups.num_experts > 1 and operands_fit(tensors)

    # -- the primitives: the CPU's own where the operands fit, TorchOps' otherwise ----------

    def empty(self, shape, like):
        if self.workspace is None:
            return like.new_empty(shape)
        return self.workspace.empty(tuple(shape), like.dtype, like.device)

    def bias_grad(self, grad_rows, groups):
        if self.elementwise_fits(grad_rows):  # the same row-order sum, one pass
            return index_add_rows(grad_rows, groups.row_expert(), groups.num_experts).to(grad_rows.dtype)
        return super().bias_grad(grad_rows, groups)

    def glu(self, h, activation, act_gate=None):
        if self.elementwise_fits(h, *([] if act_gate is None else [act_gate]), activation=activation):
            return glu_forward(h, activation, act_gate, out=self.empty((h.shape[0], h.shape[-1] // 2), h))
        return super().glu(h, activation, act_gate)

    def glu_backward(self, grad_a, h, act_gate, activation):
        if self.elementwise_fits(grad_a, h, act_gate, activation=activation):
            return glu_backward(grad_a, h, act_gate, activation, out=self.empty(h.shape, h))
        return super().glu_backward(grad_a, h, act_gate, activation)

    def has_glu_backward_one_pass(self, grad_rows, h, weight_rows, activation):
        return isinstance(activation, str) and self.elementwise_fits(grad_rows, h, activation=activation,
                                                                     extra=(weight_rows,))

    def glu_backward_one_pass(self, h, g_down, weight_rows, activation, *, a_out=None, grad_h_out=None):
        """The glu backward's elementwise work in one pass (glu_backward_one_pass below), where
        has_glu_backward_one_pass."""
        return glu_backward_one_pass(h, g_down, weight_rows, activation, a_out=a_out, grad_h_out=grad_h_out)

    def scale_rows(self, rows, weight_rows, *, out=None):
        if self.elementwise_fits(rows, extra=(weight_rows,)):
            return scale_rows(rows, weight_rows, out=out)
        return super().scale_rows(rows, weight_rows, out=out)

    def rowwise_dot(self, rows, *factors):
        if len(factors) in (1, 2) and self.elementwise_fits(rows, *factors):
            return rowwise_dot(rows, *factors)
        return super().rowwise_dot(rows, *factors)

    def combine_rows(self, rows, row_pair, num_tokens, top_k, weight_rows=None):
        if self.elementwise_fits(rows, extra=(row_pair, weight_rows)):  # the same sums, gathered per token
            return combine_pairs(rows, token_rows(row_pair, num_tokens, top_k), weight_rows)
        return super().combine_rows(rows, row_pair, num_tokens, top_k, weight_rows)


def operands_fit(tensors: tuple, extra: tuple = ()) -> bool:
    """Whether the library's ops take these operands: `tensors` CPU tensors of one fused dtype, and
    they and the `extra` operands of other dtypes (None is skipped) CPU tensors not tracked by
    autograd (the ops have no autograd formula: the layer's stages run without one)."""
    dtype = tensors[0].dtype
    if dtype not in LIBRARY_DTYPES or any(t.dtype != dtype for t in tensors):
        return False
    grad = torch.is_grad_enabled()
    return all(t.device.type == "cpu" and not (grad and t.requires_grad)
               for t in (*tensors, *(t for t in extra if t is not None)))


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    # the kernels index raw pointers: a wrong shape must stop here, not read out of bounds
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")


def _check_rows_float32(name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    _check_shape(name, tensor, (rows,))
    return tensor.to(torch.float32)


def glu_forward(h: torch.Tensor, activation: str, act_gate: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """a = act(hg) * hu [N, F] for h = [hg | hu] [N, 2F] (into `out` when given, e.g. a workspace
    buffer); act(hg) is also written to act_gate [N, F] when given. Each value is formed in
    float32 and rounded once to h's dtype."""
    rows, width = h.shape
    if width % 2:
        raise ValueError(f"h: expected an even width [hg | hu], got {width}")
    if act_gate is not None:
        _check_shape("act_gate", act_gate, (rows, width // 2))
    if out is not None:
        _check_shape("out", out, (rows, width // 2))
    a = h.new_empty((rows, width // 2)) if out is None else out
    torch.ops.shardmoe_elementwise.glu_forward(h, ACTIVATION_CODES[activation], a, act_gate)
    return a


def glu_backward(grad_a: torch.Tensor, h: torch.Tensor, act_gate: torch.Tensor, activation: str, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """dh = [dA * hu * act'(hg) | dA * act(hg)] [N, 2F] for dA, act(hg) [N, F] and h [N, 2F]
    (into `out` when given), each value formed in float32 and rounded once."""
    rows, width = h.shape
    _check_shape("grad_a", grad_a, (rows, width // 2))
    _check_shape("act_gate", act_gate, (rows, width // 2))
    if out is not None:
        _check_shape("out", out, (rows, width))
    grad_h = torch.empty_like(h, memory_format=torch.contiguous_format) if out is None else out
    torch.ops.shardmoe_elementwise.glu_backward(grad_a, h, act_gate, ACTIVATION_CODES[activation], grad_h)
    return grad_h


def glu_backward_one_pass(h: torch.Tensor, g_down: torch.Tensor, weight_rows: torch.Tensor, activation: str, *,
             a_out: torch.Tensor | None = None, grad_h_out: torch.Tensor | None = None):
    """The glu expert's backward elementwise work in one pass over h = [hg | hu] [N, 2F], the
    unscaled g_down = g Wdown [N, F] and the combine weights w [N]:
      a    = act(hg) * hu                               [N, F]       (the operand of dWdown)
      dots = sum_f g_down * act(hg) * hu                [N] float32  (stage 2: g . y = g_down . a)
      dA   = w g_down;  dh = [dA * hu * act'(hg) | dA * act(hg)]   [N, 2F]
    Returns (a, dh, dots), a and dh into a_out and grad_h_out when given; a_out may be g_down
    itself (each element of g_down is read before a is written in its place). a and dh are the bits
    of glu_forward, scale_rows and glu_backward in turn (each intermediate rounded where they
    round it), the dots rowwise_dot(g_down, act(hg), hu)'s sums in the same order (in float32 the
    compiler may fuse a different multiply-add: round-off only); h and g_down are read once,
    act(hg) and dA never stored, and SiLU's exponential is evaluated once for act and act'."""
    rows, width = h.shape
    if width % 2:
        raise ValueError(f"h: expected an even width [hg | hu], got {width}")
    _check_shape("g_down", g_down, (rows, width // 2))
    weight = _check_rows_float32("weight_rows", weight_rows, rows)
    if a_out is not None:
        _check_shape("a_out", a_out, (rows, width // 2))
    if grad_h_out is not None:
        _check_shape("grad_h_out", grad_h_out, (rows, width))
    a = h.new_empty((rows, width // 2)) if a_out is None else a_out
    grad_h = torch.empty_like(h, memory_format=torch.contiguous_format) if grad_h_out is None else grad_h_out
    dots = h.new_empty(rows, dtype=torch.float32)
    torch.ops.shardmoe_elementwise.glu_backward_one_pass(h, g_down, weight, ACTIVATION_CODES[activation], a, grad_h,
                                                         dots)
    return a, grad_h, dots


def scale_rows(rows: torch.Tensor, weight_rows: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out_r = w_r * rows_r [N, D] (into `out` when given), formed in float32 and rounded once to
    rows' dtype."""
    weight = _check_rows_float32("weight_rows", weight_rows, rows.shape[0])
    if out is not None:
        _check_shape("out", out, tuple(rows.shape))
    out = torch.empty_like(rows, memory_format=torch.contiguous_format) if out is None else out
    torch.ops.shardmoe_elementwise.scale_rows(rows, weight, out)
    return out


def rowwise_dot(rows: torch.Tensor, factor: torch.Tensor, second_factor: torch.Tensor | None = None) -> torch.Tensor:
    """out_r = sum_d rows[r, d] * factor[r, d] (* second_factor[r, d]) [N] float32; products and
    sum in float32."""
    _check_shape("factor", factor, tuple(rows.shape))
    if second_factor is not None:
        _check_shape("second_factor", second_factor, tuple(rows.shape))
    out = rows.new_empty(rows.shape[0], dtype=torch.float32)
    torch.ops.shardmoe_elementwise.rowwise_dot(rows, factor, second_factor, out)
    return out


def index_add_rows(rows: torch.Tensor, index: torch.Tensor, num_targets: int,
                   weight_rows: torch.Tensor | None = None) -> torch.Tensor:
    """out_i = sum of (w_r *) rows_r over the rows r with index[r] == i: rows [N, D], index [N] ->
    [num_targets, D] float32, each target's rows added in row order (as index_add_ does; the bias
    gradient sums an expert's rows, index = the row's expert). Indices outside [0, num_targets) raise."""
    _check_shape("index", index, (rows.shape[0],))
    weight = None if weight_rows is None else _check_rows_float32("weight_rows", weight_rows, rows.shape[0])
    out = torch.zeros((num_targets, rows.shape[1]), dtype=torch.float32)
    torch.ops.shardmoe_elementwise.index_add_rows(rows, index.to(torch.int64), weight, out)
    return out


def combine_pairs(rows: torch.Tensor, token_rows: torch.Tensor, weight_rows: torch.Tensor | None = None) -> torch.Tensor:
    """out_t = sum over j of (w_r *) rows_r for r = token_rows[t, j], skipping r = -1 (a dropped
    pair): [N, D], [S, k] int64 -> [S, D] float32, each token's rows added in the order given
    (ascending: the order index_add_rows and index_add_ add them; combine.token_rows builds it).
    One thread forms each output row from its k rows, so nothing is read-modified-written. Row
    indices outside [-1, N) raise."""
    if token_rows.dim() != 2:
        raise ValueError(f"token_rows: expected [S, k], got shape {tuple(token_rows.shape)}")
    weight = None if weight_rows is None else _check_rows_float32("weight_rows", weight_rows, rows.shape[0])
    out = torch.empty((token_rows.shape[0], rows.shape[1]), dtype=torch.float32)
    torch.ops.shardmoe_elementwise.combine_pairs(rows, token_rows.to(torch.int64), weight, out)
    return out


# -- workspace -------------------------------------------------------------------------------

# Below this a request is served by the allocator: glibc recycles small blocks itself (below its
# mmap threshold), and a pool block per small tensor would only add resident bytes.
MIN_POOLED_BYTES = 4 << 20
GROWTH = 1.25


def _use_count(storage: torch.UntypedStorage) -> int:
    """References to the storage's data (the pool's own included), as torch counts them."""
    return torch._C._storage_Use_Count(storage._cdata)


class Workspace:
    """Blocks of reusable memory, per device, lent out as tensors of any dtype and shape."""

    def __init__(self, min_bytes: int = MIN_POOLED_BYTES):
        """min_bytes: smaller requests are allocated by torch."""
        if min_bytes < 0:
            raise ValueError(f"min_bytes: expected >= 0, got {min_bytes}")
        self.min_bytes = min_bytes
        self._blocks: list[torch.UntypedStorage] = []
        # one lender at a time: a block is free until the tensor made on it exists, and making that
        # tensor releases the GIL, so two threads could otherwise be lent the same block
        self._lock = threading.Lock()

    def __reduce__(self):
        """A copy (copy.deepcopy, pickle) is an empty pool of the same settings: blocks are scratch."""
        return Workspace, (self.min_bytes,)

    @property
    def resident_bytes(self) -> int:
        """Bytes of every block the pool holds (lent or free)."""
        return sum(b.nbytes() for b in self._blocks)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` (its contents are whatever the block last
        held): from a free block when one fits, else from a new one; below min_bytes, from torch."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        device = torch.device(device)
        if nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:
            return self._lend(nbytes, shape, dtype, device)

    def _lend(self, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """empty()'s pooled case; the caller holds the lock."""
        block = self._choose_block(nbytes, device)
        return torch.empty(0, dtype=dtype, device=device).set_(block, 0, shape)

    def _choose_block(self, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        """The smallest free block of at least nbytes on device, or a new one (see "Size" above)."""
        free = [b for b in self._blocks if b.device == device and _use_count(b) == 1]
        fitting = [b for b in free if b.nbytes() >= nbytes]
        if fitting:
            block = min(fitting, key=lambda b: b.nbytes())
        else:
            self._blocks = [b for b in self._blocks if not any(b is f for f in free)]
            size = max([nbytes] + [int(b.nbytes() * GROWTH) for b in free])
            block = torch.empty(size, dtype=torch.uint8, device=device).untyped_storage()
            self._blocks.append(block)
        return block

    def owns(self, data_ptr: int) -> bool:
        """Whether data_ptr lies in one of the pool's blocks (a saved tensor the pool lent)."""
        return any(b.data_ptr() <= data_ptr < b.data_ptr() + b.nbytes() for b in self._blocks)

    def empty_copy(self) -> "Workspace":
        """A workspace of the same settings holding no blocks (for copies of a layer)."""
        return Workspace(self.min_bytes)

    def release(self) -> None:
        """Forget every block: free ones are freed now, lent ones with their last tensor."""
        with self._lock:
            self._blocks = []


def share(layers) -> Workspace:
    """One new pool for every layer in `layers` (MoE modules): see "Sharing" above."""
    pool = Workspace()
    for layer in layers:
        layer.workspace = pool
    return pool

"""The kernels as an H100 runs them, compiled without a GPU: registers, spills, shared memory, and
the tensor-core (HGMMA) and TMA instructions in the machine code.

triton compiles for a target it is told (GPUTarget("cuda", 90, 32): sm_90a, warp size 32) on a
machine without one. compile_only() replaces every autotuned kernel's launch by a compile for that
target, at the config the launch would get on an H100 (tuned.py's config for the device and key,
else the first autotune candidate: what the kernels run with SHARDMOE_AUTOTUNE=0 or before tuning).
The launchers themselves run unchanged on meta tensors (shapes and strides, no data), so every
argument, constexpr variant and specialization is the one a real launch at those shapes would have,
and a launcher that read device data would fail here (meta tensors hold none).

Of each compiled kernel (analyse):
  triton                     the version that compiled it
  registers, spill_bytes     ptxas -v (triton's own run of its bundled ptxas, its log kept):
                             registers per thread, spill stores + spill loads in bytes
  shared_bytes               the shared memory triton allocates for it (its pipeline buffers)
  mma_instructions           HGMMA (wgmma, Hopper's warpgroup tensor-core MMA) in the SASS
  mma_sync_instructions      HMMA (mma.sync, the pre-Hopper tensor-core MMA)
  tma_instructions           UTMA* / UBLK* (tensor-memory-accelerator copies) in the SASS
  tma_loads, tma_stores      of those, UTMALDG (global -> shared tile loads) and UTMASTG (stores)
  wgmma                      the wgmma instruction shapes in the PTX ("m64n256k16"; several joined by ",")
  async_buffers              the pipeline depth: the fewest buffers of the multi-buffered shared-memory
                             tiles (ttg.local_alloc of [buffers, rows, columns] in the TTGIR)
  async_wait                 the smallest cp.async wait (ttg.async_wait num: commit groups left in flight)
                             in the main loop, the innermost loop holding the MMA; 0 means each step waits
                             for every copy it issued, so loads do not overlap the MMA; None when the
                             main loop issues no cp.async (fed by TMA, or not pipelined)
  wgmma_wait                 the smallest warp_group_dot_wait pendings in the main loop (MMAs left in flight)
  program_axes               the program-id axes the kernel reads (0, 1, 2 for x, y, z)
  column_axis                the program axis the launch takes the output column tile from
                             (kernels.schedule.COLUMN_AXIS; 0 is the one the hardware walks fastest)
The SASS comes from the cubin through cuobjdump -sass (triton's bundled one, else one on PATH,
else nvdisasm); the TTGIR and PTX are triton's own stages of the compile.

toolchain() says what is missing where it cannot run: triton without its NVIDIA backend, no
cuobjdump or nvdisasm.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

H100 = "NVIDIA H100 80GB HBM3"  # torch.cuda.get_device_name of the H100s measured: the tuned table's key
CAPABILITY, WARP_SIZE = 90, 32
GEMM_KERNELS = ("forward_gemm_kernel", "grad_gemm_kernel", "down_grad_kernel", "weight_grad_kernel",
                "router_gemm_kernel")
TMA_PREFIXES = ("UTMA", "UBLK")


def toolchain() -> tuple[dict | None, str | None]:
    """({"disassembler": [command]}, None) when kernels can be compiled for sm_90 here, else
    (None, the reason)."""
    try:
        import triton.backends
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as err:  # an absent or broken triton
        return None, f"triton cannot be imported ({type(err).__name__}: {err})"
    if "nvidia" not in triton.backends.backends:
        return None, "triton has no NVIDIA backend here"
    from triton import knobs

    for name, args in (("cuobjdump", ["-sass"]), ("nvdisasm", [])):
        try:
            path = getattr(knobs.nvidia, name).path
        except Exception:  # not bundled with this triton
            path = shutil.which(name)
        if path and os.access(path, os.X_OK):
            return {"disassembler": [path, *args]}, None
    return None, "neither cuobjdump nor nvdisasm found (triton's bundled tools or PATH)"


@dataclass
class Compiled:
    """One compiled kernel variant and where it was launched."""

    name: str
    config: dict
    variant: dict
    kernel: object
    ptxas_log: str
    workloads: list = field(default_factory=list)


def _compile_launch(jit_fn, target, args: tuple, kwargs: dict):
    """triton's own binding, specialization and compile of one launch, for `target` (no launch)."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound, specialization, options)
    variant = {jit_fn.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
    key = (jit_fn.__name__, repr(sorted(signature.items())), repr(sorted(variant.items(), key=str)), repr(attrs),
           repr(sorted(options.__dict__.items(), key=str)))
    return key, variant, lambda: triton.compile(ASTSource(jit_fn, signature, constexprs, attrs), target=target,
                                                options=options.__dict__)


def run_config(device_name: str):
    """The config a launch gets on `device_name`: tuned.py's for its key, else the first candidate."""
    from shardmoe.kernels import tuned
    from shardmoe.kernels.tuning import tuning_key

    def choose(tuner, name: str, named_args: dict) -> list:
        return [tuned.lookup(device_name, name, tuning_key(tuner.keys, named_args)) or tuner.configs[0]]

    return choose


@contextlib.contextmanager
def compile_only(choose=None):
    """Inside it, a launch of any autotuned kernel of shardmoe.kernels compiles for sm_90 (once per
    variant and config) instead of running; yields ({key: Compiled}, which fills as the launchers run,
    and {"name": the workload's name, set by the caller, "launches": every launch in order, each
    {"workload", "name", "key" (into the first dict), "args": the scalar arguments and the config's,
    "shapes": {tensor argument: its shape}, "dtypes": {tensor argument: bytes per element}}}).
    `choose(tuner, kernel name, named args)`
    gives the configs to compile for a launch: by default run_config(H100), the one an H100 runs.
    Each compile runs in a fresh triton cache, so ptxas always runs and its log is the kernel's."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.autotuner import Autotuner

    from shardmoe.kernels.tuning import AUTOTUNED

    choose = choose or run_config(H100)
    target = GPUTarget("cuda", CAPABILITY, WARP_SIZE)
    found: dict = {}
    workload = {"name": None, "launches": []}
    tiles = {name: set().union(*(c.kwargs for c in tuner.configs)) for name, tuner in AUTOTUNED.items()}

    def run(self, *args, grid=None, warmup=False, **kwargs):
        name = self.fn.__name__
        for config in choose(self, name, {**dict(zip(self.arg_names, args)), **kwargs}):
            key, variant, build = _compile_launch(self.fn, target, args, {**kwargs, **config.all_kwargs()})
            if key not in found:
                log = io.StringIO()
                with contextlib.redirect_stdout(log):
                    kernel = build()
                shown = {k: v for k, v in variant.items() if k not in tiles.get(name, ()) and not k.endswith("_ptr")}
                found[key] = Compiled(name, {**config.kwargs, "num_warps": config.num_warps,
                                             "num_stages": config.num_stages}, shown, kernel, log.getvalue())
            if workload["name"] not in found[key].workloads:
                found[key].workloads.append(workload["name"])
            named = {**dict(zip(self.arg_names, args)), **kwargs, **config.all_kwargs()}
            tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
            workload["launches"].append({
                "workload": workload["name"], "name": name, "key": key,
                "args": {k: v for k, v in named.items() if isinstance(v, (bool, int, float, str)) or v is None},
                "shapes": {k: tuple(v.shape) for k, v in tensors.items()},
                "dtypes": {k: v.element_size() for k, v in tensors.items()}})

    previous_run, previous_log, previous_cache = Autotuner.run, knobs.nvidia.dump_ptxas_log, knobs.cache.dir
    with tempfile.TemporaryDirectory(prefix="shardmoe-compiled-") as cache:
        Autotuner.run = run
        knobs.nvidia.dump_ptxas_log = True
        knobs.cache.dir = cache
        try:
            yield found, workload
        finally:
            Autotuner.run = previous_run
            knobs.nvidia.dump_ptxas_log = previous_log
            knobs.cache.dir = previous_cache


def sass_opcodes(cubin: bytes, disassembler: list[str]) -> Counter:
    """Opcode (without modifiers) -> count in the cubin's machine code."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([*disassembler, f.name], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(disassembler)} failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    # an instruction line: /*0a30*/  [@P0 | @!UP1 ]OPCODE.MOD ... ;
    ops = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", done.stdout, re.M)
    return Counter(ops)


def ptxas_usage(log: str) -> tuple[int | None, int | None]:
    """(registers, spill stores + spill loads in bytes) from a ptxas -v log."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(registers.group(1)) if registers else None,
            int(spills.group(1)) + int(spills.group(2)) if spills else None)


_BUFFERED_TILE = re.compile(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x\d+x[a-z]")
_ASYNC_WAIT = re.compile(r"ttg\.async_wait\b.*\{num = (\d+) : i32\}")
_DOT_WAIT = re.compile(r"warp_group_dot_wait\b.*\{pendings = (\d+) : i32\}")
_DOT = re.compile(r"\b(?:ttng\.warp_group_dot|tt\.dot)\b(?!_)")
_PROGRAM_ID = re.compile(r"tt\.get_program_id ([xyz])\b")
_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.")


def main_loop(ttgir: str) -> list[str]:
    """The lines of the main loop of a TTGIR module: the innermost scf.for whose own body (nested
    ifs included, nested loops not) holds an MMA; [] when no loop does. A region opens on a line
    ending in "{" and closes on a line starting with "}"."""
    loops: list[list[str]] = []  # every loop's own lines, in order of opening
    stack: list[int | None] = []  # per open region, its loop's index, None for another region
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}"):
            stack.pop()
        if text.endswith("{"):
            if text.startswith("}"):  # "} else {": the same kind of region again
                stack.append(None)
            elif "scf.for" in text:
                loops.append([])
                stack.append(len(loops) - 1)
                continue
            else:
                stack.append(None)
        owner = next((i for i in reversed(stack) if i is not None), None)
        if owner is not None:
            loops[owner].append(text)
    with_dot = [body for body in loops if any(_DOT.search(t) for t in body)]
    return with_dot[-1] if with_dot else []


def pipeline(ttgir: str) -> dict:
    """async_buffers, async_wait, wgmma_wait and program_axes of a TTGIR module (module docstring)."""
    buffers = [int(n) for n in _BUFFERED_TILE.findall(ttgir)]
    loop = main_loop(ttgir)
    waits = [int(m.group(1)) for t in loop if (m := _ASYNC_WAIT.search(t))]
    dot_waits = [int(m.group(1)) for t in loop if (m := _DOT_WAIT.search(t))]
    return {"async_buffers": min(buffers) if buffers else 1, "async_wait": min(waits) if waits else None,
            "wgmma_wait": min(dot_waits) if dot_waits else None,
            "program_axes": sorted({"xyz".index(a) for a in _PROGRAM_ID.findall(ttgir)})}


def wgmma_shapes(ptx: str) -> str | None:
    """The wgmma instruction shapes of a PTX module, sorted and joined by ","; None without wgmma."""
    shapes = sorted(set(_WGMMA.findall(ptx)))
    return ",".join(shapes) if shapes else None


def analyse(compiled: Compiled, disassembler: list[str]) -> dict:
    """The report row of one compiled kernel (module docstring)."""
    import triton

    from shardmoe.kernels.schedule import COLUMN_AXIS

    ops = sass_opcodes(compiled.kernel.asm["cubin"], disassembler)
    registers, spills = ptxas_usage(compiled.ptxas_log)
    return {"name": compiled.name, "triton": triton.__version__, "config": compiled.config,
            "variant": compiled.variant, "workloads": compiled.workloads, "gemm": compiled.name in GEMM_KERNELS,
            "registers": registers, "spill_bytes": spills, "shared_bytes": compiled.kernel.metadata.shared,
            "mma_instructions": ops["HGMMA"], "mma_sync_instructions": ops["HMMA"],
            "tma_instructions": sum(n for op, n in ops.items() if op.startswith(TMA_PREFIXES)),
            "tma_loads": ops["UTMALDG"], "tma_stores": ops["UTMASTG"],
            "wgmma": wgmma_shapes(compiled.kernel.asm["ptx"]), **pipeline(compiled.kernel.asm["ttgir"]),
            "column_axis": COLUMN_AXIS.get(compiled.name)}


def meta_groups(num_experts: int, num_rows: int):
    """Groups of num_rows rows over num_experts experts on the meta device (no counts to read)."""
    from shardmoe.rows import Groups

    return Groups.from_counts(torch.empty(num_experts, dtype=torch.int64, device="meta"), num_rows=num_rows)


def trace_layer_step(config, tokens: int) -> None:
    """One forward and backward of TritonOps for a layer of `config` over `tokens` tokens,
    dropless, on meta tensors in the layer's dtype (bf16): the calls the local dispatcher makes, and
    the router's three GEMMs as routing.py makes them on CUDA (x and gate_weight bf16, dlogits
    float32; the force_kernels setting lets the meta tensors stand for CUDA ones)."""
    from shardmoe import settings
    from shardmoe.moe import routing
    from shardmoe.moe.triton_ops import TRITON_OPS

    meta = dict(device="meta", dtype=torch.bfloat16)
    num_rows, hidden = tokens * config.top_k, config.hidden_size
    shapes = config.kind.whole_shapes(hidden, config.ffn_size, config.num_experts)
    params = {name: torch.empty(shapes[name], **meta) for name in config.expert_param_names}
    params.update({name: None for name in config.kind.bias_names if not config.bias})
    groups = meta_groups(config.num_experts, num_rows)
    x = torch.empty(tokens, hidden, **meta)
    gate_weight = torch.empty(hidden, config.num_experts, **meta)
    grad_logits = torch.empty(tokens, config.num_experts, dtype=torch.float32, device="meta")
    with settings.override(force_kernels=True):
        routing.gate_logits(x, gate_weight, torch.float32)
        routing.gate_input_grad(grad_logits, gate_weight)
        routing.gate_weight_grad(x, grad_logits)
    row_token = torch.empty(num_rows, dtype=torch.int64, device="meta")
    weight_rows = torch.empty(num_rows, dtype=torch.float32, device="meta")
    activation = config.expert_activation
    y, saved = TRITON_OPS.expert_forward(config.kind, activation, config.output_activation, x, params, groups,
                                         row_index=row_token)
    TRITON_OPS.combine(y, weight_rows, row_token, tokens, config.top_k)
    grad_xs, _, _ = TRITON_OPS.expert_backward(config.kind, activation, config.output_activation, x, weight_rows, x,
                                               saved, params, groups, row_index=row_token)
    TRITON_OPS.grad_input_combine(grad_xs, row_token, tokens, config.top_k)

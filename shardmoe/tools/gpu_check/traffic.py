"""Stage traffic: a memory-traffic model of one forward + backward of the layer's kernels, no GPU needed.
It is a model: measurements on a GPU overrule it.

For each launch of one bf16 forward + backward of a glu (silu) layer at the bench's two shapes
(bench.SHAPES: "fine" and "mixtral", dropless), traced on meta tensors and compiled for sm_90a as the
static stage does (compiled.compile_only, in a child process: `python -m
shardmoe.tools.gpu_check.traffic OUT_JSON`), the model counts:

  flops             2 M N K of the GEMM (x2 for the GLU's two halves; the router's tf32x3 product
                    counts its three MMAs, at the TF32 rate, half the bf16 one)
  dram_bytes        the DRAM bytes the launch order implies. The programs run in waves of P: P the
                    programs resident together, SMs x the programs one SM holds by the compiled
                    registers, shared memory and warps (a persistent kernel: its SMs programs, one
                    tile each at a time). Within a wave an operand tile (a row tile of A over all of
                    K, a column tile of an expert's weight, a weight gradient's row-block of G or X)
                    is read from DRAM once however many programs of the wave read it (L2 reuse within
                    a wave), and again by each later wave that needs it (no reuse across waves).
                    Outputs and per-program epilogue operands are written / read once.
  compulsory_bytes  every operand tensor read once and every output written once (a gathered
                    operand: its token-order source, S rows)
  modelled_ms       the roofline max(flops / (peak x eta_flops), dram_bytes / (bandwidth x eta_bytes))

Simplifications: balanced routing (N / E rows an expert); rows of a gathered operand shared between
two experts' tiles of one wave are counted once per tile (an upper bound); vectors (indices, routing
weights, biases) are left out; the token combine and the router are counted as plain streams of their
operands. Only the Triton kernels are modelled: the torch work between them (routing, sorting,
reductions) is not, so a step's modelled time is the kernels' time.

Calibration: the efficiencies eta_flops and eta_bytes are fitted (least squares of log(modelled /
measured), on a 0.01 grid) to the per-kernel times of the 2026-11-27 H100 lease of commit 206ae40
(lease_profiles.py), whose launches the model describes as that commit launched them (launches_206ae40:
row tile fastest, the weight gradient's expert fastest; each launch at the autotune candidate whose
roofline is least, the autotuner's choice not having been recorded; one program per SM). The fit's
error per kernel is printed. On a GPU the stage also measures the current kernels (torch.profiler,
per kernel and step) and fits the efficiencies to them ("lease" calibration), so each lease
recalibrates the model and shows measured and modelled times side by side.

report.json: result.steps (one row per shape and device: shape, device, modelled_ms, roofline_ms,
dram_bytes, compulsory_bytes, flops, and row_tile_fastest: the modelled_ms and dram_bytes of the same
launches with their row tile fastest, the order before the grouped one), result.calibration (one
row per kernel and shape: kernel, shape, measured_ms, modelled_ms, error, measured_tflops: the
kernel's FLOPs a step over its measured time), result.launches (per launch and shape), result.efficiency, and on a
GPU result.measured and result.lease_calibration.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

from .report import fmt, table

LIMIT_S = 600
SHAPE_NAMES = ("fine", "mixtral")
PROFILE_WARMUP, PROFILE_STEPS = 3, 2


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    bf16_flops: float  # dense tensor-core peak, FLOP/s
    bandwidth: float  # HBM, bytes/s
    registers_per_sm: int = 65536
    shared_per_sm: int = 228 * 1024
    threads_per_sm: int = 2048
    programs_per_sm: int = 32


# SXM parts' datasheet peaks: 989 dense bf16 TFLOP/s both; HBM3 3.35 TB/s, HBM3e 4.8 TB/s
DEVICES = (Device("H100", 132, 989.4e12, 3.35e12), Device("H200", 132, 989.4e12, 4.8e12))
RESERVED_SHARED = 1024  # shared memory the runtime keeps per program


def resident(device: Device, registers: int, shared_bytes: int, warps: int) -> int:
    """Programs resident together: SMs x the fewest an SM holds by registers (allocated 8 per thread at
    a time), shared memory and threads."""
    threads = 32 * warps
    by_registers = device.registers_per_sm // (math.ceil(registers / 8) * 8 * threads)
    by_shared = device.shared_per_sm // (shared_bytes + RESERVED_SHARED)
    return device.sms * max(1, min(by_registers, by_shared, device.threads_per_sm // threads, device.programs_per_sm))


def wave_bytes(programs, per_wave: int) -> int:
    """DRAM bytes of `programs` (in launch order, each (shared tiles [(key, bytes)], private bytes)) run
    per_wave at a time: each shared tile once per wave that reads it, private bytes always."""
    total, seen, count = 0, set(), 0
    for shared, private in programs:
        if count == per_wave:
            seen.clear()
            count = 0
        for key, nbytes in shared:
            if key not in seen:
                seen.add(key)
                total += nbytes
        total += private
        count += 1
    return total


def split(size: int, block: int) -> list[int]:
    return [min(block, size - start) for start in range(0, size, block)]


def balanced(rows: int, experts: int) -> list[int]:
    return [rows // experts + (e < rows % experts) for e in range(experts)]


@dataclass
class Launch:
    """One modelled launch: its FLOPs and bytes; `programs(per_wave)` gives its DRAM bytes."""

    kernel: str
    label: str
    flops: float
    compulsory_bytes: int
    dram_bytes: int = 0
    tf32: bool = False

    def seconds(self, device: Device, eta_flops: float = 1.0, eta_bytes: float = 1.0) -> float:
        peak = device.bf16_flops / (2 if self.tf32 else 1)
        return max(self.flops / (peak * eta_flops), self.dram_bytes / (device.bandwidth * eta_bytes))


def row_tiled(sizes, block_m, block_n, width, bound_tiles, order, a_row_bytes, w_col_bytes, private):
    """Programs of a row-tiled GEMM: row tiles of BLOCK_M rows of one expert (sizes: rows an expert),
    column tiles of BLOCK_N of `width`; order(pid, row tiles, col tiles) -> (row tile, col tile), row
    tiles at or past the real ones doing nothing; each reads its row tile (rows x a_row_bytes) and its
    expert's column tile (cols x w_col_bytes), and private(rows, cols) bytes of its own."""
    real = [(e, rows) for e, size in enumerate(sizes) for rows in split(size, block_m)]
    cols = split(width, block_n)
    for pid in range(bound_tiles * len(cols)):
        r, c = order(pid, bound_tiles, len(cols))
        if r >= len(real):
            continue
        e, rows = real[r]
        yield ((("A", r), rows * a_row_bytes), (("W", e, c), cols[c] * w_col_bytes)), private(rows, cols[c])


def weight_tiles(sizes, block_o, block_k, width, depth, order, g_bytes, x_bytes, out_bytes):
    """Programs (tiles) of a weight gradient dW_e [width, depth] = sum G^T X over an expert's rows:
    order(index, experts, o tiles, k tiles) -> (expert, o tile, k tile); each reads its expert's rows
    of a G column block (rows x cols x g_bytes) and of an X one, and writes its tile."""
    o_cols, k_cols = split(width, block_o), split(depth, block_k)
    count = len(sizes) * len(o_cols) * len(k_cols)
    for index in range(count):
        e, o, k = order(index, len(sizes), len(o_cols), len(k_cols))
        rows = sizes[e]
        yield ((("G", e, o), rows * o_cols[o] * g_bytes), (("X", e, k), rows * k_cols[k] * x_bytes)), \
            o_cols[o] * k_cols[k] * out_bytes


def grouped_order(group_rows):
    from shardmoe.kernels.schedule import grouped_tile

    return lambda pid, rows, cols: grouped_tile(pid, rows, cols, group_rows)


def row_fastest(pid, rows, cols):
    return pid % rows, pid // rows


def expert_major(index, experts, o_tiles, k_tiles):
    """The persistent weight gradient's tile order: expert, then o tile, then k tile fastest."""
    e, rest = divmod(index, o_tiles * k_tiles)
    return (e, *divmod(rest, k_tiles))


def expert_fastest(index, experts, o_tiles, k_tiles):
    """206ae40's weight gradient grid (E, o tiles, k tiles): the expert fastest."""
    e, rest = index % experts, index // experts
    return e, rest % o_tiles, rest // o_tiles


def nbytes(record: dict, name: str) -> int:
    return math.prod(record["shapes"][name]) * record["dtypes"][name]


def model_launch(record: dict, compiled_row: dict, device: Device, row_tile_fastest: bool = False) -> Launch:
    """The Launch of one traced launch of the current kernels (compile_only's record and its row); with
    row_tile_fastest, its row-tiled GEMMs walk the row tile fastest (the order before the grouped one)."""
    args, shapes, size = record["args"], record["shapes"], record["dtypes"]
    name = record["name"]
    per_wave = resident(device, compiled_row["registers"], compiled_row["shared_bytes"], args["num_warps"])
    tensors = [k for k in shapes if not k.endswith("index_ptr") and k not in ("ends_ptr", "scale_ptr",
                                                                               "bias_ptr", "bias_scale_ptr")]
    compulsory = sum(nbytes(record, k) for k in tensors)
    if name in ("forward_gemm_kernel", "down_grad_kernel", "grad_gemm_kernel"):
        if name == "forward_gemm_kernel":
            a, w, width, depth = "a_ptr", "w_ptr", args["O"], args["K"]
            halves = 2 if args["GLU"] else 1
            num_rows = shapes["pre_ptr"][0]
            per_element = size["pre_ptr"] * halves + (size["post_ptr"] if "post_ptr" in shapes else 0)
            private = lambda rows, cols: rows * cols * per_element  # noqa: E731
        elif name == "down_grad_kernel":
            a, w, width, depth, halves = "g_ptr", "w_ptr", args["F"], args["H"], 1
            num_rows = shapes["h_ptr"][0]
            per_element = 2 * size["h_ptr"] + 2 * size["dh_ptr"] + size["a_ptr"]
            private = lambda rows, cols: rows * cols * per_element + rows * 4  # noqa: E731  (the dots)
        else:
            a, w, width, depth, halves = "g_ptr", "w_ptr", args["N_OUT"], args["C"], 1
            num_rows = shapes["out_ptr"][0]
            per_element = size["out_ptr"] + (size["z_ptr"] if args["ACT"] != "identity" else 0)
            private = lambda rows, cols: rows * cols * per_element  # noqa: E731
        sizes = balanced(num_rows, shapes[w][0])
        programs = row_tiled(sizes, args["BLOCK_M"], args["BLOCK_N"], width, args["num_row_tiles"],
                             row_fastest if row_tile_fastest else grouped_order(args["group_rows"]),
                             depth * size[a], depth * size[w] * halves, private)
        launch = Launch(name, "", 2 * num_rows * depth * width * halves, compulsory)
    elif name == "weight_grad_kernel":
        width, depth = args["O"], args["K"]
        sizes = balanced(shapes["g_ptr"][0] if "g_index_ptr" not in shapes else shapes["g_index_ptr"][0],
                         shapes["dw_ptr"][0])
        programs = weight_tiles(sizes, args["BLOCK_O"], args["BLOCK_K"], width, depth, expert_major,
                                size["g_ptr"], size["x_ptr"], size["dw_ptr"])
        per_wave = device.sms  # persistent: one program per SM, tile after tile
        launch = Launch(name, "", 2 * sum(sizes) * width * depth, compulsory)
    elif name == "router_gemm_kernel":
        m, n, k, chunk = args["M"], args["N"], args["K"], args["K_CHUNK"]
        rows, cols, chunks = split(m, args["BLOCK_M"]), split(n, args["BLOCK_N"]), split(k, chunk)
        programs = [(((("A", i, s), rows[i] * chunks[s] * size["a_ptr"]),
                      (("B", j, s), chunks[s] * cols[j] * size["b_ptr"])), rows[i] * cols[j] * size["c_ptr"])
                    for s in range(len(chunks)) for i in range(len(rows)) for j in range(len(cols))]
        launch = Launch(name, "", 3 * 2 * m * n * k, compulsory, tf32=True)
    elif name in ("token_combine_kernel", "gate_dots_kernel"):
        programs = iter([((), compulsory)])
        launch = Launch(name, "", 0, compulsory)
    else:
        raise ValueError(f"traffic model: no description of kernel {name!r}")
    launch.dram_bytes = wave_bytes(programs, per_wave)
    return launch


def launches_206ae40(shape, device: Device) -> list[Launch]:
    """The Triton launches of one step of commit 206ae40 (glu, dh formed once in torch), each at the
    autotune candidate of least roofline time, one program per SM (module docstring)."""
    from shardmoe.kernels.schedule import choose_block_m

    n, h, f, e = shape.tokens * shape.top_k, shape.hidden, shape.ffn, shape.experts
    sizes, block_m, bf16 = balanced(n, e), choose_block_m(n, e), 2
    bound = sum(len(split(s, block_m)) for s in sizes)  # its host schedule: the real row tiles only

    def gemm(kernel, label, depth, width, halves, per_element, dots=False):
        best = None
        for block_n in (64, 128, 256):
            private = (lambda rows, cols: rows * cols * per_element + (rows * 4 if dots else 0))
            launch = Launch(kernel, label, 2 * n * depth * width * halves, 0)
            launch.dram_bytes = wave_bytes(row_tiled(sizes, block_m, block_n, width, bound, row_fastest,
                                                     depth * bf16, depth * bf16 * halves, private), device.sms)
            best = launch if best is None or launch.seconds(device) < best.seconds(device) else best
        return best

    def weight(label, width, depth):
        best = None
        for block_o, block_k in ((64, 64), (128, 64), (64, 128), (128, 128)):
            launch = Launch("weight_grad_kernel", label, 2 * n * width * depth, 0)
            launch.dram_bytes = wave_bytes(weight_tiles(sizes, block_o, block_k, width, depth, expert_fastest,
                                                        bf16, bf16, bf16), device.sms)
            best = launch if best is None or launch.seconds(device) < best.seconds(device) else best
        return best

    return [gemm("forward_gemm_kernel", "gate_up", h, f, 2, 3 * bf16),  # h (both halves) and a stored
            gemm("forward_gemm_kernel", "down", f, h, 1, 4),  # w y into float32 slots
            gemm("grad_gemm_kernel", "g Wdown", h, f, 1, 2 * bf16, dots=True),  # dA stored, a read
            gemm("grad_gemm_kernel", "dx", 2 * f, h, 1, bf16),
            weight("dWdown", h, f), weight("dWgate_up", 2 * f, h)]


def per_kernel(launches: list[Launch], device: Device, eta=(1.0, 1.0)) -> dict:
    """{kernel: modelled ms} summed over its launches."""
    out: dict = {}
    for launch in launches:
        out[launch.kernel] = out.get(launch.kernel, 0.0) + 1e3 * launch.seconds(device, *eta)
    return out


def fit(pairs: list[tuple[list[Launch], float]], device: Device) -> tuple[float, float]:
    """(eta_flops, eta_bytes) on a 0.01 grid in (0, 1] minimising the sum of log(modelled / measured)^2
    over pairs of (a kernel's launches, its measured ms)."""
    grid = [i / 100 for i in range(1, 101)]
    best = None
    for eta_f in grid:
        for eta_b in grid:
            loss = sum(math.log(sum(1e3 * x.seconds(device, eta_f, eta_b) for x in launches) / ms) ** 2
                       for launches, ms in pairs)
            if best is None or loss < best[0]:
                best = (loss, eta_f, eta_b)
    return best[1], best[2]


def calibration_rows(modelled: dict, measured: dict, device: Device, eta) -> list[dict]:
    """One row per kernel and shape: measured ms a step, modelled ms (at eta), the relative error, and
    the rate measured: the kernel's FLOPs a step (its launches') over its measured time, TFLOP/s."""
    rows = []
    for shape_name, kernels in measured.items():
        model = per_kernel(modelled[shape_name], device, eta)
        for kernel, ms in kernels.items():
            if kernel not in model:  # measured, but not among the modelled launches
                continue
            flops = sum(x.flops for x in modelled[shape_name] if x.kernel == kernel)
            rows.append({"kernel": kernel, "shape": shape_name, "measured_ms": ms, "modelled_ms": model[kernel],
                         "error": model[kernel] / ms - 1, "measured_tflops": flops / (ms * 1e-3) / 1e12})
    return rows


def fitted(modelled: dict, measured: dict, device: Device) -> tuple[float, float]:
    pairs = [([x for x in modelled[s] if x.kernel == kernel], ms)
             for s, kernels in measured.items() for kernel, ms in kernels.items()
             if any(x.kernel == kernel for x in modelled[s])]
    return fit(pairs, device)


def trace_launches() -> dict:
    """{shape name: [(record, compiled row)]} of one step of the glu (silu) layer at each shape, traced
    and compiled for sm_90a by the installed triton; {"skipped": why} without the toolchain."""
    from shardmoe.tools.gpu_check import compiled

    from .static import WORKLOADS

    tools, why = compiled.toolchain()
    if tools is None:
        return {"skipped": why}
    by_shape = {name: next(w for w in WORKLOADS if w.name == f"{name} glu silu") for name in SHAPE_NAMES}
    with compiled.compile_only() as (found, workload):
        for name, w in by_shape.items():
            workload["name"] = name
            compiled.trace_layer_step(w.config(), w.shape.tokens)
    rows = {key: compiled.analyse(c, tools["disassembler"]) for key, c in found.items()}
    return {name: [(r, rows[r["key"]]) for r in workload["launches"] if r["workload"] == name] for name in SHAPE_NAMES}


def model(traced: dict, measured: dict | None = None) -> dict:
    """The stage's result (module docstring) from trace_launches()'s launches and, on a GPU, the
    measured {shape: {kernel: ms a step}} of the current kernels."""
    from .bench import SHAPES, SONICMOE
    from .lease_profiles import PROFILED_STEPS, PROFILES_206AE40
    from shardmoe.tools.bench.flops import expert_flops

    h100 = DEVICES[0]
    old = {s: launches_206ae40(SHAPES[s], h100) for s in SHAPE_NAMES}
    measured_206ae40 = {s: {k: ms / PROFILED_STEPS for k, ms in kernels.items()} for s, kernels in PROFILES_206AE40.items()}
    eta = fitted(old, measured_206ae40, h100)
    current = {d.name: {s: [model_launch(r, row, d) for r, row in traced[s]] for s in SHAPE_NAMES} for d in DEVICES}
    row_first = {d.name: {s: [model_launch(r, row, d, row_tile_fastest=True) for r, row in traced[s]]
                          for s in SHAPE_NAMES} for d in DEVICES}
    sonic = expert_flops(SHAPES[SONICMOE["shape"]]) / 3
    sonic_ms = 1e3 * (sonic / (SONICMOE["forward_tflops"] * 1e12) + 2 * sonic / (SONICMOE["backward_tflops"] * 1e12))
    steps = []
    for d in DEVICES:
        for s in SHAPE_NAMES:
            launches, row_first_launches = current[d.name][s], row_first[d.name][s]
            steps.append({"shape": s, "device": d.name,
                          "modelled_ms": sum(1e3 * x.seconds(d, *eta) for x in launches),
                          "roofline_ms": sum(1e3 * x.seconds(d) for x in launches),
                          "dram_bytes": sum(x.dram_bytes for x in launches),
                          "compulsory_bytes": sum(x.compulsory_bytes for x in launches),
                          "flops": sum(x.flops for x in launches),
                          "row_tile_fastest": {"modelled_ms": sum(1e3 * x.seconds(d, *eta) for x in row_first_launches),
                                               "dram_bytes": sum(x.dram_bytes for x in row_first_launches)}})
    launch_rows = []
    for s in SHAPE_NAMES:
        for i, (record, row) in enumerate(traced[s]):
            x = {d.name: current[d.name][s][i] for d in DEVICES}
            launch_rows.append({"shape": s, "kernel": record["name"], "config": row["config"],
                                "flops": x["H100"].flops, "dram_bytes": x["H100"].dram_bytes,
                                "compulsory_bytes": x["H100"].compulsory_bytes,
                                "modelled_ms": {d: 1e3 * x[d].seconds(dev, *eta) for d, dev in
                                                zip(x, DEVICES)}})
    result = {"model": "memory-traffic roofline model (traffic.py); measurements on a GPU overrule it",
              "devices": [vars(d) for d in DEVICES], "efficiency": {"flops": eta[0], "bytes": eta[1],
                                                                     "fitted_to": "the 2026-11-27 H100 lease of commit "
                                                                                  "206ae40"},
              "sonicmoe_ms": sonic_ms, "steps": steps, "launches": launch_rows,
              "calibration": calibration_rows(old, measured_206ae40, h100, eta)}
    if measured:
        lease_eta = fitted(current["H100"], measured, h100)
        result["measured"] = measured
        result["lease_calibration"] = {"efficiency": {"flops": lease_eta[0], "bytes": lease_eta[1]},
                                       "rows": calibration_rows(current["H100"], measured, h100, eta)}
    return result


def measure(device: str, shapes: dict | None = None, warmup: int = PROFILE_WARMUP, steps: int = PROFILE_STEPS) -> dict:
    """{shape: {kernel: device ms a step}} of the current Triton kernels, one bf16 forward + backward of
    the glu layer at each of `shapes` (default bench.SHAPES' two), torch.profiler over `steps` steps
    after `warmup` (on a CPU, in the interpreter, no kernel shows as a device event)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import shardmoe

    from .bench import SHAPES
    from .parity import triton_context
    from shardmoe.kernels.tuning import AUTOTUNED

    shapes = shapes or {name: SHAPES[name] for name in SHAPE_NAMES}
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    out = {}
    for name, s in shapes.items():
        layer = shardmoe.MoE(s.hidden, s.ffn, s.experts, s.top_k, dtype=torch.bfloat16, device=device)
        x = torch.randn(1, s.tokens, s.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        with triton_context():
            for _ in range(warmup):
                layer(x).backward(grad)
            if device == "cuda":
                torch.cuda.synchronize()
            with profile(activities=[activity]) as prof:
                for _ in range(steps):
                    layer(x).backward(grad)
                if device == "cuda":
                    torch.cuda.synchronize()
        kernels = {}
        for event in prof.key_averages():
            if event.key in AUTOTUNED and event.self_device_time_total > 0:
                kernels[event.key] = event.self_device_time_total / 1e3 / steps
        out[name] = kernels
        del layer, x, grad
    return out


def run(ctx) -> dict:
    out = ctx.out / "traffic.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ctx.root), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "shardmoe.tools.gpu_check.traffic", str(out)], cwd=ctx.root,
                          env=env, capture_output=True, text=True, timeout=LIMIT_S)
    (ctx.out / "traffic.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"python -m shardmoe.tools.gpu_check.traffic exited {done.returncode}: {done.stderr[-3000:]}")
    traced = json.loads(out.read_text())
    if "skipped" in traced:
        return traced
    measured = measure(ctx.device) if ctx.device == "cuda" else None
    result = model(traced, measured)
    for line in markdown(result):
        print(f"  {line}", flush=True)
    return result


def markdown(result: dict) -> list[str]:
    if "steps" not in result:
        return []
    eta = result["efficiency"]
    lines = [f"A model, not a measurement: {result['model']}. Efficiencies fitted to {eta['fitted_to']}: "
             f"{eta['flops']:.2f} of peak FLOP/s, {eta['bytes']:.2f} of peak bandwidth. SonicMoE, published "
             f"(H100, fine shape): {result['sonicmoe_ms']:.2f} ms a step.", ""]
    lines += table(["shape", "device", "modelled ms", "roofline ms", "DRAM GB", "compulsory GB", "DRAM / compulsory",
                    "TFLOP", "row tile fastest: ms", "DRAM GB"],
                   [[r["shape"], r["device"], fmt(r["modelled_ms"], ".2f"), fmt(r["roofline_ms"], ".2f"),
                     fmt(r["dram_bytes"] / 1e9, ".2f"), fmt(r["compulsory_bytes"] / 1e9, ".2f"),
                     fmt(r["dram_bytes"] / r["compulsory_bytes"], ".2f"), fmt(r["flops"] / 1e12, ".3f"),
                     fmt(r["row_tile_fastest"]["modelled_ms"], ".2f"),
                     fmt(r["row_tile_fastest"]["dram_bytes"] / 1e9, ".2f")]
                    for r in result["steps"]])
    lines += ["", "Calibration against the 2026-11-27 H100 per-kernel times of commit 206ae40 (ms a step):", ""]
    lines += table(["kernel", "shape", "measured ms", "modelled ms", "error"],
                   [[r["kernel"], r["shape"], fmt(r["measured_ms"], ".3f"), fmt(r["modelled_ms"], ".3f"),
                     fmt(100 * r["error"], "+.0f") + " %"] for r in result["calibration"]])
    lines += ["", "Per launch, in launch order:", ""]
    lines += table(["shape", "kernel", "config", "GFLOP", "DRAM MB", "compulsory MB", "modelled ms H100",
                    "modelled ms H200"],
                   [[r["shape"], r["kernel"], " ".join(f"{k}={v}" for k, v in r["config"].items()),
                     fmt(r["flops"] / 1e9, ".1f"), fmt(r["dram_bytes"] / 1e6, ".0f"),
                     fmt(r["compulsory_bytes"] / 1e6, ".0f"), fmt(r["modelled_ms"]["H100"], ".3f"),
                     fmt(r["modelled_ms"]["H200"], ".3f")]
                    for r in result["launches"]])
    if "lease_calibration" in result:
        lease = result["lease_calibration"]
        lines += ["", f"This lease's kernels, measured and modelled side by side (ms a step, the model at the 206ae40 "
                      f"fit; refitted to these: {lease['efficiency']['flops']:.2f} of peak FLOP/s, "
                      f"{lease['efficiency']['bytes']:.2f} of peak bandwidth):", ""]
        lines += table(["kernel", "shape", "measured ms", "modelled ms", "error", "measured TFLOP/s"],
                       [[r["kernel"], r["shape"], fmt(r["measured_ms"], ".3f"), fmt(r["modelled_ms"], ".3f"),
                         fmt(100 * r["error"], "+.0f") + " %", fmt(r["measured_tflops"], ".0f")]
                        for r in lease["rows"]])
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"python -m shardmoe.tools.gpu_check.traffic: expected one argument, the JSON file to write, got {argv!r}",
              file=sys.stderr)
        return 2
    traced = trace_launches()
    with open(argv[0], "w") as f:
        json.dump(traced, f, default=str)
    print("traffic: " + (f"skipped: {traced['skipped']}" if "skipped" in traced
                         else f"{sum(len(v) for v in traced.values())} launches traced"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

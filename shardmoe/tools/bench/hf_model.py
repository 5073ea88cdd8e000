"""`shardmoe bench --hf FAMILY --model`: a whole causal LM of a transformers family, one training
step (forward with labels, loss.backward()) timed with its sparse blocks run four ways:

  shardmoe, grouped_mm, eager   the model's experts implementation (config._experts_implementation)
  convert                       router and experts in shardmoe.MoE (shardmoe.hf.convert)

Each candidate runs a model of its own with the same weights: three deep copies, and the model
itself converted. A model shared by candidates measures 2-8% faster for the seam than a copy of its
own in the same run (benchmarks/convert_gap.py, docs/benchmarks.md; the cause is not established),
which would count against `convert` alone.
The bench holds four models' weights and gradients.

The model is the family's ForCausalLM (AutoModelForCausalLM.from_config on small_config: nothing is
downloaded), initialised by the family's own _init_weights under a fixed seed. Every step takes a
new batch of random token ids [B, L] (fresh routing, as in training); all candidates see the same
batch in the same round. The loss is the model's own: causal-LM cross entropy plus the family's
router aux loss (small_config switches it on; DeepSeek-V3 has none).

Before timing, one checked step per candidate on the same batch: its loss, |loss - loss_eager| /
|loss_eager|, and the worst relative error (2-norm, float64) over every parameter gradient against
eager's (convert's gradients mapped back to the family's names and layouts). Timing is
time_interleaved's (shardmoe/tools/bench/timing.py); ratios are median(row) / median(shardmoe) and
median(row) / median(convert): above 1, the column's candidate is faster.
"""
from __future__ import annotations

import math
import statistics
import sys

from shardmoe.tools.bench.candidates import Candidate
from shardmoe.tools.bench.case import relative_error
from shardmoe.tools.bench.hf_block import refusal
from shardmoe.tools.bench.timing import time_interleaved
from shardmoe.hf.families import FAMILIES, small_config

IMPLEMENTATIONS = ("shardmoe", "grouped_mm", "eager")
CANDIDATES = (*IMPLEMENTATIONS, "convert")
SIZES = ("batch", "seq_len", "hidden", "ffn", "experts", "top_k", "layers", "vocab")
# B=4 sequences of L=512 tokens, H=512, two decoder layers, Mixtral-like experts; the vocabulary is
# kept small so that the LM head ([B*L, H] x [H, V] and its backward) does not swamp the blocks
# 2 warm-up and 15 timed rounds: the first rounds are slower (at the fine-grained shape, grouped_mm's
# median step was 21% (fp32) and 26% (bf16) lower with 2/15 than with 1/5, shardmoe's 15%; cause not
# established, docs/benchmarks.md), and a training run lives in the later ones
DEFAULTS = dict(batch=4, seq_len=512, hidden=512, ffn=1024, experts=8, top_k=2, layers=2, vocab=4096,
                warmup=2, repeats=15)
# fine-grained families: many narrow experts (Qwen3-MoE's moe_intermediate_size)
FAMILY_DEFAULTS = {"qwen3_moe": dict(ffn=128, experts=64, top_k=8)}
# a few seconds for a family and dtype; E and k stay the family's, so routing keeps its shape
QUICK = dict(batch=2, seq_len=16, hidden=64, ffn=32, layers=2, vocab=128, warmup=0, repeats=1)
HEAD_DIM = 64


def sizes_for(family: str, args) -> dict:
    """The model's sizes for one family: a flag given wins, then --quick, then the family's, then DEFAULTS."""
    preset = {**DEFAULTS, **FAMILY_DEFAULTS.get(family, {}), **(QUICK if args.quick else {})}
    return {name: getattr(args, name) if getattr(args, name, None) is not None else preset[name]
            for name in (*SIZES, "warmup", "repeats")}


def size_refusal(sizes: dict) -> str | None:
    """Why these sizes cannot build a model (named by their flags), or None."""
    for name in SIZES:
        if sizes[name] < 1:
            return f"--{name.replace('_', '-')}: expected an int >= 1, got {sizes[name]}"
    if sizes["top_k"] > sizes["experts"]:
        return f"--top-k: expected at most --experts ({sizes['experts']}), got {sizes['top_k']}"
    if sizes["warmup"] < 0 or sizes["repeats"] < 1:
        return f"expected --warmup >= 0 and --repeats >= 1, got --warmup {sizes['warmup']} --repeats {sizes['repeats']}"
    return None


def _heads(hidden: int) -> tuple[int, int]:
    """(attention heads, key/value heads): heads of HEAD_DIM (one head below that), a quarter of
    them as key/value heads (grouped-query attention, as Mixtral and Qwen3-MoE), rounded down to a
    divisor of the heads."""
    heads = max(1, hidden // HEAD_DIM)
    kv = next(d for d in range(max(1, heads // 4), 0, -1) if heads % d == 0)
    return heads, kv


def build_model(family: str, dtype, *, hidden: int, ffn: int, experts: int, top_k: int, layers: int, vocab: int,
                seq_len: int, seed: int = 0, **_):
    """The family's ForCausalLM of these sizes, in train mode and `dtype`, experts "eager". Initialised
    in float32 and then cast, so the fp32 and bf16 models hold the same weights (bf16 rounded)."""
    import torch
    from transformers import AutoModelForCausalLM

    heads, kv_heads = _heads(hidden)
    options = {} if family == "deepseek_v3" else dict(num_key_value_heads=kv_heads)  # its attention is MLA
    config = small_config(family, hidden_size=hidden, ffn_size=ffn, num_experts=experts, top_k=top_k,
                          num_layers=layers, vocab_size=vocab, heads=heads,
                          max_position_embeddings=max(256, seq_len), use_cache=False, **options)
    with torch.random.fork_rng():  # the family's init draws from the global generator
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    return model.to(dtype).train()


def family_grads(model) -> dict:
    """Every parameter gradient of `model` under the family's names and layouts. Outside the
    converted blocks the names are the family's already; a ConvertedBlock's layer (mlp.moe.gate_weight
    [H, E], ...) is mapped back by shardmoe.hf.block_state_dict, read with each parameter's gradient in
    place of its data (restored at once), so the bench needs no second copy of that mapping.
    DeepSeek-V3's correction bias is a buffer, not a gradient, and is left out."""
    import torch

    from shardmoe.hf import block_state_dict
    from shardmoe.hf.converted import ConvertedBlock

    blocks = {name: m for name, m in model.named_modules() if isinstance(m, ConvertedBlock)}
    grads = {name: p.grad for name, p in model.named_parameters()
             if p.grad is not None and not any(name.startswith(b + ".") for b in blocks)}
    for block_name, block in blocks.items():
        params = list(block.moe.parameters())
        data = [p.data for p in params]
        try:
            with torch.no_grad():
                for p in params:
                    p.data = p.grad if p.grad is not None else torch.zeros_like(p)
                state = block_state_dict(block.moe)
        finally:
            for p, d in zip(params, data):
                p.data = d
        grads.update({f"{block_name}.{k}": v for k, v in state.items() if not k.endswith("e_score_correction_bias")})
    return grads


def candidates(models: dict, batches: list) -> dict[str, Candidate]:
    """One Candidate per entry of models ({name of CANDIDATES: its model}: the implementations' set
    to run it by transformers' set_experts_implementation, convert's converted). step() runs the next batch of batches[1:] (each
    [B, L] token ids, labels = the ids); forward() runs batches[0] (the checked step) and returns the
    loss; grads() gives the gradients under the family's names."""
    turn = dict.fromkeys(models, 0)

    def make(name):
        net = models[name]

        def run(ids):
            loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach()

        def step():
            turn[name] += 1
            run(batches[1 + (turn[name] - 1) % (len(batches) - 1)])

        def grads():
            if name == "convert":
                return family_grads(net)
            return {n: p.grad for n, p in net.named_parameters() if p.grad is not None}

        return Candidate(name, step, lambda: net.zero_grad(set_to_none=True), tuple(net.parameters()),
                         forward=lambda: run(batches[0]), grads=grads)

    return {name: make(name) for name in models}


def check(cands: dict[str, Candidate]) -> dict:
    """One step of each candidate on the same batch: {name: (loss, relative loss difference vs
    eager, worst relative gradient error vs eager)}; a gradient eager has and the candidate lacks
    makes the error nan (a mapping gap must not pass as agreement)."""
    out = {}
    for name in ("eager", *(n for n in cands if n != "eager")):  # eager first: the reference
        c = cands[name]
        c.reset()
        loss = c.forward().double()
        grads = c.grads()  # reset() sets .grad to None, so these tensors stay as they are
        if name == "eager":
            loss_eager, grads_eager = loss, grads
        err = math.nan if set(grads_eager) - set(grads) else relative_error(grads, grads_eager)
        out[name] = (loss.item(), (abs(loss - loss_eager) / abs(loss_eager)).item(), err)
        c.reset()
    return out


def run_model(family: str, dtype_name: str, *, batch: int, seq_len: int, hidden: int, ffn: int, experts: int,
              top_k: int, layers: int, vocab: int, warmup: int, repeats: int) -> dict:
    """Build, check and time one family's model at one dtype; returns the table's numbers."""
    import copy

    import torch

    import shardmoe.hf

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    sizes = dict(hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, layers=layers, vocab=vocab, seq_len=seq_len)
    model = build_model(family, dtype, **sizes)
    # copies taken and convert applied before any forward: a model that has run carries transformers'
    # output hooks (copies too), and convert refuses it
    models = {name: copy.deepcopy(model) for name in IMPLEMENTATIONS}
    for name, copied in models.items():
        copied.set_experts_implementation(name)
    models["convert"] = shardmoe.hf.convert(model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq_len), generator=gen) for _ in range(warmup + repeats + 1)]
    cands = candidates(models, batches)
    checked = check(cands)
    times = time_interleaved(cands, warmup, repeats, "cpu")
    median = {n: statistics.median(t) for n, t in times.items()}
    return dict(family=family, dtype=dtype_name,
                shape=f"B={batch} L={seq_len} H={hidden} F={ffn} E={experts} k={top_k} layers={layers} vocab={vocab}",
                median_ms={n: 1e3 * m for n, m in median.items()},
                over_shardmoe={n: m / median["shardmoe"] for n, m in median.items()},
                over_convert={n: m / median["convert"] for n, m in median.items()},
                loss={n: c[0] for n, c in checked.items()},
                loss_rel_diff_vs_eager={n: c[1] for n, c in checked.items()},
                grad_err_vs_eager={n: c[2] for n, c in checked.items()}, repeats=repeats)


HEADER = (f"{'family':<12} {'dtype':<5} {'candidate':<10} {'ms':>9} {'x/shardmoe':>10} {'x/convert':>10} "
          f"{'loss':>10} {'dloss/eager':>11} {'grad err':>9}")


def format_rows(r: dict) -> list[str]:
    """One row per candidate: median ms per step, median(row) / median(shardmoe) and / median(convert),
    the checked step's loss, its relative difference to eager's and the gradients' relative error."""
    return [f"{r['family']:<12} {r['dtype']:<5} {n:<10} {r['median_ms'][n]:9.1f} {r['over_shardmoe'][n]:9.2f}x "
            f"{r['over_convert'][n]:9.2f}x {r['loss'][n]:10.6f} {r['loss_rel_diff_vs_eager'][n]:11.1e} "
            f"{r['grad_err_vs_eager'][n]:9.1e}" for n in CANDIDATES]


def run(args) -> int:
    """The --hf FAMILY --model path of `shardmoe bench`; exit code."""
    import torch

    refused = refusal(args)
    if refused is None and args.tokens is not None:
        refused = (f"--tokens: expected --batch and --seq-len instead with --model (tokens per step = batch * "
                   f"seq_len), got --tokens {args.tokens}")
    families = list(FAMILIES) if args.hf == "all" else [args.hf]
    sizes = {} if refused else {family: sizes_for(family, args) for family in families}
    for family in sizes:
        refused = refused or size_refusal(sizes[family])
    if refused:
        print(f"shardmoe bench: {refused}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    print(f"shardmoe bench --hf --model: threads={torch.get_num_threads()}, one step = forward with labels + "
          f"loss.backward(), new token ids every step; ms = median per step; x/shardmoe, x/convert = median(row) "
          f"/ median(that candidate): above 1, that candidate is faster; dloss, grad err: relative to eager")
    print(HEADER)
    for family in families:
        s = sizes[family]
        for dtype_name in dtypes:
            print(f"# {family} {dtype_name}: B={s['batch']} L={s['seq_len']} H={s['hidden']} F={s['ffn']} "
                  f"E={s['experts']} k={s['top_k']} layers={s['layers']} vocab={s['vocab']} "
                  f"({s['batch'] * s['seq_len']} tokens per step)", flush=True)
            try:
                row = run_model(family, dtype_name, **s)
            except ValueError as e:  # a family convert or the experts implementation refuses: say why
                print(f"shardmoe bench: --hf {family} --model: {e}", file=sys.stderr)
                return 2
            print("\n".join(format_rows(row)), flush=True)
    return 0

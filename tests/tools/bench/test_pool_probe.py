"""pool_probe: the workspace's memory per layer, with a pool per layer or one for all layers."""
import torch

from shardmoe.tools.bench import pool_probe
from shardmoe.tools.bench.flops import Shape


def test_one_shared_pool_holds_less_per_layer_than_a_pool_each():
    """Row buffers of these shapes are pooled (>= 4 MiB); a pool per layer holds one working set
    per layer whatever the depth, a shared one the layers' saved blocks plus one scratch set."""
    shape = Shape(tokens=2048, hidden=64, ffn=256, experts=4, top_k=2)
    per_layer = pool_probe.probe(shape, torch.float32, 3, shared=False)
    one_layer = pool_probe.probe(shape, torch.float32, 1, shared=False)
    shared = pool_probe.probe(shape, torch.float32, 3, shared=True)
    assert per_layer["pool"] == one_layer["pool"] > 0
    assert shared["pool"] < per_layer["pool"]
    assert shared["footprint"] < per_layer["footprint"]
    # the saved h [N, 2F] lives in a pool block: the footprint counts it once
    assert per_layer["footprint"] < per_layer["pool"] + per_layer["saved"]
    # the step's peak holds the pools whole, and more (gradients, the output, unpooled scratch)
    assert per_layer["peak"] > per_layer["pool"] and shared["peak"] > shared["pool"]
    assert shared["peak"] < per_layer["peak"]


def test_transformers_probe_counts_its_scratch_in_the_peak():
    """transformers' saved bytes miss the scratch its backward allocates and frees; the peak has it."""
    shape = Shape(tokens=1024, hidden=64, ffn=256, experts=4, top_k=2)
    one = pool_probe.transformers_probe(shape, torch.float32, 1)
    assert one["peak"] > one["saved"] > 0

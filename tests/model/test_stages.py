"""The Transformer cut into pipeline stages, on one process: which blocks each stage and rank holds,
a part's parameters named and valued as the whole model's, and its stage modules, run one after the
other, giving the whole model's loss and gradients (the spawned worlds of tests/train/test_pipeline.py
run them through torch's schedules)."""
import dataclasses

import pytest
import torch

from shardmoe.model.stages import StageModule, rank_part, rank_stages, stage_layers
from shardmoe.model.transformer import Part, Transformer, TransformerConfig
from shardmoe.moe.config import MoEConfig

CONFIG = TransformerConfig(vocab_size=260, d_model=16, n_layers=5, n_q_heads=4, n_kv_heads=2, head_dim=4,
                           moe=MoEConfig(16, 8, 4, 2, aux_loss_coef=0.01, z_loss_coef=0.001))


def test_layers_split_evenly_and_ranks_hold_stages_in_loop_order():
    assert stage_layers(5, 2) == [range(0, 2), range(2, 5)]
    assert stage_layers(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert stage_layers(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    with pytest.raises(ValueError, match=r"model.n_layers: expected at least one block per pipeline stage, 4 stages "
                                         r"\(p x stages_per_rank\), got 3 blocks"):
        stage_layers(3, 4)
    assert rank_stages(1, 2, 2) == [1, 3]
    assert rank_part(5, 0, 2) == Part((0, 1), embedding=True, head=False)
    assert rank_part(5, 1, 2) == Part((2, 3, 4), embedding=False, head=True)
    assert rank_part(4, 0, 2, 2) == Part((0, 2), embedding=True, head=False)  # stages 0 and 2
    assert rank_part(4, 1, 2, 2) == Part((1, 3), embedding=False, head=True)  # stages 1 and 3


def test_a_part_holds_the_whole_models_parameters_under_their_names():
    whole = Transformer(CONFIG, dtype=torch.float64, seed=3)
    part = Transformer(CONFIG, dtype=torch.float64, seed=3, part=rank_part(5, 1, 2))
    names = [name for name, _ in part.named_parameters()]
    assert names[0] == "blocks.2.attn_norm.weight" and names[-1] == "unembedding.weight"
    assert not any(n.startswith(("embedding.", "blocks.0.", "blocks.1.")) for n in names)
    expected = whole.full_state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in part.full_state_dict().items())
    assert set(part.state_dict()) == set(part.full_shapes()) and part.blocks[3] is list(part.blocks)[1]
    with pytest.raises(ValueError, match=r"forward: expected a model holding every part, got Part\(layers=\(2, 3, 4\)"):
        part(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"part: expected ascending distinct block indices in 0..4, got \(3, 2\)"):
        Transformer(CONFIG, part=Part((3, 2)))


def test_stage_modules_in_turn_give_the_whole_models_loss_and_gradients():
    config = dataclasses.replace(CONFIG, n_layers=4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 257, (2, 6), generator=generator)
    targets = torch.randint(0, 257, (2, 6), generator=generator)
    is_seq_start = torch.zeros(2, 6, dtype=torch.bool)
    is_seq_start[:, 0] = is_seq_start[0, 3] = True
    whole = Transformer(config, dtype=torch.float64, seed=1)
    losses = whole(ids, is_seq_start, targets)
    losses.total.backward()
    # two pipeline ranks with two stages each (interleaved), run in stage order on one process
    parts = [Transformer(config, dtype=torch.float64, seed=1, part=rank_part(4, r, 2, 2)) for r in range(2)]
    layers = stage_layers(4, 4)
    x = ids
    for s in range(4):
        model = parts[s % 2]
        x = StageModule(model, s, layers[s], s == 0, s == 3)(x, is_seq_start=is_seq_start)
    ce = parts[1].loss(x, targets, targets.numel())
    ce.backward()
    assert abs(ce.item() - losses.ce.item()) <= 1e-14 * losses.ce.item()
    grads = {n: p.grad for n, p in whole.named_parameters()}
    for part in parts:
        for name, p in part.named_parameters():
            assert (p.grad - grads[name]).norm() <= 1e-12 * grads[name].norm(), name


def test_a_stage_whose_output_differs_from_the_declared_one_is_named():
    model = Transformer(CONFIG, seed=1, part=rank_part(5, 0, 2))
    stage = StageModule(model, 0, range(0, 2), True, False)
    stage.output = ((8,), torch.float32)  # what a neighbour built with d_model 8 would expect
    with pytest.raises(ValueError, match=r"pipeline stage 0: expected outputs of \[8\] per token in torch.float32, "
                                         r"got \[16\] in torch.float32"):
        stage(torch.zeros(1, 4, dtype=torch.long), is_seq_start=torch.ones(1, 4, dtype=torch.bool))

"""Shared fixtures of the training tests: a tiny config, single-threaded torch, a generated corpus,
BPE and word-level tokenizers built offline with the `tokenizers` package, and the plumbing of
spawned worlds that run `shardmoe train` on process groups of its own (free ports, a file barrier)."""
import dataclasses
import os
import random
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardmoe.check.command import single_threaded
from shardmoe.model.transformer import TransformerConfig
from shardmoe.moe.config import MoEConfig
from shardmoe.train.config import TrainConfig
from shardmoe.train.documents import load_corpus
from shardmoe.train.metrics import read_metrics

# vocab 260 (the 257 byte ids padded to a multiple of 4) splits over t = 2 and 4
TINY_MODEL = TransformerConfig(vocab_size=260, d_model=16, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=4,
                               moe=MoEConfig(16, 8, 4, 2, aux_loss_coef=0.01, z_loss_coef=0.001))


def with_moe(model: TransformerConfig, **changes) -> TransformerConfig:
    """`model` with its MoE layer's options `changes` (MoEConfig's names)."""
    return dataclasses.replace(model, moe=dataclasses.replace(model.moe, **changes))


NOUNS = ("river", "stone", "garden", "lantern", "harbour", "orchard", "window", "meadow", "engine", "letter")
VERBS = ("carries", "finds", "remembers", "follows", "mends", "opens", "paints", "answers")
ADJECTIVES = ("quiet", "bright", "old", "narrow", "patient", "distant", "green", "heavy")


def tiny_train_config(**changes) -> TrainConfig:
    settings = dict(model=TINY_MODEL, steps=6, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=2,
                    eval_batches=1, checkpoint_every=0, health_every=3, sample_tokens=8)
    return TrainConfig(**{**settings, **changes})


def generated_documents(count: int, seed: int = 0, sentences: int = 6) -> list[str]:
    """`count` documents of `sentences` sentences each from a small seeded grammar."""
    rng = random.Random(seed)

    def sentence():
        a, b = rng.sample(NOUNS, 2)
        return f"The {rng.choice(ADJECTIVES)} {a} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {b}."

    return ["\n".join(sentence() for _ in range(sentences)) for _ in range(count)]


def train_bpe(path, vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json of `vocab_size` tokens trained offline on the embedded corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(load_corpus()[:10], trainer)
    assert tokenizer.get_vocab_size() == vocab_size
    tokenizer.save(str(path))
    return str(path)


def word_level(path, vocab: dict[str, int], added=()) -> str:
    """A tokenizer.json of whitespace-split words with the ids `vocab` gives (and `added` tokens)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_tokens([AddedToken(token, special=False) for token in added])
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory):
    """vocab_size -> the path of a BPE tokenizer.json of that many tokens (trained once a session)."""
    made = {}

    def make(vocab_size: int = 300) -> str:
        if vocab_size not in made:
            made[vocab_size] = train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", vocab_size)
        return made[vocab_size]

    return make


@pytest.fixture
def tiny_config():
    return tiny_train_config


def losses(out: Path, steps) -> list[float]:
    """The logged loss of each of `steps` in out/metrics.jsonl, each step logged once, in order."""
    rows = [r for r in read_metrics(out, max(steps)) if r["step"] in steps]
    assert [r["step"] for r in rows] == list(steps), (out, list(steps), [r["step"] for r in rows])
    return [r["loss"] for r in rows]


def free_ports(count: int) -> list[int]:
    """`count` ports rank 0 found free, on every rank (for the command's own process groups)."""
    ports = [None]
    if dist.get_rank() == 0:
        sockets = [socket.socket() for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [[s.getsockname()[1] for s in sockets]]
        for s in sockets:
            s.close()
    dist.broadcast_object_list(ports, src=0)
    return ports[0]


def all_ranks_at(tmp: Path, name: str, world: int = 4) -> None:
    """A barrier without a process group (the command destroys its own): each rank leaves a file
    and waits up to 120 s for the others', so that every rank starts the next command together and
    none starts it while rank 0 still holds --out's lock (it plots after the others have returned)."""
    (tmp / f"{name}.{os.environ['RANK']}").touch()
    deadline = time.monotonic() + 120
    while not all((tmp / f"{name}.{r}").exists() for r in range(world)):
        assert time.monotonic() < deadline, f"{name}: a rank did not arrive"
        time.sleep(0.05)


@pytest.fixture
def one_thread():
    """Runs the test on one torch thread (as the training command does) and restores the count."""
    with single_threaded():
        yield

"""Peak memory of tokenizing one long line with a tokenizer.json: in pieces (the code) and whole.

Writes a file of --mb MB on one line (sentences of a seeded grammar, spaces between them), trains a
byte-level BPE tokenizer.json of --vocab tokens on the embedded corpus's first 10 chapters, and
tokenizes the file into a fresh token cache twice, each in a process of its own: once as
`shardmoe train` does (shardmoe.train.tokenizer.PIECE_CHARS as it is) and once whole (PIECE_CHARS
set past the file's length). Prints each process's peak RSS (ru_maxrss) and seconds, and whether
the two caches' token files are byte for byte the same.

    PYTHONPATH=. python benchmarks/tokenize_long_line.py --mb 28
"""
from __future__ import annotations

import argparse
import filecmp
import random
import subprocess
import sys
import tempfile
from pathlib import Path

NOUNS = ("river", "stone", "garden", "lantern", "harbour", "orchard", "window", "meadow", "engine", "letter")
VERBS = ("carries", "finds", "remembers", "follows", "mends", "opens", "paints", "answers")
ADJECTIVES = ("quiet", "bright", "old", "narrow", "patient", "distant", "green", "heavy")

TOKENIZE = """
import resource, sys, time
from shardmoe.train import tokenizer
from shardmoe.train.token_cache import open_tokens
if sys.argv[4] == "whole":
    tokenizer.PIECE_CHARS = sys.maxsize
started = time.perf_counter()
streams = open_tokens(sys.argv[1], tokenizer.load_tokenizer(sys.argv[2]), 0.05, sys.argv[3])
print(streams.train.size + streams.val.size, time.perf_counter() - started,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def one_line(path: Path, megabytes: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        written = 0
        while written < megabytes << 20:
            a, b = rng.sample(NOUNS, 2)
            sentence = f"The {rng.choice(ADJECTIVES)} {a} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {b}. "
            written += f.write(sentence)


def bpe(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from shardmoe.train.documents import load_corpus

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(load_corpus()[:10], trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.save(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=28, help="the line's size in MB (default 28)")
    parser.add_argument("--vocab", type=int, default=300, help="the BPE's tokens (default 300)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        one_line(scratch / "line.txt", args.mb)
        bpe(scratch / "tokenizer.json", args.vocab)
        print(f"{args.mb} MB on one line, a {args.vocab}-token byte-level BPE tokenizer.json")
        for mode in ("pieces", "whole"):
            done = subprocess.run([sys.executable, "-c", TOKENIZE, str(scratch / "line.txt"),
                                   str(scratch / "tokenizer.json"), str(scratch / mode), mode],
                                  capture_output=True, text=True, check=True)
            tokens, seconds, kib = done.stdout.split()
            print(f"{mode:>7}: {int(tokens):,} tokens in {float(seconds):.1f} s, peak RSS {int(kib):,} KiB")
        same = all(filecmp.cmp(next((scratch / "pieces").glob(f"*/{name}")), next((scratch / "whole").glob(f"*/{name}")),
                               shallow=False) for name in ("train.bin", "val.bin"))
        print(f"token files byte for byte the same: {same}")


if __name__ == "__main__":
    main()

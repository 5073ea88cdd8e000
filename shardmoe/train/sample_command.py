"""`shardmoe sample`: continue your prompts with a trained run's model, on one process.

    shardmoe sample --out runs/default --prompt "And it came to pass"
    shardmoe sample --out runs/mine --prompt "Once" --prompt "The end" --max-tokens 200 --top-k 20 --seed 1

The run's settings (DIR/config.json, else its checkpoint's) give the model and the tokenizer; the
weights are those of its newest checkpoint, of either format and any mesh (a sharded one loads
into one process), on --device (default auto: a GPU when torch sees one). Each prompt is continued
by shardmoe.train.sample.sample, with a KV cache, from a CPU generator seeded with --seed, so the
same command prints the same text: the prompt and its continuation,
one block per prompt, control characters but newline and tab shown as U+FFFD. Nothing in DIR is
written or locked: a running training may be sampled (between its checkpoints). A missing run,
an unreadable checkpoint, a tokenizer at the run's path that is not the one it trained with (its
sha256, which checkpoints keep with the data's position), a prompt that is not UTF-8 or another
bad option is one line, exit status 2.
"""
from __future__ import annotations

import argparse
import sys

from shardmoe.train.device import DEVICES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="DIR", help="the run directory (shardmoe train --out)")
    parser.add_argument("--prompt", required=True, action="append", metavar="TEXT",
                        help="text to continue (repeat for several prompts)")
    parser.add_argument("--max-tokens", type=int, metavar="N",
                        help="tokens to sample per prompt (default: the run's sample_tokens)")
    parser.add_argument("--temperature", type=float, metavar="T",
                        help="softmax temperature, > 0 (default: the run's sample_temperature)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="draw from the K most likely tokens only (default 0: from all)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the draws (default 0)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the model runs (default auto: a GPU when torch sees one, else the CPU)")


def check_arguments(args: argparse.Namespace) -> None:
    from shardmoe.arguments import check_seed
    from shardmoe.train.config import INT64_MAX

    for option, value, low in (("--max-tokens", args.max_tokens, 1), ("--top-k", args.top_k, 0)):
        if value is not None and not low <= value <= INT64_MAX:
            raise ValueError(f"{option}: expected an int in {low}..{INT64_MAX}, got {value}")
    check_seed("--seed", args.seed)
    t = args.temperature
    if t is not None and not 0 < t < float("inf"):
        raise ValueError(f"--temperature: expected a finite number > 0, got {t}")
    for prompt in args.prompt:
        try:  # bytes that are not UTF-8 reach argv as lone surrogates (Python's surrogateescape)
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raw = prompt[err.start].encode("utf-8", "surrogateescape")
            raise ValueError(f"--prompt: expected UTF-8 text, got the byte {raw!r} at character {err.start} of "
                             f"{prompt.encode('utf-8', 'surrogateescape')[:40]!r}") from None


def run(args: argparse.Namespace) -> int:
    import torch

    from shardmoe.model.transformer import Transformer
    from shardmoe.train.checkpoint import check_resumable, latest_checkpoint, load_checkpoint, saved_data_state
    from shardmoe.train.device import resolve_device
    from shardmoe.train.optim import AdamW
    from shardmoe.train.run_settings import stored_settings
    from shardmoe.train.sample import sample
    from shardmoe.train.tokenizer import check_vocab, load_tokenizer

    try:
        config = stored_settings(args.out, "--out")
        tokenizer = load_tokenizer(config.tokenizer)
        path = latest_checkpoint(args.out)
        step = check_resumable(path, config.resume_identity(), "--out")
        trained_with = saved_data_state(path).get("tokenizer_digest", tokenizer.digest)  # older: not saved
        if trained_with != tokenizer.digest:
            raise ValueError(f"--out: the tokenizer {tokenizer.spec} is not the one the run trained with (its sha256 "
                             f"was {trained_with[:16]}..., it is {tokenizer.digest[:16]}... now): the model's ids "
                             "would be read as other tokens; put the run's tokenizer back at that path")
        check_vocab(config.model.vocab_size, tokenizer)  # a checkpoint that predates the digest
        device = resolve_device(args.device)
    except ValueError as err:
        print(f"shardmoe sample: {err}", file=sys.stderr)
        return 2
    if config.threads:
        torch.set_num_threads(config.threads)
    model = Transformer(config.model, dtype=config.param_dtype, seed=config.seed, device=device)
    optimizer = AdamW(model.named_parameters(), betas=(config.beta1, config.beta2), eps=config.adam_eps,
                      weight_decay=config.weight_decay)  # load_checkpoint fills its moments; unused here
    load_checkpoint(path, model, optimizer)
    model.eval()
    generator = torch.Generator().manual_seed(args.seed)
    max_tokens = config.sample_tokens if args.max_tokens is None else args.max_tokens
    temperature = config.sample_temperature if args.temperature is None else args.temperature
    print(f"{args.out} at step {step} ({path.name}), tokenizer {tokenizer.spec}, temperature {temperature:g}, "
          f"top-k {args.top_k or 'all'}, seed {args.seed}:")
    for prompt in args.prompt:
        try:
            ids = sample(model, tokenizer.encode(prompt), max_tokens, tokenizer=tokenizer, seq_len=config.seq_len,
                         temperature=temperature, top_k=args.top_k, generator=generator)
        except ValueError as err:  # a checkpoint of a run that diverged
            print(f"shardmoe sample: {err} (checkpoint {path})", file=sys.stderr)
            return 1
        print("\n" + printable(prompt + tokenizer.decode(ids)))
    return 0


def printable(text: str) -> str:
    """text with control characters other than newline and tab shown as U+FFFD (an undertrained
    model's bytes may hold terminal escapes)."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)

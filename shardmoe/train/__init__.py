"""Training: the embedded corpus, byte tokenizer and packed, resumable data stream."""
from .data import (BOS, VOCAB_SIZE, Batch, DataPosition, PackedBatches, decode, encode, load_corpus,
                   padded_vocab_size, split_documents)

__all__ = ["BOS", "VOCAB_SIZE", "Batch", "DataPosition", "PackedBatches", "decode", "encode", "load_corpus",
           "padded_vocab_size", "split_documents"]

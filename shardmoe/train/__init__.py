"""Training: documents, tokenizers, the token cache and the packed, resumable data stream."""
from .data import Batch, DataPosition, PackedBatches, shuffled_index
from .documents import load_corpus
from .tokenizer import BOS, VOCAB_SIZE, Tokenizer, byte_tokenizer, load_tokenizer, padded_vocab_size

__all__ = ["BOS", "VOCAB_SIZE", "Batch", "DataPosition", "PackedBatches", "Tokenizer", "byte_tokenizer",
           "load_corpus", "load_tokenizer", "padded_vocab_size", "shuffled_index"]

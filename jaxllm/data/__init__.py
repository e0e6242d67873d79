"""Input pipeline: documents from files (text, lines, JSONL, Parquet, pre-tokenised
ArrayRecord) or one synthetic batch, tokenized, packed and batched with grain into global
arrays split over the 'batch' rule. See loader.py for the batch contract."""

from jaxllm.data.loader import FixedBatch, Streams, make_batches, make_eval_batches
from jaxllm.data.sources import write_token_records
from jaxllm.data.tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, Tokenizer, load_tokenizer

__all__ = ['Streams', 'FixedBatch', 'make_batches', 'make_eval_batches', 'write_token_records',
           'load_tokenizer', 'Tokenizer', 'BOS_ID', 'EOS_ID', 'BYTE_VOCAB_SIZE']

"""Data: corpus (synthetic or loaded), splits, canaries, tokenizer, packing.

The public API (see DEVELOPERS.md, "Prepared data"):

    prepare_data(cfg.data, run, vocab_size=V, progress=None) -> PreparedData
    load_prepared(run) -> PreparedData
    document_index(prepared) -> DocumentIndex   (member / holdout / heldout documents)

Heavy libraries (datasets, tokenizers, transformers, faker) are imported inside functions.
"""

from memaudit.data.canaries import AuditCanary, Canary, CanarySet, ReferenceCanary
from memaudit.data.documents import Document, Pii
from memaudit.data.index import DocumentIndex, document_index, token_ids
from memaudit.data.packing import PackedSequences
from memaudit.data.prepare import PreparedData, load_prepared, prepare_data
from memaudit.data.splits import Split

__all__ = [
    "AuditCanary", "Canary", "CanarySet", "Document", "DocumentIndex", "PackedSequences", "Pii",
    "PreparedData", "ReferenceCanary", "Split", "document_index", "load_prepared", "prepare_data",
    "token_ids",
]

"""A byte-level BPE tokenizer trained on public text, with every digit its own token.

Trained with `tokenizers` on text that is not private training data (the held-out users'
documents, or `data.tokenizer_corpus`), never on canaries. Digits are split individually
before the byte-level split, so no merge ever joins two digits: a 6-digit secret is six
tokens, and no secret can sit in the vocabulary. `<|endoftext|>` is eos, bos and pad.
Saved as a Hugging Face fast tokenizer that `AutoTokenizer.from_pretrained` loads.

References:
    Sennrich et al., "Neural Machine Translation of Rare Words with Subword Units", ACL 2016;
    Radford et al., GPT-2 (byte-level BPE), 2019; Carlini et al. 2019 (digit-level secrets).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from memaudit.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EOS = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], *, vocab_size: int, min_frequency: int = 2):
    """Train the byte-level BPE and wrap it as a `PreTrainedTokenizerFast`.

    The vocabulary holds at most `vocab_size` entries (fewer when the text is small).
    """
    # lazy: transformers (~1.3 s) only when called; this module imports without it
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257 + 1:
        raise DataError(f"vocab size {vocab_size} is below the 256 byte tokens + eos; use >= 258")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str | Path, *, vocab_size: int | None = None):
    """Load a Hugging Face tokenizer directory; its size must fit the model's vocabulary."""
    # lazy: transformers (~1.3 s) only when called; this module imports without it
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise DataError(f"tokenizer directory '{p}' not found; set data.tokenizer to a saved HF tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # noqa: BLE001 (any load failure is a user-input error)
        raise DataError(f"tokenizer directory '{p}' could not be loaded ({type(e).__name__}); "
                        "save it with save_pretrained") from None
    if tok.eos_token_id is None:
        raise DataError(f"tokenizer '{p}' has no eos token; set one and save it again")
    if vocab_size is not None and len(tok) > vocab_size:
        raise DataError(
            f"tokenizer '{p}' has {len(tok)} tokens but the model's vocabulary is {vocab_size}; "
            "use a smaller tokenizer or a larger model"
        )
    return tok


def pad_id(tok: PreTrainedTokenizerBase) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def digits_split(tok: PreTrainedTokenizerBase) -> bool:
    """True when every digit of a digit string encodes to its own token."""
    s = "0123456789" * 2
    return len(tok.encode(s, add_special_tokens=False)) == len(s)


def encode(tok: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (batch-encoded: fast)."""
    if not texts:
        return []
    return tok(texts, add_special_tokens=False)["input_ids"]

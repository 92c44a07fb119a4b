"""Fit a probe run to the model's context window, and count what that leaves out.

A causal LM with learned positions (GPT-2, GPT-NeoX's trained length) fails on a sequence longer
than its context; every probe's sequences are kept within it: documents are scored on their
first `context` tokens (counted as truncated, shown on the first screen), extraction prefix
lengths that leave no room for the suffix are dropped (counted), and unprompted samples are
shortened to fit.
"""

from __future__ import annotations

from memaudit.config import ProbeConfig


def model_context(model) -> int | None:
    """The longest sequence the model takes: n_positions or max_position_embeddings."""
    cfg = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings", "max_sequence_length"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 1:
            return v
    return None


def fit_to_context(settings: ProbeConfig, context: int | None, lengths: list[int]
                   ) -> tuple[ProbeConfig, dict]:
    """`settings` with every sequence length within `context`, and the counts it implies.

    Args:
        settings: the run's probe settings.
        context: the model's context (None: unknown, nothing changes).
        lengths: token counts (start token included) of the documents to be scored.

    Returns:
        (settings, counts) with counts {"context", "documents_truncated", "documents",
        "extraction_ks_dropped"}.

    >>> s, c = fit_to_context(ProbeConfig(), 64, [10, 80, 100])
    >>> s.max_tokens, c["documents_truncated"], s.extraction_ks
    (64, 2, ())
    """
    if context is None:
        return settings, {}
    update: dict = {"max_tokens": min(settings.max_tokens, context)}
    ks = tuple(k for k in settings.extraction_ks if 1 + k + settings.extraction_m <= context)
    update["extraction_ks"] = ks
    update["nd_length"] = min(settings.nd_length, context - 1)
    counts = {
        "context": context,
        "documents": len(lengths),
        "documents_truncated": sum(n > update["max_tokens"] for n in lengths),
        "extraction_ks_dropped": [k for k in settings.extraction_ks if k not in ks],
    }
    return settings.model_copy(update=update), counts

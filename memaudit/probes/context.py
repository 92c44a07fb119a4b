"""Fit a probe run to the model's context window, and count what that leaves out.

A causal LM with learned positions (GPT-2, GPT-NeoX's trained length) fails on a sequence longer
than its context; every probe's sequences are kept within it: a longer document is scored in
strided windows of `context` tokens, every token once (counted as windowed, shown on the first
screen), extraction prefix lengths that leave no room for the suffix are dropped (counted), and
unprompted samples are shortened to fit.
"""

from __future__ import annotations

from memaudit.config import ProbeConfig

_CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "max_sequence_length")


def model_context(model) -> int | None:
    """The longest sequence the model takes: n_positions or max_position_embeddings."""
    cfg = getattr(model, "config", None)
    return config_context({k: getattr(cfg, k, None) for k in _CONTEXT_KEYS})


def config_context(config: dict) -> int | None:
    """The context a model's config.json names (None when it names none).

    >>> config_context({"n_positions": 64}), config_context({"max_position_embeddings": 2048}), config_context({})
    (64, 2048, None)
    """
    for name in _CONTEXT_KEYS:
        v = config.get(name)
        if isinstance(v, int) and v > 1:
            return v
    return None


def fit_to_references(settings: ProbeConfig, counts: dict, references: dict[str, int | None],
                      lengths: list[int]) -> tuple[ProbeConfig, dict]:
    """`settings` whose scoring window also fits the reference models' contexts, and `counts`
    with the documents windowed in it.

    A reference attack subtracts per-document losses, which compare only when the target and the
    reference scored the same windows; so every model of the run scores in the shortest context.
    Extraction and sampling run on the target alone and keep its context. `counts` gains
    {"reference_context": {name: context}} for the references that shortened the window.

    >>> s, c = fit_to_references(ProbeConfig(max_tokens=64), {}, {"base": 32, "big": 128}, [10, 40, 100])
    >>> s.max_tokens, c["context"], c["documents_windowed"], c["window_stride"], c["reference_context"]
    (32, 32, 2, 16, {'base': 32})
    """
    shorter = {n: c for n, c in references.items() if c is not None and c < settings.max_tokens}
    if not shorter:
        return settings, counts
    window = min(shorter.values())
    stride = settings.window_stride if settings.window_stride and settings.window_stride < window else None
    settings = settings.model_copy(update={"max_tokens": window, "window_stride": stride})
    return settings, {**counts, "context": window, "documents": len(lengths),
                      "documents_windowed": sum(n > window for n in lengths),
                      "window_stride": window_stride(settings), "reference_context": shorter,
                      "target_context": counts.get("context"),
                      "extraction_ks_dropped": counts.get("extraction_ks_dropped", [])}


def fit_to_context(settings: ProbeConfig, context: int | None, lengths: list[int]
                   ) -> tuple[ProbeConfig, dict]:
    """`settings` with every sequence length within `context`, and the counts it implies.

    Args:
        settings: the run's probe settings.
        context: the model's context (None: unknown, nothing changes).
        lengths: token counts (start token included) of the documents to be scored.

    Returns:
        (settings, counts) with counts {"context", "documents_windowed", "window_stride",
        "documents", "extraction_ks_dropped"}. probes.json written before windows held
        "documents_truncated" (documents scored on their first `context` tokens) instead.

    Raises:
        ValueError: the window stride is not smaller than the window.

    >>> s, c = fit_to_context(ProbeConfig(), 64, [10, 80, 100])
    >>> s.max_tokens, c["documents_windowed"], c["window_stride"], s.extraction_ks
    (64, 2, 32, ())
    """
    if context is None:
        window_stride(settings)
        return settings, {}
    update: dict = {"max_tokens": min(settings.max_tokens, context)}
    ks = tuple(k for k in settings.extraction_ks if 1 + k + settings.extraction_m <= context)
    update["extraction_ks"] = ks
    update["nd_length"] = min(settings.nd_length, context - 1)
    counts = {
        "context": context,
        "documents": len(lengths),
        "documents_windowed": sum(n > update["max_tokens"] for n in lengths),
        "extraction_ks_dropped": [k for k in settings.extraction_ks if k not in ks],
    }
    settings = settings.model_copy(update=update)
    counts["window_stride"] = window_stride(settings)
    return settings, counts


def windowed_counts(settings: ProbeConfig, lengths: list[int]) -> dict:
    """The counts of documents longer than the scoring window (`settings.max_tokens`), or {} when
    every document fits (a memaudit run's documents usually do).

    >>> windowed_counts(ProbeConfig(max_tokens=64), [10, 80, 100])["documents_windowed"]
    2
    >>> windowed_counts(ProbeConfig(max_tokens=64), [10, 20])
    {}
    """
    n = sum(x > settings.max_tokens for x in lengths)
    if not n:
        return {}
    return {"context": settings.max_tokens, "documents": len(lengths), "documents_windowed": n,
            "window_stride": window_stride(settings), "extraction_ks_dropped": [], "window_of": "max_tokens"}


def window_stride(settings: ProbeConfig) -> int:
    """The stride of a long document's windows (default half the window), refused in one line
    unless it lies in 1..max_tokens - 1 (a stride of a whole window would leave each window's
    first token unscored).

    >>> window_stride(ProbeConfig(max_tokens=64)), window_stride(ProbeConfig(window_stride=48))
    (32, 48)
    """
    window = settings.max_tokens
    stride = settings.window_stride or max(1, window // 2)
    if stride >= window:
        raise ValueError(f"--window-stride {stride} must be smaller than the window of {window} "
                         f"tokens (the model's context or max_tokens); pass at most {window - 1}")
    return stride


def context_count(counts: dict) -> int:
    """Documents longer than the model's context: windowed, or truncated in a probes.json
    written before windows."""
    return counts.get("documents_windowed", counts.get("documents_truncated", 0))


def context_measure(counts: dict) -> str:
    """What happened to the documents longer than the model's context, in words."""
    if "documents_windowed" in counts:
        whose = ("probe.max_tokens" if counts.get("window_of") == "max_tokens" else
                 "the reference's context" if counts.get("reference_context") else "the model's context")
        return (f"documents scored in windows of {counts['context']} tokens ({whose}), "
                f"{counts.get('window_stride', counts['context'] // 2)} apart")
    return f"documents scored on their first {counts['context']} tokens (the model's context)"

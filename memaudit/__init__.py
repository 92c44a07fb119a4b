"""memaudit: measure what a language model memorized, and what privacy-preserving training removes."""

__version__ = "0.1.0"

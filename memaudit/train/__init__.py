"""Centralized training (PyTorch): the trainer, DP-SGD, Goldfish loss, checkpoint/resume.

Submodules import torch; this package itself stays light so `memaudit --help` is fast.
"""

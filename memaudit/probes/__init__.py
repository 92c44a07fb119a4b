"""Memorization probes: exposure, extraction (discoverable, Goldfish protocol, non-discoverable),
membership and user inference, PII, one-run ε audit.

`memaudit.probes.runner.run_probes(target, config)` runs the chosen probes (a `ProbeConfig`,
`runner.REGISTRY` maps each name to its probe) and returns the `probes.json` document. The
model-facing work (token log-probabilities, decoding) is in `scoring`; each probe module has
a pure function from score arrays to results (`exposure_result`, `discoverable_result`,
`completion_result`, `non_discoverable_result`, `goldfish_result`, `user_inference_result`,
`pii_result`, `run_membership`, `run_audit`), and every interval, test and correction is in
`stats`.
Earlier stages' files are read through `loaders`.
"""

from memaudit.config import PROBE_NAMES

PROBES = PROBE_NAMES  # one list of probe names, in config.py
SCHEMA = 1

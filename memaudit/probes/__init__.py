"""Memorization probes: exposure, extraction, membership and user inference, PII, one-run ε audit.

`memaudit.probes.runner.run_probes(target, settings)` runs the chosen probes and returns the
`probes.json` document; each probe module also exposes a pure function over scores so results
can be re-scored without a model.
"""

PROBES = ("exposure", "extraction", "membership", "user_inference", "pii", "audit")
SCHEMA = 1

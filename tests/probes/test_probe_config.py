"""One ProbeConfig: validated, frozen, shared by `memaudit probe` and the sweep."""

import pydantic
import pytest

from memaudit.config import PROBE_NAMES, ProbeConfig
from memaudit.probes.runner import REGISTRY


def test_defaults_registry_and_validation():
    c = ProbeConfig()
    assert c.probes == PROBE_NAMES == tuple(REGISTRY)
    assert c.extraction_ks == (32, 50) and c.extraction_m == 50 and c.user_docs is None
    with pytest.raises(pydantic.ValidationError, match="unknown probe 'expo'"):
        ProbeConfig(probes=("expo",))
    with pytest.raises(pydantic.ValidationError, match="FPR"):
        ProbeConfig(fprs=(0.0,))
    with pytest.raises(pydantic.ValidationError):
        ProbeConfig(canary_samples=4)  # extra="forbid": a typo is an error
    with pytest.raises(pydantic.ValidationError):
        c.seed = 3  # frozen


def test_sweep_probe_section_is_a_probe_config():
    from memaudit.sweep.config import SweepConfig

    s = SweepConfig(probe={"batch_size": 8, "probes": None, "extra": {"pii_max_items": 5, "n_boot": 50}})
    assert isinstance(s.probe, ProbeConfig)
    assert (s.probe.batch_size, s.probe.pii_max_items, s.probe.n_boot) == (8, 5, 50)
    assert s.probe.probes == PROBE_NAMES

"""run.json as the report reads it: which per-user algorithm a centralized DP run used."""

from __future__ import annotations

import pytest

from memaudit.probes.loaders import RunInfo
from memaudit.reports.build import mechanism_label


@pytest.mark.parametrize("backend, privacy, sampling, mechanism", [
    ("centralized", {"target_epsilon": 8, "unit": "user", "user_sampling": "els"}, "els", "DP-SGD (ELS)"),
    ("centralized", {"target_epsilon": 8, "unit": "user", "user_sampling": "uls"}, "uls", "DP-SGD (ULS)"),
    # a run written before privacy.user_sampling existed trained ULS, the only per-user algorithm then
    ("centralized", {"target_epsilon": 8, "unit": "user"}, "uls", "DP-SGD (ULS)"),
    ("centralized", {"target_epsilon": 8, "unit": "example", "user_sampling": "uls"}, None, "DP-SGD"),
    ("centralized", {"unit": "user", "user_sampling": "els"}, None, "none"),  # no DP: no algorithm
    ("federated", {"target_epsilon": 8, "unit": "user", "user_sampling": "uls"}, None, "DP-FedAvg"),
])
def test_the_per_user_algorithm_is_read_from_the_config(backend, privacy, sampling, mechanism):
    info = RunInfo.from_manifest({"backend": backend, "config": {"backend": backend, "privacy": privacy}})
    assert info.user_sampling == sampling and mechanism_label(info) == mechanism

"""grid.units: the centralized points' privacy unit; federated is always user-level."""

from __future__ import annotations

import pytest

from memaudit.errors import ConfigError
from memaudit.sweep.config import plan_points, point_config, sweep_config_from_dict


def test_units_multiply_the_centralized_dp_points_only():
    s = sweep_config_from_dict({"per_backend": {"centralized": {"privacy.max_examples_per_user": 2}},
                                "grid": {"backends": ["centralized", "federated"], "epsilons": ["inf", 4],
                                         "units": ["example", "user"]}})
    names = {p.name: p for p in plan_points(s)}
    assert set(names) == {"centralized-epsinf-s0", "centralized-eps4-s0", "centralized-eps4-user-s0",
                          "federated-epsinf-s0", "federated-eps4-s0"}
    assert point_config(s, names["centralized-eps4-user-s0"]).privacy.unit == "user"
    assert point_config(s, names["centralized-eps4-s0"]).privacy.unit == "example"
    assert names["centralized-eps4-user-s0"].unit == "user" and names["federated-eps4-s0"].unit is None


def test_example_only_units_with_the_federated_backend_are_refused():
    with pytest.raises(ConfigError, match="federated backend, which is always user-level") as e:
        sweep_config_from_dict({"grid": {"backends": ["centralized", "federated"], "epsilons": [4],
                                         "units": ["example"]}})
    assert "\n" not in str(e.value)


def test_user_unit_without_the_contribution_bound_is_refused():
    with pytest.raises(ConfigError, match="max_examples_per_user"):
        sweep_config_from_dict({"grid": {"backends": ["centralized"], "epsilons": [4], "units": ["user"]}})


def test_user_sampling_multiplies_the_centralized_per_user_dp_points_only():
    s = sweep_config_from_dict({"per_backend": {"centralized": {"privacy.max_examples_per_user": 2}},
                                "grid": {"backends": ["centralized", "federated"], "epsilons": ["inf", 4],
                                         "units": ["example", "user"], "user_sampling": ["els", "uls"]}})
    names = {p.name: p for p in plan_points(s)}
    assert set(names) == {"centralized-epsinf-s0", "centralized-eps4-s0", "centralized-eps4-user-els-s0",
                          "centralized-eps4-user-uls-s0", "federated-epsinf-s0", "federated-eps4-s0"}
    els, uls = names["centralized-eps4-user-els-s0"], names["centralized-eps4-user-uls-s0"]
    assert point_config(s, els).privacy.user_sampling == "els" and els.user_sampling == "els"
    assert point_config(s, uls).privacy.user_sampling == "uls" and uls.user_sampling == "uls"
    assert names["centralized-eps4-s0"].user_sampling is None and names["federated-eps4-s0"].user_sampling is None
    # one compute budget: the two algorithms feed the same training tokens
    assert els.tokens_seen == uls.tokens_seen


@pytest.mark.parametrize("grid, msg", [
    ({"backends": ["centralized"], "epsilons": [4], "user_sampling": ["els"]},
     "needs centralized in grid.backends and user in grid.units"),
    ({"backends": ["federated"], "epsilons": [4], "units": ["user"], "user_sampling": ["uls"]}, "needs centralized"),
    ({"backends": ["centralized"], "epsilons": [4], "units": ["user"], "user_sampling": ["els", "els"]},
     "must list els and/or uls once each"),
    ({"backends": ["centralized"], "epsilons": [4], "units": ["user"], "user_sampling": ["dp"]}, "user_sampling"),
])
def test_a_user_sampling_axis_it_cannot_apply_is_refused_in_one_line(grid, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        sweep_config_from_dict({"per_backend": {"centralized": {"privacy.max_examples_per_user": 2}}, "grid": grid})
    assert "\n" not in str(e.value)

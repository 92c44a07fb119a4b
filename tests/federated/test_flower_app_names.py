"""The module names a Flower App of memaudit's holds: one that memaudit writes now
(`memaudit.federated.flower.deploy.write_app`) and one written before the run wing moved the
apps to `memaudit.federated.flower.node` (it imports `memaudit.flower_node`) both load memaudit's
apps, and neither imports JAX (a SuperNode's ClientApp process pays no JAX start-up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memaudit.federated.flower.deploy import APP_MODULE, write_app

ROOT = Path(__file__).resolve().parents[2]
# the App module memaudit wrote before the run wing, word for word
BEFORE = ('"""memaudit on Flower: its ServerApp and ClientApp (memaudit.flower_node)."""\n'
          "from memaudit.flower_node import client_app, server_app\n\n"
          '__all__ = ["client_app", "server_app"]\n')


@pytest.mark.parametrize("written", ["now", "before"])
def test_a_flower_app_loads_memaudits_apps_without_jax(tmp_path, written):
    if written == "now":
        write_app(tmp_path)
    else:
        (tmp_path / f"{APP_MODULE}.py").write_text(BEFORE)
    code = (f"import sys, {APP_MODULE} as app, memaudit.federated.flower.node as node; "
            "assert app.client_app is node.client_app and app.server_app is node.server_app; "
            "assert node.client_app is not None and node.server_app is not None; "
            "print(sorted(m for m in ('jax', 'flax', 'optax', 'torch') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"

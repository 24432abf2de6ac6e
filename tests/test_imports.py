"""`zoo` loads its subpackages when first used (PEP 562): importing one layer loads the layers, not the planner, the
models or the checkpoint converters; the package's names still work as attributes."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT, cpu_env


def test_importing_a_layer_loads_no_planner_model_or_converter():
    code = ("import sys, zoo.layers.mlp; "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['zoo', 'plan'], ['zoo', 'models'], "
            "['zoo', 'hf'], ['zoo', 'recipe'])))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_package_names_are_attributes():
    import zoo
    from zoo.plan.types import Plan
    from zoo.recipe import Recipe
    assert zoo.Recipe is Recipe and zoo.Plan is Plan and zoo.plan.plan and zoo.models.llama3 and zoo.layers.MLP
    assert zoo.from_hf.__module__ == "zoo.hf.load" and zoo.to_hf.__module__ == "zoo.hf.save"
    assert all(getattr(zoo, n) is not None for n in zoo.__all__)
    with pytest.raises(AttributeError, match="no_such_name"):
        zoo.__getattr__("no_such_name")

"""The recipe sets (`recipes/*.py`) are data beside the training application (`recipes/train/`), not part of it: no
set imports the application, so a user's own loop takes a recipe without loading the main job."""
import ast
import pathlib
import subprocess
import sys

from tests.helpers import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imported(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_no_recipe_set_imports_the_application():
    sets = sorted((ROOT / "recipes").glob("*.py"))
    assert {p.stem for p in sets} >= {"registry", "context", "llama3"}
    found = {p.name: sorted(m for m in imported(p) if m == "recipes.train" or m.startswith("recipes.train."))
             for p in sets}
    assert not {k: v for k, v in found.items() if v}, found


def test_taking_a_recipe_loads_no_part_of_the_application():
    code = ("import sys, recipes; from recipes.registry import recipes_of\n"
            "from zoo.models import registry\n"
            "for f in registry.FAMILIES.values(): recipes_of(f)\n"
            "print(sorted(m for m in sys.modules if m.startswith('recipes.train')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

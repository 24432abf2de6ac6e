"""What a first run meets when an input is wrong or the output is piped: the message names the flag and what to
give instead (a file that is not there, a recipe of another family), and the plan's tables keep their rows whole
when stdout is not a terminal. Nothing is built or compiled."""
from __future__ import annotations

import pytest

from recipes import registry
from recipes.train import plan as plan_cli
from recipes.train.settings import cli
from tests.train.cli_runs import RUN, main
from zoo.models.registry import FAMILIES


def test_a_missing_data_file_names_the_flag(tmp_path, capsys):
    """`--data missing.bin`, and the text example's `--data corpus/ --tokenizer DIR` without its corpus: the flag
    and the path, not an internal class or "read as a token file"."""
    for args in (["--data", tmp_path / "missing.bin"], ["--data", tmp_path / "corpus"],
                 ["--data", tmp_path / "corpus", "--tokenizer", tmp_path]):
        rc, out, err = main(RUN + args, capsys)
        assert rc == 2 and f"--data '{args[1]}': no such file or directory" in err, err
        assert "TokenFile" not in err and "read as" not in err and "Traceback" not in err


def test_a_recipe_of_another_family_names_its_family_and_this_familys_recipes():
    """Every recipe name of every family, asked of another family that lacks it: the message names the family that
    has it (--model) and lists the asked family's recipes; a typo gets the close name."""
    fams = [f for f in FAMILIES.values() if f.name in {m.name for m in _with_recipes()}]
    assert len(fams) >= 2
    for fam in fams:
        for other in fams:
            for name in registry.recipes_of(other):
                if name in registry.recipes_of(fam):
                    continue
                with pytest.raises(ValueError) as e:
                    cli.recipe(fam, name)
                msg = str(e.value)
                assert f"--recipe {name!r} is not a {fam.name} recipe (it is " in msg and other.name in msg
                assert msg.endswith("choose one of: " + ", ".join(registry.recipes_of(fam)))
    llama = cli.family("llama3")
    with pytest.raises(ValueError, match=r"'mla_moe_offload' is not a llama3 recipe \(it is deepseek_v3's: --model "
                                         r"deepseek_v3\); choose one of: .*qkv_offload"):
        cli.recipe(llama, "mla_moe_offload")
    with pytest.raises(ValueError, match=r"\(did you mean qkv_offload\?\)"):
        cli.recipe(llama, "qkv_offlaod")


def _with_recipes():
    out = []
    for fam in FAMILIES.values():
        try:
            registry.recipes_of(fam)
        except ValueError:
            continue
        out.append(fam)
    return out


def test_piped_plan_tables_do_not_wrap_at_80_columns(capsys, monkeypatch):
    """`python -m recipes.train.plan ... | cat`: stdout is not a terminal; each table row stays on one line (rich would
    wrap them at 80 columns)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    rc = plan_cli.main(["--model", "llama3", "--preset", "tiny", "--recipe", "qkv_offload", "--batch", "8", "--seq",
                        "4096", "--peak", "none", "--mesh", "fsdp=2,tp=2"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    assert sum(len(line) > 80 for line in lines) > 10   # the tag table is 85 columns wide
    assert any("recompute/step" in line and "host/layer" in line for line in lines), out
    assert any("mlpwo" in line and "not a residual" in line for line in lines), out

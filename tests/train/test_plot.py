"""`python -m recipes.train.plan --plot`: the chart is written where the command says (a folder: a file in it; no
suffix: PNG under that name), a place it cannot write is a one-line error before anything is planned, --max-batch is
refused, the chart's plans are made exactly as the printed one (optimizer placement, accumulation, budget), and a bar
far above the others is cut at a readable axis."""
import json

import pytest

pytest.importorskip("matplotlib")

import zoo  # noqa: E402
from recipes.train import plan as plan_cli  # noqa: E402
from recipes.train.watching import plot  # noqa: E402

BASE = ["--model", "llama3", "--preset", "tiny", "--batch", "2", "--seq", "64", "--peak", "none"]


@pytest.mark.slow
def test_the_chart_is_written_where_the_command_says(tmp_path, capsys):
    folder = tmp_path / "charts"
    folder.mkdir()
    assert plan_cli.main([*BASE, "--plot", str(folder)]) == 0
    written = folder / "llama3-tiny.png"
    assert f"wrote {written}:" in capsys.readouterr().out
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bare = tmp_path / "chart"
    plan_cli.main([*BASE, "--plot", str(bare)])
    assert f"wrote {bare}:" in capsys.readouterr().out and bare.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart", "charts"]


def test_a_place_it_cannot_write_is_refused_before_planning(tmp_path, capsys, monkeypatch):
    def never(*a, **k):
        raise AssertionError("planned before the output was checked")
    monkeypatch.setattr(zoo, "plan", never)
    (tmp_path / "file").write_text("x")
    for where, message in ((tmp_path / "nodir" / "chart.png", "nodir does not exist"),
                           (tmp_path / "file" / "chart.png", "file is not a folder"),
                           (tmp_path / "chart.xyz", "matplotlib does not write .xyz files")):
        with pytest.raises(SystemExit) as exit_:
            plan_cli.main([*BASE, "--plot", str(where)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        plan_cli.main([*BASE, "--plot", str(tmp_path / "c.png"), "--max-batch"])
    assert "--plot draws every recipe at one batch and --max-batch searches" in capsys.readouterr().err

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(plot.tempfile, "NamedTemporaryFile", read_only)   # root writes anywhere: simulated
    with pytest.raises(SystemExit):
        plan_cli.main([*BASE, "--plot", str(tmp_path / "c.png")])
    assert f"--plot {tmp_path / 'c.png'} cannot be written: Permission denied" in capsys.readouterr().err


def test_the_chart_draws_the_plans_made_as_the_printed_one(tmp_path, capsys, monkeypatch):
    drawn = {}
    monkeypatch.setattr(plot, "recipes_chart", lambda plans, path, title: drawn.update(plans, title=title) or "")
    argv = [*BASE, "--recipe", "qkv_offload", "--opt-state", "host", "--grad-accum", "2", "--hbm", "1",
            "--json", "--plot", str(tmp_path / "c.png")]
    assert plan_cli.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    title = drawn.pop("title")
    assert "grad accum 2, opt state host" in title
    assert printed["grad_accum"] == 2                  # the printed recipe's bar is the printed plan
    assert printed == json.loads(json.dumps(zoo.plan.to_json(drawn["qkv_offload"])))
    for name, p in drawn.items():   # every recipe: moments on the host, float32 sums, the same budget
        assert p.state.optimizer_host and p.state.accum > 0 and p.hbm_budget == 2 ** 30, name
        hbm, host = plot.tag_bytes(p)
        assert host["model state"] == p.state.host > 0


def test_a_bar_far_above_the_others_is_cut_at_a_readable_axis():
    hbm = [290.0, 48.0, 47.0, 50.0, 45.0, 46.0]      # none's bar, and the others'
    host = [0.0, 0.5, 2.0, 1.0, 0.2, 9.0]           # small host bars do not pull the scale down
    top, cut = plot.axis_top(hbm, host, budget=None)
    assert cut and top == pytest.approx(55.0)
    top, cut = plot.axis_top(hbm, host, budget=104.9)   # the budget stays on the chart
    assert cut and top == pytest.approx(1.1 * 104.9)
    assert plot.axis_top([60.0, 48.0, 47.0, 50.0], [], budget=None) == (pytest.approx(66.0), False)

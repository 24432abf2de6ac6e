"""Dropped copies (capacity dispatch) in the main job: summed over every MoE stack, logged per step in the metrics,
and warned about above --max-drop-warn."""
import jax.numpy as jnp
import pytest

from zoo.layers.moe import MoEAux


def test_moe_drops_sums_every_moe_stack():
    from zoo.train_step import moe_drops
    moe_layers = MoEAux(load=jnp.ones((2, 8)) * 5, balance_loss=jnp.zeros(2), dropped=jnp.array([3, 4]))
    aux = {"dense_layers": {}, "moe_layers": moe_layers}
    dropped, routed = moe_drops(aux)
    assert (int(dropped), int(routed)) == (7, 80)
    assert tuple(map(int, moe_drops({"layers": {}}))) == (0, 0)


@pytest.mark.slow
def test_the_main_job_logs_and_warns_about_dropped_copies(tmp_path):
    import json

    from rich.console import Console

    from recipes.train import loop
    out = tmp_path / "m.jsonl"
    console = Console(record=True, width=200)
    settings = loop.RunConfig(model="deepseek_v3", preset="tiny", steps=2, batch=2, seq=16, log_every=1,
                              metrics=str(out), overrides=(("moe_backend", "capacity"), ("capacity_factor", 0.5),
                                                         ("num_layers", 1), ("first_dense_layers", 0)))
    loop.run(settings, console=console)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["dropped"] > 0 and 0 < r["drop_fraction"] < 1 for r in rows)
    assert "capacity dispatch dropped" in console.export_text()
    # the same steps' figures under --max-drop-warn 1.0 (the watch the job builds from it): nothing said
    from recipes.train.watching.watch import DropWatch
    for threshold, said in ((settings.max_drop_warn, True), (1.0, False)):
        again = Console(record=True, width=200)
        watch = DropWatch(again, threshold=threshold)
        for r in rows:   # the step's metrics as the job hands them to its watch: copies dropped and routed
            watch.check(r["step"], {"dropped": r["dropped"], "routed": round(r["dropped"] / r["drop_fraction"])})
        watch.summary()
        assert ("capacity dispatch dropped" in again.export_text()) == said, threshold

"""The main job's training defaults per preset (recipes.train.settings.config): the peak learning rate and the warm-up
from each family's published runs, the tiny preset's CPU rate, a full-size rate for presets with no published schedule,
explicit --lr and --warmup winning, and --opt-dtype checked."""
import pytest

from recipes.train import loop
from recipes.train.settings import config


def test_training_defaults_per_preset():
    tiny = loop.RunConfig()
    assert (tiny.peak_lr, tiny.total_warmup) == (3e-3, 6)   # the README's CPU run, unchanged
    assert loop.RunConfig(model="llama3", preset="llama3_1_8b").peak_lr == 3e-4
    assert loop.RunConfig(model="llama3", preset="llama3_1_70b").peak_lr == 1.5e-4
    big = loop.RunConfig(model="llama3", preset="llama3_1_405b", steps=1_200_000)
    assert (big.peak_lr, big.total_warmup) == (8e-5, 8000)   # the Llama 3 paper's 405B run
    assert loop.RunConfig(model="deepseek_v3", preset="deepseek_v3_671b", steps=100).total_warmup == 10
    assert loop.RunConfig(model="deepseek_v3", preset="deepseek_v3_671b", steps=10**6).total_warmup == 2000
    assert loop.RunConfig(model="deepseek_v3", preset="deepseek_v3_671b").peak_lr == 2.2e-4
    assert loop.RunConfig(preset="llama3_1_8b", lr=1e-3, warmup=3).peak_lr == 1e-3   # explicit wins
    assert loop.RunConfig(preset="llama3_1_8b", lr=1e-3, warmup=3).total_warmup == 3
    assert loop.RunConfig(preset="llama3_1_8b").identity()["lr"] == 3e-4
    assert config.for_preset("llama3", "some_new_preset").lr == config.FULL_SIZE[0]
    # a family's published schedules are its own: a preset of one family is not another's
    assert loop.RunConfig(model="qwen3", preset="qwen3_8b").peak_lr == config.FULL_SIZE[0]
    assert config.for_preset("deepseek_v3", "tiny").lr == 3e-3
    with pytest.raises(ValueError, match="--opt-dtype"):
        loop.RunConfig(opt_dtype="int8")

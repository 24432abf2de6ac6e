"""The attention kernel per device and config: auto takes mosaic_cudnn on one Hopper device with tokamax and cuDNN on
another GPU, for GQA and MLA, falls back with a warning where cuDNN cannot serve, an explicit choice wins or is a
ValueError, and a built model says what each layer runs.
(The main job's refusal of cuDNN on the CPU is the application's: tests/train/test_attention_choice_cli.py.)"""
import re

import jax
import pytest
from flax import nnx

import zoo
from tests.helpers import fake_gpu
from zoo.layers import attention, attention_kernel

CFG = zoo.models.DeepSeekV3Config.preset("tiny")
CPU = jax.devices()[0]


def _tokamax(monkeypatch, installed: bool) -> None:
    """tokamax importable (its Mosaic GPU attention module a stand-in) or not, whatever this machine has."""
    def missing():
        raise ImportError("No module named 'tokamax'")
    monkeypatch.setattr(attention_kernel, "_mosaic_module", (lambda: object()) if installed else missing)


def test_attention_auto_takes_cudnn_on_a_gpu_for_gqa_and_mla(monkeypatch):
    _tokamax(monkeypatch, installed=False)
    llama = zoo.models.LlamaConfig.preset("llama3_1_8b")
    ds = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b")
    assert attention.kernel_head_dim(ds) == 192
    for cfg in (llama, ds):
        assert attention_kernel.resolve_impl(cfg, fake_gpu()).impl == "cudnn"
        assert attention_kernel.resolve_impl(cfg, CPU).impl == "xla"


def test_attention_auto_on_a_gpu_that_cudnn_cannot_serve_warns_that_the_xla_kernel_runs():
    ds = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b")
    with pytest.warns(UserWarning, match="the XLA kernel on NVIDIA A100"):
        choice = attention_kernel.resolve_impl(ds, fake_gpu(cc="8.0", kind="NVIDIA A100"))  # 192 > 128 before Hopper
    assert choice.impl == "xla" and "XLA kernel" in choice.reason and "up to 128" in choice.reason
    with pytest.warns(UserWarning, match="float32"):
        assert attention_kernel.resolve_impl(zoo.models.LlamaConfig.preset("tiny"), fake_gpu()).impl == "xla"


def test_explicit_attention_choices_win_and_an_impossible_one_is_a_value_error():
    cfg = zoo.models.LlamaConfig.preset("llama3_1_8b", attention_impl="xla")
    assert attention_kernel.resolve_impl(cfg, fake_gpu()).impl == "xla"
    with pytest.raises(ValueError, match="attention_impl='cudnn' cannot run here: cuDNN runs only on NVIDIA"):
        attention_kernel.resolve_impl(zoo.models.LlamaConfig.preset("tiny", attention_impl="cudnn"), CPU)
    with pytest.raises(ValueError, match="cannot run here: cuDNN flash attention takes bf16/fp16"):
        attention_kernel.resolve_impl(zoo.models.LlamaConfig.preset("tiny", attention_impl="cudnn"), fake_gpu())


def test_a_built_model_says_which_attention_each_layer_runs():
    model = zoo.models.deepseek_v3(CFG, rngs=nnx.Rngs(0))
    got = attention.attention_impls(model)
    assert sorted(got) == ["dense_layers/layers/attn", "moe_layers/layers/attn"]
    assert {c.impl for c in got.values()} == {"xla"}



def test_attention_auto_takes_mosaic_cudnn_on_one_hopper_device_with_tokamax(monkeypatch):
    """Auto takes "mosaic_cudnn" (tokamax's Mosaic GPU forward, cuDNN's backward) where it runs and the run has one
    device; cuDNN's kernel with several devices (XLA does not partition the Mosaic forward), before Hopper, for
    MLA's head dim 192, and without tokamax."""
    llama = zoo.models.LlamaConfig.preset("llama3_1_8b")
    ds = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b")
    _tokamax(monkeypatch, installed=True)
    monkeypatch.setattr(attention_kernel.jax, "device_count", lambda: 1)
    choice = attention_kernel.resolve_impl(llama, fake_gpu())
    assert choice.impl == "mosaic_cudnn" and "one device" in choice.reason
    assert attention_kernel.resolve_impl(ds, fake_gpu()).impl == "cudnn"
    assert attention_kernel.resolve_impl(llama, fake_gpu(cc="8.0", kind="NVIDIA A100")).impl == "cudnn"
    monkeypatch.setattr(attention_kernel.jax, "device_count", lambda: 8)
    assert attention_kernel.resolve_impl(llama, fake_gpu()).impl == "cudnn"
    monkeypatch.setattr(attention_kernel.jax, "device_count", lambda: 1)
    _tokamax(monkeypatch, installed=False)
    assert attention_kernel.resolve_impl(llama, fake_gpu()).impl == "cudnn"


def test_mosaic_cudnn_asked_for_runs_where_it_can_and_refuses_by_name_what_it_cannot_serve(monkeypatch):
    """Asked for, "mosaic_cudnn" runs on a Hopper GPU with tokamax for head dims 64 and 128 (with several devices
    too: the user's choice), and is otherwise one ValueError naming the reason."""
    llama = zoo.models.LlamaConfig.preset("llama3_1_8b", attention_impl="mosaic_cudnn")
    ds = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b", attention_impl="mosaic_cudnn")
    _tokamax(monkeypatch, installed=True)
    assert str(attention_kernel.resolve_impl(llama, fake_gpu())) == "mosaic_cudnn (asked for)"
    refusals = {"cuDNN runs only on NVIDIA GPUs": (llama, CPU),
                "its forward is written for Hopper (compute capability 9.0), and the device's is 8.0":
                    (llama, fake_gpu(cc="8.0", kind="NVIDIA A100")),
                "its forward takes head dims (64, 128), and the kernel's head dim is 192": (ds, fake_gpu())}
    for why, (cfg, device) in refusals.items():
        with pytest.raises(ValueError, match=re.escape("attention_impl='mosaic_cudnn' cannot run here: " + why)):
            attention_kernel.resolve_impl(cfg, device)

    _tokamax(monkeypatch, installed=False)
    with pytest.raises(ValueError, match=r"tokamax is not installed \(No module named 'tokamax'; pip install tokamax"):
        attention_kernel.resolve_impl(llama, fake_gpu())

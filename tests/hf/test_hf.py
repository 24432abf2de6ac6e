"""Hugging Face checkpoints without torch: zoo -> safetensors -> zoo round trips, config mapping against the
published Llama 3.1 config, sharded placement, and bad checkpoints refused before anything is loaded."""
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import zoo
from zoo.hf import files as hf_files
from zoo.hf import load as hf_load
from zoo.layers import WavelengthScaling
from zoo.models.deepseek_v3 import hf as deepseek_hf
from zoo.models.llama3 import hf as llama_hf

TINY = dict(vocab_size=48, dim=24, num_layers=2, num_heads=3, num_kv_heads=1, head_dim=8, mlp_dim=40,
            rope_scaling=WavelengthScaling(original_max_position_embeddings=16), dtype="float32", param_dtype="float32")


def random_params(cfg, build, seed=0):
    """A model of `cfg` with random parameters drawn by NumPy into its abstract state: no compilation, so each
    new config costs nothing (the zoo's own initializers compile per shape)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    flat = [(p, v.replace(jnp.asarray(0.3 * rng.standard_normal(v.shape), v.dtype)))
            for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def llama(seed=0, **overrides):
    return random_params(zoo.models.LlamaConfig(**{**TINY, **overrides}), zoo.models.llama3, seed)


def deepseek(seed=0, **overrides):
    """A tiny DeepSeek-V3: one dense layer, two MoE layers, YaRN, 2 groups of 2 experts (1 kept), random biases."""
    from zoo.layers import YarnScaling
    from zoo.models.deepseek_v3 import model as ds
    cfg = ds.DeepSeekV3Config.preset("tiny", **{**dict(
        vocab_size=48, dim=24, num_layers=3, first_dense_layers=1, num_heads=3, q_lora_rank=12, kv_lora_rank=8,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, mlp_dim=40, num_experts=4, num_experts_per_tok=2,
        moe_mlp_dim=12, n_group=2, topk_group=1, moe_backend="ragged_dot",
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16)), **overrides})
    return random_params(cfg, ds.deepseek_v3, seed)


def params(model):
    """Every variable of the model (parameters and DeepSeek's routing biases), by path."""
    return {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model))}


def assert_identical(a, b):
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and pa[k].shape == pb[k].shape, k
        assert np.array_equal(np.asarray(pa[k]), np.asarray(pb[k])), k


# -- round trips ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,shard_bytes", [
    ({}, 4000),                                                       # several shards + index, Llama 3 RoPE
    (dict(tie_embeddings=True, num_heads=6, num_kv_heads=3, head_dim=4, num_layers=3, rope_scaling=None,
          param_dtype="bfloat16", dtype="bfloat16"), 2**30),          # one file, tied, odd heads, bf16
])
def test_round_trip_is_bit_identical(tmp_path, overrides, shard_bytes):
    model = llama(**overrides)
    zoo.to_hf(model, tmp_path, max_shard_bytes=shard_bytes)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert (len(files) > 1) == (tmp_path / hf_files.INDEX).exists()
    back = zoo.from_hf(tmp_path)
    assert back.config == model.config
    assert_identical(back, model)
    if model.config.tie_embeddings:   # same config and parameters: the same model (logits: test_hf_parity.py)
        assert back.lm_head is None


def test_written_layout_is_transformers(tmp_path):
    """HF names and [out, in] layouts, heads flattened head-major; the index lists every tensor once."""
    model = llama()
    zoo.to_hf(model, tmp_path, max_shard_bytes=4000)
    index = json.loads((tmp_path / hf_files.INDEX).read_text())["weight_map"]
    tensors = {}
    for name in set(index.values()):
        tensors.update(safetensors.numpy.load_file(tmp_path / name))
    assert set(tensors) == set(index)
    assert "lm_head.weight" in tensors and len(tensors) == 3 + 2 * 9
    p, L = params(model), ("layers", "layers")
    q = np.asarray(p[L + ("attn", "q_proj", "kernel")][1])                      # [D, H, hd]
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.q_proj.weight"][2 * 8 + 5], q[:, 2, 5])
    o = np.asarray(p[L + ("attn", "o_proj", "kernel")][0])                      # [H, hd, D]
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.o_proj.weight"][:, 1 * 8 + 3], o[1, 3])
    np.testing.assert_array_equal(tensors["lm_head.weight"], np.asarray(p[("lm_head", "proj", "kernel")]).T)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["rope_scaling"]["rope_type"] == "llama3"


def test_dtype_argument_casts_parameters(tmp_path):
    model = llama()
    zoo.to_hf(model, tmp_path)
    bf = zoo.from_hf(tmp_path, dtype=jnp.bfloat16)
    assert bf.config.param_dtype == "bfloat16" and bf.config.dtype == "bfloat16"
    for k, v in params(bf).items():
        assert v.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(v), np.asarray(params(model)[k].astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="dtype"):
        zoo.from_hf(tmp_path, dtype=jnp.int32)
    recipe = zoo.Recipe("qkv", offload=("query_proj", "key_proj", "value_proj"))
    assert zoo.from_hf(tmp_path, recipe=recipe).recipe == recipe
    with pytest.raises(ValueError, match="moe_mlpwi_0"):   # a recipe for tags this model never emits
        zoo.from_hf(tmp_path, recipe=zoo.Recipe("moe", offload=("moe_mlpwi_0",)))


def test_to_hf_refuses_a_directory_with_a_checkpoint(tmp_path):
    zoo.to_hf(llama(), tmp_path)
    with pytest.raises(ValueError, match="is not empty"):
        zoo.to_hf(llama(), tmp_path)


# -- placement ------------------------------------------------------------------------------------------------

def test_parameters_land_on_their_mesh_sharding(tmp_path):
    model = llama()
    zoo.to_hf(model, tmp_path)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    rules = [("heads", "model"), ("kv_heads", "model"), ("mlp", "model"), ("vocab", "model"), ("embed", "data")]
    loaded = zoo.from_hf(tmp_path, mesh=mesh, rules=rules)
    p, L = params(loaded), ("layers", "layers")
    assert p[L + ("attn", "q_proj", "kernel")].sharding == NamedSharding(mesh, P(None, "data", "model", None))
    assert p[("embed", "embedding")].sharding == NamedSharding(mesh, P("model", "data"))
    assert_identical(loaded, model)
    zoo.to_hf(loaded, tmp_path / "again")     # sharded arrays write the same checkpoint
    assert_identical(zoo.from_hf(tmp_path / "again"), model)
    with jax.set_mesh(mesh):   # the active mesh is used when none is passed; default rules: the zoo's
        q = params(zoo.from_hf(tmp_path))[L + ("attn", "q_proj", "kernel")]
    assert q.sharding.spec == P(None, None, None, None)   # a mesh without the zoo's axes: replicated
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        zoo.from_hf(tmp_path, mesh=mesh, rules=[("embed", "fsdp")])


# -- config mapping -------------------------------------------------------------------------------------------

# The published meta-llama/Llama-3.1-8B config.json (transformers 4.43 spelling).
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}


def test_published_llama_config_maps_to_the_preset():
    cfg = llama_hf.from_hf(LLAMA_3_1_8B, param_dtype="bfloat16")
    assert cfg == zoo.models.LlamaConfig.preset("llama3_1_8b", param_dtype="bfloat16", dtype="bfloat16")
    back = llama_hf.to_hf(cfg)
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rope_theta",
                  "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "vocab_size", "max_position_embeddings"):
        assert back[field] == LLAMA_3_1_8B[field], field


def test_transformers5_rope_parameters_spelling():
    hf = {k: v for k, v in LLAMA_3_1_8B.items() if k not in ("rope_scaling", "rope_theta")}
    hf["rope_parameters"] = {**LLAMA_3_1_8B["rope_scaling"], "rope_theta": 500000.0}
    assert llama_hf.from_hf(hf, param_dtype="float32") == llama_hf.from_hf(
        LLAMA_3_1_8B, param_dtype="float32")
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = llama_hf.from_hf(hf, param_dtype="float32")
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0


def test_full_size_key_map_matches_the_published_shapes():
    """Llama 3.1 8B: HF tensor shapes read off the zoo's abstract model (nothing allocated)."""
    cfg = zoo.models.LlamaConfig.preset("llama3_1_8b")
    model = nnx.eval_shape(lambda: zoo.models.llama3(cfg, rngs=nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    shapes = {k: e.hf_shape(flat[e.path].shape) for e in llama_hf.keys(cfg) for k in e.keys()}
    assert len(shapes) == 3 + 32 * 9
    assert shapes["model.layers.31.self_attn.q_proj.weight"] == (4096, 4096)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (4096, 4096)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (4096, 14336)
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (128256, 4096)


# -- bad checkpoints ------------------------------------------------------------------------------------------

@pytest.fixture
def ckpt(tmp_path):
    zoo.to_hf(llama(), tmp_path, max_shard_bytes=4000)
    return tmp_path


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensor(path, key, fn):
    """Rewrite the shard holding `key` with fn(tensor) in its place (fn returns None to drop it)."""
    name = json.loads((path / hf_files.INDEX).read_text())["weight_map"][key]
    tensors = safetensors.numpy.load_file(path / name)
    new = fn(tensors.pop(key))
    if new is not None:
        tensors[key] = new
    safetensors.numpy.save_file(tensors, path / name, metadata={"format": "pt"})


BAD = {
    "missing tensor": (lambda p: edit_tensor(p, "model.layers.1.mlp.up_proj.weight", lambda t: None),
                       "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    "wrong shape": (lambda p: edit_tensor(p, "model.layers.0.self_attn.k_proj.weight", lambda t: t[:-1]),
                    "'model.layers.0.self_attn.k_proj.weight' has shape \\[7, 24\\]"),
    "integer tensor": (lambda p: edit_tensor(p, "model.norm.weight", lambda t: t.astype(np.int32)),
                       "'model.norm.weight' has dtype I32"),
    "unexpected tensor": (lambda p: edit_tensor(p, "model.norm.weight",
                                                lambda t: t) or safetensors.numpy.save_file(
        {"model.layers.0.self_attn.q_proj.bias": np.zeros(24, np.float32)}, p / "extra.safetensors"), None),
    "unknown architecture": (lambda p: edit_config(p, architectures=["MistralForCausalLM"], model_type="mistral"),
                             "MistralForCausalLM"),
    "fewer layers than tensors": (lambda p: edit_config(p, num_hidden_layers=1),
                                  "'model.layers.1."),
    "more layers than tensors": (lambda p: edit_config(p, num_hidden_layers=3),
                                 "missing tensor 'model.layers.2.self_attn.q_proj.weight'"),
    "hidden size disagrees": (lambda p: edit_config(p, hidden_size=32, head_dim=8),
                              "'model.embed_tokens.weight' has shape \\[48, 24\\]"),
    "kv heads disagree": (lambda p: edit_config(p, num_key_value_heads=3),
                          "'model.layers.0.self_attn.k_proj.weight'"),
    "tied but a different head": (lambda p: edit_config(p, tie_word_embeddings=True), "tie_word_embeddings"),
    "attention bias": (lambda p: edit_config(p, attention_bias=True), "attention_bias"),
    "mlp bias": (lambda p: edit_config(p, mlp_bias=True), "mlp_bias"),
    "activation": (lambda p: edit_config(p, hidden_act="gelu"), "hidden_act"),
    "rope type": (lambda p: edit_config(p, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                  "rope_scaling.rope_type='dynamic'"),
    "rope field": (lambda p: edit_config(p, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0, "beta_fast": 3.0,
                                                           "original_max_position_embeddings": 16}), "beta_fast"),
    "missing field": (lambda p: edit_config(p, vocab_size=None), "vocab_size"),
    "architectures contradict model_type": (lambda p: edit_config(p, architectures=["Qwen3ForCausalLM"]),
                                            "config.json: architectures=\\['Qwen3ForCausalLM'\\] names "
                                            "Qwen3ForCausalLM, whose model_type is 'qwen3', but model_type='llama': "
                                            "transformers goes by model_type and would build LlamaForCausalLM"),
    "no positions": (lambda p: edit_config(p, max_position_embeddings=0),
                     "^config.json: max_position_embeddings must be a positive int, got 0$"),
    "bad config value": (lambda p: edit_config(p, num_key_value_heads=2), "num_kv_heads=2 must divide"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_refused_before_loading(ckpt, case, monkeypatch):
    corrupt, message = BAD[case]
    corrupt(ckpt)
    if message is None:  # the unexpected tensor is in a file the index does not list: add it
        index = json.loads((ckpt / hf_files.INDEX).read_text())
        index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = "extra.safetensors"
        (ckpt / hf_files.INDEX).write_text(json.dumps(index))
        message = "'model.layers.0.self_attn.q_proj.bias'"

    def no_loading(*args, **kwargs):
        raise AssertionError("from_hf started loading tensors before the checkpoint was checked")

    monkeypatch.setattr(hf_load, "stream", no_loading)
    with pytest.raises(ValueError, match=message):
        zoo.from_hf(ckpt)


def test_a_checkpoints_context_bounds_the_model_and_the_training_step(ckpt):
    """max_position_embeddings 8: the model refuses 32 positions, called or traced (a static shape), and so does
    the training step, as the main job and the planner do; `max_seq_len=N` raises it."""
    import optax

    from zoo.optim import make_optimizer
    from zoo.train_step import train_step
    edit_config(ckpt, max_position_embeddings=8)
    model = zoo.from_hf(ckpt)
    assert model.config.max_seq_len == 8
    tokens = jnp.zeros((1, 32), jnp.int32)
    refusal = "sequence length 32 is longer than LlamaConfig.max_seq_len=8 "
    model(tokens[:, :8])
    with pytest.raises(ValueError, match=refusal):
        model(tokens)
    with pytest.raises(ValueError, match=refusal):
        jax.jit(lambda t: model(t))(tokens)
    optimizer = make_optimizer(model, optax.constant_schedule(1e-3), clip=1.0, weight_decay=0.0)
    batch = {"tokens": jnp.zeros((1, 33), jnp.int32), "weights": jnp.ones((1, 32), jnp.float32)}
    with pytest.raises(ValueError, match=refusal):
        train_step(model, optimizer, batch)
    longer = zoo.models.llama3(dataclasses.replace(model.config, max_seq_len=32), rngs=nnx.Rngs(0))
    assert longer(tokens).shape[:2] == (1, 32)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        zoo.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    with pytest.raises(ValueError, match="safetensors"):
        zoo.from_hf(tmp_path)


# -- DeepSeek-V3 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, dict(first_dense_layers=0, num_layers=2, tie_embeddings=True,
                                                rope_scaling=None, rope_interleave=False, param_dtype="bfloat16",
                                                dtype="bfloat16")], ids=["1dense-yarn", "allmoe-tied-bf16"])
def test_deepseek_round_trip_is_bit_identical(tmp_path, overrides):
    model = deepseek(**overrides)
    zoo.to_hf(model, tmp_path, max_shard_bytes=6000)
    back = zoo.from_hf(tmp_path)
    assert back.config == dataclasses.replace(model.config, moe_backend=back.config.moe_backend)
    assert_identical(back, model)
    bias = params(back)[("moe_layers", "layers", "mlp", "gate", "e_score_correction_bias")]
    assert bias.dtype == jnp.float32 and bias.shape == (model.config.num_moe_layers, 4)


def test_deepseek_written_layout(tmp_path):
    """Published layout: one tensor per expert, [out, in]; the bias as is; layers numbered across both stacks."""
    model = deepseek()
    zoo.to_hf(model, tmp_path)
    t = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    p = params(model)
    assert "model.layers.0.mlp.gate_proj.weight" in t and "model.layers.0.mlp.gate.weight" not in t
    np.testing.assert_array_equal(t["model.layers.2.mlp.experts.3.down_proj.weight"],
                                  np.asarray(p[("moe_layers", "layers", "mlp", "experts", "down_proj")][1, 3]).T)
    np.testing.assert_array_equal(t["model.layers.1.mlp.gate.e_score_correction_bias"],
                                  np.asarray(p[("moe_layers", "layers", "mlp", "gate", "e_score_correction_bias")][0]))
    np.testing.assert_array_equal(t["model.layers.1.self_attn.q_b_proj.weight"][1 * 12 + 9],   # head 1, rope col 1
                                  np.asarray(p[("moe_layers", "layers", "attn", "q_b_proj", "kernel")][0, :, 1, 9]))
    assert len(t) == 3 + 1 * (7 + 2 + 3) + 2 * (7 + 2 + 2 + 3 * 4 + 3)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_routed_experts"] == 4 and cfg["num_nextn_predict_layers"] == 0


# The published deepseek-ai/DeepSeek-V3 config.json (its FP8 quantization_config taken out: see the test below).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


def test_published_deepseek_config_maps_to_the_preset():
    from zoo.models.deepseek_v3 import model as ds
    cfg = deepseek_hf.from_hf(DEEPSEEK_V3, param_dtype="bfloat16")
    # the published layout: the preset with its one MTP depth (num_nextn_predict_layers)
    assert cfg == ds.DeepSeekV3Config.preset("deepseek_v3_671b", param_dtype="bfloat16", dtype="bfloat16",
                                             mtp_depths=1)
    back = deepseek_hf.to_hf(cfg)
    for field in ("num_nextn_predict_layers", "hidden_size",
                  "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_group",
                  "topk_group", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "routed_scaling_factor",
                  "max_position_embeddings", "rope_theta", "v_head_dim", "num_key_value_heads"):
        assert back[field] == DEEPSEEK_V3[field], field
    assert {k: back["rope_scaling"][k] for k in DEEPSEEK_V3["rope_scaling"]} == DEEPSEEK_V3["rope_scaling"]
    fp8 = {**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    with pytest.raises(ValueError, match="quantization_config"):
        deepseek_hf.from_hf(fp8, param_dtype="bfloat16")


@pytest.fixture
def ds_ckpt(tmp_path):
    zoo.to_hf(deepseek(), tmp_path, max_shard_bytes=6000)
    return tmp_path


DS_BAD = {
    "missing expert": (lambda p: edit_tensor(p, "model.layers.2.mlp.experts.3.up_proj.weight", lambda t: None),
                       "missing tensor 'model.layers.2.mlp.experts.3.up_proj.weight'"),
    "missing bias": (lambda p: edit_tensor(p, "model.layers.1.mlp.gate.e_score_correction_bias", lambda t: None),
                     "'model.layers.1.mlp.gate.e_score_correction_bias'"),
    "wrong expert shape": (lambda p: edit_tensor(p, "model.layers.1.mlp.experts.0.gate_proj.weight", lambda t: t.T),
                           "'model.layers.1.mlp.experts.0.gate_proj.weight' has shape \\[24, 12\\]"),
    "more experts than tensors": (lambda p: edit_config(p, n_routed_experts=6, n_group=2),
                                  "'model.layers.1.mlp.gate.weight'"),
    "dense layers disagree": (lambda p: edit_config(p, first_k_dense_replace=2),
                              "model.layers.1.mlp.gate_proj.weight"),
    "routing method": (lambda p: edit_config(p, topk_method="greedy"), "topk_method"),
    "scoring": (lambda p: edit_config(p, scoring_func="softmax"), "scoring_func"),
    "rope type": (lambda p: edit_config(p, rope_scaling={"type": "linear", "factor": 2.0}),
                  "rope_scaling.rope_type='linear'"),
    "yarn attention factor": (lambda p: edit_config(p, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 0.5}),
        "attention_factor"),
    "no q latent": (lambda p: edit_config(p, q_lora_rank=None), "q_lora_rank"),
    "missing group field": (lambda p: edit_config(p, n_group=None), "n_group"),
    "kv heads": (lambda p: edit_config(p, num_key_value_heads=1), "num_key_value_heads"),
    "mtp layer not announced": (lambda p: safetensors.numpy.save_file(
        {"model.layers.3.eh_proj.weight": np.zeros((4, 4), np.float32)}, p / "mtp.safetensors") or add_to_index(
        p, "model.layers.3.eh_proj.weight", "mtp.safetensors"), "'model.layers.3.eh_proj.weight'"),
}


def add_to_index(path, key, file):
    index = json.loads((path / hf_files.INDEX).read_text())
    index["weight_map"][key] = file
    (path / hf_files.INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("case", sorted(DS_BAD))
def test_bad_deepseek_checkpoint_is_refused_before_loading(ds_ckpt, case, monkeypatch):
    corrupt, message = DS_BAD[case]
    corrupt(ds_ckpt)
    monkeypatch.setattr(hf_load, "stream", lambda *a, **k: pytest.fail("loading began before the checks"))
    with pytest.raises(ValueError, match=message):
        zoo.from_hf(ds_ckpt)


def test_deepseek_mtp_layers_are_skipped_with_mtp_false(tmp_path):
    """Published checkpoints append the multi-token-prediction layer(s) after the main model's layers; inference
    loads without them."""
    model = deepseek()
    zoo.to_hf(model, tmp_path, max_shard_bytes=6000)
    safetensors.numpy.save_file({"model.layers.3.eh_proj.weight": np.ones((4, 4), np.float32),
                                 "model.layers.3.mlp.experts.0.up_proj.weight": np.ones((4, 4), np.float32)},
                                tmp_path / "mtp.safetensors")
    for key in ("model.layers.3.eh_proj.weight", "model.layers.3.mlp.experts.0.up_proj.weight"):
        add_to_index(tmp_path, key, "mtp.safetensors")
    edit_config(tmp_path, num_nextn_predict_layers=1)
    assert_identical(zoo.from_hf(tmp_path, extra_heads=False), model)
    with pytest.raises(ValueError, match="missing tensor 'model.layers.3.enorm.weight'"):
        zoo.from_hf(tmp_path)   # by default an MTP layer the checkpoint holds is loaded: here it is incomplete
    (tmp_path / "mtp.safetensors").unlink()
    index = json.loads((tmp_path / hf_files.INDEX).read_text())
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != "mtp.safetensors"}
    (tmp_path / hf_files.INDEX).write_text(json.dumps(index))
    assert_identical(zoo.from_hf(tmp_path), model)   # none of its tensors (as transformers saves): loaded without
    with pytest.raises(ValueError, match="missing tensor 'model.layers.3.enorm.weight'"):
        zoo.from_hf(tmp_path, extra_heads=True)


# the tensors of one MTP layer below model.layers.{i}., as the published checkpoints name them
MTP_LAYER = ["embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
             "shared_head.head.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
             "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
             "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
             "mlp.shared_experts.down_proj.weight"]


@pytest.mark.parametrize("overrides", [{}, dict(tie_embeddings=True, param_dtype="bfloat16", dtype="bfloat16")],
                         ids=["untied", "tied-bf16"])
def test_deepseek_mtp_round_trip_is_bit_identical(tmp_path, overrides):
    """Every tensor of the MTP layer (layer 3 of this 3-layer model) written and read back bit for bit, its copies
    of the embedding and the head written from the shared parameters; a second write gives the same files."""
    model = deepseek(mtp_depths=1, **overrides)
    zoo.to_hf(model, tmp_path / "a", max_shard_bytes=6000)
    back = zoo.from_hf(tmp_path / "a")
    assert back.config == dataclasses.replace(model.config, moe_backend=back.config.moe_backend)
    assert_identical(back, model)
    zoo.to_hf(back, tmp_path / "b", max_shard_bytes=6000)
    a, b = (hf_files.list_tensors(tmp_path / d) for d in "ab")
    mtp = {k for k in a if k.startswith("model.layers.3.")}
    assert mtp == {f"model.layers.3.{k}" for k in MTP_LAYER} | {
        f"model.layers.3.mlp.experts.{e}.{w}_proj.weight" for e in range(4) for w in ("gate", "up", "down")}
    assert a.keys() == b.keys()
    tensors = {d: {k: t for f in (tmp_path / d).glob("*.safetensors")
                   for k, t in safetensors.numpy.load_file(f).items()} for d in "ab"}
    for k in a:
        assert np.array_equal(tensors["a"][k], tensors["b"][k]) and tensors["a"][k].dtype == tensors["b"][k].dtype, k
    head = "model.embed_tokens.weight" if model.config.tie_embeddings else "lm_head.weight"
    np.testing.assert_array_equal(tensors["a"]["model.layers.3.shared_head.head.weight"], tensors["a"][head])
    np.testing.assert_array_equal(tensors["a"]["model.layers.3.embed_tokens.weight"],
                                  tensors["a"]["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    without = zoo.from_hf(tmp_path / "a", extra_heads=False)
    assert without.mtp is None and without.config.mtp_depths == 0
    assert set(params(without)) == {p for p in params(model) if p[0] != "mtp"}
    for p, v in params(without).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(params(model)[p]))


def test_deepseek_mtp_copies_must_equal_the_shared_tensors(tmp_path):
    zoo.to_hf(deepseek(mtp_depths=1), tmp_path, max_shard_bytes=6000)
    edit_tensor(tmp_path, "model.layers.3.shared_head.head.weight", lambda t: t + 1)
    with pytest.raises(ValueError, match="'model.layers.3.shared_head.head.weight' differs from 'lm_head.weight'"):
        zoo.from_hf(tmp_path)
    zoo.from_hf(tmp_path, extra_heads=False)   # without the MTP module the copy is not read


def test_full_size_deepseek_key_map_matches_the_published_shapes():
    """DeepSeek-V3 671B: HF tensor shapes read off the zoo's abstract model (nothing allocated)."""
    from zoo.models.deepseek_v3 import model as ds
    cfg = ds.DeepSeekV3Config.preset("deepseek_v3_671b")
    model = nnx.eval_shape(lambda: ds.deepseek_v3(cfg, rngs=nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    shapes = {k: e.hf_shape(flat[e.path].shape) for e in deepseek_hf.keys(cfg) for k in e.keys()}
    assert len(shapes) == 3 + 3 * 12 + 58 * (7 + 2 + 2 + 3 * 256 + 3)
    assert shapes["model.layers.0.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert shapes["model.layers.60.self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert shapes["model.layers.60.self_attn.o_proj.weight"] == (7168, 128 * 128)
    assert shapes["model.layers.2.mlp.down_proj.weight"] == (7168, 18432)
    assert shapes["model.layers.3.mlp.gate.weight"] == (256, 7168)
    assert shapes["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)
    assert shapes["model.layers.60.mlp.experts.255.gate_proj.weight"] == (2048, 7168)
    assert shapes["model.layers.60.mlp.experts.0.down_proj.weight"] == (7168, 2048)
    assert shapes["model.layers.3.mlp.shared_experts.up_proj.weight"] == (2048, 7168)
    assert "model.layers.2.mlp.gate.weight" not in shapes and "model.layers.61.mlp.gate.weight" not in shapes


def test_full_size_deepseek_mtp_layer_matches_the_published_tensor_list():
    """Layer 61 of the published checkpoint, by name and shape, against the zoo's key map of the abstract model
    with its one MTP depth; the parameters it adds (its copies of the embedding and head excluded)."""
    from zoo.models.deepseek_v3 import model as ds
    cfg = ds.DeepSeekV3Config.preset("deepseek_v3_671b", mtp_depths=1)
    model = nnx.eval_shape(lambda: ds.deepseek_v3(cfg, rngs=nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    shapes = {k: e.hf_shape(flat[e.path].shape) for e in deepseek_hf.keys(cfg) for k in e.keys()}
    d, v, q, kv, h = 7168, 129280, 1536, 512, 128
    published = {"embed_tokens.weight": (v, d), "enorm.weight": (d,), "hnorm.weight": (d,),
                 "eh_proj.weight": (d, 2 * d), "shared_head.norm.weight": (d,), "shared_head.head.weight": (v, d),
                 "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                 "self_attn.q_a_proj.weight": (q, d), "self_attn.q_a_layernorm.weight": (q,),
                 "self_attn.q_b_proj.weight": (h * 192, q), "self_attn.kv_a_proj_with_mqa.weight": (kv + 64, d),
                 "self_attn.kv_a_layernorm.weight": (kv,), "self_attn.kv_b_proj.weight": (h * 256, kv),
                 "self_attn.o_proj.weight": (d, h * 128), "mlp.gate.weight": (256, d),
                 "mlp.gate.e_score_correction_bias": (256,), "mlp.shared_experts.gate_proj.weight": (2048, d),
                 "mlp.shared_experts.up_proj.weight": (2048, d), "mlp.shared_experts.down_proj.weight": (d, 2048),
                 **{f"mlp.experts.{e}.{w}_proj.weight": (d, 2048) if w == "down" else (2048, d)
                    for e in range(256) for w in ("gate", "up", "down")}}
    assert sorted(MTP_LAYER) == sorted(k for k in published if ".experts." not in k)
    assert {k[len("model.layers.61."):]: s for k, s in shapes.items() if k.startswith("model.layers.61.")} == published
    assert max(int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.")) == 61
    copies = 2 * v * d
    assert sum(math.prod(s) for s in published.values()) - copies == 11_610_068_224
    assert zoo.models.count_params(model) == 671_026_419_200 + 11_610_068_224


@pytest.mark.parametrize("published,arch", [(LLAMA_3_1_8B, llama_hf), (DEEPSEEK_V3, deepseek_hf)],
                         ids=["llama", "deepseek"])
def test_every_published_field_is_accounted_for(published, arch):
    """Each field of the published config.json is read, ignored as math-neutral, or refused unless neutral."""
    known = set(arch.SUPPORTED) | set(arch.IGNORED) | set(arch.UNSUPPORTED)
    assert set(published) - known == set()


SHARDED_LOAD = """
import sys, numpy as np, jax
from jax.sharding import Mesh, PartitionSpec as P
import zoo
from tests.hf.test_hf import llama, params
model = llama()
zoo.to_hf(model, sys.argv[1], max_shard_bytes=4000)
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
with jax.set_mesh(mesh):
    loaded = zoo.from_hf(sys.argv[1], rules=[("vocab", "model"), ("embed", "data"), ("mlp", "model")])
p, want = params(loaded), params(model)
up = p[("layers", "layers", "mlp", "up_proj", "kernel")]
assert up.sharding.spec == P(None, "data", "model"), up.sharding
assert {s.data.shape for s in up.addressable_shards} == {(2, 12, 20)}
emb = p[("embed", "embedding")]
assert emb.sharding.spec == P("model", "data") and {s.data.shape for s in emb.addressable_shards} == {(24, 12)}
assert all(np.array_equal(np.asarray(p[k]), np.asarray(want[k])) for k in want)
# The zoo's mesh and its default rules (zoo.sharding.rules_for): the same shardings as zoo.sharding.create.
from zoo import sharding
zmesh = sharding.make_mesh("fsdp=4")
p = params(zoo.from_hf(sys.argv[1], mesh=zmesh))
created = params(sharding.create(zoo.models.llama3, model.config, mesh=zmesh))
assert p[("layers", "layers", "mlp", "up_proj", "kernel")].sharding.spec == P(None, "fsdp", None)
try:   # 3 heads do not split over tp=2: a ValueError naming the parameter, before anything is read
    zoo.from_hf(sys.argv[1], mesh=sharding.make_mesh("fsdp=2,tp=2"))
    raise AssertionError("no error")
except ValueError as e:
    assert "_proj.kernel" in str(e) and "tp=2 does not divide" in str(e), e
assert all(p[k].sharding == created[k].sharding for k in created), [k for k in created
                                                                   if p[k].sharding != created[k].sharding]
assert all(np.array_equal(np.asarray(p[k]), np.asarray(want[k])) for k in want)
print("OK")
"""


@pytest.mark.multidevice
def test_parameters_are_split_over_a_real_mesh(tmp_path):
    """Four CPU devices (a subprocess: the device count is fixed when JAX starts)."""
    import subprocess
    import sys

    from tests.helpers import ROOT, cpu_env
    out = subprocess.run([sys.executable, "-c", SHARDED_LOAD, str(tmp_path)], env=cpu_env(4), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_damaged_hf_files_are_named_and_non_finite_weights_refused(tiny_model, tmp_path):
    d = tmp_path / "hf"
    zoo.to_hf(tiny_model, d)
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])                                  # a truncated download
    with pytest.raises(ValueError, match=f"{weights} is not a readable safetensors file"):
        zoo.from_hf(d)
    weights.write_bytes(data[:-64] + b"\xff" * 64)                              # 64 bytes of 0xff: NaNs
    with pytest.raises(ValueError, match=f"tensor 'model.norm.weight' in {weights} holds 16 non-finite"):
        zoo.from_hf(d)
    loaded = zoo.from_hf(d, allow_nonfinite=True)                               # asked for: loads
    assert np.isnan(np.asarray(loaded.norm.scale[...])).sum() == 16
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{d / 'config.json'} is not valid JSON"):
        zoo.from_hf(d)


def test_a_checkpoint_reads_nothing_outside_its_directory(tmp_path):
    """Index entries that climb out (`..`, an absolute path, a symlink escaping the directory) or are not strings
    are ValueErrors naming the entry; the hub cache's snapshots/ -> blobs/ links are read."""
    model = llama()
    zoo.to_hf(model, tmp_path / "other", max_shard_bytes=4000)
    d = tmp_path / "ckpt"
    zoo.to_hf(model, d, max_shard_bytes=4000)
    index = json.loads((d / hf_files.INDEX).read_text())
    key, name = next(iter(index["weight_map"].items()))
    for bad, message in ((f"../other/{name}", "is not a file inside"), (str(tmp_path / "other" / name),
                                                                        "is not a file inside"),
                         (3, "the file name must be a string, got int 3"), (None, "must be a string, got NoneType")):
        (d / hf_files.INDEX).write_text(json.dumps({"weight_map": {**index["weight_map"], key: bad}}))
        with pytest.raises(ValueError, match=f"weight_map entry '{key}'.*{message}"):
            zoo.from_hf(d)
    (d / hf_files.INDEX).write_text(json.dumps(index))
    (d / name).unlink()
    (d / name).symlink_to(tmp_path / "other" / name)                   # a symlink escaping the directory
    with pytest.raises(ValueError, match=f"weight_map entry '{key}' names '{name}', a symlink to .*outside"):
        zoo.from_hf(d)
    single = tmp_path / "single"
    zoo.to_hf(model, single)
    (tmp_path / "elsewhere.safetensors").write_bytes((single / "model.safetensors").read_bytes())
    (single / "model.safetensors").unlink()
    (single / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ValueError, match="the weights file names 'model.safetensors', a symlink to .*outside"):
        zoo.from_hf(single)
    (single / "model.safetensors").unlink()
    (single / "config.json").rename(tmp_path / "config.json")
    (single / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(ValueError, match="config.json names 'config.json', a symlink to .*outside"):
        zoo.from_hf(single)
    # the hub cache's layout: models--x/snapshots/<revision>/file -> ../../blobs/<hash>
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (repo / "blobs" / f"hash-{f}").write_bytes((tmp_path / "elsewhere.safetensors").read_bytes()
                                                   if f == "model.safetensors" else (tmp_path / f).read_bytes())
        (snap / f).symlink_to(f"../../blobs/hash-{f}")
    assert_identical(zoo.from_hf(snap), model)


def test_a_cast_that_overflows_is_refused_after_the_cast(tmp_path):
    """float32 values beyond float16's range would load as infinity: a ValueError naming the tensor (checked in the
    loaded dtype), unless allow_nonfinite=True; bfloat16 holds them."""
    model = llama()
    zoo.to_hf(model, tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = safetensors.numpy.load_file(file)
    tensors["model.norm.weight"][3] = 1e5
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' in .*: 1 of its 24 float32 values overflow "
                                         r"float16 \(largest magnitude 1e\+05, beyond float16's 6.55e\+04\)"):
        zoo.from_hf(tmp_path, dtype=jnp.float16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float16"}))
    with pytest.raises(ValueError, match="'model.norm.weight' .* overflow float16"):
        zoo.from_hf(tmp_path, dtype=None)
    loaded = zoo.from_hf(tmp_path, dtype=jnp.float16, allow_nonfinite=True)
    assert np.isinf(np.asarray(loaded.norm.scale[...], np.float32)).sum() == 1
    assert np.isfinite(np.asarray(zoo.from_hf(tmp_path, dtype=jnp.bfloat16).norm.scale[...], np.float32)).all()

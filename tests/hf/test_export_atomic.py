"""`zoo.to_hf` never destroys an export it did not finish: it writes into a temporary
folder beside the target and swaps it in only when complete; public functions check their arguments' types, and
config.json's fields are type-checked with architecture names matched exactly."""
from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import safetensors.numpy

import zoo


def snapshot(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_failed_overwrite_leaves_the_old_export_intact(tiny_model, tmp_path, monkeypatch):
    """A full disk while writing the new shards: an OSError naming the path, the old export byte for byte as it
    was, and no temporary folder left beside it."""
    out = tmp_path / "hf"
    zoo.to_hf(tiny_model, out)
    (out / "tokenizer.json").write_text("{}")
    before = snapshot(out)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    with pytest.raises(OSError, match=f"to_hf: writing {out} failed: No space left on device; {out} is as it was"):
        zoo.to_hf(tiny_model, out, overwrite=True)
    assert snapshot(out) == before and sorted(os.listdir(tmp_path)) == ["hf"]


def test_overwrite_swaps_in_a_complete_export_keeping_user_files(tiny_model, tmp_path):
    """overwrite=True replaces the checkpoint files (stale shards go), keeps the user's files (hard-linked: the same
    inode) and folders, and writes through a symlink to the export folder."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "model-00001-of-00003.safetensors").write_text("stale")
    (real / "tokenizer.json").write_text("tok")
    (real / "notes").mkdir()
    (real / "notes" / "a.txt").write_text("a")
    inode = os.stat(real / "tokenizer.json").st_ino
    (tmp_path / "link").symlink_to(real)
    zoo.to_hf(tiny_model, tmp_path / "link", overwrite=True)
    assert (tmp_path / "link").is_symlink()
    assert sorted(os.listdir(real)) == ["config.json", "model.safetensors", "notes", "tokenizer.json"]
    assert os.stat(real / "tokenizer.json").st_ino == inode and (real / "notes" / "a.txt").read_text() == "a"
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]
    np.testing.assert_array_equal(zoo.from_hf(real).embed.embedding[...], tiny_model.embed.embedding[...])


def test_public_functions_check_their_argument_types(tiny_model, tmp_path):
    """to_hf of something that is not a zoo model, or with a path, shard size or flag of the wrong type, is a
    TypeError naming the argument (no AttributeError from deep inside); nothing is written."""
    with pytest.raises(TypeError, match="to_hf: model must be a zoo model .* got dict"):
        zoo.to_hf({"w": 1}, tmp_path / "a")
    with pytest.raises(TypeError, match="to_hf: path must be a str or os.PathLike, got int"):
        zoo.to_hf(tiny_model, 5)
    with pytest.raises(TypeError, match="to_hf: overwrite must be a bool, got str"):
        zoo.to_hf(tiny_model, tmp_path / "a", overwrite="yes")
    with pytest.raises(ValueError, match="to_hf: max_shard_bytes must be > 0, got 0"):
        zoo.to_hf(tiny_model, tmp_path / "a", max_shard_bytes=0)
    with pytest.raises(TypeError, match="from_hf: recipe must be a zoo.Recipe or None, got str"):
        zoo.from_hf(tmp_path, recipe="qkv_offload")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("field,value,message", [
    ("architectures", "XLlamaForCausalLMX", r"architectures='XLlamaForCausalLMX' must be a list of names"),
    ("architectures", 7, r"architectures=7 must be a list of names"),
    ("architectures", ["LlamaForCausalLMv2"], r"architectures=\['LlamaForCausalLMv2'\] .* is not supported"),
    ("hidden_size", "16", r"hidden_size='16' must be an integer"),
    ("num_hidden_layers", True, r"num_hidden_layers=True must be an integer"),
    ("rms_norm_eps", "1e-6", r"rms_norm_eps='1e-6' must be a number"),
    ("tie_word_embeddings", "false", r"tie_word_embeddings='false' must be true or false"),
    ("rope_scaling", "llama3", r"rope_scaling='llama3' must be an object"),
])
def test_config_fields_are_type_checked(tiny_model, tmp_path, field, value, message):
    """A config.json field of the wrong JSON type is a ValueError naming it; architecture names must match exactly
    (a string is not searched for a substring)."""
    zoo.to_hf(tiny_model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match="config.json: " + message):
        zoo.from_hf(tmp_path / "hf")


def test_to_hf_refuses_a_non_empty_directory_unless_told_to_overwrite(tiny_model, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    with pytest.raises(ValueError, match=r"is not empty \(config.json\).*overwrite=True"):
        zoo.to_hf(tiny_model, out)
    assert (out / "config.json").read_text() == '{"mine": true}'
    # overwrite=True replaces the checkpoint files (old .bin shards, stale safetensors shards), keeps the rest.
    for name in ("pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json", "model-00001-of-00003.safetensors",
                 "tokenizer.json"):
        (out / name).write_text("old")
    zoo.to_hf(tiny_model, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == "old"
    back = zoo.from_hf(out)
    np.testing.assert_array_equal(back.embed.embedding[...], tiny_model.embed.embedding[...])


def test_overwrite_replaces_what_it_owns_and_keeps_the_rest(tiny_model, tmp_path):
    """Files and links named like the shards to_hf writes are replaced (a dangling link too: the link, never its
    target), so from_hf accepts the result; another safetensors file (an adapter) is the user's: kept, and never
    read as weights; a folder named like a shard is refused, not removed."""
    out = tmp_path / "hf"
    out.mkdir()
    target = tmp_path / "target.safetensors"
    target.write_text("not mine to delete")
    (out / "model-00001-of-00002.safetensors").symlink_to(tmp_path / "nowhere")
    (out / "model-00002-of-00002.safetensors").symlink_to(target)
    (out / "adapter_model.safetensors").write_text("adapter")
    zoo.to_hf(tiny_model, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["adapter_model.safetensors", "config.json", "model.safetensors"]
    assert target.read_text() == "not mine to delete" and (out / "adapter_model.safetensors").read_text() == "adapter"
    np.testing.assert_array_equal(zoo.from_hf(out).embed.embedding[...], tiny_model.embed.embedding[...])
    (out / "model-00003-of-00004.safetensors").mkdir()
    (out / "model-00003-of-00004.safetensors" / "keep").write_text("k")
    with pytest.raises(ValueError, match="model-00003-of-00004.safetensors is a folder named like a checkpoint "
                                         "file, which overwrite=True would have to remove; move or rename it"):
        zoo.to_hf(tiny_model, out, overwrite=True)
    assert (out / "model-00003-of-00004.safetensors" / "keep").read_text() == "k"

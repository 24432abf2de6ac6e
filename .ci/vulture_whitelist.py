"""What vulture (`.ci/run`, `[tool.vulture]` in pyproject.toml) must not report: names no code here reads.

Public API that users call and the docs show, data that tests hold complete, and names read by something vulture
cannot see (a library setting an attribute, a field read by name). A name not here and not used is dead: delete it.
"""
from bench.records import Record
from bench.shims.xprof.cli.tools import get_kernel_stats_tool
from recipes.train.loop import Result
from zoo import renames
from zoo.layers.attention import attention_impls
from zoo.models.deepseek_v3 import hf as deepseek_hf
from zoo.models.deepseek_v3 import mtp_loss
from zoo.models.llama3 import hf as llama_hf
from zoo.models.qwen3 import hf as qwen_hf
from zoo.models.qwen3_moe import hf as qwen_moe_hf
from zoo.plan.measure import model_residuals, placements_seen
from zoo.tags import Tag

# public API (the docs show it): what a model's layers run and save, the MTP loss, what a run ended with
attention_impls, model_residuals, placements_seen, mtp_loss, Result.last_checkpoint
# each family's Hugging Face fields read and ignored: tests/hf/test_hf.py holds the tables complete
for module in (llama_hf, qwen_hf, qwen_moe_hf, deepseek_hf):
    module.SUPPORTED, module.IGNORED
# a tag's meaning: for people (the vocabulary's table, docs/architecture.md)
Tag.meaning
# read by name: the record schema's float fields (bench/records.py `check`)
Record.peak_gib, Record.planned_peak_gib, Record.host_temp_gib, Record.planned_host_gib
# called by tokamax where xprof is missing (the shim stands in for xprof's module)
get_kernel_stats_tool.compute_kernel_stats
# set for a library: the tokenizer's parts (tokenizers.Tokenizer), a module's class (zoo.renames.called)
_.pre_tokenizer, _.decoder, renames.__class__

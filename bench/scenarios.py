"""Every measurement of bench/ as a scenario: its jobs (`bench.jobs`), most important first. The runner
(`python -m bench.run SCENARIO ...`) runs one; `--list` prints its jobs.
"""
from __future__ import annotations

from bench.jobs import (
    DOUBLE_BUFFER,
    HOST_STATE,
    LHS,
    LONG_ENV,
    OPT_STATE_ENV,
    SELECTIVE_MEMCPY,
    STREAM_ANNOTATION,
    Job,
    Scenario,
    anchor,
    anchor_ctx,
    anchor_deepseek,
    anchor_fsdp,
    capacity,
    ctx,
    deepseek,
    llama,
    long_job,
    main_job,
    module_job,
    probe,
    profile,
    sgd_twin,
    stream_probe,
    zoo,
)

_PROF = ("--hlo", "--profile", "{work}/trace")
_CH = {n: ("--mlp-chunks", str(n)) for n in (2, 4, 8)}
_PGLE = ("--pgle",)
_CAPACITY_START = {"full": 16, "save_mla_moe": 8, "mla_moe_offload": 8, "lowrank_wa_offload": 8}
_EP2 = ("--mesh", "ep=2", "--experts", "32")
_TILES = "{out}/tiles.json"
_NO_TILES = "{out}/no-tiles.json"
_MOSAIC = "--train-arg=--set=attention_impl=mosaic_cudnn"
_NO_TILES_FILE = {_NO_TILES: "{}"}   # an empty tile table: tokamax's own configuration (zoo.layers.grouped_matmul)


def _sweep_deepseek(recipe, **kw) -> Job:
    return deepseek(recipe, plan_peak=False, **kw)


SCENARIOS: dict[str, Scenario] = {
    "settings": Scenario(
        "offload against saving and recomputing under XLA settings: the 405B slice's ratios on GPU 0 (each pair on "
        "one chip), the settings, depth and the DeepSeek slice on GPU 1, the plain-JAX anchor beside them",
        (zoo("qkv_offload", gpu="0"), zoo("save_qkv", gpu="0"),
         zoo("minimal_offload", extra=_PROF, est=90, gpu="0"), zoo("minimal", gpu="0"), zoo("full", gpu="0"),
         anchor("offload_minimal", flags="cb_off", gpu="0"), anchor("minimal", gpu="0"),
         zoo("minimal_offload", setting="defaults", gpu="0"),
         zoo("minimal_offload", setting="concurrent", gpu="1"),
         zoo("minimal_offload", layers=6, batch=1, est=90, gpu="1"), zoo("full", layers=6, batch=1, est=90, gpu="1"),
         anchor("offload_minimal", layers=6, batch=1, flags="cb_off", est=70, gpu="1"),
         _sweep_deepseek("full", gpu="1"), _sweep_deepseek("mla_moe_offload", est=85, gpu="1"),
         _sweep_deepseek("lowrank_wa_offload", gpu="1"), _sweep_deepseek("save_mla_moe", gpu="1"),
         _sweep_deepseek("auto", gpu="1"),
         anchor("full", gpu="0"))),
    "auto": Scenario(
        "the recipe `auto` picks against the fixed ones: the main job on GPU 0, the DeepSeek slice on GPU 1",
        (main_job("qkv_offload", timeout=260, gpu="0"), main_job("save_qkv", timeout=260, gpu="0"),
         main_job("auto", timeout=260, gpu="0"),
         _sweep_deepseek("save_mla_moe", gpu="1"), _sweep_deepseek("mla_moe_offload", gpu="1"),
         _sweep_deepseek("auto", gpu="1"),
         _sweep_deepseek("full", gpu="1"))),
    "double-buffer": Scenario(
        "where the rest of the copy time goes (profiles, compiled ops) and XLA's while-loop double buffering",
        (zoo("minimal_offload", extra=_PROF, est=90, gpu="0"), zoo("minimal_offload", setting="double_buffer", gpu="0"),
         zoo("minimal", gpu="0"), anchor("offload_minimal", flags="cb_off_db", gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, extra=_PROF, est=90, gpu="1"),
         zoo("minimal_offload", layers=6, batch=1, setting="double_buffer", est=90, gpu="1"),
         zoo("qkv_offload", setting="double_buffer", gpu="1"))),
    "pipelined": Scenario(
        "XLA's pipelined host offloading (copies off the compute stream), with and without double buffering",
        (zoo("minimal_offload", setting="pipelined", gpu="0"), zoo("minimal_offload", setting="pipelined_db", gpu="0"),
         zoo("qkv_offload", setting="pipelined", gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, setting="pipelined", est=90, gpu="1"),
         zoo("minimal_offload", layers=6, batch=1, setting="pipelined_db", est=90, gpu="1"),
         zoo("save_qkv", setting="pipelined", gpu="1"))),
    "pgle": Scenario(
        "the same programs compiled again from a profile of their own steps (profile-guided latency estimation)",
        (zoo("minimal_offload", extra=_PGLE, est=100, gpu="0"), zoo("minimal", extra=_PGLE, est=90, gpu="0"),
         zoo("full", extra=_PGLE, est=90, gpu="0"),
         zoo("qkv_offload", extra=_PGLE, est=90, gpu="1"), zoo("save_qkv", extra=_PGLE, est=90, gpu="1"),
         zoo("minimal_offload", layers=6, batch=1, extra=_PGLE, est=100, gpu="1"),
         zoo("full", layers=6, batch=1, extra=_PGLE, est=90, gpu="1"))),
    "chunks": Scenario(
        "the MLP in sequence chunks (the gate/up copies start before the layer ends), beside minimal, full and the "
        "plain-JAX anchor, on one GPU, in the order of importance",
        (zoo("minimal", est=60, gpu="0"), zoo("minimal_offload", extra=_CH[4], est=50, gpu="0"),
         zoo("minimal_offload", est=50, gpu="0"), zoo("full", est=40, gpu="0"),
         zoo("minimal_offload", extra=_CH[2], est=50, gpu="0"), zoo("minimal_offload", extra=_CH[8], est=50, gpu="0"),
         anchor("offload_minimal", flags="cb_off", est=40, gpu="0"), anchor("minimal", est=35, gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, extra=_CH[4], est=60, gpu="0"),
         zoo("full", layers=6, batch=1, est=45, gpu="0"),
         zoo("qkv_offload", extra=_CH[4], est=45, gpu="0"), zoo("save_qkv", est=35, gpu="0"),
         zoo("minimal", extra=_CH[4], est=35, gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, extra=_CH[2], est=60, gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, est=60, gpu="0"),
         zoo("minimal", extra=_CH[2], est=35, gpu="0"))),
    "chunks-pgle": Scenario(
        "the two-chunk MLP under profile-guided latency estimation (each PGLE job times the step before and after "
        "the recompile) and under XLA's while-loop double buffering, at 6 layers B1 and 3 layers B2, beside full, "
        "minimal and the plain-JAX anchor, on one GPU in the order of importance",
        (zoo("full", layers=6, batch=1, est=50, gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, extra=(*_CH[2], *_PGLE), est=120, gpu="0"),
         zoo("minimal", est=60, gpu="0"), zoo("full", est=45, gpu="0"),
         zoo("minimal_offload", extra=(*_CH[2], *_PGLE), est=110, gpu="0"),
         anchor("offload_minimal", flags="cb_off", est=40, gpu="0"), anchor("minimal", est=35, gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, setting="double_buffer", extra=_CH[2], est=60, gpu="0"))),
    "llama": Scenario(
        "the 405B slice under full remat, save_qkv and qkv_offload beside the plain-JAX anchor",
        (*(llama(r, gpu="0") for r in ("full", "save_qkv", "qkv_offload")),
         *(anchor(p, est=70, gpu="0") for p in ("full", "offload_qkv")))),
    "deepseek-ragged": Scenario(
        "the DeepSeek slice with jax.lax.ragged_dot dispatch beside the plain-JAX anchor (same dispatch)",
        (anchor_deepseek("full", gpu="0"), deepseek("full", "ragged_dot", timeout=110, gpu="0"),
         anchor_deepseek("mla_moe_offload", gpu="0"), deepseek("mla_moe_offload", "ragged_dot", timeout=110, gpu="0"),
         deepseek("lowrank_wa_offload", "ragged_dot", timeout=110, gpu="0"),
         anchor_deepseek("lowrank_offload", gpu="0"))),
    "deepseek-capacity": Scenario(
        "the DeepSeek slice's recipes with capacity dispatch (a batched einsum), and ragged_dot at batch 2 for scale",
        (*(deepseek(r, timeout=110, gpu="0") for r in ("full", "mla_moe_offload", "lowrank_wa_offload",
                                                        "save_mla_moe")),
         deepseek("mla_moe_offload", batch=8, timeout=110, gpu="0"),
         deepseek("full", "ragged_dot", batch=2, timeout=110, gpu="0"))),
    "deepseek-side-by-side": Scenario(
        "the DeepSeek slice with capacity dispatch beside the plain-JAX anchor, in one call",
        (anchor_deepseek("full", gpu="0"), deepseek("full", timeout=110, gpu="0"),
         deepseek("mla_moe_offload", timeout=110, gpu="0"))),
    "deepseek-ep2": Scenario(
        "expert parallelism on two GPUs (32 experts, batch 8: each GPU's share as on one): capacity `full`, "
        "dropless tokamax (ragged all-to-all) `full` and `mla_moe_offload`",
        (deepseek("full", batch=8, extra=_EP2, timeout=180),
         deepseek("full", "tokamax", batch=8, extra=(*_EP2, "--ep-dispatch", "ragged_a2a"), timeout=180),
         deepseek("mla_moe_offload", "tokamax", batch=8, extra=(*_EP2, "--ep-dispatch", "ragged_a2a"),
                  timeout=180))),
    "deepseek-ep2-one": Scenario(
        "the model and batch of deepseek-ep2, dropless, on GPU 0 alone (the loss the ep=2 dropless runs should equal)",
        (deepseek("full", "tokamax", batch=8, extra=("--experts", "32"), est=150, timeout=300, gpu="0"),)),
    "fsdp": Scenario(
        "sharded training on two GPUs against the plain-JAX FSDP anchor, expert parallelism, and the one-GPU run "
        "of the same code path (weak scaling)",
        (*(anchor_fsdp(p) for p in ("full", "save_qkv", "offload_qkv")),
         *(llama(r, batch=4, mesh="fsdp=2", steps=4, est=80, timeout=100) for r in ("full", "save_qkv",
                                                                                     "qkv_offload")),
         *(deepseek(r, batch=8, extra=_EP2, est=70, timeout=80) for r in ("full", "mla_moe_offload")),
         llama("full", batch=2, mesh="fsdp=1", steps=4, est=80, timeout=100, gpu="0"))),
    "dropless": Scenario(
        "the DeepSeek slice's dropless tokamax against capacity dispatch and each offload recipe's host bytes, the "
        "plain-JAX anchor beside it; the main job beside the SGD bench of the same model",
        (deepseek("full", "tokamax", timeout=100), deepseek("full", timeout=90),
         deepseek("mla_moe_offload", "tokamax", timeout=90), main_job("qkv_offload", est=150, timeout=180),
         sgd_twin("qkv_offload", timeout=80), anchor_deepseek("full", timeout=90),
         *(deepseek(r, "tokamax", timeout=90) for r in ("lowrank_wa_offload", "lowrank_offload", "save_mla_moe")))),
    "tokamax-tiles": Scenario(
        "tokamax's grouped-matmul tiles per problem of the DeepSeek slice's MoE layer, then the slice with the "
        "fastest tiles, with tokamax's own choice and with capacity dispatch",
        (Job("tokamax-tiles", ("-m", "bench.tokamax_tiles", "--out", _TILES), LHS, 200, 240,
             ident={"bench": "tokamax-tiles", "setting": "zoo"}, gpus="0", gpu_only=True),
         deepseek("full", "tokamax", timeout=100, gpu="0", name="deepseek-tokamax-B4-full-measured-tiles",
                  env={"ZOO_TOKAMAX_TILES": _TILES}, requires=_TILES),
         deepseek("full", timeout=90, gpu="0"),
         deepseek("full", "tokamax", timeout=100, gpu="0", name="deepseek-tokamax-B4-full-tokamax-choice",
                  env={"ZOO_TOKAMAX_TILES": _NO_TILES}, files=_NO_TILES_FILE),
         deepseek("lowrank_offload", "tokamax", timeout=100, gpu="0", name="deepseek-tokamax-B4-lowrank_offload-"
                  "measured-tiles", env={"ZOO_TOKAMAX_TILES": _TILES}, requires=_TILES))),
    "deepseek-auto": Scenario(
        "the DeepSeek slice with the zoo's built-in tiles: tokamax against capacity dispatch, the recipe `auto` "
        "picks, and the other recipes on the same backend",
        (deepseek("full", "tokamax", est=110, timeout=150, gpu="0"), deepseek("full", est=100, timeout=130, gpu="0"),
         deepseek("auto", "tokamax", est=110, timeout=150, gpu="0"),
         *(deepseek(r, "tokamax", est=100, timeout=130, gpu="0")
           for r in ("save_mla_moe", "lowrank_offload", "mla_moe_offload", "lowrank_wa_offload")),
         deepseek("full", "tokamax", est=100, timeout=130, gpu="0", name="deepseek-tokamax-B4-full-tokamax-choice",
                  env={"ZOO_TOKAMAX_TILES": _NO_TILES}, files=_NO_TILES_FILE))),
    "step-cost": Scenario(
        "the main job's step by NaN-guard variant, the main job and its SGD twin, the plain-JAX 8B anchor",
        (*(Job(f"step-cost-{v}", ("-m", "bench.step_cost", "--recipe", "qkv_offload", "--variants", v), LHS, 80,
               110, ident={"bench": "step-cost", "setting": "zoo"}, gpus="0")
           for v in ("guard_lr", "guard_exact", "no_guard")),
         main_job("qkv_offload", est=150, timeout=200, gpu="0"), sgd_twin("qkv_offload", gpu="0"),
         *(anchor(p, shape="8b", layers=8, est=50, timeout=80, gpu="0") for p in ("full", "offload_qkv")))),
    "main-job": Scenario(
        "the main job (AdamW, 8B preset cut to 8 layers) under each recipe beside its SGD twin, and `--recipe auto`",
        (*(j for r in ("qkv_offload", "save_qkv", "none")
           for j in (main_job(r, est=120, timeout=170, gpu="0"), sgd_twin(r, gpu="0"))),
         main_job("auto", est=120, timeout=170, gpu="0"))),
    "capacity": Scenario(
        "the largest batch each DeepSeek-slice recipe fits (capacity dispatch): the planner's B*, then the step "
        "really run at B* (should run) and 2 B* (should run out of memory)",
        tuple(capacity(r, s) for r, s in _CAPACITY_START.items())),
    "opt-state": Scenario(
        "the main job with AdamW's state on the host: all 32 layers of the 8B preset (refused with the state in HBM) "
        "beside the 8-layer cut with the state in HBM",
        (Job("refused-32-layers-in-hbm", ("-m", "recipes.train", "--preset", "llama3_1_8b", "--seq", "8192",
                                          "--batch", "4", "--recipe", "qkv_offload", "--steps", "1"), "", 60, 200,
             env=OPT_STATE_ENV, ident={"bench": "main-job-8b", "impl": "zoo", "program": "main-job",
                                        "recipe": "qkv_offload", "L": 32, "B": 4, "opt_state": "device"},
             gpus="0", expect_rc=2,
             smoke_argv=("-m", "recipes.train", "--preset", "tiny", "--seq", "32", "--batch", "2", "--steps", "1",
                         "--hbm-limit", "0.0001")),
         main_job("qkv_offload", ("--layers", "32", "--batch", "4", "--grad-accum", "4", "--opt-state", "host"),
                  steps=8, est=280, timeout=320, gpu="0", name="main-job-8b-L32-opt-state-host", env=OPT_STATE_ENV),
         main_job("qkv_offload", ("--layers", "8", "--batch", "2"), est=120, timeout=170, gpu="0",
                  env=OPT_STATE_ENV),
         *(main_job("qkv_offload", ("--layers", "32", "--batch", str(k), "--grad-accum", str(k), "--opt-state",
                                    "host"), steps=5 if k == 8 else 4, est=60 + 14 * k, timeout=300, gpu="0",
                    name=f"main-job-8b-L32-opt-state-host-K{k}", env=OPT_STATE_ENV) for k in (8, 16)))),
    "host-state": Scenario(
        "all 32 layers of the 8B preset with the optimizer state on the host at 4 micro-batches: AdamW's moments in "
        "bfloat16 (DeepSeek-V3's choice; half the bytes to stream) beside the 8-layer cut with the state in HBM",
        (main_job("qkv_offload", ("--layers", "32", "--batch", "4", "--grad-accum", "4", "--opt-state", "host",
                                  "--opt-dtype", "bfloat16"), steps=5, est=200, timeout=300, gpu="0",
                  name="main-job-8b-L32-opt-state-host-bf16-moments", env=OPT_STATE_ENV),
         main_job("qkv_offload", ("--layers", "8", "--batch", "2"), est=120, timeout=170, gpu="0",
                  env=OPT_STATE_ENV))),
    "params-host": Scenario(
        "all 32 layers of the 8B preset with bfloat16 parameters in HBM and their float32 master copy and the moments "
        "on the host (--params host), beside the same with float32 parameters in HBM (bfloat16 moments on the host)",
        (main_job("qkv_offload", ("--layers", "32", "--batch", "4", "--grad-accum", "4", "--opt-state", "host",
                                  "--opt-dtype", "bfloat16", "--param-dtype", "bfloat16", "--params", "host"),
                  steps=5, est=200, timeout=300, gpu="0", name="main-job-8b-L32-params-host-bf16-moments",
                  env=OPT_STATE_ENV),)),
    "mtp": Scenario(
        "the step-time cost of DeepSeek-V3's multi-token prediction (one depth) on the deepseek-slice, capacity "
        "dispatch, under full remat and the study's offload recipe, and its host bytes against the plan",
        tuple(deepseek(r, extra=("--mtp", str(m)), name=f"deepseek-capacity-B4-{r}-mtp{m}", timeout=120)
              for r in ("full", "mla_moe_offload") for m in (0, 1))),
    "long-context": Scenario(
        "long context on one GPU: the zoo's 8B-shaped stack at 32K/8 layers, 64K/4 and 128K/2 (batch 1) under full "
        "remat and the context recipes beside the plain-JAX baseline's policies, in the order of importance",
        (ctx("full", 32768, 8), ctx("context_offload", 32768, 8), anchor_ctx("full", 32768, 8),
         anchor_ctx("ctx_offload", 32768, 8),
         ctx("full", 65536, 4), ctx("context_offload", 65536, 4), anchor_ctx("full", 65536, 4),
         anchor_ctx("ctx_offload", 65536, 4),
         ctx("full", 131072, 2, est=50), ctx("context_offload", 131072, 2, est=50), anchor_ctx("full", 131072, 2),
         anchor_ctx("ctx_offload", 131072, 2),
         ctx("minimal", 32768, 8), ctx("minimal_no_context", 32768, 8), anchor_ctx("minimal_ctx", 32768, 8),
         anchor_ctx("minimal", 32768, 8), ctx("context_save", 32768, 8), anchor_ctx("ctx_save", 32768, 8))),
    "long-context-more": Scenario(
        "long context, the rest: q, k, v recipes and auto on the 8B-shaped stack at 32K, the DeepSeek slice's stack "
        "at 32K under full and MLA's context offloaded",
        (ctx("qkv_offload", 32768, 8), ctx("qkv_context_offload", 32768, 8), ctx("save_qkv", 32768, 8),
         ctx("auto", 32768, 8), anchor_ctx("offload_qkv_ctx", 32768, 8),
         ctx("full", 32768, 4, family="deepseek_v3", est=60), ctx("context_offload", 32768, 4, family="deepseek_v3",
                                                                    est=60))),
    "qwen3-rate": Scenario(
        "Qwen3's step rate on one GPU: the 32B-shaped stack (4 layers, batch 2, seq 8192, SGD) under minimal and full "
        "(the two the rate and overhead are fitted from: zoo.models.qwen3.training), then qkv_offload, save_qkv and "
        "context_offload, whose times the fitted rate predicts",
        tuple(ctx(r, 8192, 4, family="qwen3", batch=2, est=40) for r in
              ("minimal", "full", "qkv_offload", "save_qkv", "context_offload"))),
    "long-context-main": Scenario(
        "long context in the main job (AdamW, the LM head and its loss in chunks): the 8B preset cut to 8 layers at "
        "32K under full (chunked and unchunked) and context_offload, the DeepSeek slice's stack at 32K, the 8B cut "
        "to 4 layers at 64K and 2 at 128K, and all 32 layers at 64K with the optimizer state on the host",
        (main_job("full", ("--layers", "8", "--batch", "1", "--seq", "32768"), steps=6, est=70, timeout=200,
                  gpu="0", name="main-job-8b-L8-S32K-full"),
         main_job("full", ("--layers", "8", "--batch", "1", "--seq", "32768", "--train-arg=--loss-chunk=none"),
                  steps=6, est=70, timeout=200, gpu="0", name="main-job-8b-L8-S32K-full-unchunked"),
         main_job("context_offload", ("--layers", "8", "--batch", "1", "--seq", "32768"), steps=6, est=70,
                  timeout=200, gpu="0", name="main-job-8b-L8-S32K-context_offload"),
         ctx("full", 32768, 4, family="deepseek_v3", est=60),
         ctx("context_offload", 32768, 4, family="deepseek_v3", est=60),
         main_job("context_offload", ("--layers", "4", "--batch", "1", "--seq", "65536"), steps=6, est=70,
                  timeout=200, gpu="0", name="main-job-8b-L4-S64K-context_offload"),
         main_job("context_offload", ("--layers", "32", "--batch", "1", "--seq", "65536", "--opt-state", "host",
                                      "--opt-dtype", "bfloat16"), steps=4, est=150, timeout=300, gpu="0",
                  name="main-job-8b-L32-S64K-context_offload-host-state", env=OPT_STATE_ENV),
         main_job("context_offload", ("--layers", "2", "--batch", "1", "--seq", "131072"), steps=5, est=70,
                  timeout=200, gpu="0", name="main-job-8b-L2-S128K-context_offload"))),
    "longest-context-check": Scenario(
        "before the longest runs: the 8B cut to 4 layers at 128K under long_context (tiles, groups of two, the layer "
        "input offloaded) trains; the 32-layer step at 256K compiled for the GPU under long_context and auto; the "
        "default 8K main job (auto, and the README's qkv_offload, the loss whole where it fits) beside its plain-JAX "
        "anchor",
        (long_job("long_context", 131072, layers=4, steps=3, est=90, timeout=240),
         probe(("long_context", "auto"), seq=262144, est=200, timeout=330),
         main_job("auto", est=90, timeout=200, gpu="0"), main_job("qkv_offload", est=70, timeout=170, gpu="0"),
         anchor("minimal", shape="8b", layers=8, est=50, gpu="0"))),
    "longest-context": Scenario(
        "all 32 layers of the 8B at 128K: auto beside full remat (the state on the host), and the plain-JAX "
        "long-context anchor's 128K slice",
        (long_job("auto", 131072, steps=3, est=260), long_job("full", 131072, steps=3, est=260),
         anchor_ctx("ctx_offload", 131072, 2), anchor_ctx("full", 131072, 2))),
    "longest-context-256k": Scenario(
        "all 32 layers of the 8B at 256K under auto (two steps: one takes minutes), then the planner's compiled answer "
        "for the longest length up to 512K",
        (long_job("auto", 262144, steps=2, est=420, timeout=560),
         probe(("auto",), longest=524288, est=240, timeout=400))),
    "half-million": Scenario(
        "524,288 tokens on one H200, the state on the host: all 32 layers of the 8B under auto (one step: it fits "
        "and trains, and its rate), then the 8B cut to 8 layers under longest_context (auto's structure at 512K) and "
        "under long_context (the kernel's pair kept for every layer: attention's forward never runs again), one step "
        "each from the same weights and tokens (their losses must agree); a step takes minutes: run detached",
        (long_job("auto", 524288, layers=32, steps=1, est=900, timeout=1100),
         long_job("longest_context", 524288, layers=8, steps=1, est=260, timeout=400),
         long_job("long_context", 524288, layers=8, steps=1, est=240, timeout=400))),
    "million-compile": Scenario(
        "1,048,576 tokens compiled for one H200, nothing run: all 32 layers of the 8B, batch 1, AdamW's state and the "
        "float32 master on the host, the bf16 parameters streamed a layer at a time (--params stream), attention "
        "over 16 query tiles (attention_tiles) with cuDNN's kernel, under auto (at that length groups of "
        "8, each group's input on the host, 32 sequence tiles, every other tag recomputed), then the same structure "
        "in subgroups of 4 (three-level checkpoints); the compiled peak HBM and host bytes beside the plan's, and the "
        "plan's step time",
        (probe(("auto", "carry:32:8:4"), seq=1048576, est=180, timeout=500,
               extra=("--params", "stream", "--attention-tiles", "16", "--attention-impl", "cudnn"),
               env={**LONG_ENV, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "120"},
               name="plan-probe-1024K-auto-stream-qt16"),
         )),
    "longest-context-128k-2": Scenario(
        "all 32 layers of the 8B at 128K under auto, two steps (the record times the second): the shortest check of "
        "the long-context step against its records",
        (long_job("auto", 131072, steps=2, est=330, timeout=450, name="main-job-8b-L32-S128K-auto-2"),)),
    "query-tiles-128k": Scenario(
        "attention over query tiles on the GPU: the 8B cut to 4 layers at 131,072 tokens under full remat, two steps "
        "each from the same weights and tokens, with attention whole and over 8 query tiles (their losses must "
        "agree; the tiles' step runs attention's forward once more per layer)",
        (long_job("full", 131072, layers=4, steps=2, est=120, timeout=240),
         long_job("full", 131072, layers=4, steps=2, est=130, timeout=240,
                  extra=("--train-arg=--set=attention_tiles=8",), name="main-job-8b-L4-S128K-full-qt8"))),
    "half-million-rate": Scenario(
        "the rate at 524,288 tokens past the first step: the 8B cut to 8 layers under long_context (the kernel's pair "
        "kept: attention's forward runs once), two steps from the same weights and tokens (the record times the "
        "second), with cuDNN's attention and with mosaic_cudnn (tokamax's Mosaic GPU forward, cuDNN's backward); "
        "a step takes minutes: run detached",
        (long_job("long_context", 524288, layers=8, steps=2, est=330, timeout=480,
                  extra=("--train-arg=--set=attention_impl=mosaic_cudnn",),
                  name="main-job-8b-L8-S512K-long_context-mosaic_cudnn"),
         long_job("long_context", 524288, layers=8, steps=2, est=350, timeout=480))),
    "half-million-mosaic": Scenario(
        "the 8B cut to 8 layers at 524,288 tokens under longest_context (the 32-layer auto step's structure: groups of "
        "4, each group's input on the host, the kernel's pair kept while a group's backward runs), two steps, with "
        "the attention kernel auto takes (mosaic_cudnn where tokamax is installed on one Hopper device)",
        (long_job("longest_context", 524288, layers=8, steps=2, est=430, timeout=570),)),
    "half-million-lead": Scenario(
        "the first layer of each group keeping the kernel's pair at 524,288 tokens: all 32 layers of the 8B with the "
        "bf16 parameters streamed (--params stream), compiled under auto (which keeps one layer's pair in four) and "
        "lead_context, nothing run; then the 8B cut to 8 layers under lead_context (longest_context's structure, "
        "each group's first layer keeping the pair in HBM), two steps, with the attention kernel auto takes, against "
        "longest_context's 159.88 s (half-million-mosaic); a step takes minutes: run detached",
        (probe(("auto", "lead_context"), seq=524288, est=240, timeout=500, extra=("--params", "stream"),
               env={**LONG_ENV, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "120"}, name="plan-probe-512K-lead-stream"),
         long_job("lead_context", 524288, layers=8, steps=2, est=400, timeout=560))),
    "half-million-trace": Scenario(
        "where mosaic_cudnn's step at 524,288 tokens goes: the 8B cut to 8 layers under long_context with "
        "mosaic_cudnn, two steps, the second traced (recipes.train --profile) and timed, its trace summed per kernel "
        "in the record (does cuDNN's forward still run inside the backward? cuDNN's own step: 134.3 s, this kernel's "
        "156.0 s); every step's time in step_s_each",
        (long_job("long_context", 524288, layers=8, steps=2, est=400, timeout=560,
                  extra=("--profile", "--train-arg=--set=attention_impl=mosaic_cudnn"),
                  name="main-job-8b-L8-S512K-long_context-mosaic_cudnn-trace"),)),
    "longest-context-128k-trace": Scenario(
        "where the 8B's 128K step goes: all 32 layers under auto, two steps, the second traced and summed per kernel "
        "in the record; the plain-JAX long-context anchor's 128K slice (context offloaded); then the default 8K main "
        "job (auto) beside its plain-JAX anchor",
        (long_job("auto", 131072, steps=2, est=200, timeout=330, extra=("--profile",),
                  name="main-job-8b-L32-S128K-auto-trace"),
         anchor_ctx("ctx_offload", 131072, 2),
         main_job("auto", est=90, timeout=200, gpu="0"),
         anchor("minimal", shape="8b", layers=8, est=50, gpu="0"))),
    "main-job-8k": Scenario(
        "the default 8K main job (the 8B cut to 8 layers, batch 2, AdamW, --recipe auto) beside its plain-JAX anchor "
        "(8 layers, SGD), in one call",
        (main_job("auto", est=90, timeout=200, gpu="0"), anchor("minimal", shape="8b", layers=8, est=50, gpu="0"))),
    "main-job-8k-kernels": Scenario(
        "the default 8K main job (the 8B cut to 8 layers, batch 2, AdamW, --recipe auto) with each attention kernel "
        "asked for by name: cuDNN's and mosaic_cudnn (tokamax's Mosaic GPU forward, cuDNN's backward), beside the "
        "plain-JAX anchor (8 layers, SGD), in one call",
        (main_job("auto", ("--train-arg=--set=attention_impl=cudnn",), est=90, timeout=200, gpu="0",
                  name="main-job-8b-auto-cudnn"),
         main_job("auto", (_MOSAIC,), est=90, timeout=200, gpu="0", name="main-job-8b-auto-mosaic_cudnn"),
         anchor("minimal", shape="8b", layers=8, est=50, gpu="0"))),
    "main-job-8k-per-layer": Scenario(
        "the 8K layer, like with like: the step-time difference of 8 and 4 layers (batch 2, seq 8192) for the zoo's "
        "8B under the benches' SGD step (bf16 parameters, minimal: every matmul output kept, as the anchor's "
        "policy), for the plain-JAX anchor under minimal, and for the main job (AdamW, --recipe auto), in one call",
        (sgd_twin("minimal", gpu="0", layers=4), sgd_twin("minimal", gpu="0", layers=8),
         anchor("minimal", shape="8b", layers=4, est=40, gpu="0"),
         anchor("minimal", shape="8b", layers=8, est=50, gpu="0"),
         main_job("auto", ("--layers", "4"), est=70, timeout=160, gpu="0", name="main-job-8b-L4-auto"),
         main_job("auto", est=90, timeout=200, gpu="0"))),
    "attention-in-step": Scenario(
        "how many attention forwards a layer's step runs, by kernel: the 8B's stack cut to 4 layers at 131,072 "
        "tokens under long_context (the kernel's pair kept, groups of 2), SGD, the loss in chunks, with cuDNN's "
        "attention and with mosaic_cudnn; each record the compiled step's custom calls and one traced step summed "
        "per kernel; then the default 8K main job (auto) traced, beside its plain-JAX anchor",
        (profile("long_context", shape="8b", layers=4, batch=1, seq=131072, attention="cudnn", loss_chunk="auto",
                 gpu="0", est=100, timeout=200, env=LONG_ENV),
         profile("long_context", shape="8b", layers=4, batch=1, seq=131072, attention="mosaic_cudnn",
                 loss_chunk="auto", gpu="0", est=100, timeout=200, env=LONG_ENV),
         main_job("auto", ("--profile",), steps=6, est=100, timeout=200, gpu="0", name="main-job-8b-auto-trace"),
         anchor("minimal", shape="8b", layers=8, est=50, gpu="0"))),
    "mosaic-once": Scenario(
        "mosaic_cudnn's forward once per layer: the 8B's stack cut to 4 layers at 131,072 tokens under long_context "
        "(as attention-in-step, where XLA's compiled step ran tokamax's Mosaic forward twice per layer), profiled "
        "with its outputs behind an optimization barrier, then compiled only with XLA's module dumped after every "
        "pass, each pass after which the count of Mosaic GPU calls changed in the record",
        (profile("long_context", shape="8b", layers=4, batch=1, seq=131072, attention="mosaic_cudnn",
                 loss_chunk="auto", gpu="0", est=100, timeout=200, env=LONG_ENV),
         profile("long_context", shape="8b", layers=4, batch=1, seq=131072, attention="mosaic_cudnn",
                 loss_chunk="auto", gpu="0", est=120, timeout=240, env=LONG_ENV, passes="mosaic_gpu_v2"))),
    "longest-context-mosaic": Scenario(
        "the 8B's long-context steps under auto with mosaic_cudnn (tokamax's Mosaic GPU forward, cuDNN's backward, "
        "the forward's outputs behind an optimization barrier so it runs once per layer): 262,144 tokens, two steps "
        "(a step takes minutes); 131,072 tokens, three steps, with the loss's chunks as the rule chooses and in "
        "chunks of 8,192",
        (long_job("auto", 262144, steps=2, est=420, timeout=560, extra=(_MOSAIC,),
                  name="main-job-8b-L32-S256K-auto-mosaic_cudnn"),
         long_job("auto", 131072, steps=3, est=260, timeout=330, extra=(_MOSAIC,),
                  name="main-job-8b-L32-S128K-auto-mosaic_cudnn"),
         long_job("auto", 131072, steps=3, est=260, timeout=330, extra=(_MOSAIC, "--train-arg=--loss-chunk=8192"),
                  name="main-job-8b-L32-S128K-auto-mosaic_cudnn-chunk8192"))),
    "longest-context-128k-chunks": Scenario(
        "the 8B's 128K step under auto with the loss in chunks of 8,192 positions (as fast as longer chunks, 24 GiB "
        "less HBM than 32,768, which the plan can give to activations), three steps, beside the same step with the "
        "loss's chunks chosen by the step's rule",
        (long_job("auto", 131072, steps=3, est=260, timeout=330, extra=("--train-arg=--loss-chunk=8192",),
                  name="main-job-8b-L32-S128K-auto-chunk8192"),
         long_job("auto", 131072, steps=3, est=260, timeout=330))),
    "longest-context-128k-moments": Scenario(
        "the 8B's 128K step under auto, three steps each: with the whole state in pinned host memory (the update "
        "streamed a layer at a time), and with AdamW's bf16 moments in HBM and only the float32 master on the host "
        "(the update moves half the bytes; the plan offloads more activations to make room); then two steps, the "
        "second traced, under XLA's while-loop double buffering (can each layer's offloaded inputs arrive during "
        "the layer before?)",
        (long_job("auto", 131072, steps=3, est=260, timeout=330),
         main_job("auto", ("--layers", "32", "--batch", "1", "--seq", "131072", "--opt-state", "device",
                           "--opt-dtype", "bfloat16", "--param-dtype", "bfloat16", "--params", "host"),
                  steps=3, est=420, timeout=540, gpu="0", name="main-job-8b-L32-S128K-auto-moments-hbm",
                  env=LONG_ENV),
         long_job("auto", 131072, steps=2, est=220, timeout=330, extra=("--profile",), flags=f"{LHS} {DOUBLE_BUFFER}",
                  name="main-job-8b-L32-S128K-auto-double-buffer-trace"))),
    "loss-chunks": Scenario(
        "the loss's chunk length: the 8B's LM head and cross-entropy (forward and backward) at 8K, 128K and 256K "
        "tokens, the whole sequence and chunks of 64 (the rule's old fallback at 256K), 1,024 (the rule's choice "
        "where no chunk fits) and 8,192 positions; each record the time and the compiled temporaries",
        (module_job("loss-chunks", "bench.loss_chunks", est=90, timeout=240),)),
    "streamed-params": Scenario(
        "the stacks' parameters streamed from pinned host memory a layer at a time (--params stream) beside the same "
        "run with only the master and the moments there (--params host): the 8B cut to 8 layers at 32K, then all 32 "
        "layers at 128K under auto (which plans with the HBM streaming frees); the streamed step runs as two programs "
        "(zoo.two_programs)",
        (main_job("auto", ("--layers", "8", "--batch", "1", "--seq", "32768", *HOST_STATE, "--params", "stream"),
                  steps=4, est=70, timeout=200, gpu="0", name="main-job-8b-L8-S32K-auto-stream", env=LONG_ENV),
         main_job("auto", ("--layers", "8", "--batch", "1", "--seq", "32768", *HOST_STATE), steps=4, est=70,
                  timeout=200, gpu="0", name="main-job-8b-L8-S32K-auto-host", env=LONG_ENV),
         long_job("auto", 131072, steps=2, est=230, timeout=330, extra=("--params", "stream"),
                  name="main-job-8b-L32-S128K-auto-stream", env=LONG_ENV))),
    "param-stream-probe": Scenario(
        "which parts of a step over parameters in pinned host memory (--params stream) XLA compiles and runs here: "
        "plain-JAX forms and the zoo's own pieces, each in its own process (a crash is its return code)",
        (module_job("param-stream-probe", "bench.param_stream_probe", est=120, timeout=400),)),
    "param-stream-bisect": Scenario(
        "where XLA's GPU compiler fails on the zoo's streamed update (--params stream; it crashes in "
        "HostOffloadLegalize, whatever part is left out and whichever of command buffers, the latency-hiding "
        "scheduler, autotuning and loop double buffering is off): the update as a program of its own (the gradients "
        "its argument), on one parameter, in one chunk, with every copy behind an optimization barrier, the plain-JAX "
        "update with attention-shaped weights and with Adam's moments on the host, and the update and the step with "
        "that pass off",
        (module_job("param-stream-parts", "bench.param_stream_probe", "--only",
                    "^(zoo_update_(given|given_sgd|out_oneleaf|out_onechunk|out_barrier)|zoo_step_barrier|"
                    "u_host_grads(_4d|_adam)?)$", bench="param-stream-probe", est=200, timeout=300),
         module_job("param-stream-flags", "bench.param_stream_probe", "--only", "zoo_(update_out|step)$", "--flags",
                    "nolegalize", bench="param-stream-probe", est=60, timeout=200))),
    "split-carry": Scenario(
        "what one stack run as two scans (a placement per part, as a split of the layer inputs between HBM and the "
        "host would need) costs XLA: the compiled gradient's temporaries, 32 layers of 2 GiB of bf16 weights as one "
        "scan, as two scans over slices of the stacked weights, and as two scans reading each layer out of the whole "
        "stack; nothing runs",
        (module_job("split-carry", "bench.split_carry_probe", est=40, timeout=200),)),
    "attention-rates": Scenario(
        "causal attention's own forward and backward rate, shaped as the 8B's layer (batch 1, 32 query and 8 key/value "
        "heads of 128), at 32K to 512K positions: cuDNN's kernel through jax.nn and through the zoo's layer, "
        "tokamax's Mosaic GPU and Triton kernels (from the wheels in .whl), and the zoo's mosaic_cudnn (Mosaic's "
        "forward with cuDNN's backward)",
        (module_job("attention-rates-cudnn-mosaic", "bench.attention_rates", "--impl", "cudnn", "--impl", "zoo",
                    "--impl", "mosaic", "--impl", "zoo_mosaic_cudnn", bench="attention-rates", est=400, timeout=560),
         module_job("attention-rates-triton", "bench.attention_rates", "--impl", "triton", "--seq", "32768", "--seq",
                    "131072", bench="attention-rates", est=40, timeout=120))),
    "max-seq": Scenario(
        "the planner's answer for the longest length up to 1,048,576 that the 8B (32 layers, state on the host) "
        "fits on one H200: the estimates' walk, then the answer compiled for the GPU (a length whose estimate is far "
        "over the budget is not compiled); nothing runs",
        (probe(("auto",), longest=1048576, est=300, timeout=560),)),
    "max-seq-million": Scenario(
        "the planner's answer for the longest length up to 1,048,576 that the 8B fits on one H200 with its bf16 "
        "parameters streamed from the host (--params stream), the state on the host and attention over 16 query "
        "tiles with cuDNN's kernel: where auto's compiled step at a length is over the budget, that length is planned "
        "again for a lower one (in subgroups where no structure of two levels fits), up to 3 compiles a length",
        (probe(("auto",), longest=1048576, est=360, timeout=580,
               extra=("--params", "stream", "--attention-tiles", "16", "--attention-impl", "cudnn"),
               env={**LONG_ENV, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "120"}, name="plan-probe-max-seq-stream-qt16"),)),
    "offload-profile": Scenario(
        "where the offload time goes: the plain-JAX anchor under XLA's overlap options and profiles of the zoo's "
        "step (405B slice, 3 layers, batch 2), two single-GPU queues side by side",
        (anchor("minimal", gpu="0"), anchor("offload_minimal", gpu="0"), profile("minimal_offload", gpu="0"),
         profile("minimal", gpu="0"),
         anchor("offload_minimal", flags="pipelined", gpu="1"), anchor("offload_minimal", flags="double_buffer",
                                                                       gpu="1"),
         profile("minimal_offload", flags="pipelined", gpu="1"))),
    "stream-probe": Scenario(
        "do host copies overlap compute: bench.stream_probe's variants under XLA's stream options",
        (stream_probe("device"), stream_probe("plain"), stream_probe("stream"),
         stream_probe("plain", STREAM_ANNOTATION, "annotation"),
         stream_probe("stream", STREAM_ANNOTATION, "annotation"),
         stream_probe("plain", SELECTIVE_MEMCPY, "selective"),
         stream_probe("stream", f"{STREAM_ANNOTATION} {SELECTIVE_MEMCPY}", "annotation-selective"))),
    "stack-depth": Scenario(
        "does offload survive every stack depth: XLA's host bytes against the plan at 1, 2 and 3 layers",
        (Job("stack-depth", ("-m", "bench.stack_depth", "--variant", "current"), LHS, 60, 150,
             ident={"bench": "stack-depth", "setting": "zoo"}, gpus="0"),)),
    "loss-curve": Scenario(
        "does offloading change the numbers: 50 steps of the main job under minimal_offload against full",
        (Job("loss-curve-minimal_offload", ("-m", "bench.loss_curve", "--recipe", "minimal_offload"), LHS, 150, 240,
             ident={"bench": "loss-curve", "setting": "zoo"}, gpus="0"),)),
}

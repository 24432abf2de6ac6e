"""What is known of training DeepSeek-V3: the published schedule of its preset and its measured step rates."""
from zoo.models.registry import StepRate, TrainDefaults

TRAIN_DEFAULTS = {
    "deepseek_v3_671b": TrainDefaults(2.2e-4, 2000, "DeepSeek-V3 report, 4.2: 0 -> 2.2e-4 over the first 2K steps"),
}

STEP_RATES = (
    StepRate("H200", "capacity", 970.0, 1.34, "2026-12-01",
             "bench/results/offload-pays_2026-12-01.jsonl: the DeepSeek-V3 slice (1 dense + 3 MoE layers, 16 experts, "
             "batch 4, seq 4096, capacity dispatch, SGD): full 0.964 s and auto (everything saved) 0.868 s"),
)

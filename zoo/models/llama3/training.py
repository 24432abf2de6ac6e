"""What is known of training Llama 3.1: the published schedules of its presets and its measured step rates."""
from zoo.models.registry import StepRate, TrainDefaults

TRAIN_DEFAULTS = {
    "llama3_1_8b": TrainDefaults(3e-4, 2000, "Llama 3 paper, Table 3 (8B: 3e-4); warm-up as Llama 2 (2000)"),
    "llama3_1_70b": TrainDefaults(1.5e-4, 2000, "Llama 3 paper, Table 3 (70B: 1.5e-4); warm-up as Llama 2 (2000)"),
    "llama3_1_405b": TrainDefaults(8e-5, 8000, "Llama 3 paper, 3.4.1: peak 8e-5, linear warm-up of 8000 steps"),
}

STEP_RATES = (
    StepRate("H200", None, 760.0, 0.207, "2026-12-01",
             "bench/results/offload-pays_2026-12-01.jsonl: the 405B-shaped slice (3 layers, batch 2, seq 8192, bf16, "
             "cuDNN attention, SGD): minimal 1.901 s and full 2.218 s on one GPU in one call"),
)

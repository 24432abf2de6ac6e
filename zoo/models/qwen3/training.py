"""What is known of training Qwen3 (dense): its measured step rates. Its technical report publishes no learning-rate
schedule, so the main job takes the generic defaults for its presets."""
from zoo.models.registry import StepRate

STEP_RATES = (
    StepRate("H200", None, 713.0, 0.209, "2026-12-01",
             "bench/results/qwen3-rate_2026-12-01.jsonl: the 32B-shaped stack (4 layers, batch 2, seq 8192, bf16, "
             "cuDNN attention, SGD): minimal 0.395 s and full 0.466 s on one GPU in one call"),
)

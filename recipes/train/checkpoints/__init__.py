"""What a run keeps and takes up again: checkpoints (`checkpoint`, with their manifests, `manifest`, and orbax's
logs kept quiet, `quiet`), the checks of the checkpoint directory and the metrics file (`guard`), and the inputs a run
opens and restores from, a moved run's files found again (`resume`)."""

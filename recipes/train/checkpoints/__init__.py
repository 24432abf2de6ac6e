"""What a run keeps and takes up again: checkpoints (`checkpoint`, orbax's logs kept quiet there too, with their
manifests, `manifest`), the checks of the checkpoint directory and the metrics file (`guard`), and the inputs a run
opens and restores from, a moved run's files found again (`resume`)."""

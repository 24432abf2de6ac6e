"""The step: compiled on shapes, shown and checked, then built (`prepare`); whether it fits the device, and `--recipe
auto`'s inputs taken from the device (`fit`)."""

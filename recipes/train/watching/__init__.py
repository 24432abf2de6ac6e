"""Watching a run: its progress, dropped tokens and TensorBoard (`watch`), its FLOPs, MFU and memory figures
(`meter`), and the planner's chart (`plot`)."""

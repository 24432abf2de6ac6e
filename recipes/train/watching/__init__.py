"""Watching a run: its progress, dropped tokens and TensorBoard (`watch`), and the planner's chart (`plot`)."""

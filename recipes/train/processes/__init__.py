"""The processes of a run: the mesh over every device (`mesh`), several processes starting together (`coordinator`,
`relay`, `jaxlib`) and agreeing (`agree`), the lock on the checkpoint directory (`lock`) and signals
(`interrupt`)."""

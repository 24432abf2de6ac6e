"""Plain-JAX baselines: what a user writes without the zoo (a scanned stack under one `jax.checkpoint` policy, an
SGD step under `jax.jit`), measured in the same device call as the zoo's benches so the two are compared side by
side. Each prints one JSON line; `bench.run` turns it into a record (`bench.anchor_record`, impl "anchor")."""

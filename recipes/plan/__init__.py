"""`python -m recipes.plan` is now `python -m recipes.train.plan`; this package only says so, for one release
(docs/changes.md)."""

"""`python -m recipes.tokenizer` is now `python -m recipes.train.tokenizer`; this package only says so, for one release
(docs/changes.md)."""

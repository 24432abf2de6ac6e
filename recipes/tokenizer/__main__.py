"""`python -m recipes.tokenizer`: one line naming the new command, exit 2 (docs/changes.md)."""
import sys

print("error: `python -m recipes.tokenizer` is now `python -m recipes.train.tokenizer` (the same flags)",
      file=sys.stderr)
sys.exit(2)

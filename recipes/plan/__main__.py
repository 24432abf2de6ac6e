"""`python -m recipes.plan`: one line naming the new command, exit 2 (docs/changes.md)."""
import sys

print("error: `python -m recipes.plan` is now `python -m recipes.train.plan` (the same flags)",
      file=sys.stderr)
sys.exit(2)

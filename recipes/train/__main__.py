"""`python -m recipes.train`: the main job (`recipes.train.command`)."""
import sys

from recipes.train.command import main

sys.exit(main())

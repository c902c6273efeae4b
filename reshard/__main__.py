"""`python -m reshard ...` and `torchrun ... -m reshard ...`: see reshard.cli."""
import sys

from reshard.cli import main

sys.exit(main())

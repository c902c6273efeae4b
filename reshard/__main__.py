"""`python -m reshard ...` and `torchrun ... -m reshard ...`: see reshard.cli."""
import os
import sys

from reshard.cli import main

code = main()
# Skip interpreter teardown: with torch.distributed loaded, static destructors of its C++
# threads sometimes abort the process ("terminate called without an active exception") after
# all work is done and every file is closed, turning a success into exit status 134.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)

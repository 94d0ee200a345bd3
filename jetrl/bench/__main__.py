"""``python -m jetrl.bench [options]`` is ``jetrl bench [options]``."""

import sys

from jetrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

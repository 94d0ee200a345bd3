import sys

from jetrl.cli import main

sys.exit(main())

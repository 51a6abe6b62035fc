import sys

from lite_runtime.serve.cli import main

sys.exit(main())

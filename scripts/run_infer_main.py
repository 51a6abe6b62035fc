"""Run a model folder (or two graph files): one --prompt and exit, or an interactive loop until EOF or `exit`.

    python scripts/run_infer_main.py --model_dir model_dirs/qwen2-tiny --backend ms --prompt "Hello"

MindFormers' file name and flags; the launcher itself is lite_runtime/launcher.py (python scripts/run_infer_main.py
--help lists every flag).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, from any cwd

from lite_runtime.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

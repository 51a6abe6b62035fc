"""Write a small random Hugging Face checkpoint (qwen2, qwen3 or llama) with a locally trained tokenizer (no downloads).

The weights are random, so the text it generates is gibberish: the checkpoint exists to exercise
export and runtime end to end (export/checkpoints/random_checkpoint.py writes it; neither torch nor transformers is needed).

    python scripts/make_demo_checkpoint.py --output demo/qwen2-tiny
    python scripts/make_demo_checkpoint.py --output demo/llama-tiny --family llama
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, from any cwd

from export.checkpoints.random_checkpoint import FAMILIES, make_checkpoint  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="folder to write the checkpoint into")
    p.add_argument("--family", choices=FAMILIES, default="qwen2", help="the HF model_type to write (default: qwen2)")
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--intermediate_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=2)
    p.add_argument("--num_attention_heads", type=int, default=4)
    p.add_argument("--num_key_value_heads", type=int, default=2)
    p.add_argument("--vocab_size", type=int, default=512)
    p.add_argument("--max_position_embeddings", type=int, default=1024)
    p.add_argument("--untied", action="store_true", help="write a separate lm_head (default: tied to the embedding)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_shard_bytes", type=int, default=None, help="shard the weights (writes an index file)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = make_checkpoint(args.output, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                              num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                              num_key_value_heads=args.num_key_value_heads, vocab_size=args.vocab_size,
                              max_position_embeddings=args.max_position_embeddings,
                              tie_word_embeddings=not args.untied, dtype=args.dtype, seed=args.seed,
                              max_shard_bytes=args.max_shard_bytes, family=args.family)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a random {args.family} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

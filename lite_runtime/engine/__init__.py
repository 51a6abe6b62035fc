"""The engine room (docs/architecture.md, "The engine room"): what runs a folder's graphs step by step, below both
the server (lite_runtime/serve/) and `pipeline()` (lite_runtime/task.py, generator.py), neither of which reaches
into the other.

- `runner.py` (ModelRunner): loads the graphs through a backend, owns the KV pool, builds each step's inputs
  (InputOfInfer: block tables, slot mapping) and runs prefill, inc, chunk and score graphs.
- `blocks.py` (BlockPool, SequenceBlocks): the pool's blocks: reference counts, full-block hashes (parent, tokens,
  the folder's identity), the LRU free queue, prefix lookups.
- `kv_pool.py`: how many blocks the pool gets (--kv_cache_memory, --num_blocks, free memory), refused when it
  cannot hold one full-length request.
- `scheduler.py` (BatchEngine): continuous batching: admission by free rows and blocks, chunked prefill, prefix
  sharing, preemption and recompute.
- `request.py` (SlotRequest): one request's tokens, text, stops, grammar and logprobs.
- `sampling.py`: logits processing and token choice; `speculative.py`: prompt lookup and draft folders.

Importable without MindSpore, torch or transformers, as all of lite_runtime/.
"""

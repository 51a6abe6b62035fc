"""export: a Hugging Face Qwen2/Qwen2.5, Qwen3 or Llama checkpoint becomes a model folder of MindIR graphs.

Rooms, each importing only from below it (docs/architecture.md, "export/ in rooms"): checkpoints/ (the readers behind
open_checkpoint), network/ (the MindSpore network, its matmul methods and quantization), writers/ (graphs, weights
files, golden references, tokenizer files); pipeline.py, __main__.py and compare.py on top; config.py, devices.py,
families/, native/ and errors.py below them all."""

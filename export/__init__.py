"""export: a Hugging Face Qwen2/Qwen2.5, Qwen3 or Llama checkpoint becomes a model folder of MindIR graphs
(docs/architecture.md)."""

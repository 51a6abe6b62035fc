"""export: a Hugging Face Qwen2 checkpoint becomes a model folder of MindIR graphs (see DESIGN.md)."""

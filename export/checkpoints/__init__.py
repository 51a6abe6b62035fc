"""Checkpoint readers, behind the one interface they share: `open_checkpoint(path)` maps every tensor name (Hugging
Face's) to an object with `shape(name)`, `stored(name)` and `read(name)` (float32/float16 numpy), whatever the
checkpoint is: safetensors (one file or shards with an index: safetensors.py), a GGUF file (gguf.py over gguf_file.py,
dequantized by the `gguf` package), or a GPTQ/AWQ checkpoint's packed layers (packed.py, unpacked here). methods.py
says how a checkpoint's or folder's linear layers are quantized (QuantMethod), the vocabulary readers and the network
share. random_checkpoint.py writes random HF checkpoints for tests, demos and benchmarks.

This room imports nothing of export/ above it (docs/architecture.md, "export/ in rooms").
"""
from __future__ import annotations

from typing import Dict, List, Set, Tuple

from export.checkpoints.safetensors import SafetensorsFile, open_safetensors
from export.errors import ExportError

# Tensors a checkpoint may carry that the network derives itself.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


def open_checkpoint(folder: str) -> Dict[str, SafetensorsFile]:
    """Map every tensor name to the file that holds it (one file, or shards with an index); a GGUF file instead of a
    folder: to its tensors under their HF names, dequantized (gguf.py, the same interface); a GPTQ or AWQ
    checkpoint's packed layers: to their weights, dequantized (packed.py)."""
    from export.checkpoints.gguf import is_gguf, open_gguf
    from export.checkpoints.packed import open_packed

    if is_gguf(folder):
        return open_gguf(folder)[1]
    return open_packed(folder, open_safetensors(folder))


def plan_weights(expected: Dict[str, Tuple[int, ...]], where: Dict[str, SafetensorsFile],
                 tied: bool) -> List[str]:
    """Check names and shapes before reading anything. Returns the names to load.

    Missing and unexpected tensors are reported together, by name; either refuses the export (a tied head saved
    anyway and derived buffers such as rotary inv_freq are not unexpected).
    """
    available: Set[str] = set(where)
    ignorable = {n for n in available if n.endswith(_DERIVED_SUFFIXES)}
    if tied:
        ignorable.add("lm_head.weight")  # a tied head may be saved too; the embedding is used
    missing = sorted(set(expected) - available)
    unexpected = sorted(available - set(expected) - ignorable)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:8])}{' …' if len(unexpected) > 8 else ''}")
        # unexpected ones too: a tensor the network would not read (a bias of another family, say) means the export
        # would compute something other than the checkpoint
        raise ExportError(f"checkpoint tensors do not match config.json ({'; '.join(parts)}); "
                          "check that the weights belong to this config")
    for name, shape in expected.items():
        got = where[name].shape(name)
        if tuple(got) != tuple(shape):
            raise ExportError(f"{where[name].path}: tensor {name} has shape {list(got)}, config.json implies "
                              f"{list(shape)}; check that the weights belong to this config")
    return list(expected)

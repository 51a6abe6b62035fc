"""InputOfInfer: per model family, token ids -> the named graph inputs of the prefill, inc and chunk graphs."""
from __future__ import annotations

from typing import Dict, Sequence, Type

import numpy as np

from lite_runtime.errors import InferError


class DecoderInputs:
    """The graphs of `python -m export` for every family it exports (qwen2, qwen3, llama): `input_ids` and
    `valid_length` (positions are derived in-graph; rope scaling is baked into the graphs' tables).

    prefill: input_ids [B, S] right-padded with pad_token_id, valid_length [B] = prompt lengths.
    inc:     input_ids [B, 1] = each row's newest token, valid_length [B] = tokens in the cache after it.
    chunk:   inc's inputs (the step of every row) and one row's piece: chunk_ids [1, C] right-padded, chunk_length
             [1] = its tokens, start [1] = the position of its first token, slot [1] = the cache row it writes.
    """

    def prefill(self, rows: Sequence[Sequence[int]], seq_length: int, pad_token_id: int) -> Dict[str, np.ndarray]:
        ids = np.full((len(rows), seq_length), pad_token_id, np.int32)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = row
        return {"input_ids": ids, "valid_length": np.array([len(r) for r in rows], np.int32)}

    def chunk(self, step_tokens: Sequence[int], step_lengths: Sequence[int], tokens: Sequence[int], size: int,
              start: int, slot: int, pad_token_id: int) -> Dict[str, np.ndarray]:
        piece = self.prefill([tokens], size, pad_token_id)
        return {**self.increment(step_tokens, step_lengths), "chunk_ids": piece["input_ids"],
                "chunk_length": piece["valid_length"], "start": np.array([start], np.int32),
                "slot": np.array([slot], np.int32)}

    def increment(self, tokens: Sequence[int], lengths: Sequence[int]) -> Dict[str, np.ndarray]:
        return {"input_ids": np.asarray(tokens, np.int32).reshape(-1, 1),
                "valid_length": np.asarray(lengths, np.int32)}


class InputOfInfer:
    """The registry: model family (the folder's `infer.model_name`, export/families) -> input builder. A family whose
    graphs need another input gets its own class here; one with the shared graph contract reuses DecoderInputs."""

    MAPPING: Dict[str, Type] = {"qwen2": DecoderInputs, "qwen3": DecoderInputs, "llama": DecoderInputs}

    @classmethod
    def get(cls, model_name: str):
        try:
            return cls.MAPPING[model_name]()
        except KeyError:
            raise InferError(f"model_name {model_name!r} has no input mapping; known: "
                             f"{', '.join(sorted(cls.MAPPING))}") from None

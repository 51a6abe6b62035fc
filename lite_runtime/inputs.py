"""InputOfInfer: per model family, token ids, block tables and slots -> the named graph inputs of the prefill, inc and
chunk graphs."""
from __future__ import annotations

from typing import Dict, Sequence, Type

import numpy as np

from lite_runtime.errors import InferError


class DecoderInputs:
    """The graphs of `python -m export` for every family it exports (qwen2, qwen3, llama, qwen3_moe, qwen2_moe):
    `input_ids`, `valid_length`, and the paged KV cache's `block_tables` and `slot_mapping` (positions are derived
    in-graph; rope scaling is baked into the graphs' tables). The runner (lite_runtime/engine/runner.py) computes the
    tables and slots.

    prefill: input_ids [B, S] right-padded with pad_token_id, valid_length [B] = prompt lengths, block_tables [B, M],
             slot_mapping [B*S] (each token's slot: block * block_size + position in it; -1 for padding).
    inc:     input_ids [B, 1] = each row's newest token, valid_length [B] = tokens of its sequence after it,
             block_tables [B, M], slot_mapping [B] (-1: an idle row).
    chunk:   inc's inputs (the step of every row) and one more sequence's piece: chunk_ids [1, C] right-padded,
             chunk_length [1] = its tokens, start [1] = the position of its first token, chunk_block_table [1, M] = its
             blocks, chunk_slot_mapping [C] = where its tokens go (-1 for padding).
    """

    def prefill(self, rows: Sequence[Sequence[int]], seq_length: int, pad_token_id: int, tables: np.ndarray,
                slots: np.ndarray) -> Dict[str, np.ndarray]:
        ids = np.full((len(rows), seq_length), pad_token_id, np.int32)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = row
        return {"input_ids": ids, "valid_length": np.array([len(r) for r in rows], np.int32),
                "block_tables": np.asarray(tables, np.int32), "slot_mapping": np.asarray(slots, np.int32)}

    def chunk(self, step_tokens: Sequence[int], step_lengths: Sequence[int], step_tables: np.ndarray,
              step_slots: Sequence[int], tokens: Sequence[int], size: int, start: int, table: np.ndarray,
              slots: Sequence[int], pad_token_id: int) -> Dict[str, np.ndarray]:
        ids = np.full((1, size), pad_token_id, np.int32)
        ids[0, :len(tokens)] = tokens
        return {**self.increment(step_tokens, step_lengths, step_tables, step_slots), "chunk_ids": ids,
                "chunk_length": np.array([len(tokens)], np.int32), "start": np.array([start], np.int32),
                "chunk_block_table": np.asarray(table, np.int32), "chunk_slot_mapping": np.asarray(slots, np.int32)}

    def increment(self, tokens: Sequence[int], lengths: Sequence[int], tables: np.ndarray,
                  slots: Sequence[int]) -> Dict[str, np.ndarray]:
        return {"input_ids": np.asarray(tokens, np.int32).reshape(-1, 1),
                "valid_length": np.asarray(lengths, np.int32), "block_tables": np.asarray(tables, np.int32),
                "slot_mapping": np.asarray(slots, np.int32)}


class InputOfInfer:
    """The registry: model family (the folder's `infer.model_name`, export/families) -> input builder. A family whose
    graphs need another input gets its own class here; one with the shared graph contract reuses DecoderInputs."""

    MAPPING: Dict[str, Type] = {"qwen2": DecoderInputs, "qwen3": DecoderInputs, "llama": DecoderInputs,
                                "qwen3_moe": DecoderInputs, "qwen2_moe": DecoderInputs}

    @classmethod
    def get(cls, model_name: str):
        try:
            return cls.MAPPING[model_name]()
        except KeyError:
            raise InferError(f"model_name {model_name!r} has no input mapping; known: "
                             f"{', '.join(sorted(cls.MAPPING))}") from None

"""lite_runtime: load a model folder's graphs (mindspore_lite + GE on Atlas, or MindSpore on a CPU) and generate.

Imports neither MindSpore nor torch nor transformers at module level: an Atlas server may have
only mindspore_lite. Each backend imports its engine when it is constructed.
"""
from lite_runtime.config import InferConfig
from lite_runtime.errors import BackendUnavailableError, InferError, ModelFolderError
from lite_runtime.generator import GenerateOutput, InferOutput, TextGenerator
from lite_runtime.inputs import InputOfInfer
from lite_runtime.streamers import BatchTextIteratorStreamer, TextIteratorStreamer
from lite_runtime.task import InferTask, pipeline

__all__ = [
    "BackendUnavailableError", "BatchTextIteratorStreamer", "GenerateOutput", "InferConfig", "InferError",
    "InferOutput", "InferTask", "InputOfInfer", "ModelFolderError", "TextGenerator", "TextIteratorStreamer",
    "pipeline",
]

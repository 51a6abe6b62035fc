"""Errors of the runtime: one line that names the file, field or value and what to do."""


class InferError(Exception):
    """Bad input to the runtime (a folder, a setting, a request). Its message is one actionable line."""


class ModelFolderError(InferError):
    """A model folder that is incomplete, corrupted or inconsistent."""


class BackendUnavailableError(InferError):
    """The chosen backend cannot be loaded on this machine."""


class MissingDependencyError(InferError):
    """A package the asked feature needs cannot be imported here: this machine's setup, not the input, is at fault
    (the server answers it with a 500, not a 400)."""

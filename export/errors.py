"""Errors of the export stage: one class, a one-line message that names the field or file."""


class ExportError(Exception):
    """Bad input or a failed export. The message is one line a person can act on.

    The CLI prints it without a traceback and exits non-zero.
    """

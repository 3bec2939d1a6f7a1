"""Typed errors raised by the library; the CLI maps each to a one-line message and exit code."""

from __future__ import annotations


class SpecgraphError(Exception):
    """Base class: every error the library raises on bad input derives from it.

    Its text is always one line: messages quote file names, JSON keys and library errors that
    can hold line breaks, and the CLI promises one line on stderr.
    """

    exit_code = 1

    def __str__(self) -> str:
        return " ".join(super().__str__().splitlines())


class ModelLoadError(SpecgraphError):
    """The model file or folder cannot be read (missing, truncated, corrupt, unsafe)."""

    exit_code = 2


class UnsafeModelError(ModelLoadError):
    """The file would execute code when loaded (a pickle), so it is refused."""


class AnatomyError(SpecgraphError):
    """The graph lacks a part the compiler needs; the message names what is missing."""

    exit_code = 3


class ExportError(SpecgraphError):
    """ONNX export of the rewritten graph failed."""

    exit_code = 4


class BundleError(SpecgraphError):
    """A compiled bundle is missing files, fails its checksums or has a foreign format."""

    exit_code = 5


class InputError(SpecgraphError):
    """A request the engine cannot serve (prompt longer than the maximum context, bad flags)."""

    exit_code = 6


class OutputError(InputError):
    """An output path that would replace something specgraph did not make, or the command's input."""

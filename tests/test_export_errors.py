"""An ONNX export failure is one plain line: the innermost cause, without terminal colour codes."""

from __future__ import annotations

from specgraph.exporters.onnx import _root_cause


def test_export_errors_name_the_innermost_cause_without_colour():
    try:
        try:
            raise ValueError("\x1b[96mCannot view\x1b[0m a tensor of shape [s52, s27, 96]\nas (1, s27, 6*s52, 16)")
        except ValueError as inner:
            raise RuntimeError(
                "Failed to export the model with torch.export. \x1b[96mThis is step 1/3\x1b[0m"
            ) from inner
    except RuntimeError as exc:
        line = _root_cause(exc)
    assert line == "Cannot view a tensor of shape [s52, s27, 96]"

"""kiln-torch: export a PyTorch `nn.Module` to a Kiln graph file.

```python
import kiln_torch
kiln_torch.export(model, (torch.randn(1, 3, 224, 224),), "model.kiln.safetensors")
```

Only `export` needs torch; the op table (`ops`), the report (`report`) and the graph file writer
(`graph`) are plain Python and NumPy.
"""

from .ops import TABLE, CustomOp, Unsupported
from .report import Missing, UnsupportedOpsError, format_report

__version__ = "0.1.0"


def export(model, example_inputs, path=None, **options):
    """See `kiln_torch.frontend.export`."""
    from .frontend import export as _export

    return _export(model, example_inputs, path, **options)


__all__ = ["export", "CustomOp", "Unsupported", "UnsupportedOpsError", "Missing", "format_report", "TABLE"]

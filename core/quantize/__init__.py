"""Offline quantisation: a dense LLaMA-family model written as a 4-bit HF GPTQ
checkpoint, calibrated by GPTQ or rounded to nearest (``infergraft quantize``).

```python
from infergraft.core.quantize import quantize_model
quantize_model("smollm2-135m", "smollm2-gptq", method="gptq", group_size=128)
engine = core.build("smollm2-gptq")  # the int4 quantiser, chosen by the checkpoint
```

``model`` (the function), ``sequential`` (layer by layer through an HF model), ``gptq``
(one layer's algorithm), ``calibration`` (the text), ``pack`` (codes and the GPTQ / AWQ
layouts), ``checkpoint`` (the directory written).
"""
from .model import METHODS, QuantizeResult, quantize_model

__all__ = ["METHODS", "QuantizeResult", "quantize_model"]

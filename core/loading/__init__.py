"""Model loading: where a model comes from (``source``: an HF model in memory, a local
safetensors directory, the demo alias fetched by ``demo``) and how its tensors stream
into our slots (``weights``), packed by a weight quantiser on the way (``packing``)."""

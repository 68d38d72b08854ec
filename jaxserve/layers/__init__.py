"""Building blocks of the model: norm, rotary embedding, (quantized) linear, paged attention dispatch."""

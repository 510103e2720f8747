"""The quantization room: one method per weight format, owning how a linear layer stores, loads,
shards and multiplies its weight (layers/linear.py's `LinearMethod` interface). `config.py` picks the
format from `--quantization` or the checkpoint's `quantization_config`."""

"""The speed benchmark (`python -m transformer_jax.benchmark`): training MFU per model size
(`training.py`, FLOP formula in `flops.py`), decoding speed (`decoding.py`) and input-pipeline
throughput (`pipeline.py`), run together by `runner.run` and printed by `report.py`."""

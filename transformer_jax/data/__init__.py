"""The data layer: datasets prepared as tfds `array_record` (the embedded number-words task,
your parallel text files, or tfds catalog datasets), the shared SentencePiece vocabulary, and
the batches training and evaluation read (`input_pipeline.make_train_iterator`; the planned
token-budget and packed batches of `batching.py` are JAX-free)."""

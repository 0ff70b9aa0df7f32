"""Exports of a trained workdir: CTranslate2 (`ctranslate2_spec` writes it through CTranslate2's
spec API; `ctranslate2_runtime` decodes with it as ours does) and StableHLO (`stablehlo`, with
the self-contained `stablehlo_runner` copied beside it)."""

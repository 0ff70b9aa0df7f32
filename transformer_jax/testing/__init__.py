"""Utilities for tests and by-hand checks, shipped so that tests and bench/ scripts can share
them: our models written in Marian's format (`marian_npz`) and a check of that format against
CTranslate2's converter (`marian_npz_check`)."""

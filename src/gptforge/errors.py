"""User-facing error families. The CLI prints these as one line and exits with code 2."""

from __future__ import annotations


class GPTForgeError(Exception):
    """Base class for errors caused by user input (config, data, files), not by bugs."""


class ConfigError(GPTForgeError):
    """A config file, key, value or override is invalid."""


class DataError(GPTForgeError):
    """Input data (text, jsonl, token files, eval sets) is missing or malformed."""


class CheckpointError(GPTForgeError):
    """A checkpoint directory or weight file is missing, incomplete or incompatible."""


class UsageError(GPTForgeError):
    """A command-line usage problem (missing flag, conflicting options)."""


class DiskFullError(GPTForgeError):
    """A write failed because the disk (or a quota, or the file-size limit) is full."""

"""The one error type every checkpoint loader raises for a bad or unsupported file."""


class CheckpointError(ValueError):
    """A checkpoint (GGUF file or HF directory) is malformed, truncated or unsupported.

    The message names the file and, where one is at fault, the tensor or metadata key.
    """

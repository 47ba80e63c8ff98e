"""Offline quantization: RTN, GPTQ and AWQ for INT4 / INT8, FP8, calibration on ShareGPT, and
writers of AutoGPTQ / AutoAWQ-layout checkpoints that ``LLM(model=DIR)`` loads back."""

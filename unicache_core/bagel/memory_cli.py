"""The command line's memory options: how the weights are stored (``--weight-dtype``) and placed (``--offload``)."""

from __future__ import annotations

import argparse

from .checkpoint.loader import OFFLOAD_MODES
from .weights import WEIGHT_DTYPES


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--weight-dtype`` and ``--offload`` to ``parser``."""
    parser.add_argument("--weight-dtype", choices=list(WEIGHT_DTYPES), default="auto",
                        help="storage of the LLM/ViT Linear and Embedding weights, upcast to --dtype at each call: "
                             "auto (= --dtype), bf16, fp16, fp32, fp8_e4m3fn, fp8_e5m2 (one scale per row) or "
                             "int8 (weight-only, one scale per row); fp8/int8 halve the weights' memory")
    parser.add_argument("--offload", choices=list(OFFLOAD_MODES), default="none",
                        help="layers: keep the decoder layers in host memory and bring each to --device as it runs")


__all__ = ["add_memory_arguments"]

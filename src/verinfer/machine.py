"""The machine line every benchmark and experiment result records (ratios only mean something next to it)."""

from __future__ import annotations

import os
import platform

import torch

import verinfer


def describe(threads: int, extra: str = "") -> str:
    return (f"{platform.processor() or platform.machine()} ({platform.machine()}), {os.cpu_count()} CPU cores "
            f"(shared with other processes), torch {torch.__version__} CPU, {threads} torch thread(s), "
            + (f"{extra}, " if extra else "") + f"Python {platform.python_version()}, verinfer {verinfer.__version__}")

"""Shared test setup: one torch thread (the tiny networks here run fastest on one, and
results are reproducible for a given thread count)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)

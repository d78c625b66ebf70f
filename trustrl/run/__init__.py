"""The run layer: the trainer (the loop over a ``Runner``), checkpoints (the only place that
saves and loads), evaluation, progress logging, export, and the plot and video commands
(the only modules that import matplotlib and moviepy)."""

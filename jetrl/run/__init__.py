"""Runs: configs and presets, model sources, the training job, evaluation and generation."""

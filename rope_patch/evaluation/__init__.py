"""Evaluation helpers shared by the training recipes and the evaluation sweeps."""

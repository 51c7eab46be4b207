"""Fine-tuning helpers: PoSE position ids (pose.py)."""

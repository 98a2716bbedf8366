"""Training utilities for the small embedded looped models (corpus preparation, training loops)."""

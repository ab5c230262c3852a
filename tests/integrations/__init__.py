"""Trainer integrations (CheckpointManager, Lightning, Hugging Face, JAX) against real daemons."""

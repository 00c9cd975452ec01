"""Checkpoint formats: HF safetensors directories <-> NNX param trees; orbax train state."""

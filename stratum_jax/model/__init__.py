"""Llama-family decoder (flax), HF checkpoint and tokenizer loading, named random-init presets."""

"""Flax models: the shared encoder, text models and ViT."""
